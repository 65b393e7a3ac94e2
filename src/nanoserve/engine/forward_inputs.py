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
