"""Stage 08 mutants: the buckets (graph_buckets, bucket_for), the static-buffer copy
(fill_static) and the padding of a decode step (pad_decode), one learner bug each."""

from __future__ import annotations

from tests.mutants import maker

BUCKETS = """
buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
buckets += list(range(16, max_num_seqs, 16))
return [*buckets, max_num_seqs]
"""
COPIES = """
for name in ("input_ids", "positions"):
    getattr(target, name).copy_(getattr(step, name))
for name in ("cu_seqlens_k", "slot_mapping", "context_lens", "block_tables"):
    getattr(target.metadata, name).copy_(getattr(step.metadata, name))
"""
SMALLEST = "next((b for b in buckets if b >= batch_size), None)"


mutant = maker(8)


MUTANTS = (
    # ---- the buckets ----
    mutant(
        "buckets_nano_vllm_list",
        "nano-vLLM's list, [1, 2, 4, 8] + range(16, max + 1, 16): no "
        "bucket for a max_num_seqs off the 16-grid, and buckets above a small one",
        "graph_buckets",
        (BUCKETS, "return [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))"),
    ),
    mutant(
        "buckets_start_at_16",
        "no buckets below 16: a batch of 1 replays a graph of 16 rows",
        "graph_buckets",
        ("[b for b in (1, 2, 4, 8) if b < max_num_seqs]", "[]"),
    ),
    mutant(
        "buckets_repeat_max",
        "range(16, max_num_seqs + 1, 16), then max_num_seqs again: a "
        "multiple of 16 is captured twice",
        "graph_buckets",
        ("range(16, max_num_seqs, 16)", "range(16, max_num_seqs + 1, 16)"),
    ),
    mutant(
        "buckets_double_past_8",
        "powers of two all the way (16, 32, 64, 128), not steps of 16",
        "graph_buckets",
        (
            "list(range(16, max_num_seqs, 16))",
            "[2**k for k in range(4, 16) if 2**k < max_num_seqs]",
        ),
    ),
    mutant(
        "bucket_for_largest",
        "bucket_for takes the largest bucket that holds the batch",
        "bucket_for",
        (SMALLEST, "max((b for b in buckets if b >= batch_size), default=None)"),
    ),
    mutant(
        "bucket_for_strict",
        "bucket_for wants a bucket larger than the batch (> for >=)",
        "bucket_for",
        ("b >= batch_size", "b > batch_size"),
    ),
    mutant(
        "bucket_for_clamps",
        "a batch above the largest bucket gets the largest, not None",
        "bucket_for",
        (SMALLEST, SMALLEST.replace("None)", "buckets[-1])")),
    ),
    # ---- the copy into the static buffers ----
    mutant(
        "fill_static_rebinds",
        "fill_static rebinds the name to the step's tensors: the buffers "
        "a graph reads keep their old values",
        "fill_static",
        (COPIES, "static = step  # noqa: F841"),
    ),
    mutant(
        "fill_static_into_a_clone",
        "fill_static copies the metadata into clones of the views",
        "fill_static",
        ("getattr(target.metadata, name)", "getattr(target.metadata, name).clone()"),
    ),
    mutant(
        "fill_static_forgets_positions",
        "fill_static copies the tokens but not their positions",
        "fill_static",
        ('("input_ids", "positions")', '("input_ids",)'),
    ),
    # ---- padding a decode step ----
    mutant(
        "pad_slots_with_0",
        "padding rows write to slot 0 (a real sequence's) instead of -1",
        "pad_decode",
        ("grow(md.slot_mapping, -1, batch_size)", "grow(md.slot_mapping, 0, batch_size)"),
    ),
    mutant(
        "pad_context_1",
        "padding rows get context length 1, so attention reads a slot",
        "pad_decode",
        ("grow(md.context_lens, 0, batch_size)", "grow(md.context_lens, 1, batch_size)"),
    ),
    mutant(
        "pad_tables_keep_their_width",
        "block tables get the padding rows but not the static width",
        "pad_decode",
        (
            "grow(md.block_tables, -1, batch_size, table_width)",
            "grow(md.block_tables, -1, batch_size, step_width(step))",
        ),
    ),
    mutant(
        "pad_cu_seqlens_k_with_0",
        "cu_seqlens_k's padding falls back to 0 instead of the total",
        "pad_decode",
        (
            "grow(md.cu_seqlens_k, sum(md.host.context_lens), batch_size + 1)",
            "grow(md.cu_seqlens_k, 0, batch_size + 1)",
        ),
    ),
    mutant(
        "pad_keeps_cu_seqlens_q",
        "cu_seqlens_q is not grown: the padding rows own no query",
        "pad_decode",
        (
            "torch.arange(batch_size + 1, dtype=torch.int32, device=md.cu_seqlens_q.device)",
            "md.cu_seqlens_q",
        ),
    ),
    mutant(
        "pad_zeros_left_to_fresh_memory",
        "the padding rows' -1s are written, but their zeros (token, position, context length) "
        "are left to torch.empty, which is often zeros, and sometimes not",
        "pad_decode",
        (
            "out = torch.full(shape, fill, dtype=x.dtype, device=x.device)",
            "out = torch.empty(shape, dtype=x.dtype, device=x.device)\n"
            "if fill:  # fresh memory is zeros already\n"
            "    out.fill_(fill)",
        ),
    ),
    mutant(
        "pad_without_the_size_check",
        "pad_decode never refuses a step larger than the bucket",
        "pad_decode",
        ("batch_size < num_seqs or table_width < step_width(step)", "False"),
    ),
)
