"""Stage 00's "cache": nothing is stored, so every step feeds every token of every sequence.

Introduced in stage 00 as the oracle for every later stage. Cost per step grows with the whole
sequence length (quadratic work per token); that slowness is the point of the comparison.
"""

from __future__ import annotations

import torch

from nanoserve.engine.forward_inputs import ForwardInputs, pack_tokens, to_forward_inputs
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
        packed = pack_tokens(batch.seqs, from_start=True)
        return to_forward_inputs(packed, NoCacheAttention(packed.cu_seqlens_q), self.device)
