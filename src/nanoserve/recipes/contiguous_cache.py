"""Stage 01's engine: one worst-case slab per running sequence, written and read by the learner's
`store_slab` / `load_slab` around the torch oracle."""

from __future__ import annotations

from nanoserve.cache.contiguous import ContiguousKVCache
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.slab_manager import SlabManager
from nanoserve.engine.runner.input_packer import InputPacker, slab_table
from nanoserve.kernels.slab_attention import SlabAttention, load_slab, store_slab
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """Slabs of max_model_len tokens, as many as fit (at most max_num_seqs)."""
    num_slabs = config.num_slabs or min(
        config.max_num_seqs, sizing.units(config.max_model_len, "slab")
    )
    cache = ContiguousKVCache(num_slabs, max_model_len=config.max_model_len, **sizing.cache_shape())
    manager = parts.get("SlabManager", SlabManager)(num_slabs)
    packer = InputPacker(cache.block_size, sizing.device, table_of=slab_table)
    attention = SlabAttention(
        cache, parts.get("store_slab", store_slab), parts.get("load_slab", load_slab)
    )
    return EngineParts(manager, cache, packer, attention)


RECIPE = Recipe(
    build,
    api={
        "SlabManager": "nanoserve.engine.memory.slab_manager:SlabManager",
        "store_slab": "nanoserve.kernels.slab_attention:store_slab",
        "load_slab": "nanoserve.kernels.slab_attention:load_slab",
    },
    parts=("SlabManager", "store_slab", "load_slab"),
)
