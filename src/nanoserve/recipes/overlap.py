"""Stage 11's engine: stage 09's model, pool, kernels and graphs, run by the overlap loop.

Its learner writes the persistent batch's row bookkeeping (`PersistentBatch`) and the scheduler's
half of the overlap (`OverlapScheduler.commit/land`: progress when a step is launched, tokens when
they land); given to them: the device batch, the runner that keeps one step in flight, and the
device sampler. The loop itself is every stage's (schedule, execute, update).
"""

from __future__ import annotations

import dataclasses

from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.runner.cuda_graphs import table_width
from nanoserve.engine.runner.persistent_batch import PersistentBatch
from nanoserve.recipes import prefix_cache, tensor_parallel
from nanoserve.recipes.recipe import EngineParts, Sizing


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """Stage 07's manager (or the one parts names), pool and kernels; a persistent batch of
    max_num_seqs rows (it grows if more run) as wide as the longest table; the learner's
    scheduler bookkeeping (or ours)."""
    built = prefix_cache.build(config, sizing, parts, backend)  # reads PrefixBlockManager
    width = table_width(config.max_model_len, config.block_size)
    state = parts.get("PersistentBatch", PersistentBatch)(
        config.max_num_seqs, width, config.block_size, sizing.device
    )
    return built._replace(state=state, scheduler=parts.get("OverlapScheduler", Scheduler))


RECIPE = dataclasses.replace(
    tensor_parallel.RECIPE,
    build=build,
    api={
        "PersistentBatch": "nanoserve.engine.runner.persistent_batch:PersistentBatch",
        "OverlapScheduler": "nanoserve.engine.loop.scheduler:Scheduler",
    },
    # stage 07's manager stays replaceable (enable_prefix_caching=False puts stage 04's there)
    parts=("PersistentBatch", "OverlapScheduler", "PrefixBlockManager"),
)
