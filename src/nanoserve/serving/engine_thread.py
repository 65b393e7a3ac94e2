"""The loop thread of stage 10's engine loop: the thread, its command queue, the snapshot.

Introduced in stage 10 and given to its learner: `EngineThread` owns the one thread that ever
touches the `LLMEngine`, the queue of `Add` / `Abort` commands from every other thread, and the
way out when the loop breaks. What runs on the thread each turn (apply, fan out, deliver,
generate) is `AsyncEngine`'s, in serving/async_engine.py: the learner's part.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading

from nanoserve.engine.loop.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from nanoserve.serving.request_stream import (
    Abort,
    Add,
    Delivery,
    EngineStats,
    Request,
    RequestStream,
    RequestTable,
    TokenDelta,
    with_logprobs,
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
        self.requests = RequestTable()  # request_id -> tracked Request (loop thread)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # Add / Abort, in arrival order
        self.stats = EngineStats.of(engine)  # replaced by the loop thread after each iteration
        self.failure: BaseException | None = None  # what stopped the loop thread, if it broke
        self._request_ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False  # request_stop was called: no new requests

    # ---- any thread ----

    def start(self) -> None:
        """Start the loop thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine-loop", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to abort whatever is in flight and end, without waiting for it; from
        now on a new request is refused (EngineError)."""
        self._stopping = True
        self.commands.put(_STOP)

    def shutdown(self, timeout: float | None = 30) -> None:
        """Abort whatever is in flight, stop the loop thread and wait for it."""
        if self._thread is None:
            return
        self.request_stop()
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
        if self._stopping:
            raise EngineError("the engine loop is stopping: the server is shutting down")
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
        """run_once, its deltas given their logprobs where asked (`fan_out` sends token ids
        only), or, when it fails (a step raised), every request's end with the error: a failed
        step must not stop the loop that later requests need."""
        try:
            self.requests.start_turn()  # fan_out drops the requests it finishes: `held` keeps them
            return with_logprobs(self.run_once(commands), self.requests.held)
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
