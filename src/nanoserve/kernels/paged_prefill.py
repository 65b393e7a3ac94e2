"""Stage 06: causal attention of packed variable-length queries over their sequences' pages.

Introduced in stage 06. One kernel serves a whole prompt and an extend step on top of a cached
prefix (stage 07): each query row attends to every earlier position of its sequence, read in
place through the block table with FlashAttention's online softmax. It never writes the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.e4m3 import converts_fp8
from nanoserve.kernels.paged_tiles import (
    LOG2E,
    NEG_BIG,
    acc_dtype,
    block_d,
    check_paged_args,
    default_tile,
    load_kv_tile,
    online_softmax_step,
)

# ---------------------------------------------------------------------------------------------
# Prefill / extend: packed variable-length queries, causal over cached prefix + new tokens.
#
#   q (T, H, D), T = sum of q_len_b       cu_seqlens_q = [0, 3, 5]   context_lens = [7, 9]
#   rows 0..2 -> sequence 0, positions 4, 5, 6   (7 - 3 + i: the last 3 of its 7 positions)
#   rows 3..4 -> sequence 1, positions 7, 8
#
#   grid = (B, H, cdiv(max_seqlen_q, BLOCK_M)): program (b, h, m) owns query rows
#   m*BLOCK_M .. m*BLOCK_M + BLOCK_M - 1 of sequence b at head h, and attends to the keys from
#   position 0 up to its last row's position in tiles of BLOCK_N (keys after that are hidden by
#   causality).
#
#   The key tiles of one query tile, BLOCK_M = 8 rows at positions 16..23, BLOCK_N = 4:
#
#     keys  0..3   4..7   8..11  12..15 | 16..19  20..23
#           full   full   full   full   | diagonal tiles: row p sees keys <= p, the mask
#           every row sees every key,   |   hides the rest
#           no mask needed              |
#
#   Most tiles of a long prompt are full, so the kernel masks only the tiles that cross the
#   diagonal, in one loop, and walks the full ones in a second loop without the mask (a compare
#   and a select per score saved: a fifth of the loop's instructions at BLOCK_M 128, BLOCK_N 64).
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["block_tables_stride"])  # one build for every table width
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    k_scales_ptr,  # stage 13: (num_blocks, H_kv) exponents of an e4m3 pool; None otherwise
    v_scales_ptr,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    block_tables_stride,
    qk_scale,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    FP8_HARDWARE: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    # The longest programs first: in a prompt, query tile m attends to (m + 1) * BLOCK_M keys,
    # and the GPU starts programs roughly in program-id order. Counting m down from the last tile
    # starts the long programs first and lets the short ones fill the gaps at the end, instead of
    # ending on a wave of long programs with part of the GPU idle.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # the grid is sized for the longest sequence
        return
    context_len = tl.load(context_lens_ptr + seq)  # cached prefix + the q_len new tokens
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this sequence
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = context_len - q_len + offs_m  # each row's absolute position
    row_mask = offs_m < q_len
    q_rows = (q_start + offs_m)[:, None]
    io_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_rows * q_stride_t + head * q_stride_h + offs_d[None, :], io_mask, 0.0)

    m_i = tl.full([BLOCK_M], NEG_BIG, ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)
    kv_head = head // GROUP  # GQA: GROUP query heads read the same kv head, never copied
    table = block_tables_ptr + seq * block_tables_stride
    kv_end = context_len - q_len + tl.minimum((m_block + 1) * BLOCK_M, q_len)  # last row + 1
    # Full tiles end at or before the first row's position: every row sees all of their keys.
    first_pos = context_len - q_len + m_block * BLOCK_M
    kv_full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    # The diagonal tiles first, then the full ones: the online softmax gives the same result in
    # any order of tiles (FlashAttention 2 also starts at the diagonal). The order matters to the
    # compiler, though: with the masked loop after the pipelined one, ptxas (Triton 3.6, sm_90,
    # num_stages >= 3) serialises every wgmma of the kernel (its message C7515).
    for start_n in range(kv_full_end, kv_end, BLOCK_N):  # the diagonal tiles: masked
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v, k_scale, v_scale = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table,
            offs_n,
            context_len,
            kv_head,
            offs_d,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            k_scales_ptr,
            v_scales_ptr,
            q_ptr.dtype.element_ty,
            FP8_HARDWARE,
        )
        visible = offs_n[None, :] <= q_pos[:, None]  # causal: a row sees keys up to itself
        m_i, l_i, acc = online_softmax_step(
            q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE, k_scale, v_scale
        )

    for start_n in range(0, kv_full_end, BLOCK_N):  # the full tiles: no mask
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v, k_scale, v_scale = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table,
            offs_n,
            context_len,
            kv_head,
            offs_d,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            k_scales_ptr,
            v_scales_ptr,
            q_ptr.dtype.element_ty,
            FP8_HARDWARE,
        )
        # visible=True: nothing hidden; the compiler drops the select tl.where(True, s, -inf).
        m_i, l_i, acc = online_softmax_step(
            q, k, v, True, m_i, l_i, acc, qk_scale, ACC_DTYPE, k_scale, v_scale
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i > 0 on every real row (key 0)
    out_ptrs = out_ptr + q_rows * out_stride_t + head * out_stride_h + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), io_mask)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens q (T, H, D) over their sequences' pages; (T, H, D).
    Stage 13: k_scales, v_scales (num_blocks, H_kv) int32 for caches of e4m3 codes (uint8)."""
    group, block_size, head_dim = check_paged_args(q, k_cache, v_cache, block_tables, out,
                                                   k_scales, v_scales)  # fmt: skip
    num_seqs = block_tables.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,):
        raise ValueError("cu_seqlens_q must be (B + 1,) and context_lens (B,) for B block tables")
    out = torch.empty_like(q) if out is None else out
    block_m = block_m or default_tile(q)
    block_n = block_n or default_tile(q)
    grid = (num_seqs, q.shape[1], triton.cdiv(max_seqlen_q, block_m))
    if num_seqs == 0 or max_seqlen_q == 0:
        return out
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        k_scales,
        v_scales,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        float(scale) * LOG2E,
        GROUP=group,
        NUM_KV_HEADS=k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=block_d(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ACC_DTYPE=acc_dtype(q),
        FP8_HARDWARE=k_scales is not None and converts_fp8(k_cache),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
