"""prepare_prefill / prepare_decode: a batch of sequences in, packed tensors for one step out.

Introduced in stage 04. Reads each sequence's `block_table` (decided earlier by the block
manager) and serializes it; decides nothing. The result is passed explicitly to the model's
attention, never through a module global. Seed trace, block_size 4, prompt A of 11 tokens with
table [0, 1, 2]: prefill slot_mapping = 0..10; decode at length 12 writes slot 2 * 4 + 3 = 11.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoserve.engine.sequence import Sequence


class AttentionMetadata(NamedTuple):
    """Where this step's K/V goes and what each sequence reads."""

    is_prefill: bool
    cu_seqlens_q: torch.Tensor  # (B + 1,) packed query rows of each sequence
    cu_seqlens_k: torch.Tensor  # (B + 1,) logical context of each sequence (cached + new)
    slot_mapping: torch.Tensor  # (T,) flat pool slot each new token's K/V is written to
    context_lens: torch.Tensor  # (B,) tokens each sequence attends over
    block_tables: torch.Tensor  # (B, max_blocks) int32 block ids, padded with -1
    cu_seqlens_q_list: list[int]  # the same numbers on the host, for per-sequence loops
    context_lens_list: list[int]


class StepInputs(NamedTuple):
    """Packed token ids and positions plus their metadata."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


def slots_for(seq: Sequence, start: int, end: int, block_size: int) -> list[int]:
    """Flat slots of positions start .. end-1: block_table[p // bs] * bs + p % bs."""
    table = seq.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def prepare_block_tables(seqs: list[Sequence], device) -> torch.Tensor:
    """(B, max_blocks) int32, each row a sequence's block table padded with -1."""
    width = max(len(seq.block_table) for seq in seqs)
    rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def prepare_prefill(seqs: list[Sequence], block_size: int, device) -> StepInputs:
    """Every uncached token of each sequence; cu_seqlens_k also counts the cached prefix."""
    input_ids, positions, slot_mapping = [], [], []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
    for seq in seqs:
        start, end = seq.num_cached_tokens, len(seq)
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slot_mapping.extend(slots_for(seq, start, end, block_size))
        cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)
    context_lens = [len(seq) for seq in seqs]
    return _step_inputs(True, input_ids, positions, slot_mapping, cu_seqlens_q, cu_seqlens_k,
                        context_lens, seqs, device)  # fmt: skip


def prepare_decode(seqs: list[Sequence], block_size: int, device) -> StepInputs:
    """One token per sequence, its last; it attends over its whole history."""
    input_ids = [seq.last_token_id for seq in seqs]
    positions = [len(seq) - 1 for seq in seqs]
    slot_mapping = [slots_for(seq, len(seq) - 1, len(seq), block_size)[0] for seq in seqs]
    context_lens = [len(seq) for seq in seqs]
    cu_seqlens_q = list(range(len(seqs) + 1))
    cu_seqlens_k = [0]
    for n in context_lens:
        cu_seqlens_k.append(cu_seqlens_k[-1] + n)
    return _step_inputs(False, input_ids, positions, slot_mapping, cu_seqlens_q, cu_seqlens_k,
                        context_lens, seqs, device)  # fmt: skip


def _step_inputs(is_prefill, input_ids, positions, slot_mapping, cu_seqlens_q, cu_seqlens_k,
                 context_lens, seqs, device) -> StepInputs:  # fmt: skip
    def as_tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
        is_prefill=is_prefill,
        cu_seqlens_q=as_tensor(cu_seqlens_q, torch.int32),
        cu_seqlens_k=as_tensor(cu_seqlens_k, torch.int32),
        slot_mapping=as_tensor(slot_mapping),
        context_lens=as_tensor(context_lens, torch.int32),
        block_tables=prepare_block_tables(seqs, device),
        cu_seqlens_q_list=cu_seqlens_q,
        context_lens_list=context_lens,
    )
    return StepInputs(as_tensor(input_ids), as_tensor(positions), metadata)
