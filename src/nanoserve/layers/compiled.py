"""Fused small ops on a GPU: RMSNorm, RoPE and SiLU-times-up compiled into one kernel each.

Introduced in stage 08. Eager torch runs each of these as several elementwise kernels (a cast,
a square, a mean, an rsqrt, a multiply, a cast back), and at decode batch sizes every one of them
is a full round trip through memory. `torch.compile` fuses each into a single Triton kernel. The
plain functions stay the oracle and the CPU path; this swaps bound methods only, so parameter
names, the state dict and the arithmetic's order of operations do not change.
"""

from __future__ import annotations

import logging

import torch

from nanoserve.layers.activation import silu_mul
from nanoserve.layers.norm import RMSNorm, rms_norm
from nanoserve.layers.rotary import apply_rotary

logger = logging.getLogger("nanoserve")


def fuse_small_ops(model: torch.nn.Module) -> int:
    """Point every RMSNorm, rotary and SwiGLU of model at compiled versions; returns how many."""
    norm = torch.compile(rms_norm, dynamic=True)
    rotate = torch.compile(apply_rotary, dynamic=True)
    middle = torch.compile(silu_mul, dynamic=True)
    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            _point(module, "forward", lambda x, m=module: norm(x, m.weight, m.eps))
        elif hasattr(module, "rotate"):  # the decoder's attention
            _point(module, "rotate", rotate)
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
        module.__dict__.pop("forward", None)  # the instance override, if any; the class's stays
        if hasattr(module, "rotate"):
            _point(module, "rotate", apply_rotary)
        if hasattr(module, "act"):
            _point(module, "act", silu_mul)


def _point(module: torch.nn.Module, name: str, function) -> None:
    """Set an instance attribute of module to a plain function (`unfuse_small_ops` pops it)."""
    module.__dict__[name] = function  # nn.Module's setattr is typed for tensors and modules only
