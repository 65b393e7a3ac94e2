"""The engine loop of a server: one thread steps the engine while requests come and go (stage 10).

Introduced in stage 10. `LLMEngine` is not thread-safe, and need not be: exactly one thread, the
loop thread, ever touches it. Everyone else talks to that thread through a command queue (`Add`,
`Abort`) and hears back through their own `RequestStream`. Each iteration of the loop is

    apply every queued command  ->  one engine.step()  ->  fan the new tokens out to the streams

so an abort issued during a step is applied before the next one: a client that hangs up frees
its KV blocks within one step. It knows token ids only: text, HTTP and metrics are
`nanoserve/serving/`'s. `LLM` (offline, one caller) stays as it is.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

from nanoserve.sampling import SamplingParams
from nanoserve.serving.engine_thread import (
    EngineThread,
    put_all,
)
from nanoserve.serving.request_stream import (
    Abort,
    Add,
    Delivery,
    Request,
    TokenDelta,
)

logger = logging.getLogger("nanoserve")


class AsyncEngine(EngineThread):
    """An `LLMEngine` served to many asyncio callers: `generate` streams one request's tokens."""

    def apply(self, command: Add | Abort) -> list[Delivery]:
        """Queue an Add's request (or deliver why the engine rejects it); carry out an Abort."""
        if isinstance(command, Add):
            try:
                seq = self.engine.add_request(command.prompt_token_ids, command.params)
            except ValueError as err:  # a bad request is its own caller's problem, nobody else's
                return [Delivery(command.stream, err)]
            self.requests[command.stream.request_id] = Request(seq, command.stream)
            return [Delivery(command.stream, TokenDelta([]))]  # accepted: an empty first delta
        request = self.requests.pop(command.request_id, None)
        if request is None:  # finished (its last delta is on its way) or never accepted
            return []
        self.engine.abort([request.seq])  # out of the queues, its blocks back in the pool, now
        return [Delivery(request.stream, TokenDelta([], "abort"))]

    def fan_out(self) -> list[Delivery]:
        """Each tracked request's new tokens; a finished one gets its reason and is dropped."""
        deliveries = []
        for request_id, request in list(self.requests.items()):
            seq = request.seq
            new_token_ids = seq.token_ids[seq.num_prompt_tokens + request.num_sent :]
            if not new_token_ids and not seq.is_finished:
                continue  # waiting, or a prefill chunk that sampled nothing yet
            request.num_sent += len(new_token_ids)
            deliveries.append(
                Delivery(request.stream, TokenDelta(new_token_ids, seq.finish_reason))
            )
            if seq.is_finished:
                del self.requests[request_id]
        return deliveries

    def run_once(self, commands: list) -> list[Delivery]:
        """One turn of the loop: apply every command, step once if anything is left, fan out.
        Commands come first, so an abort frees its blocks before the next step."""
        deliveries = []
        for command in commands:
            deliveries += self.apply(command)
        if self.engine.has_unfinished():
            self.engine.step()
        return deliveries + self.fan_out()

    def deliver(self, deliveries: list[Delivery]) -> None:
        """Hand each item to its stream on the stream's event loop: one wake-up per loop."""
        by_loop = defaultdict(list)
        for delivery in deliveries:
            by_loop[delivery.stream.loop].append(delivery)
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is left to read
                loop.call_soon_threadsafe(put_all, batch)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas until it finishes: first an empty one once the engine has
        queued it (or the engine's ValueError, raised, if it rejects it), then its tokens as they
        come. EngineError if a step fails. Leaving early (close, cancel: a client hung up)
        aborts it."""
        stream = self.add_request(prompt_token_ids, params)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):  # rejected (ValueError) or failed (EngineError)
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                self.abort(stream.request_id)
