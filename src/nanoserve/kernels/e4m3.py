"""Stage 13: e4m3 in Triton, from the bits: a code's value, a value's code, exact powers of two.

Introduced in stage 13. NumPy has no float8, so Triton's interpreter cannot convert to or from
it; these do it with integer arithmetic on float32 bits, the same on a CPU and a GPU, and bit for
bit what torch's float8_e4m3fn conversions (and `cache/fp8.py`) give. The store kernel
(`store_fp8.py`) encodes; the attention kernels' tile loader (`paged_tiles.py`) decodes, with
`e4m3_to_float`: on a GPU with fp8 instructions (compute capability 8.9 and up: Ada, Hopper)
one hardware conversion, which gives the same values, else the bits.

    e4m3 code   s eeee mmm         value = (1 + m/8) * 2**(e - 7), or m * 2**-9 when e = 0
    float32     s eeeeeeee mmm0...0 (20 zero bits): the same value when e_32 = e + 120
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanoserve.cache.fp8_pool import SMALLEST_EXPONENT

_SMALLEST_EXPONENT: tl.constexpr = tl.constexpr(SMALLEST_EXPONENT)


@triton.jit
def power_of_two(exponent):
    """2**exponent as float32, from the bits (exact; no exp2, whose rounding varies), for
    exponents in [-126, 127]."""
    return ((exponent.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_exponent(amax):
    """`fp8.scale_exponent`: the smallest e with amax <= 448 * 2**e, from amax's float32 bits."""
    bits = amax.to(tl.int32, bitcast=True)
    above = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa > 1.75 = 448 / 2**8
    return tl.maximum((bits >> 23) - 127 - 8 + above, _SMALLEST_EXPONENT)


@triton.jit
def e4m3_value(codes):
    """float32 values of e4m3 codes: 0eeeemmm -> bits of float32 by a rebias of 120."""
    codes = codes.to(tl.int32)
    mag = codes & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    # The sign goes in as a bit: 0x80 decodes to -0.0, as torch's. (`-value` would not do: a GPU
    # build computes it as 0 - value, which is +0.0 for 0; the interpreter's NumPy gives -0.0.)
    return (value.to(tl.int32, bitcast=True) | ((codes & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_float(codes, DTYPE: tl.constexpr, HARDWARE: tl.constexpr):
    """Values of e4m3 codes (uint8) in DTYPE (every e4m3 value is exact in bfloat16, float16 and
    float32). HARDWARE: the GPU converts them (a bitcast to float8e4nv, torch's float8_e4m3fn,
    then to DTYPE; bfloat16 by way of float32 and `bfloat16_of_float32`): exact, as the bits are.
    On the H200, at batch 256 and context 1,024, the decode kernel took 17.3 ms with the bits
    and 10.8 ms converting straight to bfloat16 in hardware (docs/benchmarks.md, "Where a
    decode step's time goes"); one layer's kernel took 247 us straight to bfloat16 and 218 us
    through float32 ("Stage 13 after the kernel changes")."""
    if HARDWARE:
        fp8 = codes.to(tl.float8e4nv, bitcast=True)
        if tl.bfloat16 == DTYPE:
            return bfloat16_of_float32(fp8.to(tl.float32))
        return fp8.to(DTYPE)  # float16: one instruction a pair of codes
    return e4m3_value(codes).to(DTYPE)


@triton.jit
def bfloat16_of_float32(value):
    """bfloat16 of float32 values with at most 8 significant bits (e4m3's have 4): the top 16
    bits, exact, by a shift. Not `.to(tl.bfloat16)`, nor e4m3 to bfloat16 in one step: those
    compile to conversion instructions, which Hopper issues at 16 a clock per SM. e4m3 straight
    to bfloat16 costs 1.5 of them a code (a pair to float16, then each to bfloat16); through
    float32 and this shift, 0.5 (the compiler widens float16 with an addition, HADD2.F32, and
    packs two top halves with one byte permute). `tools/kernel_sass.py` counts them;
    docs/benchmarks.md, "The fp8 decode kernel read without a GPU"."""
    return (value.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


def converts_fp8(cache: torch.Tensor) -> bool:
    """True when the kernels may convert e4m3 codes in hardware: a CUDA device of compute
    capability 8.9 or more (the interpreter, on a CPU, decodes the bits). Asked at every
    launch, so each device is looked up once."""
    return cache.is_cuda and _has_fp8_instructions(cache.device.index or 0)


@functools.cache
def _has_fp8_instructions(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


@triton.jit
def e4m3_code(y):
    """e4m3 codes (uint8) of float32 y, clamped to +-448 and rounded to nearest even, as torch's
    `.clamp(-448, 448).to(torch.float8_e4m3fn)`: the sign bit stays, so -0.0 gives 0x80."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # |y| >= 2**-6: drop 20 of float32's 23 mantissa bits, ties to even (a carry may bump the
    # exponent, as it should), then rebias the exponent from 127 to 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2**-6 the codes are m * 2**-9: adding 2**23 to a * 512 rounds it to an integer
    # (ties to even) in the low mantissa bits; m = 8 is 0x08, the smallest normal, as it should.
    # a * 512 is exact, so the fused multiply-add a GPU compiles this to rounds the same.
    subnormal = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return (tl.where(a >= 0.015625, normal, subnormal) | sign).to(tl.uint8)
