"""Stage 03's cache: sequences live on block tables, and K/V sits at their flat slots.

Introduced in stage 03. Each running sequence owns a `BlockTable` (engine/memory/table_manager.py);
every token's K/V is written to its flat slot of a per-layer tensor and read back by translating
positions 0 .. n-1, one by one, through the table. Block-table reads of whole pages (and lazy
growth with preemption) arrive in stage 04.

    flat cache [2, L, num_blocks * block_size, H_kv, D]      block_size 4, A's table [1, 0, 2]
    slot:  0  1  2  3 | 4  5  6  7 | 8  9 10 11 | ...
          A4 A5 A6 A7 | A0 A1 A2 A3 | A8 A9 .  . |          A reads slots 4..7, 0..3, 8..9
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Flat per-layer K/V addressed by slot; `kernels/slot_attention.py` writes and reads it."""

    def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device):
        shape = (2, num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.device = device
