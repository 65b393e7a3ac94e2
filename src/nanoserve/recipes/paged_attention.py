"""Stage 06's engine: stage 05's, with Triton kernels that read K/V straight from the pages.

`kernel_attention` is also the `triton` backend of every later stage (their learners write other
pieces, so they run these reference kernels).
"""

from __future__ import annotations

from nanoserve.cache.fp8_pool import Fp8KVPool
from nanoserve.cache.paged import PagedKVPool
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.runner.input_packer import InputPacker
from nanoserve.kernels.backend import AttentionBackend
from nanoserve.kernels.torch_paged import TorchPagedAttention
from nanoserve.recipes.paged_pool import build_kv_pool
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing


def kernel_attention(pool: PagedKVPool | Fp8KVPool, backend: str, parts: dict) -> AttentionBackend:
    """Triton stores and reads pages in place (prefill and split-K decode); or flash-attn reads
    them (stage 07 on, when installed); or stage 04's torch path when backend is "torch". Triton
    and flash-attn are imported only for the backend that needs them. Stage 13's e4m3 pool gets
    the quantizing store and the kernels' dequantizing reads (torch or Triton)."""
    if isinstance(pool, Fp8KVPool):
        return fp8_attention(pool, backend, parts)
    if backend == "torch":
        return TorchPagedAttention(pool)
    if backend == "flash_attn":
        from nanoserve.kernels.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(pool)
    from nanoserve.kernels.paged_decode import paged_attention_decode
    from nanoserve.kernels.paged_prefill import paged_attention_prefill
    from nanoserve.kernels.store import store_kvcache
    from nanoserve.kernels.triton_backend import TritonPagedAttention

    return TritonPagedAttention(
        pool,
        parts.get("store_kvcache", store_kvcache),
        parts.get("paged_attention_prefill", paged_attention_prefill),
        parts.get("paged_attention_decode", paged_attention_decode),
    )


def fp8_attention(pool: Fp8KVPool, backend: str, parts: dict) -> AttentionBackend:
    """Stage 13: the torch backend with the learner's store and gather (or ours), or the Triton
    kernels with the quantizing store kernel (flash-attn reads no e4m3 pages: not offered)."""
    if backend == "torch":
        from nanoserve.kernels.torch_fp8 import TorchFp8Attention, gather_kv_fp8, store_kvcache_fp8

        store = parts.get("store_kvcache_fp8", store_kvcache_fp8)
        return TorchFp8Attention(pool, store, parts.get("gather_kv_fp8", gather_kv_fp8))
    from nanoserve.kernels.paged_decode import paged_attention_decode
    from nanoserve.kernels.paged_prefill import paged_attention_prefill
    from nanoserve.kernels.store_fp8 import store_kvcache_fp8 as store_kernel
    from nanoserve.kernels.triton_backend import TritonPagedAttention

    return TritonPagedAttention(pool, store_kernel, paged_attention_prefill, paged_attention_decode)


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """Stage 04's pool and manager, attended by the learner's kernels (or ours)."""
    pool = build_kv_pool(config, sizing)
    manager = BlockManager(pool.num_blocks, config.block_size)
    packer = InputPacker(pool.block_size, sizing.device)
    return EngineParts(manager, pool, packer, kernel_attention(pool, backend, parts))


RECIPE = Recipe(
    build,
    api={
        "paged_attention_prefill": "nanoserve.kernels.paged_prefill:paged_attention_prefill",
        "paged_attention_decode": "nanoserve.kernels.paged_decode:paged_attention_decode",
    },
    # stage 05's store kernel stays replaceable beside the two read kernels
    parts=("store_kvcache", "paged_attention_prefill", "paged_attention_decode"),
    backends=("triton", "torch"),
    parts_run_on="triton",
)
