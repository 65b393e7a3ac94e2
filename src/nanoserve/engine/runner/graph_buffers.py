"""Graph buffers: the static decode inputs every CUDA graph reads, and views of their first rows.

Introduced in stage 08, given to its learner (whose `fill_static` copies a step into them;
engine/runner/cuda_graphs.py holds the reference). Allocated once, for the largest bucket: padding
rows write to slot -1 and read context length 0, so a graph of any bucket may read them.
"""

from __future__ import annotations

import torch

from nanoserve.types import AttentionMetadata, HostMetadata, StepInputs


def static_decode_inputs(max_batch: int, width: int, device) -> StepInputs:
    """Zeroed decode inputs of the largest bucket: what every graph reads (and padding means)."""
    zeros = dict(dtype=torch.int64, device=device)
    ints = dict(dtype=torch.int32, device=device)
    metadata = AttentionMetadata(
        is_prefill=False,
        cu_seqlens_q=torch.arange(max_batch + 1, **ints),
        cu_seqlens_k=torch.zeros(max_batch + 1, **ints),
        max_seqlen_q=1,
        max_seqlen_k=0,  # not read by decode kernels; they loop to each row's context_lens
        slot_mapping=torch.full((max_batch,), -1, **zeros),  # -1: padding rows write nothing
        context_lens=torch.zeros(max_batch, **ints),  # 0: padding rows read nothing
        block_tables=torch.full((max_batch, width), -1, **ints),
        host=HostMetadata([], [], []),  # graphs never read host lists
    )
    return StepInputs(torch.zeros(max_batch, **zeros), torch.zeros(max_batch, **zeros), metadata)


def view_rows(static: StepInputs, rows: int) -> StepInputs:
    """The first `rows` rows of the static buffers (views: a graph records their addresses)."""
    md = static.metadata
    metadata = md._replace(
        cu_seqlens_q=md.cu_seqlens_q[: rows + 1],
        cu_seqlens_k=md.cu_seqlens_k[: rows + 1],
        slot_mapping=md.slot_mapping[:rows],
        context_lens=md.context_lens[:rows],
        block_tables=md.block_tables[:rows],
    )
    return StepInputs(static.input_ids[:rows], static.positions[:rows], metadata)
