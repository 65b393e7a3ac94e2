"""Stage 07's engine: stage 06's, with a block manager that shares cached prefixes by hash."""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager
from nanoserve.engine.runner.input_packer import InputPacker
from nanoserve.recipes.paged_attention import kernel_attention
from nanoserve.recipes.paged_pool import build_kv_pool
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """The learner's prefix-caching manager (or ours) over stage 04's pool, stage 06's kernels."""
    pool = build_kv_pool(config, sizing)
    manager = parts.get("PrefixBlockManager", PrefixBlockManager)(
        pool.num_blocks, config.block_size
    )
    packer = InputPacker(pool.block_size, sizing.device)
    return EngineParts(manager, pool, packer, kernel_attention(pool, backend, parts))


# flash_attn is offered but never the default: "auto" takes triton, the first importable
RECIPE = Recipe(
    build,
    api={
        "chain_hash": "nanoserve.engine.memory.prefix_block_manager:chain_hash",
        "PrefixBlockManager": "nanoserve.engine.memory.prefix_block_manager:PrefixBlockManager",
    },
    parts=("PrefixBlockManager",),
    backends=("triton", "flash_attn", "torch"),
)
