"""Assembling the engine of a stage: check its parts, pick a backend, build, size, capture.

Introduced when the seams were drawn (before stage 05). `build_engine(stage=N)` is how
`LLM(stage=N)` gets "the engine as of stage N" from the stage's row in `compositions.py`; stage 08
adds the capture of decode graphs once the pool exists. It decides nothing itself: every choice is
the composition's, the config's or the backend selector's.
"""

from __future__ import annotations

from nanoserve.cache.budget import kv_budget_bytes
from nanoserve.config import EngineConfig
from nanoserve.engine.compositions import COMPOSITIONS, Sizing
from nanoserve.engine.cuda_graphs import DecodeGraphs, table_width
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.kernels.backend import log_choice, logger, select_attention_backend
from nanoserve.layers.compiled import fuse_small_ops
from nanoserve.layers.tensor_parallel import min_over_ranks
from nanoserve.stages import require_implemented
from nanoserve.types import ModelSpec


def build_engine(stage: int, config: EngineConfig, spec: ModelSpec, eos_ids, components=None,
                 model=None) -> LLMEngine:  # fmt: skip
    """The engine as of `stage`: the shared loop plus that stage's manager, cache and backend.

    The runner builds the model from `spec` (or reuses `model`, built from the same spec).
    """
    require_shardable(stage, spec.tp_size)
    composition = COMPOSITIONS[stage]
    choice = select_attention_backend(config.attention_backend, spec.device,
                                      tuple(composition.attention))  # fmt: skip
    parts = composition.resolve(stage, components, choice.name)  # before any slow loading
    runner = ModelRunner(spec, model)

    def budget_bytes() -> int:
        """This rank's budget, then the smallest over the ranks: every pool gets as many blocks
        (rank 0's block ids must mean the same slots on every rank)."""
        on_cuda = spec.device.type == "cuda"
        budget = kv_budget_bytes(config, spec.device,
                                 runner.warmup_peak_bytes(config) if on_cuda else 0)  # fmt: skip
        return min_over_ranks(budget, runner.model.tp, spec.device)

    sizing = Sizing(runner.model.config, spec.dtype, spec.device, budget_bytes, spec.tp_size)
    manager, cache = composition.build(config, sizing, parts)
    runner.bind(cache, composition.attention[choice.name](cache, parts))
    log_choice(choice)
    if composition.captures_decode:
        capture_decode_graphs(runner, config, choice.name)
    return LLMEngine(config, runner, manager, eos_ids, choice)


def require_shardable(stage: int, tp_size: int) -> None:
    """ValueError unless the stage exists and can run on tp_size processes."""
    require_implemented(stage)
    if tp_size > 1 and not COMPOSITIONS[stage].shards_model:
        raise ValueError(
            f"tensor_parallel_size={tp_size} needs stage 9 or later (tensor parallelism); "
            f"stage {stage} runs on one process: pass tensor_parallel_size=1"
        )


def capture_decode_graphs(runner: ModelRunner, config: EngineConfig, backend: str) -> None:
    """Stage 08: fuse the small ops and record decode graphs once the pool exists, or say (once)
    why decode stays eager."""
    why_eager = None
    if runner.device.type != "cuda":
        why_eager = f"on {runner.device.type} there is nothing to capture: stage 08 runs as 07"
    elif config.enforce_eager:
        why_eager = "enforce_eager=True"
    elif backend != "triton":
        why_eager = f"the {backend} backend's store is not capturable (use triton)"
    if why_eager is not None:
        logger.info("CUDA graphs off: %s", why_eager)
        return
    fuse_small_ops(runner.model)  # compiled norm / RoPE / SiLU-mul, captured like the rest
    width = table_width(config.max_model_len, config.block_size)
    runner.graphs = DecodeGraphs(runner.model, runner.attention, config.max_num_seqs, width,
                                 runner.device)  # fmt: skip
    runner.graphs.capture()
