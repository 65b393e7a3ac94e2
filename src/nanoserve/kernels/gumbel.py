"""Stage 11: Gumbel-max sampling of every row in two Triton kernels, one pass over the logits.

Introduced in stage 11, for `device_sampler.sample` on a GPU. The torch expression of the same
draw (device_sampler.gumbel_argmax) builds the whole (B, V) noise tensor: about a dozen
elementwise passes over (B, V) integers, each reading and writing 156 MB at batch 256 and
Qwen3's 151,936 tokens (its time on the H200 was not measured separately). These kernels read
each logit once and keep only a running best:

    program (r, p), key = hash(seed_r, position_r) computed beforehand (B values), for each tile
    of BLOCK tokens i in the p-th span of the row:
                                           u_i = to_unit(mix32(low32(key) + i * G32))
                                           v_i = x_i / T_r - log(-log(u_i))      (x_i when T_r = 0)
                                           best = max(best, (v_i, i))            first index on ties
        partial[r, p] = best
    program r:                             out[r] = the index of max_p partial[r, p], the first
                                           index among equal maxima

Why a span per program and a second kernel: with one program per row, a batch of one ran a
single program over all 151,936 logits, two logs each, while the other 131 SMs idled (180 us
of a 2 ms step on the H200). Spans of SPAN_TILES tiles give a row 19 programs; picking among
19 partial bests is a second, small launch: B programs of 19 loads each.

The noise is the torch expression's, bit for bit (the same lowbias32 on 32-bit unsigned lanes);
the logs may differ from torch's in the last bit, so a token can change only where two scores
tie to within a rounding. Splitting the row changes no token: the maximum is exact, and ties
go to the first index in both kernels as in one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (the same constants as device_sampler.mix32); each product is
    cut back to 32 bits, as the unsigned arithmetic it stands for wraps."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D).to(tl.uint32)
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B).to(tl.uint32)
    return x ^ (x >> 16)


SPAN_TILES = 2  # tiles of BLOCK logits per program


@triton.jit
def _gumbel_best_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    keys_ptr,
    best_value_ptr,
    best_index_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
    SPAN: tl.constexpr,
):
    row = tl.program_id(0)
    span = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True).to(tl.uint32)  # its low 32 bits
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    best_value = -float("inf")
    best_index = 0
    first = span * SPAN
    for start in range(first, tl.minimum(first + SPAN, vocab_size), BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < vocab_size
        x = tl.load(logits_ptr + row * stride_row + offsets, mask=mask, other=-float("inf"))
        x = x.to(tl.float32)
        lanes = (key + offsets.to(tl.uint64) * 0x9E3779B9).to(tl.uint32)  # low32(key) + i * G32
        bits = _mix32(lanes) >> 9  # the top 23 bits
        u = (bits.to(tl.float32) + 0.5) / 8388608.0  # in (0, 1): both logs stay finite
        noise = -tl.log(-tl.log(u))
        value = tl.where(greedy, x, x / divisor + noise)
        value = tl.where(mask, value, -float("inf"))
        tile_best = tl.max(value, axis=0)
        tile_index = tl.argmax(value, axis=0) + start  # the first index of the tile's best
        if tile_best > best_value:  # strictly: an earlier tile wins a tie
            best_value = tile_best
            best_index = tile_index
    slot = row * tl.num_programs(1) + span
    tl.store(best_value_ptr + slot, best_value)
    tl.store(best_index_ptr + slot, best_index)


@triton.jit
def _gumbel_pick_kernel(best_value_ptr, best_index_ptr, out_ptr, num_spans, SPANS: tl.constexpr):
    row = tl.program_id(0)
    spans = tl.arange(0, SPANS)
    mask = spans < num_spans
    values = tl.load(best_value_ptr + row * num_spans + spans, mask=mask, other=-float("inf"))
    indices = tl.load(best_index_ptr + row * num_spans + spans, mask=mask, other=2**31 - 1)
    best = tl.max(values, axis=0)
    first = tl.min(tl.where(mask & (values == best), indices, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, block: int = 4096
) -> torch.Tensor:
    """(B,) int64: per row, argmax of logits / T + Gumbel noise keyed by keys; argmax when T = 0.

    logits (B, V) float32/bfloat16/float16 (rows contiguous); temperature (B,) float32; keys (B,)
    int64, each row's hash of seed and position. block: logits per tile (a power of two; the
    tests use small ones to split a small vocabulary into many spans).
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab_size = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(block, triton.next_power_of_2(vocab_size))
        num_spans = triton.cdiv(vocab_size, block * SPAN_TILES)
        best_value = torch.empty(rows, num_spans, dtype=torch.float32, device=logits.device)
        best_index = torch.empty(rows, num_spans, dtype=torch.int32, device=logits.device)
        _gumbel_best_kernel[(rows, num_spans)](
            logits,
            logits.stride(0),
            temperature.float().contiguous(),
            keys.contiguous(),
            best_value,
            best_index,
            vocab_size,
            BLOCK=block,
            SPAN=block * SPAN_TILES,
        )
        spans = triton.next_power_of_2(num_spans)
        _gumbel_pick_kernel[(rows,)](best_value, best_index, out, num_spans, SPANS=spans)
    return out
