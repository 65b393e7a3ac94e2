"""Stage 06: what the paged prefill and decode kernels share: one key tile through the block table,
folded into an online softmax, plus the argument checks and launch choices of both wrappers.

Introduced in stage 06 (FlashAttention's inner loop, over pages). It neither launches a kernel nor
writes the cache: paged_prefill.py and paged_decode.py launch, store.py writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.e4m3 import e4m3_to_float, power_of_two

# Where position n of sequence b lives in one layer's cache (num_blocks, block_size, H_kv, D):
#
#   block_tables[b] = [7, 2, 9, -1]       block_size 4, context_len 10
#   positions  0 1 2 3 | 4 5 6 7 | 8 9
#   block id   ---7--- | ---2--- | -9-        slot = block_tables[b][n // bs] * bs + n % bs
#
# A key tile is BLOCK_N consecutive positions; each position looks up its own block id, so a tile
# may span several pages (small block_size) or part of one page (large block_size). Entries at or
# past context_len (stale ids, the -1 padding) are masked and never dereferenced.

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E); exp2 is the cheaper instruction
# The running max starts here, not at -inf, so a row that has seen no key never computes
# -inf - (-inf) = NaN; exp2(-inf - NEG_BIG) is exactly 0 and exp2(NEG_BIG - real max) too.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    offs_n,
    context_len,
    kv_head,
    offs_d,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    k_scales_ptr=None,
    v_scales_ptr=None,
    DTYPE: tl.constexpr = None,
    FP8_HARDWARE: tl.constexpr = False,
):
    """K and V of positions offs_n (BLOCK_N,) of one kv head: two (BLOCK_N, BLOCK_D) tiles, and
    the scale of each tile's rows (1.0: none).

    Stage 13: with scale pointers given, the caches hold e4m3 codes and each block one exponent
    per kv head. The tiles come back as the codes' values in DTYPE (the queries' dtype;
    FP8_HARDWARE: the GPU converts them, `e4m3_to_float`) and the scales as (1, BLOCK_N) rows of
    2**e, which `online_softmax_step` applies to the scores and the probabilities: BLOCK_G x
    BLOCK_N products instead of BLOCK_N x BLOCK_D. Scaling by a power of two is exact, so the
    result is bit for bit what a pool of DTYPE holding the dequantized values gives."""
    in_context = offs_n < context_len
    block_id = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_context, other=0)
    slot = block_id.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE  # int64: big pools
    row = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM  # start of (slot, kv_head)'s D values
    mask = in_context[:, None] & (offs_d < HEAD_DIM)[None, :]
    if k_scales_ptr is None:
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
        return k, v, 1.0, 1.0
    else:
        codes_k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0)
        codes_v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0)
        scale_idx = block_id.to(tl.int64) * NUM_KV_HEADS + kv_head  # (BLOCK_N,): each row's block
        k_exp = tl.load(k_scales_ptr + scale_idx, mask=in_context, other=0)
        v_exp = tl.load(v_scales_ptr + scale_idx, mask=in_context, other=0)
        k = e4m3_to_float(codes_k, DTYPE, FP8_HARDWARE)
        v = e4m3_to_float(codes_v, DTYPE, FP8_HARDWARE)
        return k, v, power_of_two(k_exp)[None, :], power_of_two(v_exp)[None, :]


@triton.jit
def online_softmax_step(
    q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE: tl.constexpr, k_scale=1.0, v_scale=1.0
):
    """Fold one key tile into the running (max m_i, sum l_i, weighted values acc) of each row.
    Stage 13: k_scale, v_scale are the tile's row scales (`load_kv_tile`), applied to the scores
    and to the probabilities the values are weighted by.

    Online softmax: after any prefix of the keys, acc / l_i is the softmax-weighted mean of the
    values seen so far. A new tile may raise a row's max from m to m'; everything summed so far
    was weighted by exp2(s - m), so multiplying by alpha = exp2(m - m') re-weights it to m'.
    """
    # Scores in log2 units: qk_scale = scale * log2(e), so exp(scale * q.k) = exp2(score).
    s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC_DTYPE) * qk_scale * k_scale
    s = tl.where(visible, s, float("-inf"))  # (rows, BLOCK_N)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # hidden keys: exp2(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot((p * v_scale).to(v.dtype), v, input_precision="ieee", out_dtype=ACC_DTYPE)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------------
# Host side: argument checks and launch choices both wrappers make.
# ---------------------------------------------------------------------------------------------


def check_paged_args(
    q, k_cache, v_cache, block_tables, out, k_scales=None, v_scales=None
) -> tuple[int, int, int]:
    """Validate what both kernels assume; return (H // H_kv, block_size, head_dim)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be (tokens, H, D); caches (num_blocks, block_size, H_kv, D)")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads} x D {head_dim} do not fit caches {k_cache.shape}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (one layer's view of the pool)")
    if q.stride(2) != 1 or (out is not None and (out.shape != q.shape or out.stride(2) != 1)):
        raise ValueError("q and out must be alike, each with a contiguous last dimension")
    if k_scales is not None or v_scales is not None:
        check_fp8_caches(k_cache, v_cache, k_scales, v_scales)
    elif not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q {q.dtype} and the caches {k_cache.dtype} must share one dtype")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be (B, max_blocks) int32 or int64, padded with -1")
    return num_heads // num_kv_heads, block_size, head_dim


def check_fp8_caches(k_cache, v_cache, k_scales, v_scales) -> None:
    """Stage 13: caches of e4m3 codes (uint8), exponents (num_blocks, H_kv) int32, contiguous."""
    if k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8:
        raise ValueError(f"with k_scales the caches hold e4m3 codes (uint8), got {k_cache.dtype}")
    want = (k_cache.shape[0], k_cache.shape[2])
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales is None or scales.shape != want or scales.dtype != torch.int32:
            got = None if scales is None else (tuple(scales.shape), scales.dtype)
            raise ValueError(f"{name} must be {want} int32 (num_blocks, H_kv), got {got}")
        if not scales.is_contiguous():
            raise ValueError(f"{name} must be contiguous (one layer's view of the exponents)")


def acc_dtype(q: torch.Tensor):
    """Accumulate in float32, or in float64 when the inputs are float64."""
    return tl.float64 if q.dtype == torch.float64 else tl.float32


def block_d(head_dim: int) -> int:
    """head_dim padded to a power of two of at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(head_dim))


def default_tile(q: torch.Tensor) -> int:
    """Rows or keys per tile: 64 for 2-byte dtypes, 32 for wider ones (shared memory)."""
    return 64 if q.element_size() <= 2 else 32
