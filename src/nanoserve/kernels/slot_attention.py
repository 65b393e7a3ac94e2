"""Stage 03's attention backend: write every new token's K/V to its slot, read slots one by one.

Introduced in stage 03. Each sequence's positions 0 .. n-1 are translated through its block table
to flat slots of `cache/slot_cache.py`'s tensor, and the torch oracle attends over them. Stage 04
reads whole pages instead of single slots.
"""

from __future__ import annotations

import torch

from nanoserve.cache.slot_cache import SlotKVCache
from nanoserve.kernels.attention import attend
from nanoserve.types import AttentionMetadata


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
