"""Stage 00's "cache": nothing is stored, so every step feeds every token of every sequence.

Introduced in stage 00 as the oracle for every later stage. Cost per step grows with the whole
sequence length (quadratic work per token); that slowness is the point of the comparison.
"""

from __future__ import annotations

import torch

from nanoserve.cache.attention_metadata import pack_step
from nanoserve.types import ScheduledBatch, StepInputs


class NoCache:
    """Packs every sequence whole, prefill and decode alike; the model recomputes everything."""

    def __init__(self, device: torch.device):
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Inputs that recompute each sequence from its first token (no slots: nothing stored)."""
        tables = [[] for _ in batch.seqs]
        return pack_step(batch.seqs, tables, 1, self.device, is_prefill=batch.is_prefill,
                         from_start=True)  # fmt: skip
