"""Stage 06's attention backend: Triton kernels that store K/V by slot and read pages in place.

Introduced in stage 06; stage 05's backend (`TritonStoreAttention`) is stage 04's torch backend
with the Triton store kernel. Per layer: the store kernel writes this
step's K/V into the pool, then a prefill step runs the varlen paged kernel and a decode step the
split-K paged kernel, both reading each sequence's blocks through its block table; nothing is
gathered into a contiguous copy. It imports triton, so the engine imports it only when chosen.
"""

from __future__ import annotations

from nanoserve.kernels.paged_decode import paged_attention_decode
from nanoserve.kernels.paged_prefill import paged_attention_prefill
from nanoserve.kernels.store import store_kvcache
from nanoserve.kernels.torch_paged import TorchPagedAttention
from nanoserve.types import AttentionMetadata


class TritonPagedAttention:
    """The pool's attention on Triton: store by slot_mapping, attend through block_tables."""

    name = "triton"

    def __init__(
        self,
        pool,
        store=store_kvcache,
        prefill=paged_attention_prefill,
        decode=paged_attention_decode,
    ):
        self.pool = pool  # anything with layer_caches(layer_id) and layer_scales(layer_id)
        self.store, self.prefill, self.decode = store, prefill, decode

    def forward(self, layer_id: int, q, k, v, scale: float, metadata: AttentionMetadata):
        """(T, H, D) outputs for the packed new tokens."""
        k_cache, v_cache = self.pool.layer_caches(layer_id)
        scales = self.pool.layer_scales(layer_id)  # stage 13's exponents; none before
        md = metadata
        self.store(k, v, k_cache, v_cache, md.slot_mapping, **scales)
        if md.is_prefill:
            return self.prefill(
                q,
                k_cache,
                v_cache,
                md.cu_seqlens_q,
                md.context_lens,
                md.block_tables,
                md.max_seqlen_q,
                scale,
                **scales,
            )
        return self.decode(q, k_cache, v_cache, md.context_lens, md.block_tables, scale, **scales)


class TritonStoreAttention(TorchPagedAttention):
    """Stage 05: the Triton store kernel writes K/V by slot; torch still gathers and attends."""

    name = "triton"

    def __init__(self, pool, store=store_kvcache):
        super().__init__(pool, store=store)
