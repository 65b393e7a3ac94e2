"""The engine loop in a process of its own, so that HTTP work never waits on its GIL (stage 10).

Introduced in stage 10. In one process, the event loop that parses requests and writes 256 event
streams and the loop thread that steps the engine take turns holding one interpreter lock: on
the H200 the served run lost a third of the offline throughput to it. `nanoserve serve` therefore
runs the stage's `AsyncEngine` in a child process (vLLM's "engine core") and keeps only the HTTP
side, the tokenizer and the text in the server process. The two talk over one pipe:

    server process                                        engine process
      EngineClient.add_request --- Add(RemoteStream(7), ids, params) -->  EngineCore, the
      EngineClient.abort       --- Abort(7) ----------------------------> AsyncEngine you built,
      reader thread <--- ([(7, TokenDelta([17], None)), ...], EngineStats) --- one batch per turn
      the streams' event loop <-- call_soon_threadsafe (AsyncEngine.deliver) -- reader thread

The engine process only swaps the loop's way in (commands from the pipe) and way out (each
turn's deliveries pickled down the pipe): apply, step and fan out are the thread loop's, word
for word. The server side is `AsyncEngine`'s `generate` and `deliver` over a pipe instead of a
queue. If the engine process dies, every waiting request gets an EngineError and /health says so.
Starting it, the pipe, the handshake and telling how it ended are `child_process.py`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import NamedTuple

from nanoserve.child_process import ChildDied, ChildProcess, Ready, Stop, stop_all
from nanoserve.sampling import SamplingParams
from nanoserve.serving.async_engine import AsyncEngine
from nanoserve.serving.engine_thread import _STOP, EngineError
from nanoserve.serving.request_stream import Add, Delivery, EngineStats, RequestStream

logger = logging.getLogger("nanoserve")
STARTUP_TIMEOUT_S = 900.0  # load the weights, size the pool, capture the graphs


class RemoteStream(NamedTuple):
    """What stands for a caller's RequestStream in the engine process: its id, nothing else."""

    request_id: int


class EngineCore(AsyncEngine):
    """The stage's AsyncEngine with its deliveries sent down a pipe, batched per turn."""

    def __init__(self, engine, conn: Connection):
        super().__init__(engine)
        self.conn = conn

    def deliver(self, deliveries: list[Delivery]) -> None:
        batch = [(d.stream.request_id, d.item) for d in deliveries]
        self.conn.send((batch, EngineStats.of(self.engine)))

    def deliver_regardless(self, deliveries: list[Delivery]) -> None:
        with contextlib.suppress(OSError):  # the server is gone too: nobody is left to tell
            self.conn.send(([(d.stream.request_id, d.item) for d in deliveries], self.stats))


def engine_main(conn: Connection, model: str, llm_options: dict) -> None:
    """The engine process: build the LLM, say Ready, run the loop until Stop, EOF or failure
    (Stop: every request is answered with "abort"; a failure to build is run_child's to send)."""
    from nanoserve.llm import LLM

    llm = LLM(model, **llm_options)
    core = EngineCore(llm.engine, conn)
    core.start()
    conn.send(Ready(EngineStats.of(llm.engine)))

    def pump() -> None:  # commands in, in arrival order, until told to stop
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the server process is gone: stop with it
                command = Stop()
            core.commands.put(_STOP if isinstance(command, Stop) else command)
            if isinstance(command, Stop):
                return

    threading.Thread(target=pump, name="nanoserve-engine-commands", daemon=True).start()
    try:
        core.wait()  # until Stop ends the loop, or the loop breaks (its waiting requests are told)
    finally:
        llm.shutdown()
    # Every request is answered and the workers are stopped: exit now. The interpreter's own
    # teardown (torch's modules, one by one) took 2 s of every server shutdown, for nothing.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1 if core.failure is not None else 0)


class EngineClient:
    """The server's side of the engine process: AsyncEngine's interface, over a pipe.

    It also stands in for the `LLM` the routes read (`tokenizer`, `config`,
    `apply_chat_template`), loaded without the weights, which only the engine process holds.
    """

    generate = AsyncEngine.generate  # the caller's side is the thread loop's

    def __init__(
        self, model: str, stage: int | None = None, device=None, dtype=None, **engine_options
    ):
        """Check and describe the model here; `start` builds its engine in a new process."""
        from nanoserve.config import engine_config_for
        from nanoserve.llm_arguments import resolve_device
        from nanoserve.models.loader import load_model_config, load_tokenizer, model_source
        from nanoserve.stages import latest_stage, require_implemented

        self.stage = latest_stage() if stage is None else require_implemented(stage)
        source = model_source(model)
        self.tokenizer = load_tokenizer(source)
        model_config = load_model_config(source)  # the engine process's config, as it will be
        self.config = engine_config_for(model_config, resolve_device(device), **engine_options)
        self.model = model
        self.llm_options = dict(
            stage=self.stage.number, device=device, dtype=dtype, **engine_options
        )
        self.streams: dict[int, RequestStream] = {}  # request_id -> its caller's stream
        self.stats = EngineStats()
        self.failure: EngineError | None = None
        self.child: ChildProcess | None = None
        self._send_lock = threading.Lock()
        self._request_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._stopping = False  # request_stop was called: no new requests

    def deliver(self, deliveries: list[Delivery]) -> None:
        """One call_soon_threadsafe per event loop per batch: AsyncEngine's own (it reads only
        the deliveries, never the engine)."""
        AsyncEngine.deliver(self, deliveries)  # type: ignore[arg-type]

    def apply_chat_template(self, conversation: list[dict]) -> str:
        from nanoserve.llm_arguments import chat_prompt

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
        return chat_prompt(self.tokenizer, conversation)

    @property
    def process(self):
        """The engine process (a multiprocessing.Process), once started."""
        return None if self.child is None else self.child.process

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Start the engine process and wait until its loop runs; ChildDied (a RuntimeError)
        with its traceback or its exit if it fails."""
        if self.child is not None:
            raise RuntimeError("the engine process is already started")
        # Not a daemon: with tensor_parallel_size > 1 it starts worker processes of its own.
        self.child = ChildProcess(
            engine_main, (self.model, self.llm_options), name="the engine process", daemon=False
        )
        try:
            self.stats = self.child.receive(Ready, timeout, doing="start").info
        except BaseException:
            stop_all([self.child], polite=False, timeout_s=1.0)
            raise
        self._reader = threading.Thread(
            target=self._read, name="nanoserve-engine-reader", daemon=True
        )
        self._reader.start()

    @property
    def is_running(self) -> bool:
        """True while the engine process runs its loop and the pipe to it is open."""
        return self._reader is not None and self._reader.is_alive() and self.failure is None

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Send a request to the engine process; call it on the event loop that reads it."""
        import asyncio

        if self._stopping:
            raise EngineError("the engine process is stopping: the server is shutting down")
        if not self.is_running:
            raise EngineError(str(self.failure or "the engine process is not running"))
        stream = RequestStream(next(self._request_ids), asyncio.get_running_loop(), coalesce=True)
        self.streams[stream.request_id] = stream
        try:
            remote = RemoteStream(stream.request_id)  # the stream's stand-in across the pipe
            self._send(Add(remote, list(prompt_token_ids), params))  # type: ignore[arg-type]
        except OSError as err:  # the engine process died just now
            self.streams.pop(stream.request_id, None)
            raise EngineError(f"the engine process is not running ({err})") from None
        return stream

    def abort(self, request_id: int) -> None:
        """Ask the engine process to drop a request (unknown or finished: no-op)."""
        from nanoserve.serving.request_stream import Abort

        with contextlib.suppress(OSError, EngineError):  # a dead engine process aborted it
            self._send(Abort(request_id))

    def request_stop(self) -> None:
        """Ask the engine process to abort what runs and exit, without waiting for it; from now
        on a new request is refused (EngineError)."""
        self._stopping = True
        with contextlib.suppress(OSError, EngineError):
            self._send(Stop())

    def shutdown(self, timeout: float = 30) -> None:
        """Stop the engine process (in-flight requests end with "abort") and wait for it."""
        if self.child is None:
            return
        self.request_stop()
        if self._reader is not None:
            self._reader.join(timeout)  # it reads the aborts, then the end of the pipe
        stop_all([self.child], polite=False, timeout_s=timeout)  # Stop is sent: make sure

    # ---- the reader thread ----

    def _read(self) -> None:
        """Route each batch to its streams until the pipe closes; then fail whoever waits."""
        assert self.child is not None, "the reader starts after the engine process"
        try:
            while True:
                batch, self.stats = self.child.receive(tuple)
                self.deliver([Delivery(stream, item) for stream, item in self._route(batch)])
        except ChildDied as err:  # it exited (asked to, or not), failed, or closed its pipe
            self.failure = EngineError(str(err))
        except BaseException as err:
            logger.exception("engine process reader: a batch could not be delivered")
            self.failure = EngineError(f"the engine process reader failed: {err!r}")
        if self.child.exit_code() != 0:
            logger.error("%s", self.failure)
        waiting = [Delivery(self.streams.pop(i), self.failure) for i in list(self.streams)]
        self.deliver(waiting)

    def _route(self, batch: list) -> list:
        """(stream, item) for each (request_id, item); a stream is forgotten at its last item."""
        routed = []
        for request_id, item in batch:
            last = isinstance(item, Exception) or item.finish_reason is not None
            stream = self.streams.pop(request_id) if last else self.streams.get(request_id)
            if stream is not None:
                routed.append((stream, item))
        return routed

    def _send(self, command) -> None:
        if self.child is None or self.child.conn.closed:
            raise EngineError("the engine process is not running")
        with self._send_lock:
            self.child.send(command)
