"""Stage 09 starter: the shard arithmetic and the layers that hold one rank's slice of a weight.

Fill in each body (the lesson, stages/09_tensor_parallel/README.md, walks through them in task
order) in a copy: `cp stages/09_tensor_parallel/starter.py my_tp.py`, then grade it with
`pytest stages/09_tensor_parallel --impl my_tp.py`; this file itself must keep failing. Tasks 2
to 6 run your layers in real processes: 2 or 4 CPU ranks joined by a gloo process group.

    size 2, 4 query heads, 2 KV heads, gate/up of 8 features each; rows each rank holds:
      qkv_proj  rank 0: [q heads 0,1 | k head 0 | v head 0]   gate_up  rank 0: [gate 0..3 | up 0..3]
                rank 1: [q heads 2,3 | k head 1 | v head 1]            rank 1: [gate 4..7 | up 4..7]
    o_proj / down_proj (row-parallel): rank r holds the input columns its heads / features feed,
    and an all-reduce sums the ranks' partial outputs.
    vocabulary 5 over 2 ranks: rank 0 rows = ids 0 1 2, rank 1 rows = ids 3 4 + one zero row.

The constructors are given: they allocate only this rank's slice (that is the memory tensor
parallelism saves) under the attribute names the decoder reads (`num_heads`, `num_kv_heads`,
`local_sizes()`, `vocab_start`, ...). You write the arithmetic, every `weight_loader` and every
`forward`. `loaded`, in a weight_loader, is the WHOLE checkpoint tensor: a torch tensor, or a
safetensors slice that has not been read yet. Index it with `loaded[a:b]`, `loaded[:, a:b]` or
`loaded[:]` only (a slice knows nothing else: no .shape, no .narrow); `full_shape(loaded)` gives
its shape and `check_shape(loaded, shape)` raises ValueError when it is not the one you expect.
Copy into the parameter in place: `param.data.copy_(...)`, or into a part of it,
`param.data[a:b].copy_(...)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: F401  (the forwards)
from torch import nn

from nanoserve.layers.tensor_parallel import (  # noqa: F401  (given: use them, do not rewrite)
    ONE_RANK,
    TensorParallel,
    all_reduce,
    gather_on_first,
)
from nanoserve.layers.weight_loader import check_shape, default_weight_loader, full_shape  # noqa: F401

# Given (nanoserve/layers/tensor_parallel.py):
#   TensorParallel(rank, size)     which rank this process is among how many; tp.split(total,
#                                  what) is total // size, or a ValueError naming `what`
#   all_reduce(x, tp)              every rank's x summed, in place, on every rank
#   gather_on_first(x, tp)         rank 0: every rank's (N, C) side by side, (N, size * C) in
#                                  rank order; the other ranks: None
# Both are the identity at size 1 (no process group needed).

# ---- task 1: the shard arithmetic ----


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's equal slice of total items; ValueError if size does not divide it,
    or if rank is not in 0..size-1.

    12 items over 2 ranks: (0, 6) for rank 0 and (6, 12) for rank 1. 7 items over 2 ranks is an
    error, never a silent 3 + 3 that drops the 7th (or 3 + 4 that makes rank 1's slice larger
    than the tensor it was allocated for).
    """
    raise NotImplementedError("task 1: shard_range")


def padded_shard_range(total: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, end, rows) for a dimension that need not divide (the vocabulary): every rank holds
    rows = ceil(total / size) rows, of which [start, end) are real and the rest are padding.

    5 over 2: (0, 3, 3) and (3, 5, 3). 515 over 4: rows 129, rank 3 gets (387, 515, 129).
    A rank whose rows start past the end holds padding only: 2 over 4 gives rank 3 (2, 2, 1).

    Hint: rows = -(-total // size) is the ceiling; clamp start and end to total with min().
    """
    raise NotImplementedError("task 1: padded_shard_range")


# ---- task 2: column-parallel: split the output features ----


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: rank r computes output features [r * n, (r + 1) * n), n = out / size.

    Nothing is exchanged: each rank keeps its slice of y (its heads, or the input of a
    row-parallel layer).
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel = ONE_RANK
    ):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        local = tp.split(output_size, "the output features")
        self.weight = nn.Parameter(torch.empty(local, input_size))  # (out / size, in)
        self.register_parameter("bias", nn.Parameter(torch.empty(local)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's random init (free on the meta device, where checkpoints are built)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.input_size) if self.input_size > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """Copy this rank's rows of the whole (out, in) weight, or of the whole (out,) bias.

        Hint: check_shape(loaded, (self.output_size, *param.shape[1:])) covers both; then the
        rows shard_range gives this rank.
        """
        raise NotImplementedError("task 2: ColumnParallelLinear.weight_loader")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, in) -> (T, out / size): this rank's output features."""
        raise NotImplementedError("task 2: ColumnParallelLinear.forward")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same x in one weight, each split on its own.

    gate and up of 8 features each, size 2: rank 0 holds [gate 0..3 | up 0..3], rank 1
    [gate 4..7 | up 4..7], so each rank's output splits into its gate half and its up half (the
    MLP does `.chunk(2, dim=-1)`). Not [gate 0..7] on rank 0 and [up 0..7] on rank 1: that rank
    could not compute silu(gate) * up for any feature.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TensorParallel = ONE_RANK,
    ):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            tp.split(size, "each merged projection's features")
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def local_sizes(self) -> list[int]:
        """This rank's features of each merged projection, in order."""
        return [size // self.tp.size for size in self.output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        """Copy this rank's rows of projection number shard_id (a whole checkpoint tensor of
        output_sizes[shard_id] rows) into that projection's place in the merged weight.

        Hint: its place starts after this rank's rows of the projections before it,
        sum(self.local_sizes()[:shard_id]); which of its rows are this rank's is shard_range
        of output_sizes[shard_id], not of the merged total.
        """
        raise NotImplementedError("task 2: MergedColumnParallelLinear.weight_loader")


# ---- task 3: q, k and v, split by heads ----


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v in one weight, split by heads: rank r holds query heads [r * H/size, ...) and
    the KV heads [r * H_kv/size, ...) that exactly those query heads read.

    With GQA (H_kv < H) query head h reads KV head h // (H / H_kv). 8 query heads, 2 KV heads,
    size 2: rank 0 holds q heads 0-3 and KV head 0 (which q 0-3 read), rank 1 q heads 4-7 and
    KV head 1. The KV share is H_kv / size heads, not H / size.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TensorParallel = ONE_RANK,
    ):
        self.num_heads = tp.split(num_heads, "num_attention_heads")  # this rank's
        self.num_kv_heads = tp.split(num_kv_heads, "num_key_value_heads")  # this rank's
        self.head_dim = head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        """shard_id is "q", "k" or "v": the checkpoint's whole q_proj, k_proj or v_proj tensor
        (weight or bias).

        Hint: one line. The merged layout [q | k | v] with output_sizes [H*D, H_kv*D, H_kv*D]
        is already a head split: the rows a rank takes of k_proj are shard_range(H_kv * D, ...),
        which are whole heads because H_kv divides by size.
        """
        raise NotImplementedError("task 3: QKVParallelLinear.weight_loader")


# ---- task 4: row-parallel: split the input features, sum the partial outputs ----


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b: rank r holds input features [r * n, (r + 1) * n).

    Its input is the slice a column-parallel layer left on this rank; the all-reduce makes every
    rank's output whole again. The bias is added once, after the sum.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel = ONE_RANK
    ):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        local = tp.split(input_size, "the input features")
        self.weight = nn.Parameter(torch.empty(output_size, local))  # (out, in / size)
        self.register_parameter("bias", nn.Parameter(torch.empty(output_size)) if bias else None)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(input_size), 1 / math.sqrt(input_size))

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """This rank's COLUMNS of the whole (out, in) weight; the (out,) bias whole.

        Hint: param.dim() tells the weight (2) from the bias (1); default_weight_loader copies
        a whole tensor. Columns: loaded[:, start:end].
        """
        raise NotImplementedError("task 4: RowParallelLinear.weight_loader")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, in / size), this rank's input features -> (T, out), whole, on every rank.

        Hint: all_reduce the partial product first, then add the bias (added before the sum,
        it would be added size times).
        """
        raise NotImplementedError("task 4: RowParallelLinear.forward")


# ---- task 5: the vocabulary, split with padding ----


class VocabParallelEmbedding(nn.Module):
    """Embedding rows of this rank's token ids; the other ranks' ids contribute zeros, and an
    all-reduce puts every row together on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.vocab_end, rows = padded_shard_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))  # (ceil(V / size), hidden)
        nn.init.normal_(self.weight)  # nn.Embedding's init (free on the meta device)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """Copy rows vocab_start..vocab_end-1 of the whole (V, hidden) table into the first rows
        of param; the padding rows after them must hold zeros."""
        raise NotImplementedError("task 5: VocabParallelEmbedding.weight_loader")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden) embeddings, whole on every rank.

        Hint: is_mine = (ids >= vocab_start) & (ids < vocab_end); look up ids - vocab_start
        where is_mine (any row, say 0, elsewhere: ids outside this rank's rows are out of
        range), zero the rows that are not mine, all_reduce.
        """
        raise NotImplementedError("task 5: VocabParallelEmbedding.forward")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over this rank's vocabulary slice; the logits meet on rank 0.

    With tied embeddings the decoder sets head.weight = embed_tokens.weight: the same rows.
    """

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, V) logits on rank 0 (the rank that samples); None on the others.

        Hint: this rank's (N, rows) logits, gather_on_first, then keep the first vocab_size
        columns: the padding rows' logits (0) must never be sampled.
        """
        raise NotImplementedError("task 5: ParallelLMHead.compute_logits")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.compute_logits(hidden)
