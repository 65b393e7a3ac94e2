"""Linear layers that hold one rank's slice of a weight: column-, merged-column- and row-parallel.

Introduced in stage 09 (stage 00 had one plain linear here, the seam). Each layer allocates only
its rank's slice and fills it through `weight_loader`, which reads that slice of the checkpoint
tensor and nothing more (a safetensors slice reads only those bytes). At tensor_parallel_size 1
every slice is the whole weight and no layer communicates: it is `nn.Linear`'s arithmetic.

    QKVParallelLinear at size 2, 4 query heads and 2 KV heads (GQA, 2 queries per KV head):
    rank 0 weight rows: [q heads 0,1 | k head 0 | v head 0]   q heads 0,1 read KV head 0
    rank 1 weight rows: [q heads 2,3 | k head 1 | v head 1]   q heads 2,3 read KV head 1
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.shards import shard_range
from nanoserve.layers.tensor_parallel import ONE_RANK, TensorParallel, all_reduce
from nanoserve.layers.weight_loader import check_shape, default_weight_loader


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: rank r computes output features [r * n, (r + 1) * n), n = out / size.

    Nothing is exchanged: the next layer consumes the slice (heads, or a row-parallel input).
    """

    bias: nn.Parameter | None  # registered in __init__ (None: no bias)

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel = ONE_RANK
    ):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        local = tp.split(output_size, "the output features")
        self.weight = nn.Parameter(torch.empty(local, input_size))
        self.register_parameter("bias", nn.Parameter(torch.empty(local)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's random init (a no-op cost on the meta device, where checkpoints build)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.input_size) if self.input_size > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """Copy this rank's rows of the whole (out, in) weight or (out,) bias."""
        check_shape(loaded, (self.output_size, *param.shape[1:]))
        start, end = shard_range(self.output_size, self.tp.rank, self.tp.size)
        param.data.copy_(loaded[start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp.rank}/{self.tp.size}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same x in one weight, each split on its own.

    gate and up of 6 features each, size 2: rank 0 holds [gate 0..2 | up 0..2], rank 1
    [gate 3..5 | up 3..5], so each rank's output splits into its gate and its up halves.
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

    # The loader passes shard_id to merged layers only: their signature differs from the base's
    # on purpose (as in vLLM), hence the ignore.
    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:  # type: ignore[override]
        """Copy this rank's rows of projection shard_id into its place in the merged weight."""
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        local = self.local_sizes()
        offset = sum(local[:shard_id])
        start, end = shard_range(self.output_sizes[shard_id], self.tp.rank, self.tp.size)
        param.data[offset : offset + local[shard_id]].copy_(loaded[start:end])


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v in one weight, split by heads: rank r holds query heads [r * H/size, ...) and
    the KV heads [r * H_kv/size, ...) that exactly those query heads read (see the picture)."""

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
        self.num_kv_heads = tp.split(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:  # type: ignore[override]
        """shard_id is "q", "k" or "v": the checkpoint's q_proj, k_proj or v_proj tensor."""
        super().weight_loader(param, loaded, "qkv".index(shard_id))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b: rank r holds input features [r * n, (r + 1) * n).

    Its input is the slice a column-parallel layer left on this rank; the all-reduce makes every
    rank's output whole again. The bias is added once, after the sum.
    """

    bias: nn.Parameter | None  # registered in __init__ (None: no bias)

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel = ONE_RANK
    ):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        local = tp.split(input_size, "the input features")
        self.weight = nn.Parameter(torch.empty(output_size, local))
        self.register_parameter("bias", nn.Parameter(torch.empty(output_size)) if bias else None)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(input_size), 1 / math.sqrt(input_size))

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """This rank's columns of the whole (out, in) weight; the (out,) bias whole."""
        if param.dim() == 1:
            return default_weight_loader(param, loaded)
        check_shape(loaded, (self.output_size, self.input_size))
        start, end = shard_range(self.input_size, self.tp.rank, self.tp.size)
        param.data.copy_(loaded[:, start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp.rank}/{self.tp.size}"
