"""SwiGLU's elementwise middle, silu(gate) * up, on the halves of one merged projection.

Introduced in stage 09, when gate and up became one matmul (`MergedColumnParallelLinear`); stage
08's fused-ops pass swaps in a compiled version on a GPU. The stage 00 oracle stays
`models/decoder.swiglu`, which takes the three weights apart.
"""

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: SwiGLU's elementwise middle."""
    return F.silu(gate) * up
