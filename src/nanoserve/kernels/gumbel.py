"""Stage 11: Gumbel-max sampling of every row in one Triton kernel, one pass over the logits.

Introduced in stage 11, for `device_sampler.sample` on a GPU. The torch expression of the same
draw (device_sampler.gumbel_argmax) builds the whole (B, V) noise tensor: about fifteen
elementwise passes over 64-bit integers, each reading and writing 311 MB at batch 256 and Qwen3's
151,936 tokens (its time on the H200 was not measured separately). This kernel reads each logit
once and keeps only a running best per row:

    program r (one row), key = hash(seed_r, position_r) computed beforehand (B values):
        for each tile of BLOCK tokens i:   u_i = to_unit(mix64(key + i * GOLDEN))
                                           v_i = x_i / T_r - log(-log(u_i))      (x_i when T_r = 0)
                                           best = max(best, (v_i, i))            first index on ties
        out[r] = argmax

The noise is the torch expression's, bit for bit (the same SplitMix64 on 64-bit unsigned lanes);
the logs may differ from torch's in the last bit, so a token can change only where two scores
tie to within a rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix64(x):
    """SplitMix64's finalizer on uint64 lanes (the same constants as device_sampler.mix64)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    keys_ptr,
    out_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    best_value = -float("inf")
    best_index = 0
    for start in range(0, vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < vocab_size
        x = tl.load(logits_ptr + row * stride_row + offsets, mask=mask, other=-float("inf"))
        x = x.to(tl.float32)
        bits = _mix64(key + offsets.to(tl.uint64) * 0x9E3779B97F4A7C15) >> 41  # the top 23 bits
        u = (bits.to(tl.float32) + 0.5) / 8388608.0  # in (0, 1): both logs stay finite
        noise = -tl.log(-tl.log(u))
        value = tl.where(greedy, x, x / divisor + noise)
        value = tl.where(mask, value, -float("inf"))
        tile_best = tl.max(value, axis=0)
        tile_index = tl.argmax(value, axis=0) + start  # the first index of the tile's best
        if tile_best > best_value:  # strictly: an earlier tile wins a tie
            best_value = tile_best
            best_index = tile_index
    tl.store(out_ptr + row, best_index)


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """(B,) int64: per row, argmax of logits / T + Gumbel noise keyed by keys; argmax when T = 0.

    logits (B, V) float32/bfloat16/float16 (rows contiguous); temperature (B,) float32; keys (B,)
    int64, each row's hash of seed and position.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab_size = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](
            logits,
            logits.stride(0),
            temperature.float().contiguous(),
            keys.contiguous(),
            out,
            vocab_size,
            BLOCK=min(4096, triton.next_power_of_2(vocab_size)),
        )
    return out
