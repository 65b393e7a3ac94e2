"""One choice's generation: from the engine loop's deltas to a whole choice or chunk choices.

Introduced in stage 10. A `Generation` waits until the loop has accepted its request (or turns the
engine's rejection into a 400 naming the prompt), then either collects the whole choice or yields
it piece by piece in OpenAI's chunk shape, each with the logprobs of its own tokens when the
request asks for them; completion.py puts a request's choices together.
Whatever way it ends (finished, a stop string, the client gone), closing the loop's generator
aborts what still runs. It counts what the client sees for /metrics: time to first token and the
gaps between tokens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import NamedTuple, cast

from nanoserve.detokenizer import TextStream
from nanoserve.logprobs import TokenLogprobs
from nanoserve.sampling import SamplingParams
from nanoserve.serving import responses
from nanoserve.serving.async_engine import AsyncEngine
from nanoserve.serving.engine_thread import EngineError
from nanoserve.serving.metrics import Metrics
from nanoserve.serving.protocol import APIError


class Piece(NamedTuple):
    """What one delta adds to a choice: text safe to send, tokens, and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # one per token if the request asks for them, else empty


class Generation:
    """One choice of a request through the engine loop; `chat` picks chat's shapes."""

    def __init__(
        self,
        loop: AsyncEngine,
        metrics: Metrics,
        prompt_token_ids: list[int],
        params: SamplingParams,
        text: TextStream,
        chat: bool,
        index: int = 0,
        prompt_param: str = "prompt",
    ):
        self.loop, self.metrics = loop, metrics
        self.prompt_token_ids, self.params, self.text = prompt_token_ids, params, text
        self.chat, self.index = chat, index  # index: the choice's, in the response
        self.prompt_param = prompt_param  # the field a rejection names
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
            self.metrics.requests.labels(finish_reason="rejected").inc()
            raise APIError(400, f"{self.prompt_param}: {err}", param=self.prompt_param) from None
        except EngineError as err:
            raise APIError(503, str(err), type="server_error") from None
        self.metrics.prompt_tokens.inc(len(self.prompt_token_ids))

    async def close(self) -> None:
        """Abort the request if it runs (a batch-mate was rejected); nothing if it does not."""
        if self.deltas is not None:
            await self.deltas.aclose()

    async def pieces(self) -> AsyncIterator[Piece]:
        """A Piece per delta until the request is done; sets finish_reason."""
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
                yield Piece(piece, delta.token_ids, delta.logprobs or [])
                if self.finish_reason is not None:
                    break
        finally:
            await deltas.aclose()  # leaving early aborts the request in the engine
            self.metrics.requests.labels(finish_reason=self.finish_reason or "abort").inc()

    async def choice(self) -> dict:
        """The whole choice, once the request is done."""
        token_ids, entries = [], []
        async for piece in self.pieces():
            token_ids += piece.token_ids
            entries += piece.logprobs
        build = responses.chat_choice if self.chat else responses.completion_choice
        logprobs = self.logprobs(token_ids, entries, text_offset=0)
        return build(self.index, self.text.text, token_ids, self.finish_reason, logprobs)

    async def chunk_choices(self) -> AsyncIterator[dict]:
        """The choice as a stream chunk's choices: one per delta (chat's first names the role)."""
        if self.chat:
            yield responses.chat_chunk_choice(
                self.index, {"role": "assistant", "content": ""}, [], None
            )
        num_chars_sent = 0
        async for piece in self.pieces():
            ids, reason = piece.token_ids, self.finish_reason
            logprobs = self.logprobs(ids, piece.logprobs, text_offset=num_chars_sent)
            num_chars_sent += len(piece.text)
            if not self.chat:
                yield responses.completion_choice(self.index, piece.text, ids, reason, logprobs)
                continue
            delta = {"content": piece.text} if piece.text or reason is None else {}
            yield responses.chat_chunk_choice(self.index, delta, ids, reason, logprobs)

    def logprobs(
        self, token_ids: list[int], entries: list[TokenLogprobs], text_offset: int
    ) -> dict | None:
        """A choice's (or chunk's) `logprobs` for these tokens; None unless the request asks.
        text_offset: the characters of the choice's text before the first of them."""
        if self.params.logprobs is None:
            return None
        if self.chat:
            return responses.chat_logprobs(self.text.tokenizer, token_ids, entries)
        return responses.completion_logprobs(self.text.tokenizer, token_ids, entries, text_offset)

    def _count(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        now = time.perf_counter()
        if self.num_tokens == 0:
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:  # a delta of k tokens (a reader that fell behind) counts k equal gaps
            gap = (now - self.last_token_time) / len(token_ids)
            for _ in token_ids:
                self.metrics.inter_token_latency.observe(gap)
        self.last_token_time = now
        self.num_tokens += len(token_ids)
        self.metrics.generation_tokens.inc(len(token_ids))
