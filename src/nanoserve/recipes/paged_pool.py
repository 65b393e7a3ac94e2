"""Stage 04's engine: one paged pool, lazy block growth with preemption, torch store and gather.

Later stages keep this pool and change the pieces around it, so `build_pool` is shared with them
(and `TorchPagedAttention` stays their torch path).
"""

from __future__ import annotations

from nanoserve.cache.fp8_pool import Fp8KVPool
from nanoserve.cache.paged import PagedKVPool
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.runner.input_packer import InputPacker, prepare_decode, prepare_prefill
from nanoserve.kernels.torch_paged import TorchPagedAttention, gather_kv, store_kvcache
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing


def build_pool(config: EngineConfig, sizing: Sizing) -> PagedKVPool:
    """The pool: as many blocks as fit the budget (or as config names)."""
    return PagedKVPool(sizing.num_blocks(config), config.block_size, **sizing.cache_shape())


def build_kv_pool(config: EngineConfig, sizing: Sizing) -> PagedKVPool | Fp8KVPool:
    """The pool of the kernel stages (06 on): stage 13's of e4m3 codes when kv_cache_dtype is
    "fp8" (only stage 13's recipe accepts it), else `build_pool`'s."""
    if config.kv_cache_dtype == "fp8":
        return Fp8KVPool(sizing.num_blocks(config), config.block_size, **sizing.cache_shape())
    return build_pool(config, sizing)


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """The learner's block manager, step packing, store and gather (or ours) over one pool."""
    pool = build_pool(config, sizing)
    manager = parts.get("BlockManager", BlockManager)(pool.num_blocks, config.block_size)
    packer = InputPacker(
        pool.block_size,
        sizing.device,
        prepare_prefill=parts.get("prepare_prefill", prepare_prefill),
        prepare_decode=parts.get("prepare_decode", prepare_decode),
    )
    attention = TorchPagedAttention(
        pool, parts.get("store_kvcache", store_kvcache), parts.get("gather_kv", gather_kv)
    )
    return EngineParts(manager, pool, packer, attention)


RECIPE = Recipe(
    build,
    api={
        "BlockManager": "nanoserve.engine.memory.block_manager:BlockManager",
        "store_kvcache": "nanoserve.kernels.torch_paged:store_kvcache",
        "gather_kv": "nanoserve.kernels.torch_paged:gather_kv",
        "prepare_prefill": "nanoserve.engine.runner.input_packer:prepare_prefill",
        "prepare_decode": "nanoserve.engine.runner.input_packer:prepare_decode",
    },
    parts=("BlockManager", "store_kvcache", "gather_kv", "prepare_prefill", "prepare_decode"),
)
