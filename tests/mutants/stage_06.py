"""Stage 06 mutants: the paged prefill kernel (kernels/paged_prefill.py), the split-K decode
kernels (kernels/paged_decode.py) and the two helpers they share (kernels/paged_tiles.py), one
learner bug each.

A learner writes the shared helpers in the same file as the kernels, so a bug in one of them is
a mutant of a kernel module whose import of that helper is replaced by a buggy copy of it."""

from __future__ import annotations

from tests.mutants import Mutant, reference_source

PREFILL = "nanoserve.kernels.paged_prefill"
DECODE = "nanoserve.kernels.paged_decode"
IMPORTS = "    load_kv_tile,\n    online_softmax_step,\n)\n"  # the end of both kernels' imports


def mutant(name: str, bug: str, module: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(6, name, bug, module, edits)


def buggy_helper(name: str, old: str, new: str) -> tuple[str, str]:
    """An edit that defines paged_tiles' `name` in the kernel module, with `old` made `new`."""
    source = reference_source("nanoserve.kernels.paged_tiles")
    start = source.index(f"@triton.jit\ndef {name}(")
    helper = source[start : source.index("\n\n\n", start)]
    if helper.count(old) != 1:
        raise ValueError(f"{old!r} is not once in paged_tiles.{name}: update the mutant")
    kept = IMPORTS.replace(f"    {name},\n", "")
    return IMPORTS, f"{kept}\n\n{helper.replace(old, new)}\n"


MUTANTS = (
    # ---- prefill ----
    mutant(
        "causal_off_by_one", "the causal mask is offs_n < q_pos: a row does not see its own key",
        PREFILL, ("visible = offs_n[None, :] <= q_pos[:, None]",
                  "visible = offs_n[None, :] < q_pos[:, None]"),
    ),
    mutant(
        "cached_prefix_ignored", "query row i is taken for position i, as if nothing were cached",
        PREFILL, ("q_pos = context_len - q_len + offs_m", "q_pos = offs_m"),
    ),
    mutant(
        "kv_head_modulo", "GQA maps query head h to kv head h % H_kv, not h // group",
        PREFILL, ("kv_head = head // GROUP", "kv_head = head % NUM_KV_HEADS"),
    ),
    mutant(
        "one_query_tile_per_sequence", "the grid launches one query tile per (sequence, head): "
        "rows past BLOCK_M are never computed",
        PREFILL, ("triton.cdiv(max_seqlen_q, block_m))", "1)"),
    ),
    mutant(
        "no_alpha_rescale", "the online softmax never rescales what it summed when the max rises",
        PREFILL, buggy_helper("online_softmax_step", "alpha = tl.exp2(m_i - m_new)",
                                   "alpha = tl.exp2(m_i - m_i)"),
    ),
    # ---- decode ----
    mutant(
        "group_heads_strided", "a KV group's query heads are taken as g, g + H_kv, ... (the "
        "h % H_kv grouping), not g * group ..",
        DECODE, ("heads = kv_head * GROUP + offs_g", "heads = kv_head + offs_g * NUM_KV_HEADS"),
    ),
    mutant(
        "logical_block_as_physical", "the tile loader uses the logical block n // block_size as "
        "the physical block, never reading the block table",
        DECODE, buggy_helper("load_kv_tile",
                             "block_id = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, "
                             "mask=in_context, other=0)",
                             "block_id = offs_n // BLOCK_SIZE"),
    ),
    mutant(
        "context_mask_missing", "decode scores every key of the tile: positions past the context "
        "(loaded as zeros) join the softmax",
        DECODE, ("visible = (offs_n < part_end)[None, :]", "visible = (offs_n >= 0)[None, :]"),
    ),
    mutant(
        "padding_rows_not_zeroed", "decode divides by l_i unguarded: a context-0 row gets 0 / 0",
        DECODE, ("out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty row: 0 / 1 = 0",
                 "out = acc / l_i[:, None]"),
    ),
    mutant(
        "partitions_run_to_the_end", "every partition attends from its start to the context end, "
        "so later keys are counted several times",
        DECODE, ("part_end = tl.minimum(part_start + partition_size, context_len)",
                 "part_end = context_len"),
    ),
    mutant(
        "reduce_without_reweighting", "the reduce adds the partials as they are, each still "
        "weighted by its own max",
        DECODE, ("w = tl.where(written, tl.exp2(m - tl.max(m, 0)), 0.0)",
                 "w = tl.where(written, 1.0, 0.0)"),
    ),
    mutant(
        "reduce_sums_unweighted_l", "the reduce re-weights the values but not the sums",
        DECODE, ("total = tl.sum(w * l, 0)", "total = tl.sum(tl.where(written, l, 0.0), 0)"),
    ),
    mutant(
        "scale_without_log2e", "decode scales by 1/sqrt(D) but still uses exp2: softmax at the "
        "wrong temperature",
        DECODE, ("float(scale) * LOG2E, partition_size", "float(scale), partition_size"),
    ),
)  # fmt: skip
