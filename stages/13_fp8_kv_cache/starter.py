"""Stage 13 starter: an FP8 KV cache. Store each K and V value as one byte, an e4m3 code, with one
power-of-two scale per (block, KV head), and read the values back exactly as the codes say.

Fill in each body (the lesson, stages/13_fp8_kv_cache/README.md, walks through them in task order)
in a copy: `cp stages/13_fp8_kv_cache/starter.py my_fp8.py`, then grade it with
`pytest stages/13_fp8_kv_cache --impl my_fp8.py`; this file itself must keep failing.
Every task runs on a CPU.

    one block's scale, by hand: a head whose largest magnitude (amax) in the block is 3.1

      e     = smallest integer with 3.1 <= 448 * 2**e    -> 3.1 / 448 = 0.0069 -> e = -7
      x 1.3 -> 1.3 * 2**7 = 166.4 -> nearest e4m3: 160 (1.25 * 2**7), code 0x72 -> 1.25
      x 3.1 -> 396.8 -> 384 (1.5 * 2**8), code 0x7C -> 3.0;  x -3.1: the sign bit, code 0xFC

    one step's writes, block_size 4, slot_mapping [5, 6, 7, 8, -1, 12, 13] (slot -1: padding)

      runs  (tokens 0..2, block 1, offset 1)   three tokens appended to block 1, after its slot 4
            (token 3,     block 2, offset 0)   a fresh block: its own exponents
            (tokens 5..6, block 3, offset 0)   another sequence's fresh block; token 4 writes none
"""

from __future__ import annotations

import torch

from nanoserve.cache.fp8_pool import runs  # noqa: F401  (task 3: a step's slot_mapping, run by run)

# Given (nanoserve/cache/fp8_pool.py): `runs(slot_mapping, block_size)`, the (first token,
# end token, block, offset) of each run of consecutive slots of one block, padding (-1)
# skipped; `power_of_two(exponent)`, 2**exponent as float32 from its bits; the pool, `Fp8KVPool`
# (codes (2, L, num_blocks, block_size, H_kv, D) uint8, exponents (2, L, num_blocks, H_kv)
# int32). Also given: the torch backend that calls your store and gather
# (`TorchFp8Attention` in kernels/torch_fp8.py) and the Triton kernels.

E4M3_MAX = 448.0  # the largest finite e4m3 value, 1.75 * 2**8 (code 0x7E); 0x7F is NaN
SMALLEST_EXPONENT = -64  # the exponent of an all-zero head: its scale, 2**-64, a normal float


# ---- task 1: the scale and the codes ----


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32, per element: the smallest integer e with amax <= 448 * 2**e, but never below
    SMALLEST_EXPONENT (-64; an amax of 0 gets -64).

        amax 3.1 -> -7 (448 * 2**-7 = 3.5);  3.5 -> -7;  3.6 -> -6;  448 -> 0;  449 -> 1

    Hint: torch.log2 of a float32 ratio can land a hair off an exact power of two; either check
    the neighbour, or read the exponent and mantissa from the float32 bits (448 = 1.75 * 2**8).
    """
    raise NotImplementedError("task 1: scale_exponent")


def quantize(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of x (..., H, D) at scale 2**exponent[h] for head h (exponent (H,)):
    x / 2**e rounded to the nearest e4m3 value, ties to even (what torch's
    `.to(torch.float8_e4m3fn)` does), then the code's bits (`.view(torch.uint8)`).

    Clamp to +-448 first: a caller may pass an exponent smaller than the values need, and what a
    cast makes of a value past e4m3's range depends on the library (torch 2.13 saturates it to
    448, code 0x7E; NumPy's ml_dtypes gives NaN, 0x7F, past 464). With the clamp it is 448 on
    every one. x / 2**e is exact in float32 or float64 alike (a power of two): either will do.

        x 1.3 at e -7 -> code 0x72 (1.25);  x -3.1 at e -7 -> code 0xFC (-3.0)
    """
    raise NotImplementedError("task 1: quantize")


def dequantize(codes: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values codes (..., H, D) stand for at scale 2**exponent (H,), in dtype: the e4m3
    value of each code times 2**exponent[h]. Exact: a power of two only moves the exponent.
    (Task 3's gather can call it once per block, with that block's scales[block], (H,).)"""
    raise NotImplementedError("task 1: dequantize")


# ---- task 2: one block's write ----


def write_run(rows: torch.Tensor, block: torch.Tensor, exponents: torch.Tensor, offset: int):
    """Store rows (n, H, D) at offsets offset .. offset + n - 1 of one block's codes
    (block_size, H, D), updating the block's per-head exponents (H,) in place; the offsets
    before `offset` hold the block's older tokens. Returns nothing.

    The rows' own exponent per head is scale_exponent of their amax over (tokens, D).
    - offset 0: a fresh block. Its exponents are the rows' own; whatever `exponents` held
      (the block's previous owner) is ignored.
    - offset > 0: each head keeps max(its old exponent, the rows' own). A head whose exponent
      grew has its older codes block[:offset] requantized at the new scale (dequantize at the
      old, quantize at the new), so every code of a head in the block shares that head's scale.

        block_size 4, one head: rows [1.3, 3.1] at offset 0 -> e -7, values [1.25, 3.0]
        then [6.0] at offset 2: own e -6 > -7 -> e -6, older codes requantized (1.25 and 3.0
        are still 1.25 and 3.0 at 2**-6), values [1.25, 3.0, 6.0]
    """
    raise NotImplementedError("task 2: write_run")


# ---- task 3: the store and the gather of the torch backend ----


def store_kvcache_fp8(k, v, k_cache, v_cache, slot_mapping, *, k_scales, v_scales) -> None:
    """Quantize one step's k and v (T, H_kv, D) into one layer's code caches (num_blocks,
    block_size, H_kv, D) uint8, token t at slot slot_mapping[t] (= block * block_size +
    offset; -1 is padding: write nothing), updating k_scales and v_scales (num_blocks, H_kv)
    int32 in place. Returns nothing.

    Write run by run (`runs(slot_mapping, block_size)`): one write_run per run for K (with
    k_scales[block]) and one for V (with v_scales[block]). Not one per token: a token written
    alone and requantized when the next one grows the exponent is rounded twice, and can land a
    step away from the once-rounded code the GPU's store kernel writes.

        block_size 4, slot_mapping [5, 6, 7, 8, -1, 12, 13]:
        runs (0, 3, 1, 1), (3, 4, 2, 0), (5, 7, 3, 0)  ->  write_run(k[0:3], k_cache[1],
        k_scales[1], 1), write_run(k[3:4], k_cache[2], k_scales[2], 0), ... and the same for v
    """
    raise NotImplementedError("task 3: store_kvcache_fp8")


def gather_kv_fp8(cache, scales, block_table, context_len: int, dtype) -> torch.Tensor:
    """One sequence's first context_len positions, dequantized, (context_len, H_kv, D) in dtype:
    the blocks block_table[0], block_table[1], ... (as many as context_len needs; the table may
    be longer, padded with -1) of cache (num_blocks, block_size, H_kv, D), each at its own
    exponents scales[block] (H_kv,), in table order, cut at context_len."""
    raise NotImplementedError("task 3: gather_kv_fp8")
