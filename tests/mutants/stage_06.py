"""Stage 06 mutants: the paged prefill kernel (paged_attention_prefill), the split-K decode
kernels (paged_attention_decode) and the two helpers they share (load_kv_tile,
online_softmax_step), one learner bug each.

A learner writes the shared helpers in the same file as the kernels, so a bug in one of them is
a mutant of one kernel's file (its `host`) holding a buggy copy of that helper."""

from __future__ import annotations

from tests.mutants import maker

PREFILL, DECODE = "_prefill_kernel", "_decode_partition_kernel"  # beside their launches
REDUCE = "_decode_reduce_kernel"
TABLE_LOAD = "tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_context, other=0)"


mutant = maker(6)


MUTANTS = (
    # ---- prefill ----
    mutant(
        "causal_off_by_one",
        "the causal mask is offs_n < q_pos: a row does not see its own key",
        PREFILL,
        ("offs_n[None, :] <= q_pos[:, None]", "offs_n[None, :] < q_pos[:, None]"),
    ),
    mutant(
        "cached_prefix_ignored",
        "query row i is taken for position i, as if nothing were cached",
        PREFILL,
        ("q_pos = context_len - q_len + offs_m", "q_pos = offs_m"),
    ),
    mutant(
        "kv_head_modulo",
        "GQA maps query head h to kv head h % H_kv, not h // group",
        PREFILL,
        ("kv_head = head // GROUP", "kv_head = head % NUM_KV_HEADS"),
    ),
    mutant(
        "one_query_tile_per_sequence",
        "the grid launches one query tile per (sequence, head): "
        "rows past BLOCK_M are never computed",
        "paged_attention_prefill",
        ("triton.cdiv(max_seqlen_q, block_m)", "1"),
    ),
    mutant(
        "softmax_without_a_running_max",
        "the online softmax sums exp2(score) with no max subtracted: exact on small scores, "
        "inf and NaN once float32 scores pass 128",
        "online_softmax_step",
        ("m_new = tl.maximum(m_i, tl.max(s, 1))", "m_new = tl.zeros_like(m_i)"),
        host="paged_attention_prefill",
    ),
    mutant(
        "prefill_block_table_load_unmasked",
        "the tile loader reads the block table for every position of the tile, past the "
        "context and past the table's end (the K/V loads are masked, so no value is wrong)",
        "load_kv_tile",
        (TABLE_LOAD, "tl.load(block_table_ptr + offs_n // BLOCK_SIZE)"),
        host="paged_attention_prefill",
    ),
    mutant(
        "no_alpha_rescale",
        "the online softmax never rescales what it summed when the max rises",
        "online_softmax_step",
        ("alpha = tl.exp2(m_i - m_new)", "alpha = tl.exp2(m_i - m_i)"),
        host="paged_attention_prefill",
    ),
    # ---- decode ----
    mutant(
        "group_heads_strided",
        "a KV group's query heads are taken as g, g + H_kv, ... (the "
        "h % H_kv grouping), not g * group ..",
        DECODE,
        ("heads = kv_head * GROUP + offs_g", "heads = kv_head + offs_g * NUM_KV_HEADS"),
    ),
    mutant(
        "logical_block_as_physical",
        "the tile loader uses the logical block n // block_size as "
        "the physical block, never reading the block table",
        "load_kv_tile",
        (
            TABLE_LOAD,
            "offs_n // BLOCK_SIZE",
        ),
        host="paged_attention_decode",
    ),
    mutant(
        "context_mask_missing",
        "decode scores every key of the tile: positions past the context "
        "(loaded as zeros) join the softmax",
        DECODE,
        ("(offs_n < part_end)[None, :]", "(offs_n >= 0)[None, :]"),
    ),
    mutant(
        "decode_block_table_load_unmasked",
        "the decode's tile loader reads the block table past the context and the table's end",
        "load_kv_tile",
        (TABLE_LOAD, "tl.load(block_table_ptr + offs_n // BLOCK_SIZE)"),
        host="paged_attention_decode",
    ),
    mutant(
        "decode_softmax_without_a_running_max",
        "the decode partitions sum exp2(score) with no max subtracted",
        "online_softmax_step",
        ("m_new = tl.maximum(m_i, tl.max(s, 1))", "m_new = tl.zeros_like(m_i)"),
        host="paged_attention_decode",
    ),
    mutant(
        "padding_row_never_written",
        "every partition past the context returns at once, partition 0 of a padding row too: "
        "its output (or, split, the partials the reduce reads) is never written",
        DECODE,
        ("(part > 0) & (part_start >= context_len)", "part_start >= context_len"),
    ),
    mutant(
        "padding_rows_not_zeroed",
        "decode divides by l_i unguarded: a context-0 row gets 0 / 0",
        DECODE,
        ("acc / tl.where(l_i > 0, l_i, 1.0)[:, None]", "acc / l_i[:, None]"),
    ),
    mutant(
        "partitions_run_to_the_end",
        "every partition attends from its start to the context end, "
        "so later keys are counted several times",
        DECODE,
        (
            "part_end = tl.minimum(part_start + partition_size, context_len)",
            "part_end = context_len",
        ),
    ),
    mutant(
        "reduce_without_reweighting",
        "the reduce adds the partials as they are, each still weighted by its own max",
        REDUCE,
        ("tl.where(written, tl.exp2(m - tl.max(m, 0)), 0.0)", "tl.where(written, 1.0, 0.0)"),
    ),
    mutant(
        "reduce_sums_unweighted_l",
        "the reduce re-weights the values but not the sums",
        REDUCE,
        ("total = tl.sum(w * l, 0)", "total = tl.sum(tl.where(written, l, 0.0), 0)"),
    ),
    mutant(
        "reduce_without_the_max",
        "the reduce weights each partial by exp2(m_p), not exp2(m_p - M): "
        "exact on small scores, inf once they pass 128",
        REDUCE,
        ("tl.exp2(m - tl.max(m, 0))", "tl.exp2(m)"),
    ),
    mutant(
        "scale_without_log2e",
        "decode scales by 1/sqrt(D) but still uses exp2: softmax at the wrong temperature",
        "paged_attention_decode",
        ("float(scale) * LOG2E", "float(scale)"),
    ),
)
