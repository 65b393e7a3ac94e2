"""The `flash_attn` attention backend: flash-attn 2's paged kernels over the pool, when installed.

Offered from stage 07 (beside stage 06's Triton kernels), never chosen by "auto": the Triton
store kernel writes this step's K/V by slot, then a prefill step runs `flash_attn_varlen_func` and
a decode step `flash_attn_with_kvcache`, both reading each sequence's blocks through its block
table, as nano-vLLM does. flash-attn's paged KV needs a block size that is a multiple of 256
(`backend.check_block_size`, run before the model loads). It imports flash_attn and triton, so
only a recipe that chose it imports it; it is never required.
"""

from __future__ import annotations

from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanoserve.kernels.backend import check_block_size
from nanoserve.kernels.store import store_kvcache
from nanoserve.types import AttentionMetadata


class FlashAttnBackend:
    """The pool's attention on flash-attn 2: store by slot_mapping, attend through block_tables."""

    name = "flash_attn"

    def __init__(self, pool, store=store_kvcache):
        check_block_size("flash_attn", pool.block_size)
        self.pool = pool  # anything with block_size and layer_caches(layer_id)
        self.store = store

    def forward(self, layer_id: int, q, k, v, scale: float, metadata: AttentionMetadata):
        """(T, H, D) outputs for the packed new tokens."""
        k_cache, v_cache = self.pool.layer_caches(layer_id)  # (num_blocks, block_size, H_kv, D)
        md = metadata
        self.store(k, v, k_cache, v_cache, md.slot_mapping)
        tables = md.block_tables.clamp(min=0)  # -1 padding (never read: past context_lens)
        if md.is_prefill:
            return flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=md.cu_seqlens_q,
                cu_seqlens_k=md.cu_seqlens_k,
                max_seqlen_q=md.max_seqlen_q,
                max_seqlen_k=md.max_seqlen_k,
                softmax_scale=scale,
                causal=True,
                block_table=tables,
            )
        out = flash_attn_with_kvcache(
            q.unsqueeze(1),  # (B, 1, H, D): one new token per sequence
            k_cache,
            v_cache,
            cache_seqlens=md.context_lens,
            block_table=tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)
