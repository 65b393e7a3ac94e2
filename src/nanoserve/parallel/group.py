"""Rank 0's side of tensor parallelism: start the workers, hand them each step, notice a death.

Introduced in stage 09. The control channel is one pipe per worker (`child_process.py`: each
message is pickled and sent length-prefixed, so a message of any size goes through, and the pipe
has no name to clash with). The data plane is the process group the layers' collectives use. A
step that fails on any rank ends the group: the ranks no longer agree on where they are, so every
worker is stopped, the group is torn down, and the error says which worker and why.

    rank 0 (your process)                         rank 1..K-1 (worker processes)
    scheduler, block manager, sampler
    runner.run(batch) ── StepMessage ─ pipe ──>   runner.execute_rows(message)
       forward (shard 0) <── all_reduce, gather ──> forward (shard r)
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from nanoserve.child_process import ChildDied, ChildProcess, Ready, broadcast, receive_all, stop_all
from nanoserve.config import EngineConfig
from nanoserve.engine.loop.llm_engine import LLMEngine
from nanoserve.layers.tensor_parallel import TensorParallel
from nanoserve.models.loader import load_model_config
from nanoserve.parallel import process_group
from nanoserve.parallel.worker import Booted, run_worker
from nanoserve.recipes.assemble import build_engine, require_shardable
from nanoserve.types import ModelSpec, StepMessage

logger = logging.getLogger("nanoserve")
STARTUP_TIMEOUT_S = 600.0  # build a shard, size the pool, capture graphs: minutes at worst


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or failed; the engine is shut down and cannot go on."""


class WorkerGroup:
    """Ranks 1..K-1: their processes, their pipes, and whether they are still in step with us."""

    def __init__(self, workers: list[ChildProcess], backend: str, store) -> None:
        self.workers, self.backend = workers, backend
        self.store = store  # rank 0's rendezvous server: it lives as long as the group
        self.closed_because: str | None = None  # set once: why the group no longer runs
        self.largest_message_bytes = 0  # the control channel has no size limit; this shows it
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, stop_all, workers)
        threading.Thread(target=self._watch, name="nanoserve-worker-watch", daemon=True).start()

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker processes, rank 1 first."""
        return [worker.process for worker in self.workers]

    @contextmanager
    def step(self, message: StepMessage) -> Iterator[None]:
        """Send every worker this step, then let rank 0 run its own share (see StepFanout)."""
        if self.closed_because is not None:
            raise WorkerDied(
                f"the tensor-parallel engine is shut down ({self.closed_because}); "
                "build a new LLM to go on"
            )
        try:
            num_bytes = broadcast(self.workers, message)
            self.largest_message_bytes = max(self.largest_message_bytes, num_bytes)
            yield
        except BaseException as err:  # a dead peer, a collective error, or Ctrl-C mid-step
            # A collective fails as soon as a killed peer's socket closes, which can be before
            # that peer is reaped; on a loaded machine that took over a second (a test saw the
            # bare gloo error). Ctrl-C keeps the shorter wait: the user is waiting on it.
            interrupted = isinstance(err, KeyboardInterrupt)
            failure = self.describe_failure(grace_s=1.0 if interrupted else 5.0)
            self.shutdown(broken=True, reason=failure or f"a step failed on rank 0: {err!r}")
            if failure is None:
                raise
            raise WorkerDied(
                f"{failure}; the engine is shut down and this call's requests "
                "were aborted; build a new LLM to go on"
            ) from err

    def describe_failure(self, grace_s: float = 1.0) -> str | None:
        """Which workers failed and how, if any did (waiting up to grace_s for them to exit)."""
        deadline = time.monotonic() + grace_s
        stories = [w.failure(max(0.0, deadline - time.monotonic())) for w in self.workers]
        return "; ".join(story for story in stories if story) or None

    def wait_until(self, kind: type, timeout_s: float) -> None:
        """Block until every worker has said `kind` (Booted, Ready); WorkerDied if one dies."""
        try:
            receive_all(self.workers, kind, timeout_s, doing="start")
        except ChildDied as err:
            raise WorkerDied(str(err)) from None

    def shutdown(self, broken: bool = False, reason: str = "shut down") -> None:
        """Stop every worker (politely unless broken), close the pipes, leave the group (once)."""
        with self._lock:
            if self.closed_because is not None:
                return
            self.closed_because = reason
        stop_all(self.workers, polite=not broken, timeout_s=0.2 if broken else 5.0)
        self._finalizer.detach()
        process_group.leave(broken)

    def _watch(self) -> None:
        """Notice a worker that dies between or inside steps; on NCCL, abort the communicator so
        that rank 0's collective (which would wait for the dead peer forever) raises instead."""
        sentinels = [w.sentinel for w in self.workers]
        while self.closed_because is None:
            if wait(sentinels, timeout=0.5) and self.closed_because is None:
                dead = [
                    w.describe_exit() for w in self.workers if w.exit_code() not in (None, 0)
                ]  # 0: asked to stop
                if not dead:
                    return
                logger.error("tensor-parallel worker died: %s", ", ".join(dead))
                if self.backend == "nccl":
                    process_group.leave(broken=True)
                return


def start_engine(
    stage: int, config: EngineConfig, spec: ModelSpec, eos_ids, components: dict | None = None
) -> LLMEngine:
    """Rank 0's engine plus tensor_parallel_size - 1 workers, each holding its shard."""
    size = config.tensor_parallel_size
    require_shardable(stage, size)
    check_divisible(load_model_config(spec.source), size)
    backend = process_group.backend_for(spec.device)
    if backend == "nccl" and size > torch_cuda_count():
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs; {torch_cuda_count()} are visible"
        )
    store = process_group.host_store(size)
    group = spawn_workers(stage, config, spec, components, store, backend)
    try:
        group.wait_until(Booted, STARTUP_TIMEOUT_S)
        rank0 = spec._replace(
            tp_rank=0, tp_size=size, device=process_group.device_for(spec.device, 0)
        )
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
    """Start ranks 1..size-1, each a `ChildProcess` running `run_worker` on its shard's spec."""
    size, workers = config.tensor_parallel_size, []
    try:
        for rank in range(1, size):
            device = process_group.device_for(spec.device, rank)
            worker_spec = spec._replace(tp_rank=rank, tp_size=size, device=device)
            args = (rank, store.port, stage, config, worker_spec, components)
            workers.append(ChildProcess(run_worker, args, name=f"tensor-parallel worker {rank}"))
    except BaseException:
        stop_all(workers, polite=False)
        raise
    return WorkerGroup(workers, backend, store)


def torch_cuda_count() -> int:
    """GPUs torch can see."""
    import torch

    return torch.cuda.device_count()
