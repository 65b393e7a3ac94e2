"""Fused small ops on a GPU: each RMSNorm with the residual add before it, q/k norms with RoPE,
and SiLU-times-up, compiled into one kernel each.

Introduced in stage 08. Eager torch runs each of these as several elementwise kernels (a cast,
a square, a mean, an rsqrt, a multiply, a cast back), and at decode batch sizes every one of them
is a full round trip through memory. `torch.compile` fuses each into a single Triton kernel, and
the pairs the decoder runs back to back (the residual add and the norm after it; Qwen3's q and k
norms and the rotation after them) into one function per pair: a decode step pays about 2 ms
for its small kernels whatever its batch, a third of a step at batch 186 and most of it at
batch 16 (docs/benchmarks.md, "Where the workload's time goes").
The plain functions stay the oracle and the CPU path; this swaps bound methods only, so
parameter names, the state dict and the arithmetic's order of operations do not change.
"""

from __future__ import annotations

import logging

import torch

from nanoserve.layers.activation import silu_mul
from nanoserve.layers.norm import RMSNorm, add_rms_norm, rms_norm
from nanoserve.layers.rotary import apply_rotary

logger = logging.getLogger("nanoserve")


def norm_rotate(q, k, cos, sin, q_weight, k_weight, eps: float):
    """Qwen3's q and k norms, then RoPE: `Attention.norm_and_rotate` as one function of tensors,
    so that one compiled graph serves every layer (a bound method would be compiled per layer)."""
    return apply_rotary(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)


def fuse_small_ops(model: torch.nn.Module) -> int:
    """Point every RMSNorm (and its residual add), q/k norm and RoPE and SwiGLU of model at
    compiled versions; returns how many modules now run compiled code."""
    norm = torch.compile(rms_norm, dynamic=True)
    add_norm = torch.compile(add_rms_norm, dynamic=True)
    rotate = torch.compile(apply_rotary, dynamic=True)
    norms_rotate = torch.compile(norm_rotate, dynamic=True)
    middle = torch.compile(silu_mul, dynamic=True)
    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            _point(module, "forward", lambda x, m=module: norm(x, m.weight, m.eps))
            _point(module, "add_then_norm", lambda x, d, m=module: add_norm(x, d, m.weight, m.eps))
        elif hasattr(module, "norm_and_rotate") and getattr(module, "qk_norm", False):
            _point(module, "norm_and_rotate", lambda q, k, cos, sin, m=module: norms_rotate(
                q, k, cos, sin, m.q_norm.weight, m.k_norm.weight, m.q_norm.eps))  # fmt: skip
        elif hasattr(module, "norm_and_rotate"):  # the decoder's attention, no q/k norms
            _point(module, "norm_and_rotate", rotate)
        elif hasattr(module, "act"):  # the MLP's silu(gate) * up
            _point(module, "act", middle)
        else:
            continue
        count += 1
    logger.info("fused %d small ops with torch.compile", count)
    return count


def unfuse_small_ops(model: torch.nn.Module) -> None:
    """Undo `fuse_small_ops`: every module back on the plain torch functions."""
    for module in model.modules():
        for name in ("forward", "add_then_norm", "norm_and_rotate"):
            module.__dict__.pop(name, None)  # the instance override, if any; the class's stays
        if hasattr(module, "act"):
            _point(module, "act", silu_mul)


def _point(module: torch.nn.Module, name: str, function) -> None:
    """Set an instance attribute of module to a plain function (`unfuse_small_ops` pops it)."""
    module.__dict__[name] = function  # nn.Module's setattr is typed for tensors and modules only
