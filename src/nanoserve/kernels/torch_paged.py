"""Stage 04's attention backend in plain torch: scatter K/V to slots, gather pages, attend.

Introduced in stage 04 (its learner writes `store_kvcache` and `gather_kv`). Writes scatter each
new token's K/V to its flat slot of the pool (`cache/paged.py`); reads gather a sequence's blocks
in table order into a contiguous copy and run the torch oracle. Stage 05 swaps the store for a
Triton kernel, stage 06 reads the pages in place.
"""

from __future__ import annotations

import torch

from nanoserve.kernels.attention import attend, attend_decode_padded
from nanoserve.types import AttentionMetadata


def store_kvcache(k, v, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """Scatter k, v (T, H_kv, D) into the caches at slot_mapping (T,); slot -1 is skipped."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    keep = slot_mapping >= 0  # -1 marks padding rows that own no slot
    slots = slot_mapping[keep]
    k_cache.view(num_slots, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(num_slots, *v_cache.shape[2:])[slots] = v[keep]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first context_len positions, (context_len, H_kv, D), in logical order."""
    num_blocks = -(-context_len // cache.shape[1])  # ceil: the blocks that hold any of it
    rows = cache[block_table[:num_blocks]]  # (num_blocks, block_size, H_kv, D)
    return rows.flatten(0, 1)[:context_len]


class TorchPagedAttention:
    """The torch backend of the pool: store this step's K/V by slot, attend over gathered pages.

    Prefill gathers each sequence's pages one sequence at a time; decode gathers every block of
    every table at once and masks past each context length. Stage 06's kernels read the pages in
    place instead of gathering a copy.
    """

    name = "torch"

    def __init__(self, pool, store=store_kvcache, gather=gather_kv):
        self.pool = pool  # anything with layer_caches(layer_id) -> (k_cache, v_cache)
        self.store, self.gather = store, gather

    def forward(self, layer_id: int, q, k, v, scale: float, metadata: AttentionMetadata):
        """(T, H, D) outputs for the packed new tokens."""
        k_cache, v_cache = self.pool.layer_caches(layer_id)
        md = metadata
        self.store(k, v, k_cache, v_cache, md.slot_mapping)
        if not md.is_prefill:
            return self._decode(q, k_cache, v_cache, scale, md)
        outputs = []
        for i, context_len in enumerate(md.host.context_lens):
            s, e = md.host.cu_seqlens_q[i], md.host.cu_seqlens_q[i + 1]
            keys = self.gather(k_cache, md.block_tables[i], context_len)
            values = self.gather(v_cache, md.block_tables[i], context_len)
            outputs.append(attend(q[s:e], keys, values, scale))
        return torch.cat(outputs)

    @staticmethod
    def _decode(q, k_cache, v_cache, scale: float, md: AttentionMetadata) -> torch.Tensor:
        """All sequences at once: gather every block of every table, mask past context_len."""
        tables = md.block_tables.clamp(min=0)  # -1 padding reads block 0, then is masked
        keys = k_cache[tables].flatten(1, 2)  # (B, max_blocks * block_size, H_kv, D)
        values = v_cache[tables].flatten(1, 2)
        return attend_decode_padded(q, keys, values, md.context_lens, scale)
