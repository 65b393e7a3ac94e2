"""Stage 00's engine: no KV cache; every step feeds every token of every sequence again.

Its learner writes the model's pieces (graded on their own), so no part is replaceable here.
"""

from __future__ import annotations

from nanoserve.cache.no_cache import NoCache
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.kv_manager import NoCacheManager
from nanoserve.engine.runner.input_packer import InputPacker, no_table
from nanoserve.kernels.attention import NoCacheAttention
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """Nothing stored: packed sequences attend only to themselves, from their first token."""
    cache = NoCache(sizing.device)
    packer = InputPacker(cache.block_size, sizing.device, table_of=no_table, from_start=True)
    return EngineParts(NoCacheManager(), cache, packer, NoCacheAttention())


RECIPE = Recipe(build)
