"""nanoserve's side of `nanoserve bench`: a stage's engine on the workload, timed.

Introduced in stage 04 (moved out of bench/run.py beside the peer comparison). The model is loaded
once and shared by every stage's engine; each run builds its engine, warms it up with one short
request, times the whole workload and frees the engine again. It prints and compares nothing.
"""

from __future__ import annotations

import dataclasses
import logging

from nanoserve.bench.workload import (
    WARMUP_MAX_TOKENS,
    WARMUP_PROMPT_LEN,
    BenchResult,
    Workload,
    release_memory,
    timer,
)
from nanoserve.config import EngineConfig
from nanoserve.kernels.compile_log import CompileLog
from nanoserve.options import CheckedFlags
from nanoserve.types import ModelSpec

logger = logging.getLogger(__name__)


def load_bench_model(flags: CheckedFlags, progress: bool = False):
    """(spec, model): the checked --model on the --device in the --dtype (with a bar of tensors
    loaded on stderr when `progress`: a terminal, no --quiet).

    Loaded once and reused by every stage's engine, so each runs on the very same weights.
    """
    from nanoserve.models.loader import load_model

    spec = ModelSpec(flags.source, flags.dtype, flags.device)
    return spec, load_model(spec.source, spec.device, spec.dtype, progress=progress)


def drive(engine, prompts: list[list[int]], params: list, progress: str | None = None) -> list:
    """Queue every request and step until all finish (what `LLM.generate` does, minus text).

    progress: a label for a bar of finished requests on stderr (None: no bar; a bar only
    redraws a few times a second, so the timed loop barely notices it)."""
    from tqdm import tqdm

    seqs = [engine.add_request(ids, p) for ids, p in zip(prompts, params)]
    with tqdm(total=len(seqs), desc=progress, disable=progress is None, leave=False) as bar:
        while engine.has_unfinished():
            bar.update(len(engine.step()))
    return seqs


def run_nanoserve(
    spec,
    model,
    stage: int,
    config: EngineConfig,
    workload: Workload,
    parts=None,
    progress: bool = False,
    temperature: float = 0.6,
) -> BenchResult:
    """Build the stage's engine on `model`, warm it up, and time the whole workload; `parts`
    (--impl's LearnerParts) puts the learner's pieces into it; progress: a bar on stderr."""
    from nanoserve.layers.compiled import unfuse_small_ops
    from nanoserve.llm_arguments import prefix_caching_components
    from nanoserve.parallel.group import start_engine
    from nanoserve.recipes.assemble import build_engine, recipe_for
    from nanoserve.sampling import SamplingParams

    device = spec.device
    shards = recipe_for(stage).shards_model and config.tensor_parallel_size > 1
    if config.kv_cache_dtype not in recipe_for(stage).kv_cache_dtypes:  # fp8 is stage 13's: a
        config = dataclasses.replace(config, kv_cache_dtype="auto")  # stage before it, beside it
    yours = None if parts is None else parts.components
    components = prefix_caching_components(stage, config.enable_prefix_caching, yours)
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m)
        for m in [WARMUP_MAX_TOKENS, *workload.max_tokens]
    ]
    eos = model.config.eos_token_ids
    with CompileLog() as startup:  # building (graphs captured) and the warm-up request
        if shards:  # rank 0 and each worker build their own shard; the shared model sits idle
            engine = start_engine(stage, config, spec, eos, components)
        else:  # a stage before 09 runs on one rank, beside the sharded one in the same table
            config = dataclasses.replace(config, tensor_parallel_size=1)
            engine = build_engine(stage, config, spec, eos, components, model)
        drive(engine, [workload.prompt_token_ids[0][:WARMUP_PROMPT_LEN]], params[:1])
    preemptions_before = engine.scheduler.num_preemptions
    prefill_before = engine.num_prefill_tokens
    start = timer(device)
    label = f"stage {stage}" if progress else None
    speculation_before = getattr(engine, "speculation", None)
    with CompileLog() as timed:
        seqs = drive(engine, workload.prompt_token_ids, params[1:], label)
        seconds = timer(device) - start
    logger.info("stage %d start-up: %s", stage, startup.summary())
    if timed.compiled or timed.graphs:  # the compile's seconds are in the engine's time
        logger.warning("stage %d compiled inside its timed run: %s", stage, timed.summary())
    guesses = speculation_result(speculation_before, getattr(engine, "speculation", None))
    preemptions = engine.scheduler.num_preemptions - preemptions_before
    prefill_tokens = engine.num_prefill_tokens - prefill_before
    output_tokens = sum(seq.num_completion_tokens for seq in seqs)
    ranks = f", tp {config.tensor_parallel_size}" if shards else ""
    ranks += ", kv fp8" if config.kv_cache_dtype == "fp8" else ""
    yours = "" if parts is None else f", {parts.label}"
    name = f"nanoserve stage {stage} ({engine.attention.name}{ranks}{yours})"
    engine.shutdown()
    unfuse_small_ops(model)  # stage 08 fused the shared model's small ops: the next stage must not
    del engine, seqs
    release_memory(device)
    counted = startup.available  # compiles counted only where Triton has a listener
    return BenchResult(
        name, output_tokens, seconds, preemptions, None, prefill_tokens, *guesses,
        startup_compile_s=startup.seconds if counted else None,
        timed_compiles=len(timed.compiled) if counted else None,
    )  # fmt: skip


def speculation_result(before, after) -> tuple[float | None, float | None]:
    """Stage 12's acceptance rate and tokens per verified sequence-step over the timed run
    (None, None for an engine that does not speculate)."""
    if before is None or after is None:
        return None, None
    proposed = after.num_proposed - before.num_proposed
    accepted = after.num_accepted - before.num_accepted
    seqs = after.num_verified_seqs - before.num_verified_seqs
    rate = accepted / proposed if proposed else 0.0
    return rate, (accepted + seqs) / seqs if seqs else 0.0
