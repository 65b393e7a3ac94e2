"""Stage 08 starter: the pieces around a captured decode graph. Which graph a batch replays, how
its step is padded to that graph's shapes, and how it is copied into the buffers the graph reads.

Fill in each body (the lesson, stages/08_cuda_graphs/README.md, walks through them in task
order) in a copy: `cp stages/08_cuda_graphs/starter.py my_graphs.py`, then grade it with
`pytest stages/08_cuda_graphs --impl my_graphs.py`; this file itself must keep failing. Tasks 1
to 4 run on any machine: task 4 runs the engine's graph runner (`DecodeGraphs`) on your four
functions, with a CPU stand-in for each graph. Task 5 captures real CUDA graphs: it needs a GPU.

    static buffers, allocated once for the largest bucket (max_num_seqs 12, table width 6):
      input_ids, positions, slot_mapping, context_lens   (12,)     cu_seqlens_q/k  (13,)
      block_tables                                        (12, 6)

    a decode step of 3 sequences, blocks of 16, replays the graph of bucket 4 (buckets 1, 2,
    4, 8, 12); each real row's slot is its last position's: block_tables[r][p // 16] * 16 + p % 16
      row            0             1             2           | 3             | 4 .. 11
                     real rows                               | padding       | past the bucket:
      slot_mapping   17            5             40          | -1            | graph 4 never
      context_lens   18            6             41          | 0             | reads them
      block_tables   [4, 1, -1,..] [0, -1, ..]   [3, 9, 2,..]| [-1, -1, ...] |
"""

from __future__ import annotations

from nanoserve.engine.runner.graph_buffers import view_rows  # noqa: F401  (given; use it in task 3)
from nanoserve.types import StepInputs

# Given (in nanoserve/engine/runner/graph_buffers.py):
# `static_decode_inputs(max_batch, width, device)`
# allocates the static buffers, every row padding; `view_rows(static, rows)` is the StepInputs
# of their first `rows` rows, as views (same memory); `DecodeGraphs` captures one graph per
# bucket and replays them, calling the four functions below.

# ---- task 1: the buckets ----


def graph_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes a decode graph is captured for, ascending and without repeats.

    1, 2, 4, 8, then 16, 32, 48, ... in steps of 16, and max_num_seqs itself as the largest,
    whether or not it is a multiple of 16; nothing above it. max_num_seqs 40 gives
    [1, 2, 4, 8, 16, 32, 40], 48 gives [1, 2, 4, 8, 16, 32, 48], 5 gives [1, 2, 4, 5].

    Hint: those of 1, 2, 4, 8 below max_num_seqs, then range(16, max_num_seqs, 16), then
    max_num_seqs (nano-vLLM's range(16, max_bs + 1, 16) forgets a max off the 16-grid).
    """
    raise NotImplementedError("task 1: graph_buckets")


def bucket_for(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest of `buckets` (ascending) that holds batch_size sequences; None when even the
    largest is too small, and that batch runs eagerly. With [1, 2, 4, 8, 16, 20]: 3 -> 4,
    8 -> 8, 9 -> 16, 20 -> 20, 21 -> None.
    """
    raise NotImplementedError("task 1: bucket_for")


# ---- task 2: padding a decode step to a bucket ----


def pad_decode(step: StepInputs, batch_size: int, table_width: int) -> StepInputs:
    """The decode step grown to batch_size rows and table_width block-table columns.

    The real rows come first, unchanged. Each extra row is harmless padding: token 0 at position
    0, slot -1 (the store kernel writes nothing), context length 0 (attention reads nothing),
    a block table of -1s; every table is widened with -1 to table_width. cu_seqlens_q becomes
    0, 1, ..., batch_size (one query token per row); cu_seqlens_k stays at its total over the
    padding rows. Every other field (max_seqlen_q, max_seqlen_k, ...) is kept as it is. The
    host copies (`metadata.host`) are left alone: they hold only the real
    sequences, so `metadata.num_seqs` still counts those. Every tensor keeps its dtype and
    device. A step with more rows than batch_size, or a wider table than table_width, cannot be
    padded: raise ValueError (cutting it would drop a sequence or part of its history).

    Hint: a helper grow(x, fill, *shape) that makes torch.full(shape, fill, dtype=x.dtype,
    device=x.device) and copies x into its leading corner; then step.metadata._replace(...)
    and StepInputs(input_ids, positions, metadata).
    """
    raise NotImplementedError("task 2: pad_decode")


# ---- task 3: copying a padded step into the static buffers ----


def fill_static(static: StepInputs, step: StepInputs) -> None:
    """Copy a padded decode step (its rows = a bucket) into the first rows of the static buffers.

    A captured graph reads the static buffers' addresses, fixed at capture: copy the values into
    them, in place (Tensor.copy_). Building new tensors, or rebinding a name to the step's
    tensors, leaves the graph reading the old values. Copy input_ids, positions and the
    metadata's cu_seqlens_k, slot_mapping, context_lens and block_tables (cu_seqlens_q of a
    padded step is 0, 1, 2, ... like the static one). Rows past the step's are not the graph's:
    leave them as they are.

    Hint: target = view_rows(static, rows) shares the static buffers' memory.
    """
    raise NotImplementedError("task 3: fill_static")
