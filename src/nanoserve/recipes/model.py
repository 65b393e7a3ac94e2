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


RECIPE = Recipe(
    build,
    api={
        "rms_norm": "nanoserve.layers.norm:rms_norm",
        "rotate_half": "nanoserve.layers.rotary:rotate_half",
        "rope_inv_freq": "nanoserve.layers.rotary:rope_inv_freq",
        "rope_cos_sin": "nanoserve.layers.rotary:rope_cos_sin",
        "apply_rotary": "nanoserve.layers.rotary:apply_rotary",
        "attend": "nanoserve.kernels.attention:attend",
        "swiglu": "nanoserve.models.decoder:swiglu",
        "filter_probs": "nanoserve.sampling:filter_probs",
        "sample": "nanoserve.sampling:sample_one",
    },
)
