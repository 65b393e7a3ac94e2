"""A tensor-parallel worker process: build this rank's runner, then run every step rank 0 sends.

Introduced in stage 09. A worker schedules nothing and samples nothing: it packs the rows rank 0
sent with the same code rank 0 used, and runs the same forward, whose collectives meet rank 0's.
It exits when told to `Stop`, when rank 0's end of the pipe closes (rank 0 is gone), when its
parent process dies, or on any error (its traceback sent first): `child_process.run_child` sees to
the last three, and to leaving Ctrl-C to rank 0, which alone decides what it means.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import NamedTuple

from nanoserve.child_process import Ready, Stop
from nanoserve.config import EngineConfig
from nanoserve.parallel import process_group
from nanoserve.recipes.assemble import build_runner
from nanoserve.types import ModelSpec


class Booted(NamedTuple):
    """A worker's very first word: it started and imported; next it joins the group."""

    rank: int


def run_worker(
    conn: Connection,
    rank: int,
    port: int,
    stage: int,
    config: EngineConfig,
    spec: ModelSpec,
    components: dict | None,
) -> None:
    """The worker's whole life, run by `child_process.run_child`; an error ends it there."""
    conn.send(Booted(rank))
    store = process_group.worker_store(port, spec.tp_size)
    backend = process_group.backend_for(spec.device)
    process_group.join(store, backend, rank, spec.tp_size, spec.device)
    runner = build_runner(stage, config, spec, components).runner
    conn.send(Ready(rank))
    try:
        while not isinstance(message := conn.recv(), Stop):
            runner.execute_rows(message)
    except EOFError:  # rank 0 closed its end: it is gone, or gave up on us; no clean leave
        return
    process_group.leave(broken=False)
