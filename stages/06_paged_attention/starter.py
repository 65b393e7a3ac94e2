"""Stage 06 starter: attention that reads each sequence's K/V straight from its scattered pages.

Fill in the kernels and their launch wrappers (the lesson, stages/06_paged_attention/README.md,
walks through them task by task) in a copy: `cp stages/06_paged_attention/starter.py mine.py`,
then grade it with `pytest stages/06_paged_attention --impl mine.py`; this file itself must keep
failing. Without a GPU the kernels run through Triton's interpreter (the repository's conftest.py
sets TRITON_INTERPRET=1 for pytest); test in float32 or float64 there: its bf16 tl.dot is wrong.

    one layer's cache (num_blocks, block_size, H_kv, D), contiguous; block_size 4 below

    block_tables[b] = [7, 2, 9, -1]          context_lens[b] = 10
    positions   0 1 2 3 | 4 5 6 7 | 8 9
    block id    ---7--- | ---2--- | -9-       slot(n) = table[n // 4] * 4 + n % 4
    (slot, kv head h) starts at (slot * H_kv + h) * D

Both kernels walk a sequence's positions in tiles of BLOCK_N, load each tile's K and V through
the block table, and fold them into an online softmax: FlashAttention's algorithm, over pages.
The -1 entries and every position at or past context_len are masked, never dereferenced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E): fold LOG2E into the scale, use tl.exp2
# Start each row's running max here, not at -inf: a row that has seen no visible key yet would
# compute exp2(-inf - (-inf)) = NaN; with NEG_BIG, exp2(-inf - NEG_BIG) is exactly 0.
NEG_BIG = tl.constexpr(-1.0e30)


# ---- the step both kernels share (tasks 1 and 3) ----


@triton.jit
def _load_kv_tile(
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
):
    """K and V of positions offs_n (BLOCK_N,) of one kv head: two (BLOCK_N, BLOCK_D) tiles.

    Hints: in_context = offs_n < context_len; load the block id of each position from
    block_table_ptr + offs_n // BLOCK_SIZE with mask=in_context (other=0: a masked lane must
    still hold a valid address); slot = block_id (as tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE;
    each row starts at (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM; load with
    mask = in_context[:, None] & (offs_d < HEAD_DIM)[None, :] and other=0.0. Return k, v.
    """
    pass  # task 1


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE: tl.constexpr):
    """Fold one key tile into each row's running max m_i, sum l_i and weighted values acc.

    q (rows, BLOCK_D), k and v (BLOCK_N, BLOCK_D), visible (rows, BLOCK_N) bool. Hints:
      s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC_DTYPE) * qk_scale
      hide the invisible scores (-inf); m_new = max(m_i, the tile's row max);
      alpha = exp2(m_i - m_new) re-weights what was summed under the old max;
      p = exp2(s - m_new[:, None]); l_i = l_i * alpha + sum(p); acc = acc * alpha + p @ v
      (cast p to v's dtype for the dot, accumulate in ACC_DTYPE). Return m_new, l_i, acc.
    """
    pass  # task 1


# ---- tasks 1-2: prefill (and extend on a cached prefix) ----


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
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
):
    """Program (b, h, m): query rows m * BLOCK_M ... of sequence b at query head h.

    Hints: q_len from cu_seqlens_q; return when m * BLOCK_M >= q_len (the grid is sized for the
    longest sequence). Row i of sequence b sits at position context_len - q_len + i (task 2: a
    cached prefix comes first). kv_head = h // GROUP. Start m_i at NEG_BIG, l_i and acc at 0, in
    ACC_DTYPE. Walk start_n from 0 to the last row's position + 1 in steps of BLOCK_N; a row sees
    the keys at positions <= its own. Write acc / l_i for the rows < q_len.
    """
    pass  # tasks 1-2


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
    """Causal attention of packed new tokens q (T, H, D) over their sequences' pages; (T, H, D).

    cu_seqlens_q (B + 1,): sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q.
    context_lens (B,): its cached prefix plus those new tokens (their K/V already stored).
    block_tables (B, W): its blocks, padded with -1. out: where to write, or a new tensor; the
    tests pass it positionally (the ninth argument), the engine not at all. Return it.

    Hints: grid (B, H, triton.cdiv(max_seqlen_q, BLOCK_M)); tiles of 32 rows/keys (16 at least:
    tl.dot's smallest); BLOCK_D = max(16, triton.next_power_of_2(D)); qk_scale = scale * LOG2E;
    ACC_DTYPE: pass tl.float64 (a constexpr, straight from Python) for float64 inputs, else
    tl.float32.
    """
    raise NotImplementedError("task 1: paged_attention_prefill")


# ---- tasks 3-4: decode, split-K ----


@triton.jit
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
):
    """Program (b, g, p): the GROUP query heads of kv head g over partition p of sequence b.

    Hints: the GROUP heads are the rows of one tile (BLOCK_G >= 16 rows, the extra ones masked),
    so K/V are read once per group. Partition p covers positions p * partition_size up to the
    next partition or context_len; a partition past the context returns at once, except
    partition 0, which must still write (a padding row's output is 0, never NaN).
    Task 3 (SPLIT false, one partition): write acc / l_i (0 where l_i is 0) to out.
    Task 4 (SPLIT): write m_i, l_i and acc, unnormalised, at [b, head, p] of the partial buffers,
    where head = g * GROUP + row runs over all H = GROUP * NUM_KV_HEADS query heads. The tile
    loader's context_len is where this partition's keys end (the smaller of the partition's end
    and context_len): positions past it are masked.
    """
    pass  # tasks 3-4


@triton.jit
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
    """Program (b, h): merge the partitions' partials of row b, head h (task 4).

    Hints: only partitions that held a position wrote (at least partition 0); M = max of their
    m_p; w_p = exp2(m_p - M) (0 for the others); out = sum_p w_p acc_p / sum_p w_p l_p.
    """
    pass  # task 4


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
    """One query per sequence q (B, H, D) over its context_lens[b] paged positions; (B, H, D).

    Row b's query sits at its last position, so it sees its whole context: no causal mask. A row
    with context_lens[b] == 0 is padding: its output is 0. partition_size: positions per
    partition (task 4); None chooses from static shapes, and one partition is fine until then.
    out: where to write, or a new tensor; the tests pass it positionally (the seventh argument).

    Hints: the launch may depend only on shapes, never on context_lens' values (stage 08
    captures it): num_partitions = triton.cdiv(W * block_size, partition_size) for a table of W
    blocks. Grid (B, H_kv, num_partitions); BLOCK_G = max(16, triton.next_power_of_2(H // H_kv));
    key tiles of block_n positions must divide partition_size. With more than one partition,
    allocate partial buffers m, l (B, H, P) and acc (B, H, P, D) in the accumulation dtype, then
    launch the reduce on grid (B, H) with BLOCK_P = triton.next_power_of_2(P).
    """
    raise NotImplementedError("task 3: paged_attention_decode")
