"""Stage 06: decode attention, one query per sequence, its context split across programs.

Introduced in stage 06 (flash-decoding over pages). A partition kernel attends all query heads of
one KV group over one slice of a sequence's pages; a reduce kernel merges the slices' partial
softmaxes. The launch depends on static shapes only, so stage 08 can capture it in a CUDA graph.
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
# Decode: one query per sequence, split-K (flash-decoding).
#
#   grid = (B, H_kv, num_partitions). A sequence's context is cut into partitions of
#   partition_size positions; program (b, g, p) attends the GROUP query heads of kv head g
#   (one tile of rows: K/V are read once per group, not once per query head) over partition p
#   and writes its partial (max, sum, unnormalised acc). The reduce kernel, grid (B, H), merges
#   the partials of row b, head h:
#
#     context_len 1100, partition_size 512, num_partitions 4 (static: 4 x 512 = table capacity)
#     |---- p0: 0..511 ----|---- p1: 512..1023 ----|- p2: 1024..1099 -|  p3: exits at once
#       (m0, l0, acc0)         (m1, l1, acc1)         (m2, l2, acc2)
#     M = max(m_p);  w_p = exp2(m_p - M);  out = sum_p w_p acc_p / sum_p w_p l_p
#
#   num_partitions comes from static shapes only, so a CUDA graph can capture the launch; the
#   lengths are read on the device. With one partition (split-K off) the first kernel
#   normalises and writes the output itself and the reduce is not launched.
# ---------------------------------------------------------------------------------------------


# Widths and partition counts vary from step to step: one build serves them all (do_not_specialize).
@triton.jit(do_not_specialize=["block_tables_stride", "partition_size", "num_partitions"])
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    context_lens_ptr,
    block_tables_ptr,
    k_scales_ptr,  # stage 13: (num_blocks, H_kv) exponents of an e4m3 pool; None otherwise
    v_scales_ptr,
    q_stride_b,
    q_stride_h,
    out_stride_b,
    out_stride_h,
    block_tables_stride,
    qk_scale,
    partition_size,
    num_partitions,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    FP8_HARDWARE: tl.constexpr,
):
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)  # 0 on a padding row
    part_start = part * partition_size
    # Partition 0 always runs, so an empty row still writes a finite result (zeros).
    if (part > 0) & (part_start >= context_len):
        return
    part_end = tl.minimum(part_start + partition_size, context_len)
    offs_g = tl.arange(0, BLOCK_G)  # query heads of this group, padded to tl.dot's 16 rows
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    io_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, io_mask, 0.0)  # (BLOCK_G, BLOCK_D)

    m_i = tl.full([BLOCK_G], NEG_BIG, ACC_DTYPE)
    l_i = tl.zeros([BLOCK_G], ACC_DTYPE)
    acc = tl.zeros([BLOCK_G, BLOCK_D], ACC_DTYPE)
    table = block_tables_ptr + seq * block_tables_stride
    for start_n in range(part_start, part_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v, k_scale, v_scale = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table,
            offs_n,
            part_end,
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
        visible = (offs_n < part_end)[None, :]  # the one query is last: it sees all context
        m_i, l_i, acc = online_softmax_step(
            q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE, k_scale, v_scale
        )

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty row: 0 / 1 = 0
        out_ptrs = out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), io_mask)
    else:
        part_idx = (seq * NUM_KV_HEADS * GROUP + heads) * num_partitions + part  # (BLOCK_G,)
        tl.store(part_m_ptr + part_idx, m_i, offs_g < GROUP)
        tl.store(part_l_ptr + part_idx, l_i, offs_g < GROUP)
        tl.store(part_acc_ptr + part_idx[:, None] * HEAD_DIM + offs_d[None, :], acc, io_mask)


@triton.jit(do_not_specialize=["partition_size", "num_partitions"])
def _decode_reduce_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    context_lens_ptr,
    out_stride_b,
    out_stride_h,
    partition_size,
    num_partitions,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    # Only partitions that held a position wrote partials; partition 0 of an empty row did too,
    # with l = 0, so it adds nothing and the output stays 0.
    written = offs_p < tl.maximum(tl.cdiv(context_len, partition_size), 1)
    idx = (seq * NUM_HEADS + head) * num_partitions + offs_p
    m = tl.load(part_m_ptr + idx, written, other=NEG_BIG)
    l = tl.load(part_l_ptr + idx, written, other=0.0)  # noqa: E741
    acc_mask = written[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.load(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc_mask, other=0.0)

    # Each partial was weighted by exp2(s - m_p); re-weight all to the global max M.
    w = tl.where(written, tl.exp2(m - tl.max(m, 0)), 0.0)  # (BLOCK_P,)
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # (BLOCK_D,)
    out_ptrs = out_ptr + seq * out_stride_b + head * out_stride_h + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), offs_d < HEAD_DIM)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    partition_size: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence q (B, H, D) over its context_lens[b] paged positions; (B, H, D).
    Stage 13: k_scales, v_scales (num_blocks, H_kv) int32 for caches of e4m3 codes (uint8)."""
    group, block_size, head_dim = check_paged_args(q, k_cache, v_cache, block_tables, out,
                                                   k_scales, v_scales)  # fmt: skip
    batch, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = k_cache.shape[2]
    if context_lens.shape != (batch,) or block_tables.shape[0] != batch:
        raise ValueError(f"context_lens (B,) and block_tables (B, W) must have B = {batch} rows")
    max_context_len = block_tables.shape[1] * block_size  # static: what the table can address
    block_n = block_n or decode_tile(q, k_scales is not None)
    if partition_size is None:
        partition_size = decode_partition_size(batch, num_kv_heads, max_context_len, q.device)
        partition_size = max(partition_size, block_n)
    if partition_size < block_n or partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_n {block_n}")
    num_partitions = max(triton.cdiv(max_context_len, partition_size), 1)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    part_m, part_l, part_acc = _decode_scratch(q, num_partitions)
    _decode_partition_kernel[(batch, num_kv_heads, num_partitions)](
        q,
        k_cache,
        v_cache,
        out,
        part_m,
        part_l,
        part_acc,
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
        partition_size,
        num_partitions,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=num_partitions > 1,
        ACC_DTYPE=acc_dtype(q),
        FP8_HARDWARE=k_scales is not None and converts_fp8(k_cache),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_partitions > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            context_lens,
            out.stride(0),
            out.stride(1),
            partition_size,
            num_partitions,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d(head_dim),
            BLOCK_P=triton.next_power_of_2(num_partitions),
        )
    return out


# Keys per decode tile over e4m3 codes on a GPU: half the bytes per key, so twice the keys per
# load. Measured on the H200 (batch 256, context 1,024, Qwen3-0.6B's heads, one layer): 248 us
# at 128 against 272 at 64; bfloat16's pool at its 64, 280 us (docs/benchmarks.md).
FP8_DECODE_TILE = 128


def decode_tile(q: torch.Tensor, fp8: bool) -> int:
    """Keys per tile: `default_tile`, or FP8_DECODE_TILE over e4m3 codes with 2-byte queries
    on a GPU (the interpreter keeps the smaller tile: its cost is per element anyway)."""
    if fp8 and q.is_cuda and q.element_size() <= 2:
        return FP8_DECODE_TILE
    return default_tile(q)


def decode_partition_size(batch: int, num_kv_heads: int, max_context_len: int, device) -> int:
    """Positions per decode partition: split only when batch * H_kv programs cannot fill the GPU.

    Depends on static shapes alone (a CUDA graph bucket fixes all of them), never on context_lens.
    Aims at >= 4 programs per SM, with partitions of at least 256 positions (a shorter one costs
    more in partials than it saves). A power of two, so few distinct values reach the launch.
    """
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else 2
    most_splits = triton.cdiv(max_context_len, 256)
    splits = max(1, min(triton.cdiv(4 * num_sms, max(batch * num_kv_heads, 1)), most_splits))
    return max(triton.next_power_of_2(triton.cdiv(max_context_len, splits)), 64)


def _decode_scratch(q: torch.Tensor, num_partitions: int):
    """Partial max, sum (B, H, P) and acc (B, H, P, D) buffers; empty when nothing is split.

    Sized by static shapes only; torch.empty inside a CUDA graph capture comes from the graph's
    pool, the same buffer on every replay. The reduce reads only entries the first kernel wrote.
    """
    batch, num_heads, head_dim = q.shape
    shape = (batch, num_heads, num_partitions) if num_partitions > 1 else (0,)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # = acc_dtype(q)
    part_m = torch.empty(shape, dtype=dtype, device=q.device)
    part_l = torch.empty(shape, dtype=dtype, device=q.device)
    part_acc = torch.empty((*shape, head_dim), dtype=dtype, device=q.device)
    return part_m, part_l, part_acc
