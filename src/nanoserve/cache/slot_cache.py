"""Stage 03's cache: sequences live on block tables, and K/V sits at their flat slots.

Introduced in stage 03. Each running sequence owns a `BlockTable` (engine/table_manager.py);
every token's K/V is written to its flat slot of a per-layer tensor and read back by translating
positions 0 .. n-1, one by one, through the table. Block-table reads of whole pages (and lazy
growth with preemption) arrive in stage 04.

    flat cache [2, L, num_blocks * block_size, H_kv, D]      block_size 4, A's table [1, 0, 2]
    slot:  0  1  2  3 | 4  5  6  7 | 8  9 10 11 | ...
          A4 A5 A6 A7 | A0 A1 A2 A3 | A8 A9 .  . |          A reads slots 4..7, 0..3, 8..9
"""

from __future__ import annotations

import torch

from nanoserve.cache.attention_metadata import pack_step
from nanoserve.kernels.attention import attend
from nanoserve.types import AttentionMetadata, ScheduledBatch, StepInputs


class SlotKVCache:
    """Flat per-layer K/V addressed by slot, and the inputs for each sequence's new tokens."""

    def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype,
                 device):  # fmt: skip
        shape = (2, num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """New tokens of each sequence, the slots they are written to, the tables to read."""
        tables = [seq.block_table for seq in batch.seqs]
        return pack_step(batch.seqs, tables, self.block_size, self.device,
                         is_prefill=batch.is_prefill)  # fmt: skip


class SlotAttention:
    """Write every new token's K/V to its slot, then read each sequence's slots and attend."""

    name = "torch"

    def __init__(self, cache: SlotKVCache):
        self.cache = cache

    def forward(self, layer_id: int, q, k, v, scale: float, metadata: AttentionMetadata):
        """(T, H, D) outputs for the packed new tokens of every sequence."""
        kv, bs = self.cache.kv, self.cache.block_size
        k_cache, v_cache = kv[0, layer_id], kv[1, layer_id]  # (num_slots, H_kv, D)
        k_cache[metadata.slot_mapping] = k
        v_cache[metadata.slot_mapping] = v
        host, outputs = metadata.host, []
        for i, context_len in enumerate(host.context_lens):
            p = torch.arange(context_len, device=kv.device)  # positions 0 .. n-1
            slots = metadata.block_tables[i, p // bs].long() * bs + p % bs  # one slot each
            s, e = host.cu_seqlens_q[i], host.cu_seqlens_q[i + 1]
            outputs.append(attend(q[s:e], k_cache[slots], v_cache[slots], scale))
        return torch.cat(outputs)
