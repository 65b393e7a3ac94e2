"""Assembling the engine of a stage: check its parts, pick a backend, load, size, build, capture.

`build_engine(stage=N)` is how `LLM(stage=N)` gets "the engine as of stage N": it loads the model,
runs the stage's recipe (recipes/<slug>.py) and hands the model runner everything it needs at
construction. It decides nothing itself: every choice is the recipe's, the config's or the
backend selector's.

    load model -> measure the KV budget -> recipe.build -> (stage 08) capture -> ModelRunner
                                                        (stage 11: OverlapRunner)
"""

from __future__ import annotations

import importlib
import logging
from typing import NamedTuple

from nanoserve.cache.budget import kv_budget_bytes
from nanoserve.config import EngineConfig
from nanoserve.engine.loop.llm_engine import LLMEngine
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.memory.kv_manager import KVCacheManager
from nanoserve.engine.runner.cuda_graphs import DecodeGraphs, table_width
from nanoserve.engine.runner.model_runner import ModelRunner, StepFanout, warmup_peak_bytes
from nanoserve.engine.runner.overlap_runner import OverlapRunner
from nanoserve.kernels.backend import (
    BackendChoice,
    check_block_size,
    log_choice,
    select_attention_backend,
)
from nanoserve.layers.compiled import fuse_small_ops
from nanoserve.layers.tensor_parallel import TensorParallel, min_over_ranks
from nanoserve.models.decoder import CausalLM
from nanoserve.models.loader import load_model
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing
from nanoserve.stages import STAGES, require_implemented
from nanoserve.types import ModelSpec

logger = logging.getLogger("nanoserve")


def recipe_for(stage: int) -> Recipe:
    """The recipe of an implemented stage: `RECIPE` of recipes/<its stem without the number>."""
    stem = require_implemented(stage).stem
    return importlib.import_module(f"nanoserve.recipes.{stem[3:]}").RECIPE


class BuiltRunner(NamedTuple):
    """A stage's model runner, the manager whose tables it packs, and the backend chosen."""

    runner: ModelRunner
    manager: KVCacheManager
    attention: BackendChoice
    scheduler: type[Scheduler] = Scheduler  # stages 11-12: the learner's bookkeeping, or ours


def build_engine(
    stage: int,
    config: EngineConfig,
    spec: ModelSpec,
    eos_ids,
    components=None,
    model: CausalLM | None = None,
    workers: StepFanout | None = None,
) -> LLMEngine:
    """The engine as of `stage`: the shared loop plus that stage's manager, cache and backend.

    The model is loaded from `spec` (or `model` is reused, built from the same spec); `workers`
    are the other tensor-parallel ranks, already started (stage 09, rank 0 of several).
    """
    runner, manager, choice, scheduler = build_runner(stage, config, spec, components, model,
                                                      workers)  # fmt: skip
    engine = LLMEngine(config, runner, manager, eos_ids, choice, scheduler)
    if spec.device.type == "cuda":  # compile every kernel now (the interpreter compiles none)
        logger.info("start-up compile: %s", engine.warm_up().summary())
    return engine


def build_runner(
    stage: int,
    config: EngineConfig,
    spec: ModelSpec,
    components=None,
    model: CausalLM | None = None,
    workers: StepFanout | None = None,
) -> BuiltRunner:
    """Everything of a stage's engine but its loop: what a tensor-parallel worker runs."""
    require_shardable(stage, spec.tp_size)
    recipe = recipe_for(stage)
    if config.kv_cache_dtype not in recipe.kv_cache_dtypes:
        raise ValueError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} needs stage 13 or later (an e4m3 KV "
            f"cache); stage {stage} keeps the model's dtype: pass kv_cache_dtype='auto'"
        )
    offered = recipe.backends
    if config.kv_cache_dtype == "fp8":  # flash-attn reads no e4m3 pages
        offered = tuple(b for b in offered if b != "flash_attn")
    choice = select_attention_backend(config.attention_backend, spec.device, offered, spec.dtype)
    parts = checked_components(stage, recipe, components, choice.name)  # before slow loading
    check_block_size(choice.name, config.block_size)
    if model is None:
        tp = TensorParallel(spec.tp_rank, spec.tp_size)
        model = load_model(spec.source, spec.device, spec.dtype, tp)
    sizing = Sizing(
        model.config,
        spec.dtype,
        spec.device,
        lambda: budget_bytes(model, config, spec),
        spec.tp_size,
        config.kv_cache_dtype,
    )
    built = recipe.build(config, sizing, parts, choice.name)
    log_choice(choice)
    graphs = None
    if recipe.captures_decode:
        graphs = capture_decode_graphs(model, built, config, choice.name)
    parts_of_runner = (model, built.cache, built.attention, built.packer, graphs, workers)
    runner: ModelRunner
    if built.state is not None:  # stage 11: a runner that launches steps without waiting
        runner = OverlapRunner(
            *parts_of_runner, state=built.state, proposer=built.proposer, rule=built.rule
        )  # fmt: skip (stage 12: it guesses, too)
    else:
        runner = ModelRunner(*parts_of_runner)
    return BuiltRunner(runner, built.manager, choice, built.scheduler)


def budget_bytes(model: CausalLM, config: EngineConfig, spec: ModelSpec) -> int:
    """This rank's KV budget, then the smallest over the ranks: every pool gets as many blocks
    (rank 0's block ids must mean the same slots on every rank)."""
    on_cuda = spec.device.type == "cuda"
    peak = warmup_peak_bytes(model, config, spec.device) if on_cuda else 0
    return min_over_ranks(kv_budget_bytes(config, spec.device, peak), model.tp, spec.device)


def require_shardable(stage: int, tp_size: int) -> None:
    """ValueError unless the stage exists and can run on tp_size processes."""
    if tp_size > 1 and not recipe_for(stage).shards_model:
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs stage 9 or later (tensor parallelism); "
            f"stage {stage} runs on one process: pass tensor_parallel_size=1"
        )


def checked_components(stage: int, recipe: Recipe, components: dict | None, backend: str) -> dict:
    """The learner's components, every key checked against the parts the recipe can replace."""
    components = dict(components or {})
    unknown = sorted(set(components) - set(recipe.parts))
    if unknown:
        raise ValueError(unknown_components_message(stage, unknown, sorted(recipe.parts)))
    if components and recipe.parts_run_on not in (None, backend):
        raise ValueError(
            f"components {', '.join(sorted(components))} run only on stage {stage}'s "
            f"{recipe.parts_run_on!r} backend, but {backend!r} was chosen; pass "
            f"attention_backend={recipe.parts_run_on!r} (on a CPU with TRITON_INTERPRET=1)"
        )
    return components


def unknown_components_message(stage: int, unknown: list[str], valid: list[str]) -> str:
    """Which keys are wrong, what the stage takes, and where a misplaced key belongs."""
    takes = ", ".join(valid) if valid else "no components"
    homes = [
        f"{name} is a stage {s.number} component"
        for name in unknown
        for s in STAGES
        if s.number != stage and name in recipe_for(s.number).parts
    ][:1]
    hint = f" ({homes[0]})" if homes else ""
    return (
        f"components {', '.join(map(repr, unknown))} are not parts of stage {stage}'s "
        f"engine{hint}; stage {stage} takes {takes}"
    )


def capture_decode_graphs(
    model: CausalLM, built: EngineParts, config: EngineConfig, backend: str
) -> DecodeGraphs | None:
    """Stage 08: fuse the small ops and record decode graphs once the pool exists, or say (once)
    why decode stays eager (None)."""
    why_eager = None
    if built.cache.device.type != "cuda":
        why_eager = f"on {built.cache.device.type} there is nothing to capture: stage 08 runs as 07"
    elif config.enforce_eager:
        why_eager = "enforce_eager=True"
    elif backend not in ("triton", "flash_attn"):
        why_eager = f"the {backend} backend's store is not capturable (use triton or flash_attn)"
    if why_eager is not None:
        logger.info("CUDA graphs off: %s", why_eager)
        return None
    fuse_small_ops(model)  # compiled norm / RoPE / SiLU-mul, captured like the rest
    width = table_width(config.max_model_len, config.block_size)
    graphs = DecodeGraphs(model, built.attention, config.max_num_seqs, width, built.cache.device)
    graphs.capture()
    return graphs
