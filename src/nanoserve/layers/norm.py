"""RMSNorm, the only normalization the Llama / Qwen families use.

Introduced in stage 00. It reduces in at least float32 (bf16 sums lose too many bits) and never in
less. `add_then_norm` is the residual add and the norm after it, written as the two plain steps
they are; layers/compiled.py compiles the pair into one kernel on a GPU.
"""

import torch
from torch import nn


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to reduce in: float32, or the input's dtype when that is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_then_norm(self, x: torch.Tensor, delta: torch.Tensor):
        """(x + delta, the norm of x + delta): a residual add, then this norm."""
        return add_rms_norm(x, delta, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., size) with a learned scale weight (size,)."""
    x_wide = x.to(reduction_dtype(x.dtype))
    variance = x_wide.pow(2).mean(-1, keepdim=True)
    x_normed = x_wide * torch.rsqrt(variance + eps)
    return weight * x_normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)): the residual stream after the add, and its norm."""
    x = x + delta
    return x, rms_norm(x, weight, eps)
