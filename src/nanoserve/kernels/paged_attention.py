"""Stage 06: attention reading K/V straight from scattered pages: varlen prefill, split-K decode.

Introduced in stage 06. Both kernels share one step: load a key tile through the block table and
fold it into an online softmax (FlashAttention's algorithm; decode adds flash-decoding's reduce).
Neither gathers a contiguous copy of a sequence's K/V, nor writes the cache (store runs first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
# -inf - (-inf) = NaN; exp2(-inf - _NEG_BIG) is exactly 0 and exp2(_NEG_BIG - real max) too.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_ptr, offs_n, context_len, kv_head, offs_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """K and V of positions offs_n (BLOCK_N,) of one kv head: two (BLOCK_N, BLOCK_D) tiles."""
    in_context = offs_n < context_len
    block_id = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_context, other=0)
    slot = block_id.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE  # int64: big pools
    row = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM  # start of (slot, kv_head)'s D values
    mask = in_context[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE: tl.constexpr):
    """Fold one key tile into the running (max m_i, sum l_i, weighted values acc) of each row.

    Online softmax: after any prefix of the keys, acc / l_i is the softmax-weighted mean of the
    values seen so far. A new tile may raise a row's max from m to m'; everything summed so far
    was weighted by exp2(s - m), so multiplying by alpha = exp2(m - m') re-weights it to m'.
    """
    # Scores in log2 units: qk_scale = scale * log2(e), so exp(scale * q.k) = exp2(score).
    s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC_DTYPE) * qk_scale
    s = tl.where(visible, s, float("-inf"))  # (rows, BLOCK_N)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # hidden keys: exp2(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee", out_dtype=ACC_DTYPE)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------------
# Prefill / extend: packed variable-length queries, causal over cached prefix + new tokens.
#
#   q (T, H, D), T = sum of q_len_b       cu_seqlens_q = [0, 3, 5]   context_lens = [7, 9]
#   rows 0..2 -> sequence 0, positions 4, 5, 6   (7 - 3 + i: the last 3 of its 7 positions)
#   rows 3..4 -> sequence 1, positions 7, 8
#
#   grid = (B, H, cdiv(max_seqlen_q, BLOCK_M)): program (b, h, m) owns query rows
#   m*BLOCK_M .. m*BLOCK_M + BLOCK_M - 1 of sequence b at head h, and walks its keys from position
#   0 up to its last row's position in tiles of BLOCK_N (keys after that are hidden by causality).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    block_tables_ptr, q_stride_t, q_stride_h, out_stride_t, out_stride_h, block_tables_stride,
    qk_scale, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, ACC_DTYPE: tl.constexpr,
):  # fmt: skip
    seq, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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

    m_i = tl.full([BLOCK_M], _NEG_BIG, ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)
    kv_head = head // GROUP  # GQA: GROUP query heads read the same kv head, never copied
    table = block_tables_ptr + seq * block_tables_stride
    kv_end = context_len - q_len + tl.minimum((m_block + 1) * BLOCK_M, q_len)  # last row + 1
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, context_len, kv_head,
                             offs_d, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)  # fmt: skip
        visible = offs_n[None, :] <= q_pos[:, None]  # causal: a row sees keys up to itself
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE)

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
) -> torch.Tensor:
    """Causal attention of packed new tokens q (T, H, D) over their sequences' pages; (T, H, D)."""
    group, block_size, head_dim = _check_common(q, k_cache, v_cache, block_tables, out)
    num_seqs = block_tables.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,):
        raise ValueError("cu_seqlens_q must be (B + 1,) and context_lens (B,) for B block tables")
    out = torch.empty_like(q) if out is None else out
    block_m = block_m or _default_tile(q)
    block_n = block_n or _default_tile(q)
    grid = (num_seqs, q.shape[1], triton.cdiv(max_seqlen_q, block_m))
    if num_seqs == 0 or max_seqlen_q == 0:
        return out
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        float(scale) * LOG2E, GROUP=group, NUM_KV_HEADS=k_cache.shape[2], HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim), BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        ACC_DTYPE=_acc_dtype(q), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


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


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    context_lens_ptr, block_tables_ptr, q_stride_b, q_stride_h, out_stride_b, out_stride_h,
    block_tables_stride, qk_scale, partition_size, num_partitions, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, ACC_DTYPE: tl.constexpr,
):  # fmt: skip
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

    m_i = tl.full([BLOCK_G], _NEG_BIG, ACC_DTYPE)
    l_i = tl.zeros([BLOCK_G], ACC_DTYPE)
    acc = tl.zeros([BLOCK_G, BLOCK_D], ACC_DTYPE)
    table = block_tables_ptr + seq * block_tables_stride
    for start_n in range(part_start, part_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, part_end, kv_head,
                             offs_d, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)  # fmt: skip
        visible = (offs_n < part_end)[None, :]  # the one query is last: it sees all context
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE)

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty row: 0 / 1 = 0
        out_ptrs = out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), io_mask)
    else:
        part_idx = (seq * NUM_KV_HEADS * GROUP + heads) * num_partitions + part  # (BLOCK_G,)
        tl.store(part_m_ptr + part_idx, m_i, offs_g < GROUP)
        tl.store(part_l_ptr + part_idx, l_i, offs_g < GROUP)
        tl.store(part_acc_ptr + part_idx[:, None] * HEAD_DIM + offs_d[None, :], acc, io_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, context_lens_ptr, out_stride_b, out_stride_h,
    partition_size, num_partitions, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    # Only partitions that held a position wrote partials; partition 0 of an empty row did too,
    # with l = 0, so it adds nothing and the output stays 0.
    written = offs_p < tl.maximum(tl.cdiv(context_len, partition_size), 1)
    idx = (seq * NUM_HEADS + head) * num_partitions + offs_p
    m = tl.load(part_m_ptr + idx, written, other=_NEG_BIG)
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
) -> torch.Tensor:
    """One query per sequence q (B, H, D) over its context_lens[b] paged positions; (B, H, D)."""
    group, block_size, head_dim = _check_common(q, k_cache, v_cache, block_tables, out)
    batch, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = k_cache.shape[2]
    if context_lens.shape != (batch,) or block_tables.shape[0] != batch:
        raise ValueError(f"context_lens (B,) and block_tables (B, W) must have B = {batch} rows")
    max_context_len = block_tables.shape[1] * block_size  # static: what the table can address
    block_n = block_n or _default_tile(q)
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
        q, k_cache, v_cache, out, part_m, part_l, part_acc, context_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        float(scale) * LOG2E, partition_size, num_partitions, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=num_partitions > 1, ACC_DTYPE=_acc_dtype(q), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if num_partitions > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            out, part_m, part_l, part_acc, context_lens, out.stride(0), out.stride(1),
            partition_size, num_partitions, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim), BLOCK_P=triton.next_power_of_2(num_partitions),
        )  # fmt: skip
    return out


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
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    part_m = torch.empty(shape, dtype=acc_dtype, device=q.device)
    part_l = torch.empty(shape, dtype=acc_dtype, device=q.device)
    part_acc = torch.empty((*shape, head_dim), dtype=acc_dtype, device=q.device)
    return part_m, part_l, part_acc


# ---------------------------------------------------------------------------------------------
# Shared argument checks and launch choices.
# ---------------------------------------------------------------------------------------------


def _check_common(q, k_cache, v_cache, block_tables, out) -> tuple[int, int, int]:
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
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q {q.dtype} and the caches {k_cache.dtype} must share one dtype")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be (B, max_blocks) int32 or int64, padded with -1")
    return num_heads // num_kv_heads, block_size, head_dim


def _acc_dtype(q: torch.Tensor):
    """Accumulate in float32, or in float64 when the inputs are float64."""
    return tl.float64 if q.dtype == torch.float64 else tl.float32


def _block_d(head_dim: int) -> int:
    """head_dim padded to a power of two of at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(head_dim))


def _default_tile(q: torch.Tensor) -> int:
    """Rows or keys per tile: 64 for 2-byte dtypes, 32 for wider ones (shared memory)."""
    return 64 if q.element_size() <= 2 else 32
