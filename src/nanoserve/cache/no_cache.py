"""Stage 00's "cache": nothing is stored, so every step feeds every token of every sequence.

Introduced in stage 00 as the oracle for every later stage. Cost per step grows with the whole
sequence length (quadratic work per token); that slowness is the point of the comparison.
"""

from __future__ import annotations

import torch

from nanoserve.engine.forward_inputs import ForwardInputs
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels.attention import NoCacheAttention


class NoCacheManager:
    """Memory never limits admission: only `max_num_seqs` bounds the batch."""

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Every request fits: nothing is stored."""

    def can_allocate(self, seq: Sequence) -> bool:
        return True

    def allocate(self, seq: Sequence) -> None:
        pass

    def can_append(self, seq: Sequence) -> bool:
        return True

    def may_append(self, seq: Sequence) -> None:
        pass

    def deallocate(self, seq: Sequence) -> None:
        seq.num_cached_tokens = 0


class NoCache:
    """Packs every sequence whole, prefill and decode alike; the model recomputes everything."""

    def __init__(self, device: torch.device):
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> ForwardInputs:
        """Inputs that recompute each sequence from its first token."""
        input_ids, positions, cu_seqlens = [], [], [0]
        for seq in batch.seqs:
            input_ids.extend(seq.token_ids)
            positions.extend(range(len(seq)))
            cu_seqlens.append(cu_seqlens[-1] + len(seq))
        last_token_indices = [end - 1 for end in cu_seqlens[1:]]
        return ForwardInputs(
            input_ids=torch.tensor(input_ids, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            attn=NoCacheAttention(cu_seqlens),
            logits_indices=torch.tensor(last_token_indices, device=self.device),
        )
