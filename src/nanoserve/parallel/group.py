"""Rank 0's side of tensor parallelism: start the workers, hand them each step, notice a death.

Introduced in stage 09. The control channel is one multiprocessing Pipe per worker: each message
is pickled and sent length-prefixed, so a message of any size goes through (no fixed buffer), and
the pipe has no name to clash with. The data plane is the process group the layers' collectives
use. A step that fails on any rank ends the group: the ranks no longer agree on where they are,
so every worker is stopped, the group is torn down, and the error says which worker and why.

    rank 0 (your process)                         rank 1..K-1 (worker processes)
    scheduler, block manager, sampler
    runner.run(batch) ── StepMessage ─ pipe ──>   runner.execute(message)
       forward (shard 0) <── all_reduce, gather ──> forward (shard r)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.layers.tensor_parallel import TensorParallel
from nanoserve.models.loader import load_model_config
from nanoserve.parallel import process_group
from nanoserve.parallel.worker import Booted, Ready, WorkerFailed, run_worker
from nanoserve.recipes.assemble import build_engine, require_shardable
from nanoserve.types import ModelSpec, StepMessage

logger = logging.getLogger("nanoserve")
STARTUP_TIMEOUT_S = 600.0  # build a shard, size the pool, capture graphs: minutes at worst


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or failed; the engine is shut down and cannot go on."""


class WorkerGroup:
    """Ranks 1..K-1: their processes, their pipes, and whether they are still in step with us."""

    def __init__(self, processes: list[mp.Process], conns: list[Connection], backend: str,
                 store) -> None:  # fmt: skip
        self.processes, self.conns, self.backend = processes, conns, backend
        self.store = store  # rank 0's rendezvous server: it lives as long as the group
        self.closed_because: str | None = None  # set once: why the group no longer runs
        self.largest_message_bytes = 0  # the control channel has no size limit; this shows it
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, stop_processes, processes, conns)
        threading.Thread(target=self._watch, name="nanoserve-worker-watch", daemon=True).start()

    @contextmanager
    def step(self, message: StepMessage) -> Iterator[None]:
        """Send every worker this step, then let rank 0 run its own share (see StepFanout)."""
        if self.closed_because is not None:
            raise WorkerDied(f"the tensor-parallel engine is shut down ({self.closed_because}); "
                             "build a new LLM to go on")  # fmt: skip
        try:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            self.largest_message_bytes = max(self.largest_message_bytes, len(payload))
            for conn in self.conns:
                conn.send_bytes(payload)  # length-prefixed; the worker's recv() unpickles it
            yield
        except BaseException as err:  # a dead peer, a collective error, or Ctrl-C mid-step
            failure = self.describe_failure()
            self.shutdown(broken=True, reason=failure or f"a step failed on rank 0: {err!r}")
            if failure is None:
                raise
            raise WorkerDied(f"{failure}; the engine is shut down and this call's requests "
                             "were aborted; build a new LLM to go on") from err  # fmt: skip

    def describe_failure(self, grace_s: float = 1.0) -> str | None:
        """Which workers failed and how, if any did (waiting up to grace_s for them to exit)."""
        deadline, stories = time.monotonic() + grace_s, []
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            process.join(max(0.0, deadline - time.monotonic()))
            last_word = read_last_word(conn)
            if isinstance(last_word, WorkerFailed):
                stories.append(f"tensor-parallel worker {rank} failed:\n{last_word.traceback}")
            elif process.exitcode is not None:
                stories.append(f"tensor-parallel worker {rank} (pid {process.pid}) "
                               f"{exit_story(process)}")  # fmt: skip
        return "; ".join(stories) or None

    def wait_until(self, kind: type, timeout_s: float) -> None:
        """Block until every worker has said `kind` (Booted, Ready); WorkerDied if one dies."""
        deadline = time.monotonic() + timeout_s
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            while not conn.poll(0.05):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise WorkerDied(self.describe_failure(0.5) or
                                     f"tensor-parallel worker {rank} did not start in "
                                     f"{timeout_s:.0f} s")  # fmt: skip
            word = conn.recv()
            if isinstance(word, WorkerFailed):
                raise WorkerDied(f"tensor-parallel worker {rank} failed:\n{word.traceback}")
            if not isinstance(word, kind):
                raise WorkerDied(f"worker {rank} said {word!r}, expected {kind.__name__}")

    def shutdown(self, broken: bool = False, reason: str = "shut down") -> None:
        """Stop every worker (politely unless broken), close the pipes, leave the group (once)."""
        with self._lock:
            if self.closed_because is not None:
                return
            self.closed_because = reason
        stop_processes(self.processes, self.conns, polite=not broken)
        self._finalizer.detach()
        process_group.leave(broken)

    def _watch(self) -> None:
        """Notice a worker that dies between or inside steps; on NCCL, abort the communicator so
        that rank 0's collective (which would wait for the dead peer forever) raises instead."""
        sentinels = [p.sentinel for p in self.processes]
        while self.closed_because is None:
            if wait(sentinels, timeout=0.5) and self.closed_because is None:
                dead = [f"{p.name} ({exit_story(p)})" for p in self.processes
                        if p.exitcode not in (None, 0)]  # 0: asked to stop  # fmt: skip
                if not dead:
                    return
                logger.error("tensor-parallel worker died: %s", ", ".join(dead))
                if self.backend == "nccl":
                    process_group.leave(broken=True)
                return


def read_last_word(conn: Connection):
    """A message a worker left in the pipe before it exited, if any."""
    try:
        return conn.recv() if conn.poll(0) else None
    except (EOFError, OSError):
        return None


def exit_story(process: mp.Process) -> str:
    """How a process ended, in words: 'was killed by signal 9', 'exited with status 1'."""
    code = process.exitcode
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def stop_processes(processes: list[mp.Process], conns: list[Connection], polite=True) -> None:
    """Ask the workers to stop (polite), then terminate and kill what is left; close the pipes."""
    for conn in conns:
        try:
            if polite:
                conn.send(None)
        except OSError:
            pass
    for process in processes:
        process.join(5.0 if polite else 0.2)
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


def start_engine(stage: int, config: EngineConfig, spec: ModelSpec, eos_ids,
                 components: dict | None = None) -> LLMEngine:  # fmt: skip
    """Rank 0's engine plus tensor_parallel_size - 1 workers, each holding its shard."""
    size = config.tensor_parallel_size
    require_shardable(stage, size)
    check_divisible(load_model_config(spec.source), size)
    backend = process_group.backend_for(spec.device)
    if backend == "nccl" and size > torch_cuda_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; "
                         f"{torch_cuda_count()} are visible")  # fmt: skip
    store = process_group.host_store(size)
    group = spawn_workers(stage, config, spec, components, store, backend)
    try:
        group.wait_until(Booted, STARTUP_TIMEOUT_S)
        rank0 = spec._replace(tp_rank=0, tp_size=size,
                              device=process_group.device_for(spec.device, 0))  # fmt: skip
        process_group.join(store, backend, 0, size, rank0.device)
        engine = build_engine(stage, config, rank0, eos_ids, components, workers=group)
        group.wait_until(Ready, STARTUP_TIMEOUT_S)
    except BaseException as err:
        failure = group.describe_failure(1.0)
        group.shutdown(broken=True, reason=failure or repr(err))
        if failure is None:
            raise
        raise WorkerDied(failure) from err
    return engine


def check_divisible(model_config, size: int) -> None:
    """ValueError before any process starts when size cannot split the heads or the MLP."""
    tp = TensorParallel(0, size)
    tp.split(model_config.num_attention_heads, "num_attention_heads")
    tp.split(model_config.num_key_value_heads, "num_key_value_heads (the KV heads)")
    tp.split(model_config.intermediate_size, "intermediate_size")


def spawn_workers(stage, config, spec, components, store, backend: str) -> WorkerGroup:
    """Start ranks 1..size-1 (spawned: a fresh interpreter, never a fork of a CUDA process)."""
    context = mp.get_context("spawn")
    processes, conns = [], []
    for rank in range(1, config.tensor_parallel_size):
        ours, theirs = context.Pipe()
        worker_spec = spec._replace(tp_rank=rank, tp_size=config.tensor_parallel_size,
                                    device=process_group.device_for(spec.device, rank))  # fmt: skip
        process = context.Process(target=run_worker, name=f"nanoserve-tp-worker-{rank}",
                                  args=(rank, store.port, stage, config, worker_spec, components,
                                        theirs),
                                  daemon=True)  # fmt: skip
        process.start()
        theirs.close()  # ours is now the only handle: the worker sees EOF when we go
        processes.append(process)
        conns.append(ours)
    return WorkerGroup(processes, conns, backend, store)


def torch_cuda_count() -> int:
    """GPUs torch can see."""
    import torch

    return torch.cuda.device_count()
