"""Linear layers of the decoder: one plain layer now, its tensor-parallel siblings in stage 09.

Introduced in stage 00 as the seam stage 09 needs: `ReplicatedLinear` holds the whole (out, in)
weight and copies a checkpoint tensor in through `weight_loader`. Stage 09 adds column-, row- and
vocab-parallel layers beside it whose `weight_loader` copies only their rank's slice; nothing here
shards, communicates or fuses projections (parameter names stay Hugging Face's).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into param; ValueError when their shapes differ."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, found {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)  # .data: loading is not part of any autograd graph


class ReplicatedLinear(nn.Module):
    """y = x W^T + b, with all of W (output_size, input_size) on this rank: tensor parallel size 1.

    A drop-in for `nn.Linear` (same parameter names, shapes, init and arithmetic), so Hugging Face
    state dicts load as they are and float64 outputs do not move.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        bias_param = nn.Parameter(torch.empty(output_size)) if bias else None
        self.register_parameter("bias", bias_param)  # None registered, as nn.Linear does
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's random init; a no-op cost on the meta device, where checkpoints build."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.input_size) if self.input_size > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy the checkpoint's tensor for `param` (weight or bias); replicated: all of it."""
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
