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

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncIterator

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from nanoserve.serving.request_stream import (
    Abort,
    Add,
    Delivery,
    EngineStats,
    Request,
    RequestStream,
    TokenDelta,
)

logger = logging.getLogger("nanoserve")
_STOP = object()  # the command that ends the loop thread


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault): a server error."""


class EngineThread:
    """The thread, the command queue and the shared snapshot; `AsyncEngine` adds what runs on it.

    Called from any thread: `start`, `shutdown`, `add_request`, `abort`, reading `stats`.
    Called on the loop thread only: everything that touches `engine` or `requests`.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.requests: dict[int, Request] = {}  # request_id -> tracked request (loop thread)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # Add / Abort, in arrival order
        self.stats = EngineStats.of(engine)  # replaced by the loop thread after each iteration
        self.failure: BaseException | None = None  # what stopped the loop thread, if it broke
        self._request_ids = itertools.count()
        self._thread: threading.Thread | None = None

    # ---- any thread ----

    def start(self) -> None:
        """Start the loop thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30) -> None:
        """Abort whatever is in flight, stop the loop thread and wait for it."""
        if self._thread is None:
            return
        self.commands.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine loop did not stop within {timeout} s")
        self._thread = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the loop thread ends (a shutdown, or the loop broke: see `failure`)."""
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request for the loop; call it on an event loop, which will get its deltas."""
        if not self.is_running:
            raise EngineError(
                f"the engine loop is not running (it failed: {self.failure!r})"
                if self.failure
                else "the engine loop is not running"
            )
        stream = RequestStream(next(self._request_ids), asyncio.get_running_loop(), coalesce=True)
        self.commands.put(Add(stream, list(prompt_token_ids), params))
        return stream

    def abort(self, request_id: int) -> None:
        """Ask the loop to drop a request before its next step (unknown or finished: no-op)."""
        self.commands.put(Abort(request_id))

    # ---- the loop thread ----

    def _run(self) -> None:
        commands = []
        try:
            while True:
                commands = self._take_commands(block=not self.engine.has_unfinished())
                if _STOP in commands:  # answer everyone: nobody may wait on a stopped loop
                    late = unanswered(commands, self.requests, TokenDelta([], "abort"))
                    self.deliver(late + self.abort_all())
                    return
                self.deliver(self._iterate(commands))
                self.stats = EngineStats.of(self.engine)
        except BaseException as err:  # the loop itself broke: tell whoever waits, then die
            self.failure = err
            error = EngineError(f"the engine loop stopped: {err!r}")
            late = unanswered(commands, self.requests, error)
            self.deliver_regardless(late + self.abort_all(error))
            raise

    def _iterate(self, commands: list) -> list[Delivery]:
        """run_once, or, when it fails (a step raised), every request's end with the error: a
        failed step must not stop the loop that later requests need."""
        try:
            return self.run_once(commands)
        except Exception as err:
            logger.exception("engine loop: an iteration failed; its requests are aborted")
            error = EngineError(f"the engine failed: {err!r}")
            late = unanswered(commands, self.requests, error)
            return late + self.abort_all(error)

    def _take_commands(self, block: bool) -> list:
        """Every queued command; with nothing to step (block=True), wait for the first one."""
        commands = [self.commands.get()] if block else []
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def abort_all(self, error: EngineError | None = None) -> list[Delivery]:
        """Abort every tracked request; each stream gets `error`, or an "abort" delta."""
        self.engine.abort(request.seq for request in self.requests.values())
        deliveries = [
            Delivery(request.stream, error or TokenDelta([], "abort"))
            for request in self.requests.values()
        ]
        self.requests.clear()
        return deliveries

    def deliver_regardless(self, deliveries: list[Delivery]) -> None:
        """The way out of a broken loop: hand each item over one by one, trusting nothing the
        loop built (deliver may be what broke)."""
        put_all_threadsafe(deliveries)

    def run_once(self, commands: list) -> list[Delivery]:
        raise NotImplementedError  # AsyncEngine's

    def deliver(self, deliveries: list[Delivery]) -> None:
        raise NotImplementedError  # AsyncEngine's


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


def put_all(deliveries: list[Delivery]) -> None:
    """Put each item into its stream; runs on the streams' event loop (call_soon_threadsafe)."""
    for delivery in deliveries:
        delivery.stream.put(delivery.item)


def unanswered(commands: list, requests: dict[int, Request], item) -> list[Delivery]:
    """`item` for the stream of each Add in `commands` that the loop does not track: on the way
    out of a failed iteration, the requests that would otherwise never hear back."""
    return [
        Delivery(c.stream, item)
        for c in commands
        if isinstance(c, Add) and c.stream.request_id not in requests
    ]


def put_all_threadsafe(deliveries: list[Delivery]) -> None:
    """Hand deliveries over one by one, trusting nothing but call_soon_threadsafe (the way out
    of a broken loop, which may not deliver by itself)."""
    for delivery in deliveries:
        with contextlib.suppress(RuntimeError):
            delivery.stream.loop.call_soon_threadsafe(delivery.stream.put, delivery.item)
