"""Stage 01's attention backend: store each sequence's new K/V in its slab, attend over the slab.

Introduced in stage 01 (its learner writes `store_slab` and `load_slab`). Per sequence, one at a
time: the new tokens' K/V go to positions start .. end-1 of its slab, then its queries attend over
positions 0 .. end-1 with the torch oracle. The slab tensor is `cache/contiguous.py`'s.
"""

from __future__ import annotations

import torch

from nanoserve.cache.contiguous import ContiguousKVCache
from nanoserve.kernels.attention import attend
from nanoserve.types import AttentionMetadata


def store_slab(cache: torch.Tensor, slab_id: int, start: int, values: torch.Tensor) -> None:
    """Write values (n, H_kv, D) at positions start .. start+n-1 of one slab of cache."""
    cache[slab_id, start : start + values.shape[0]] = values


def load_slab(cache: torch.Tensor, slab_id: int, end: int) -> torch.Tensor:
    """Positions 0 .. end-1 of one slab of cache, (end, H_kv, D)."""
    return cache[slab_id, :end]


class SlabAttention:
    """Per sequence: store the new K/V in its slab, then attend over the slab's prefix."""

    name = "torch"

    def __init__(self, cache: ContiguousKVCache, store=store_slab, load=load_slab):
        self.cache = cache
        self.store, self.load = store, load

    def forward(self, layer_id: int, q, k, v, scale: float, metadata: AttentionMetadata):
        """(T, H, D) outputs for the packed new tokens of every sequence."""
        k_cache, v_cache = self.cache.kv[0, layer_id], self.cache.kv[1, layer_id]
        host, outputs = metadata.host, []
        for i, ((slab_id,), end) in enumerate(zip(host.block_tables, host.context_lens)):
            s, e = host.cu_seqlens_q[i], host.cu_seqlens_q[i + 1]
            start = end - (e - s)  # the new tokens are the last e - s of the context
            self.store(k_cache, slab_id, start, k[s:e])
            self.store(v_cache, slab_id, start, v[s:e])
            keys = self.load(k_cache, slab_id, end)
            values = self.load(v_cache, slab_id, end)
            outputs.append(attend(q[s:e], keys, values, scale))
        return torch.cat(outputs)
