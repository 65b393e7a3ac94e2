"""Step tensors: a step's plain lists made into the device tensors the model reads.

Introduced in stage 04, given to its learner (whose `prepare_prefill` / `prepare_decode` compute
the lists; engine/runner/input_packer.py holds the reference). It computes nothing about the batch:
dtypes, -1 padding of the block tables, max_seqlen_q/k, the host copies, and the copy to the
device (through pinned memory on a GPU, without waiting).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from nanoserve.types import AttentionMetadata, HostMetadata, StepInputs


def step_inputs_from_lists(
    is_prefill: bool,
    input_ids: list[int],
    positions: list[int],
    slot_mapping: list[int],
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    device,
) -> StepInputs:
    """StepInputs from plain lists: tensors in the engine's dtypes, tables padded with -1."""

    def as_tensor(values, dtype=np.int64) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=dtype), device)

    lens_q = [e - s for s, e in itertools.pairwise(cu_seqlens_q)]
    metadata = AttentionMetadata(
        is_prefill=is_prefill,
        cu_seqlens_q=as_tensor(cu_seqlens_q, np.int32),
        cu_seqlens_k=as_tensor(cu_seqlens_k, np.int32),
        max_seqlen_q=max(lens_q, default=0),
        max_seqlen_k=max(context_lens, default=0),
        slot_mapping=as_tensor(slot_mapping),
        context_lens=as_tensor(context_lens, np.int32),
        block_tables=to_device(padded_tables(block_tables), device),
        host=HostMetadata(list(cu_seqlens_q), list(context_lens), [list(t) for t in block_tables]),
    )
    return StepInputs(as_tensor(input_ids), as_tensor(positions), metadata)


def padded_tables(block_tables: list[list[int]]) -> np.ndarray:
    """(B, longest) int32, row i = block_tables[i] then -1s; one vectorized fill, no row loop."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = int(lens.max(initial=0))
    out = np.full((len(block_tables), width), -1, dtype=np.int32)
    out[np.arange(width) < lens[:, None]] = list(itertools.chain.from_iterable(block_tables))
    return out


def to_device(array: np.ndarray, device) -> torch.Tensor:
    """A host array on device; to a GPU through pinned memory, without waiting for the copy."""
    tensor = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
