"""Stage 05's engine: stage 04's, with the Triton store kernel writing K/V into slots.

On the `torch` backend (the CPU default) it runs exactly as stage 04; the learner's kernel runs
only on `triton` (a GPU, or a CPU through TRITON_INTERPRET=1). Triton is imported only when that
backend is chosen: it is not a run dependency.
"""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.runner.input_packer import InputPacker
from nanoserve.kernels.torch_paged import TorchPagedAttention
from nanoserve.recipes.paged_pool import build_pool
from nanoserve.recipes.recipe import EngineParts, Recipe, Sizing


def build(config: EngineConfig, sizing: Sizing, parts: dict, backend: str) -> EngineParts:
    """Stage 04's pool and manager; the store is the learner's Triton kernel (or ours)."""
    pool = build_pool(config, sizing)
    manager = BlockManager(pool.num_blocks, config.block_size)
    packer = InputPacker(pool.block_size, sizing.device)
    if backend == "torch":
        return EngineParts(manager, pool, packer, TorchPagedAttention(pool))
    from nanoserve.kernels.store import store_kvcache
    from nanoserve.kernels.triton_backend import TritonStoreAttention

    attention = TritonStoreAttention(pool, parts.get("store_kvcache", store_kvcache))
    return EngineParts(manager, pool, packer, attention)


RECIPE = Recipe(
    build,
    api={"store_kvcache": "nanoserve.kernels.store:store_kvcache"},
    parts=("store_kvcache",),
    backends=("triton", "torch"),
    parts_run_on="triton",
)
