"""Stage 00's "cache": nothing is stored, so every step feeds every token of every sequence.

Introduced in stage 00 as the oracle for every later stage. Cost per step grows with the whole
sequence length (quadratic work per token); that slowness is the point of the comparison. The
packer feeds each sequence from its first token (`InputPacker(from_start=True)`).
"""

from __future__ import annotations

import torch


class NoCache:
    """No tensors at all; every slot is -1 and every step recomputes every token."""

    block_size = 1  # no table entry covers anything: there are no tables

    def __init__(self, device: torch.device):
        self.device = device
