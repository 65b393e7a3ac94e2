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
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

from nanoserve.parallel.group import exit_story
from nanoserve.sampling import SamplingParams
from nanoserve.serving.async_engine import _STOP, AsyncEngine, EngineError
from nanoserve.serving.request_stream import Add, Delivery, EngineStats, RequestStream

logger = logging.getLogger("nanoserve")
STARTUP_TIMEOUT_S = 900.0  # load the weights, size the pool, capture the graphs


class RemoteStream(NamedTuple):
    """What stands for a caller's RequestStream in the engine process: its id, nothing else."""

    request_id: int


class Stop(NamedTuple):
    """Command: answer every request with "abort", stop the loop and exit."""


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
    """The engine process: build the LLM, say "ready", run the loop until Stop, EOF or failure."""
    from nanoserve.llm import LLM

    try:
        llm = LLM(model, **llm_options)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise
    core = EngineCore(llm.engine, conn)
    core.start()
    conn.send(("ready", EngineStats.of(llm.engine)))

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
    if core.failure is not None:
        raise SystemExit(1)


class EngineClient:
    """The server's side of the engine process: AsyncEngine's interface, over a pipe.

    It also stands in for the `LLM` the routes read (`tokenizer`, `config`,
    `apply_chat_template`), loaded without the weights, which only the engine process holds.
    """

    generate = AsyncEngine.generate  # the caller's side is the thread loop's
    deliver = AsyncEngine.deliver  # one call_soon_threadsafe per event loop per batch

    def __init__(self, model: str, stage: int | None = None, device=None, dtype=None,
                 **engine_options):  # fmt: skip
        """Check and describe the model here; `start` builds its engine in a new process."""
        from nanoserve.config import engine_config_for
        from nanoserve.models.loader import load_model_config, load_tokenizer, model_source
        from nanoserve.stages import latest_stage, require_implemented

        self.stage = latest_stage() if stage is None else require_implemented(stage)
        source = model_source(model)
        self.tokenizer = load_tokenizer(source)
        self.config = engine_config_for(load_model_config(source), **engine_options)
        self.model = model
        self.llm_options = dict(stage=self.stage.number, device=device, dtype=dtype,
                                **engine_options)  # fmt: skip
        self.streams: dict[int, RequestStream] = {}  # request_id -> its caller's stream
        self.stats = EngineStats()
        self.failure: EngineError | None = None
        self.process = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._request_ids = itertools.count()
        self._reader: threading.Thread | None = None

    def apply_chat_template(self, conversation: list[dict]) -> str:
        from nanoserve.llm import chat_prompt

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
        return chat_prompt(self.tokenizer, conversation)

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Start the engine process and wait until its loop runs; RuntimeError if it fails."""
        if self.process is not None:
            raise RuntimeError("the engine process is already started")
        context = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_end = context.Pipe()
        self.process = context.Process(target=engine_main, name="nanoserve-engine",
                                       args=(child_end, self.model, self.llm_options))  # fmt: skip
        self.process.start()
        child_end.close()
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.1):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self._stop_process(0)
                raise RuntimeError(f"the engine process did not start (exit code "
                                   f"{self.process.exitcode})")  # fmt: skip
        kind, detail = self._conn.recv()
        if kind != "ready":
            self._stop_process(30)
            raise RuntimeError(f"the engine process failed to start:\n{detail}")
        self.stats = detail
        self._reader = threading.Thread(target=self._read, name="nanoserve-engine-reader",
                                        daemon=True)  # fmt: skip
        self._reader.start()

    @property
    def is_running(self) -> bool:
        """True while the engine process runs its loop and the pipe to it is open."""
        return self._reader is not None and self._reader.is_alive() and self.failure is None

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Send a request to the engine process; call it on the event loop that reads it."""
        import asyncio

        if not self.is_running:
            raise EngineError(str(self.failure or "the engine process is not running"))
        stream = RequestStream(next(self._request_ids), asyncio.get_running_loop(), coalesce=True)
        self.streams[stream.request_id] = stream
        try:
            self._send(Add(RemoteStream(stream.request_id), list(prompt_token_ids), params))
        except OSError as err:  # the engine process died just now
            self.streams.pop(stream.request_id, None)
            raise EngineError(f"the engine process is not running ({err})") from None
        return stream

    def abort(self, request_id: int) -> None:
        """Ask the engine process to drop a request (unknown or finished: no-op)."""
        from nanoserve.serving.request_stream import Abort

        with contextlib.suppress(OSError, EngineError):  # a dead engine process aborted it
            self._send(Abort(request_id))

    def shutdown(self, timeout: float = 30) -> None:
        """Stop the engine process (in-flight requests end with "abort") and wait for it."""
        if self.process is None:
            return
        with contextlib.suppress(OSError, EngineError):
            self._send(Stop())
        if self._reader is not None:
            self._reader.join(timeout)
        self._stop_process(timeout)

    # ---- the reader thread ----

    def _read(self) -> None:
        """Route each batch to its streams until the pipe closes; then fail whoever waits."""
        try:
            while True:
                batch, self.stats = self._conn.recv()
                self.deliver([Delivery(stream, item) for stream, item in self._route(batch)])
        except (EOFError, OSError):
            pass
        except BaseException:
            logger.exception("engine process reader: a batch could not be delivered")
        self.process.join(5)
        ended = "closed its pipe" if self.process.exitcode is None else exit_story(self.process)
        self.failure = EngineError(f"the engine process {ended}")
        if self.process.exitcode != 0:
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
        if self._conn is None or self._conn.closed:
            raise EngineError("the engine process is not running")
        with self._send_lock:
            self._conn.send(command)

    def _stop_process(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()
