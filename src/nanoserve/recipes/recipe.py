"""The shape of a stage recipe, and what its build function is given and returns.

Introduced with the recipes (between stages 10 and 11). A `Recipe` says how to build a stage's
parts (`build`), what its learner writes (`api`: the names of the stage's starter, each with where
its reference lives), which of them a learner may replace (`parts`) and which attention backends
it offers; `Sizing` is what `build` knows about the model and the memory; `EngineParts` is what it
returns. Nothing here builds an engine (assemble.py) or imports an API (learner_api.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from nanoserve.cache.budget import kv_bytes_per_token, units_in_budget
from nanoserve.cache.fp8_pool import kv_bytes_per_token_fp8
from nanoserve.cache.kv_cache import KVCache
from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.memory.kv_manager import KVCacheManager
from nanoserve.engine.runner.input_packer import InputPacker
from nanoserve.engine.runner.launched import Proposer
from nanoserve.engine.runner.overlap_runner import OverlapRunner
from nanoserve.engine.runner.persistent_batch import PersistentBatch
from nanoserve.kernels.backend import AttentionBackend
from nanoserve.models.config import ModelConfig
from nanoserve.samplers.speculative_sampler import RULE, Rule


class Sizing(NamedTuple):
    """What a stage's build function knows about the model and the memory it may fill."""

    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    budget_bytes: Callable[[], int]  # measured only when a pool must be sized from it
    tp_size: int = 1  # stage 09: each rank stores only its 1/tp_size of the KV heads
    kv_cache_dtype: str = "auto"  # stage 13: "fp8" stores a byte per value, plus exponents

    def units(self, tokens_per_unit: int, unit: str) -> int:
        """How many slabs or blocks of tokens_per_unit tokens fit the KV budget."""
        mc = self.model_config
        if self.kv_cache_dtype == "fp8":  # this rank's heads, one byte a value
            heads = mc.num_key_value_heads // self.tp_size
            per_token = kv_bytes_per_token_fp8(
                mc.num_hidden_layers, heads, mc.head_dim, tokens_per_unit
            )
        else:
            per_token = kv_bytes_per_token(mc, self.dtype) // self.tp_size
        return units_in_budget(self.budget_bytes(), per_token, tokens_per_unit, unit)

    def num_blocks(self, config: EngineConfig) -> int:
        """KV blocks that fit the budget, unless config names a number."""
        return config.num_kv_blocks or self.units(config.block_size, "block")

    def cache_shape(self) -> dict[str, Any]:
        """Layer count, this rank's KV heads, head size, dtype and device, as caches take them."""
        mc = self.model_config
        return dict(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads // self.tp_size,
            head_dim=mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )


class EngineParts(NamedTuple):
    """What a recipe builds: the control plane's manager and the data plane around the model."""

    manager: KVCacheManager
    cache: KVCache
    packer: InputPacker
    attention: AttentionBackend
    state: PersistentBatch | None = None  # stage 11: the running requests' rows on the device
    scheduler: type[Scheduler] = Scheduler  # stages 11-12: the learner's bookkeeping, or ours
    proposer: Callable[[OverlapRunner], Proposer] | None = None  # stage 12: built by the runner
    rule: Rule = RULE  # stage 12: the rejection rule's two functions


# build(config, sizing, parts, backend): parts holds the learner's replacements only (by the
# recipe's part names; build takes the reference for a name it lacks); backend is the chosen
# attention backend's name.
Build = Callable[[EngineConfig, Sizing, dict, str], EngineParts]


@dataclass(frozen=True)
class Recipe:
    """How one stage's engine is made, what its learner writes, and what of it they may swap in."""

    build: Build
    # what the stage's starter.py defines, in its order: name -> "module:attr" of the reference.
    # Strings, imported only by learner_api.py: a reference may sit above the recipes (stage 10's
    # serving loop) or need Triton (stages 05-06). A stage derived by dataclasses.replace names
    # its own.
    api: Mapping[str, str] = field(default_factory=dict)
    # the API names components= may replace: this stage's or an earlier stage's (BlockAllocator,
    # stage 02's, is plugged in at stage 03)
    parts: tuple[str, ...] = ()
    backends: tuple[str, ...] = ("torch",)  # the attention backends offered, best first
    parts_run_on: str | None = None  # the one backend that runs the parts (None: every one)
    captures_decode: bool = False  # stage 08: decode steps replay CUDA graphs (on a GPU)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)  # stage 13 adds "fp8" (EngineConfig's names)
    shards_model: bool = False  # stage 09: the model may span tensor_parallel_size processes
