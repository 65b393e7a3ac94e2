"""Stage 13: a KV pool of float8 (e4m3) codes, one power-of-two scale per (block, KV head).

Introduced in stage 13. Each stored K or V value is one byte, an e4m3 code; the value it stands
for is `e4m3(code) * 2**e`, where `e` is the exponent of its block and KV head. The exponent is the
smallest that keeps the block's largest magnitude (its amax) within e4m3's 448:

    e = the smallest integer with amax <= 448 * 2**e    amax 3.1 -> 3.1 / 448 = 0.0069 -> e = -7
    code = e4m3(x / 2**e)               x = 1.3 -> 1.3 * 128 = 166.4 -> code 0x72 (160), 1.25

A power of two, because then dividing by the scale and multiplying it back are exact: the only
rounding is e4m3's own (3 mantissa bits), and a dequantized value is exactly representable in
bf16, float32 or float64, so stage 11 run on the dequantized values reads the very same numbers.

A block fills over several steps (a prompt, then one token per decode). A write that starts a
block (offset 0) sets its exponents from its own values; a write into a block that already holds
tokens keeps the larger of the old and the new exponent per head, and when one grew it rewrites
the block's older codes at the new scale (`write_run`). An exponent only grows while the block is
in use, so no stored value is ever clipped.

    pool.codes      [2, L, num_blocks, block_size, H_kv, D]  uint8   (the e4m3 bits)
    pool.exponents  [2, L, num_blocks, H_kv]                 int32   (scale = 2**exponent)
"""

from __future__ import annotations

import torch

from nanoserve.cache.fp8_pool import E4M3_MAX, SMALLEST_EXPONENT, power_of_two


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest integer e with amax <= 448 * 2**e, per element (int32), from amax's bits.

    amax = m * 2**E with m in [1, 2): 448 = 1.75 * 2**8, so e = E - 8 when m <= 1.75, else
    E - 7. Reading E and m from the float32 bits (no log, no division) makes it exact, and the
    same on every device."""
    bits = amax.float().view(torch.int32)
    exponent = (bits >> 23) - 127
    above = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # m > 1.75
    return torch.clamp(exponent - 8 + above, min=SMALLEST_EXPONENT)


def quantize(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) of x (..., H, D) at scale 2**exponent (H,): round to nearest even.

    x / 2**e is within +-448 by the choice of e; should a caller pass a smaller exponent, the
    clamp saturates at 448 on every library and device (torch on a CPU saturates too; a
    conversion that does not would give NaN)."""
    scaled = x.float() * power_of_two(-exponent)[:, None]
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize(codes: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values codes (..., H, D) stand for at scale 2**exponent (H,), in dtype (exact)."""
    values = codes.view(torch.float8_e4m3fn).float() * power_of_two(exponent)[:, None]
    return values.to(dtype)


def write_run(rows: torch.Tensor, block: torch.Tensor, exponents: torch.Tensor, offset: int):
    """Store rows (n, H, D) at offsets offset.. of one block (block_size, H, D) of codes, whose
    per-head exponents (H,) are updated in place; offsets before `offset` hold older tokens.

    A fresh block (offset 0) takes the rows' own exponents. Otherwise each head keeps the larger
    exponent; when any grew, the older codes are requantized at the new scale (by a power of
    two: exact, but for values that fall below e4m3's normal range)."""
    new = scale_exponent(rows.float().abs().amax(dim=(0, 2)))  # one amax per head
    if offset > 0:
        old = exponents.clone()
        new = torch.maximum(new, old)
        if bool((new > old).any()):
            block[:offset] = quantize(dequantize(block[:offset], old, torch.float32), new)
    exponents.copy_(new)
    block[offset : offset + rows.shape[0]] = quantize(rows, new)
