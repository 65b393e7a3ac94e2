"""What one model call needs: packed token ids, their positions, and the attention backend.

Introduced in stage 00. Each stage's cache builds these from a scheduled batch; the model runner
only feeds them to the model.
"""

from typing import Any, NamedTuple

import torch


class ForwardInputs(NamedTuple):
    """Packed inputs of one step (T tokens across the batch's sequences)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, position of each token inside its own sequence
    attn: Any  # the attention backend: stores/reads K/V for this step's layout
    logits_indices: torch.Tensor  # (num_seqs,) which rows of the hidden states to sample from


class PackedTokens(NamedTuple):
    """Several sequences' tokens laid end to end, with where each one starts."""

    input_ids: list[int]
    positions: list[int]
    cu_seqlens_q: list[int]  # sequence i owns packed rows cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1


def pack_tokens(seqs, from_start: bool = False) -> PackedTokens:
    """Each sequence's uncached tokens (all of them when from_start) on one axis, no padding.

    Prefill packs the whole uncached prompt, decode the one newest token: both are
    `token_ids[num_cached_tokens:]`. Two sequences of 3 and 2 new tokens give cu_seqlens [0, 3, 5].
    """
    input_ids, positions, cu_seqlens_q = [], [], [0]
    for seq in seqs:
        start = 0 if from_start else seq.num_cached_tokens
        input_ids.extend(seq.token_ids[start:])
        positions.extend(range(start, len(seq)))
        cu_seqlens_q.append(cu_seqlens_q[-1] + len(seq) - start)
    return PackedTokens(input_ids, positions, cu_seqlens_q)


def to_forward_inputs(packed: PackedTokens, attn, device) -> ForwardInputs:
    """Tensors for the model, sampling from the last packed row of each sequence."""
    return ForwardInputs(
        input_ids=torch.tensor(packed.input_ids, device=device),
        positions=torch.tensor(packed.positions, device=device),
        attn=attn,
        logits_indices=torch.tensor(packed.cu_seqlens_q[1:], device=device) - 1,
    )
