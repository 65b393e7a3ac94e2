"""Stage 12's engine: stage 11's, with a proposer, a verify step and the rollback.

Its learner writes the n-gram lookup (`propose_ngram`), the rejection rule (`num_accepted`,
`residual`) and the scheduler's half of a guess (`SpeculativeScheduler`: `make_room` before the
verify step, `land` and `settle_guesses` after it); given to them: the speculation policy, the
draft proposer, the verify step and the device-side verdict.
"""

from __future__ import annotations

import dataclasses

from nanoserve.cache.paged import PagedKVPool
from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.speculation.draft_proposer import Draft
from nanoserve.engine.speculation.ngram_proposer import propose_ngram
from nanoserve.engine.speculation.proposers import proposer_for, speculative_method
from nanoserve.models.loader import load_model
from nanoserve.recipes import overlap
from nanoserve.recipes.paged_attention import kernel_attention
from nanoserve.recipes.recipe import EngineParts, Sizing
from nanoserve.samplers.rejection import num_accepted, residual
from nanoserve.samplers.speculative_sampler import Rule

FP8_PARTS = ("store_kvcache_fp8", "gather_kv_fp8")  # stage 13's recipe makes them replaceable


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """Stage 11's parts; the learner's scheduler bookkeeping, lookup and rule (or ours)."""
    # stage 07's manager and stage 13's store and gather (the torch backend's) reach the pool's
    # builder; the rest are this stage's
    below = {k: v for k, v in parts.items() if k in ("PrefixBlockManager", *FP8_PARTS)}
    built = overlap.build(config, sizing, below, backend)  # stage 11's persistent batch
    if speculative_method(config) == "draft" and sizing.tp_size > 1:
        raise ValueError(
            "speculative_method='draft' runs the draft on one rank; with "
            f"tensor_parallel_size={sizing.tp_size} use speculative_method='ngram'"
        )
    draft = draft_model(config, sizing, built.cache, backend)
    return built._replace(
        scheduler=parts.get("SpeculativeScheduler", Scheduler),
        proposer=proposer_for(config, parts.get("propose_ngram", propose_ngram), draft),
        rule=Rule(parts.get("num_accepted", num_accepted), parts.get("residual", residual)),
    )


def draft_model(config: EngineConfig, sizing: Sizing, pool, backend: str) -> Draft | None:
    """The separate draft model config names (None: the target drafts with its own layers), on
    a pool of its own with as many blocks as the target's: the target's block tables index it.
    That pool is not in the KV budget (a GPU needs a lower gpu_memory_utilization for it)."""
    if config.speculative_model is None:
        return None
    model = load_model(config.speculative_model, sizing.device, sizing.dtype)
    target_vocab = sizing.model_config.vocab_size
    if model.config.vocab_size != target_vocab:
        raise ValueError(
            f"speculative_model={config.speculative_model!r} has a vocabulary of "
            f"{model.config.vocab_size} tokens, the target {target_vocab}: a draft's guesses "
            "must be the target's token ids (use a model of the same tokenizer)"
        )
    mc = model.config
    shape = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    own = PagedKVPool(pool.num_blocks, pool.block_size, *shape, sizing.dtype, sizing.device)
    return Draft(model, kernel_attention(own, backend, {}))


RECIPE = dataclasses.replace(
    overlap.RECIPE,
    build=build,
    api={
        "propose_ngram": "nanoserve.engine.speculation.ngram_proposer:propose_ngram",
        "num_accepted": "nanoserve.samplers.rejection:num_accepted",
        "residual": "nanoserve.samplers.rejection:residual",
        "SpeculativeScheduler": "nanoserve.engine.loop.scheduler:Scheduler",
    },
    # stage 07's manager stays replaceable (enable_prefix_caching=False puts stage 04's there)
    parts=(
        "SpeculativeScheduler",
        "propose_ngram",
        "num_accepted",
        "residual",
        "PrefixBlockManager",
    ),
)
