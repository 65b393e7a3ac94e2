"""One HTTP request's generation: from the engine loop's deltas to a response or an event stream.

Introduced in stage 10. A `Generation` waits until the loop has accepted its request (or turns the
engine's rejection into a 400), then either collects the whole completion or yields it as
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. Whatever way it ends
(finished, a stop string, the client gone), closing the loop's generator aborts what still runs.
It counts what the client sees for /metrics: time to first token and the gaps between tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from nanoserve.detokenizer import TextStream
from nanoserve.sampling import SamplingParams
from nanoserve.serving import protocol
from nanoserve.serving.async_engine import AsyncEngine
from nanoserve.serving.engine_thread import EngineError
from nanoserve.serving.metrics import Metrics
from nanoserve.serving.protocol import APIError


def sse(data: dict | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class Generation:
    """One request through the engine loop; `chat` picks the chat shapes over completions'."""

    def __init__(
        self,
        loop: AsyncEngine,
        metrics: Metrics,
        model: str,
        prompt_token_ids,
        params: SamplingParams,
        text: TextStream,
        chat: bool,
    ):
        self.loop, self.metrics, self.model = loop, metrics, model
        self.prompt_token_ids, self.params, self.text, self.chat = (
            prompt_token_ids,
            params,
            text,
            chat,
        )
        self.prompt_param = "messages" if chat else "prompt"  # the field a rejection names
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.kind = "chat.completion" if chat else "text_completion"
        self.deltas: AsyncGenerator | None = None  # set by start()
        self.arrival = self.last_token_time = time.perf_counter()
        self.num_tokens = 0
        self.finish_reason: str | None = None

    async def start(self) -> None:
        """Queue the request and wait for the loop's answer; APIError if it is rejected."""
        # an async generator (annotated as an iterator): aclose() is what aborts the request
        self.deltas = cast(AsyncGenerator, self.loop.generate(self.prompt_token_ids, self.params))
        try:
            await anext(self.deltas)  # the empty "accepted" delta, one loop iteration away
        except ValueError as err:
            self.metrics.requests["rejected"] += 1
            raise APIError(400, str(err), param=self.prompt_param) from None
        except EngineError as err:
            raise APIError(503, str(err), type="server_error") from None
        self.metrics.num_prompt_tokens += len(self.prompt_token_ids)

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        """(new text, new token ids) per delta until the request is done; sets finish_reason."""
        deltas = self.deltas
        assert deltas is not None, "start() comes first"
        try:
            async for delta in deltas:
                self._count(delta.token_ids)
                piece = self.text.push(delta.token_ids)
                if self.text.stopped:  # a stop string: the engine's request is aborted below
                    self.finish_reason = "stop"
                elif delta.finish_reason is not None:
                    self.finish_reason = delta.finish_reason
                    piece += self.text.finish()
                yield piece, delta.token_ids
                if self.finish_reason is not None:
                    break
        finally:
            await deltas.aclose()  # leaving early aborts the request in the engine
            self.metrics.requests[self.finish_reason or "abort"] += 1

    async def response(self) -> dict:
        """The whole completion, as one response object."""
        token_ids = []
        async for _, new_ids in self.pieces():
            token_ids += new_ids
        choice = protocol.chat_choice if self.chat else protocol.completion_choice
        choices = [choice(self.text.text, token_ids, self.finish_reason)]
        return {**protocol.envelope(self.id, self.model, self.kind, choices), "usage": self.usage()}

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """The completion as server-sent events, one chunk per delta, then [DONE]."""
        kind = f"{self.kind}.chunk" if self.chat else self.kind
        try:
            if self.chat:  # OpenAI's first chat chunk names the role
                yield sse(
                    protocol.envelope(
                        self.id,
                        self.model,
                        kind,
                        [
                            protocol.chat_chunk_choice(
                                {"role": "assistant", "content": ""}, [], None
                            )
                        ],
                    )
                )
            async for piece, new_ids in self.pieces():
                yield sse(
                    protocol.envelope(
                        self.id, self.model, kind, [self._chunk_choice(piece, new_ids)]
                    )
                )
        except EngineError as err:  # the headers are sent: the error becomes an event
            yield sse(APIError(500, str(err), type="server_error").body())
        if include_usage:
            yield sse({**protocol.envelope(self.id, self.model, kind, []), "usage": self.usage()})
        yield sse("[DONE]")

    def usage(self) -> dict:
        """OpenAI's usage object for this request."""
        return protocol.usage(len(self.prompt_token_ids), self.num_tokens)

    def _chunk_choice(self, piece: str, token_ids: list[int]) -> dict:
        if self.chat:
            delta = {"content": piece} if piece or self.finish_reason is None else {}
            return protocol.chat_chunk_choice(delta, token_ids, self.finish_reason)
        return protocol.completion_choice(piece, token_ids, self.finish_reason)

    def _count(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        now = time.perf_counter()
        if self.num_tokens == 0:
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:  # a delta of k tokens (a reader that fell behind) counts k equal gaps
            gap = (now - self.last_token_time) / len(token_ids)
            self.metrics.inter_token_latency.observe(gap, times=len(token_ids))
        self.last_token_time = now
        self.num_tokens += len(token_ids)
        self.metrics.num_generation_tokens += len(token_ids)


async def until_disconnected(receive) -> None:
    """Return when the client hangs up (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def response_unless_disconnected(generation: Generation, receive) -> dict | None:
    """The whole response, or None when the client hung up first (the request is aborted)."""
    work = asyncio.ensure_future(generation.response())
    watch = asyncio.ensure_future(until_disconnected(receive))
    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if work.done():
        return work.result()
    work.cancel()  # CancelledError inside the loop's generator: it aborts the request
    await asyncio.gather(work, return_exceptions=True)
    return None
