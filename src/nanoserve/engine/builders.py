"""Which cache manager and cache each stage plugs into the one engine loop.

Introduced in stage 00; each stage adds one entry. `build_engine(stage=N)` is how `LLM(stage=N)`
gets "the engine as of stage N", so the equivalence chain between stages is a plain test.
"""

from __future__ import annotations

import torch

from nanoserve.cache.no_cache import NoCache, NoCacheManager
from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.stages import require_implemented


def build_no_cache(config: EngineConfig, model, device: torch.device):
    """Stage 00: nothing stored; every step recomputes every token."""
    return NoCacheManager(), NoCache(device)


STAGE_BUILDERS = {
    0: build_no_cache,
}


def build_engine(stage: int, config: EngineConfig, model, eos_ids) -> LLMEngine:
    """The engine as of `stage`: the shared loop plus that stage's manager and cache."""
    require_implemented(stage)
    device = next(model.parameters()).device
    manager, cache = STAGE_BUILDERS[stage](config, model, device)
    return LLMEngine(config, ModelRunner(model, cache), manager, eos_ids)
