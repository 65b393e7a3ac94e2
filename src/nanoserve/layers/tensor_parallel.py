"""Tensor parallelism's rank and size, and its three collectives, for the sharded layers.

Introduced in stage 09, given to the learner (the shard arithmetic they write is `shards.py`).
`TensorParallel(rank, size)` says which slice of every weight this process holds. The
collectives run on torch.distributed's default group (gloo on a CPU, NCCL on GPUs), which
`parallel/` sets up; at size 1 each is the identity and touches no process group at all, so one
rank pays nothing. It starts no processes and knows nothing of the engine.

    column-parallel (rows of W split)        row-parallel (columns of W split)
    x ──> [W_0] ──> y_0   (rank 0)           x_0 ──> [W_0] ──> y_0 ─┐
      └─> [W_1] ──> y_1   (rank 1)           x_1 ──> [W_1] ──> y_1 ─┴─ all_reduce(sum) ──> y
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class TensorParallel(NamedTuple):
    """Which rank this process is among how many; (0, 1) is one process holding everything."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> int:
        """total // size, the share of each rank; ValueError naming `what` if it does not divide."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} does not divide {what} ({total}); "
                f"choose a size that divides it"
            )
        return total // self.size


ONE_RANK = TensorParallel()  # one process holding every weight whole: the default everywhere


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The elementwise sum of x over all ranks, in place (every rank gets the sum)."""
    if tp.size > 1:
        dist.all_reduce(x)
    return x


def gather_on_first(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor | None:
    """Rank 0: every rank's x (N, C) side by side, (N, size * C) in rank order. Others: None."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    if tp.rank != 0:
        dist.gather(x, None, dst=0)
        return None
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest of every rank's value (each rank passes its own; all get the minimum)."""
    if tp.size == 1:
        return value
    x = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return int(x.item())
