"""The process group every rank joins: one fresh rendezvous per engine, gloo on CPUs, NCCL on GPUs.

Introduced in stage 09. Rank 0 hosts a TCPStore on a port the OS picks (port 0), so two engines,
or a stale one from a crashed run, never meet at the same address; the workers learn the port
when they are started. Nothing is named and nothing outlives the processes: there is no shared
memory segment to leak. It runs no model and sends no steps (that is `group.py`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

HOST = "127.0.0.1"  # ranks live on one machine; nothing listens beyond loopback
# A hung (not dead) peer is noticed only when a collective waits this long; a dead one at once.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def device_for(device: torch.device, rank: int) -> torch.device:
    """Each rank's device: GPU `rank` on CUDA (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def host_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous server, on a free port the OS picks (read it back from `.port`)."""
    return dist.TCPStore(
        HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
    )


def join(store: dist.Store, backend: str, rank: int, world_size: int, device) -> None:
    """Join this engine's process group as `rank`; returns once every rank has joined."""
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel engine is already running in this process; shut it down first "
            "(LLM.shutdown()): one process group per process"
        )
    if backend == "nccl":
        torch.cuda.set_device(device)
        # Let a failed collective raise here instead of the NCCL watchdog killing the process
        # (its default); group.py aborts the communicator when a worker dies.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if backend == "nccl" else None,
    )


def worker_store(port: int, world_size: int) -> dist.TCPStore:
    """A worker's connection to rank 0's rendezvous server."""
    return dist.TCPStore(HOST, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def leave(broken: bool) -> None:
    """Tear this process's group down; `broken`: a peer died, so abort instead of a clean exit
    (a clean destroy of an NCCL group waits for peers that will never answer)."""
    if not dist.is_initialized():
        return
    if broken and dist.get_backend() == "nccl":
        c10d._abort_process_group()
    else:
        dist.destroy_process_group()
