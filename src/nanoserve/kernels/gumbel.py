"""Stage 11: Gumbel-max sampling of every row in one Triton kernel, one pass over the logits.

Introduced in stage 11, for `device_sampler.sample` on a GPU. The torch expression of the same
draw (device_sampler.gumbel_argmax) builds the whole (B, V) noise tensor: about a dozen
elementwise passes over (B, V) integers, each reading and writing 156 MB at batch 256 and
Qwen3's 151,936 tokens (its time on the H200 was not measured separately). This kernel reads
each logit once and keeps only a running best per row:

    program r (one row), key = hash(seed_r, position_r) computed beforehand (B values):
        for each tile of BLOCK tokens i:   u_i = to_unit(mix32(low32(key) + i * G32))
                                           v_i = x_i / T_r - log(-log(u_i))      (x_i when T_r = 0)
                                           best = max(best, (v_i, i))            first index on ties
        out[r] = argmax

The noise is the torch expression's, bit for bit (the same lowbias32 on 32-bit unsigned lanes);
the logs may differ from torch's in the last bit, so a token can change only where two scores
tie to within a rounding.
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
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True).to(tl.uint32)  # its low 32 bits
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    best_value = -float("inf")
    best_index = 0
    for start in range(0, vocab_size, BLOCK):
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
