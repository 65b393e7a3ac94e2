"""Stage 03's engine: a block table per sequence over one allocator, the worst case reserved at
admission; K/V at flat slots, read one slot at a time."""

from __future__ import annotations

from nanoserve.cache.slot_cache import SlotKVCache
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.allocator import BlockAllocator
from nanoserve.engine.memory.block_table import BlockTable
from nanoserve.engine.memory.table_manager import TableManager
from nanoserve.engine.runner.input_packer import InputPacker
from nanoserve.kernels.slot_attention import SlotAttention
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """The learner's allocator and block table (or ours) behind the stage-03 manager."""
    num_blocks = sizing.num_blocks(config)
    allocator = parts.get("BlockAllocator", BlockAllocator)(num_blocks)
    table_cls = parts.get("BlockTable", BlockTable)
    manager = TableManager(allocator, config.block_size, config.max_model_len, table_cls)
    cache = SlotKVCache(num_blocks, config.block_size, **sizing.cache_shape())
    packer = InputPacker(cache.block_size, sizing.device)
    return EngineParts(manager, cache, packer, SlotAttention(cache))


RECIPE = Recipe(
    build,
    api={
        "BlockPosition": "nanoserve.engine.memory.block_table:BlockPosition",
        "BlockTable": "nanoserve.engine.memory.block_table:BlockTable",
    },
    parts=("BlockAllocator", "BlockTable"),  # stage 02's allocator is plugged in here
)
