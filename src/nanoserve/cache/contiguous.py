"""Stage 01: a contiguous K/V slab per running sequence, each sized for `max_model_len`.

Introduced in stage 01. This module holds the tensor only: the packer
(engine/runner/input_packer.py) builds each step's inputs and `kernels/slab_attention.py` writes
and reads the slabs.
A sequence gets one whole slab at admission, whatever its real length,
so capacity is counted in worst-case sequences: that waste is what paging (stage 04) removes.
There is no sharing and no preemption: a slab never runs out (generation stops at max_model_len).

    cache tensor  [2, L, num_slabs, max_model_len, H_kv, D]
                   |  |      |            |
                   |  |      |            +-- position inside the sequence
                   |  |      +-- slab id (one per running sequence)
                   |  +-- layer
                   +-- 0 = K, 1 = V
    slab 0: | A0 A1 A2 A3 A4 . . . . . . . . . . |   A has 5 tokens, the rest sits idle
    slab 1: | B0 B1 . . . . . . . . . . . . . . |
"""

from __future__ import annotations

import torch


class ContiguousKVCache:
    """The slab tensor. To the input packer a slab is one block of max_model_len tokens:
    sequence i's block table is [slab_id], so slot_mapping reads slab_id * max_model_len + p."""

    def __init__(self, num_slabs, num_layers, max_model_len, num_kv_heads, head_dim, dtype, device):
        shape = (2, num_layers, num_slabs, max_model_len, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.max_model_len = max_model_len
        self.block_size = max_model_len  # tokens one table entry (a slab) covers
        self.device = device
