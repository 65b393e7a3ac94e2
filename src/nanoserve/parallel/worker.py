"""A tensor-parallel worker process: build this rank's engine, then run every step rank 0 sends.

Introduced in stage 09. A worker schedules nothing and samples nothing: it packs the rows rank 0
sent with the same code rank 0 used, and runs the same forward, whose collectives meet rank 0's.
It exits when told to stop, when rank 0's end of the pipe closes (rank 0 is gone), when its
parent process dies, or on any error (reported through the pipe first). Ctrl-C is rank 0's to
handle: the terminal sends SIGINT to every process, and only rank 0 decides what it means.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

from nanoserve.config import EngineConfig
from nanoserve.parallel import process_group
from nanoserve.recipes.assemble import build_engine
from nanoserve.types import ModelSpec


class Ready(NamedTuple):
    """A worker's first word: its engine is built, its graphs (if any) captured."""

    rank: int


class Booted(NamedTuple):
    """A worker's very first word: it started and imported; next it joins the group."""

    rank: int


class WorkerFailed(NamedTuple):
    """A worker's last word: the traceback of what stopped it."""

    rank: int
    traceback: str


STOP = None  # rank 0's message for "exit cleanly"


def run_worker(rank: int, port: int, stage: int, config: EngineConfig, spec: ModelSpec,
               components: dict | None, conn: Connection) -> None:  # fmt: skip
    """The worker's whole life; the target of its process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    broken = False
    try:
        conn.send(Booted(rank))
        store = process_group.worker_store(port, spec.tp_size)
        backend = process_group.backend_for(spec.device)
        process_group.join(store, backend, rank, spec.tp_size, spec.device)
        engine = build_engine(stage, config, spec, (), components)
        conn.send(Ready(rank))
        while (message := conn.recv()) is not STOP:
            engine.runner.execute(message)
    except EOFError:  # rank 0 closed its end: it is gone, or gave up on us
        broken = True
    except BaseException:
        broken = True
        with contextlib.suppress(OSError):  # rank 0 may be gone already
            conn.send(WorkerFailed(rank, traceback.format_exc()))
        os._exit(1)  # a peer may be stuck in a collective with us: do not wait on any cleanup
    finally:
        if not broken:
            process_group.leave(broken=False)


def exit_with_parent() -> None:
    """Exit the moment rank 0's process dies, even from inside a collective that would wait."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="nanoserve-parent-watch", daemon=True).start()
