"""Stage compositions: the one table of what each stage's engine is made of.

Introduced when the seams were drawn (before stage 05). Per stage: the builder of its cache
manager (control plane) and KV cache (data plane), the pieces a learner may replace with
`components=` (by the API names their starter defines), the attention backends it offers (best
first), and its learner API. `engine/assemble.py` builds an engine from a row; a new stage adds
one row, so the equivalence chain between stages stays a plain test.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanoserve.cache import contiguous, paged
from nanoserve.cache.attention_metadata import pad_decode, prepare_decode, prepare_prefill
from nanoserve.cache.budget import kv_bytes_per_token, units_in_budget
from nanoserve.cache.no_cache import NoCache
from nanoserve.cache.slot_cache import SlotAttention, SlotKVCache
from nanoserve.config import EngineConfig
from nanoserve.engine.allocator import BlockAllocator, OutOfBlocks
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.block_table import BlockPosition, BlockTable
from nanoserve.engine.cuda_graphs import (
    bucket_for,
    fill_static,
    graph_buckets,
)
from nanoserve.engine.kv_manager import NoCacheManager
from nanoserve.engine.prefix_block_manager import PrefixBlockManager, chain_hash
from nanoserve.engine.slab_manager import SlabManager
from nanoserve.engine.table_manager import build_table_manager
from nanoserve.kernels.attention import NoCacheAttention, attend
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanoserve.layers.norm import rms_norm
from nanoserve.layers.rotary import apply_rotary, rope_cos_sin, rope_inv_freq, rotate_half
from nanoserve.layers.tensor_parallel import padded_shard_range, shard_range
from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import swiglu
from nanoserve.sampling import filter_probs, sample_one


class Sizing(NamedTuple):
    """What a stage's builder knows about the model and the memory it may fill."""

    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    budget_bytes: Callable[[], int]  # measured only when a pool must be sized from it
    tp_size: int = 1  # stage 09: each rank stores only its 1/tp_size of the KV heads

    def units(self, tokens_per_unit: int, unit: str) -> int:
        """How many slabs or blocks of tokens_per_unit tokens fit the KV budget."""
        per_token = kv_bytes_per_token(self.model_config, self.dtype) // self.tp_size
        return units_in_budget(self.budget_bytes(), per_token, tokens_per_unit, unit)

    def cache_shape(self) -> dict:
        """Layer count, this rank's KV heads, head size, dtype and device, as caches take them."""
        mc = self.model_config
        num_kv_heads = mc.num_key_value_heads // self.tp_size
        return dict(num_layers=mc.num_hidden_layers, num_kv_heads=num_kv_heads,
                    head_dim=mc.head_dim, dtype=self.dtype, device=self.device)  # fmt: skip


# A builder makes (manager, cache) from the config, the sizing and the stage's resolved parts.
Builder = Callable[[EngineConfig, Sizing, dict], tuple]
# An attention factory makes the backend over the cache the builder made.
AttentionFactory = Callable[[object, dict], object]


def build_no_cache(config: EngineConfig, sizing: Sizing, parts: dict):
    """Stage 00: nothing stored; every step recomputes every token."""
    return NoCacheManager(), NoCache(sizing.device)


def build_slabs(config: EngineConfig, sizing: Sizing, parts: dict):
    """Stages 01-02: one worst-case slab per running sequence."""
    num_slabs = config.num_slabs or min(
        config.max_num_seqs, sizing.units(config.max_model_len, "slab")
    )
    cache = contiguous.ContiguousKVCache(num_slabs, max_model_len=config.max_model_len,
                                         **sizing.cache_shape())  # fmt: skip
    return parts["SlabManager"](num_slabs), cache


def num_blocks_for(config: EngineConfig, sizing: Sizing) -> int:
    """KV blocks that fit the budget, unless config names a number."""
    return config.num_kv_blocks or sizing.units(config.block_size, "block")


def build_block_tables(config: EngineConfig, sizing: Sizing, parts: dict):
    """Stage 03: block tables over an allocator; K/V at flat slots; worst case reserved."""
    num_blocks = num_blocks_for(config, sizing)
    manager = build_table_manager(num_blocks, config.block_size, config.max_model_len,
                                  parts["BlockAllocator"], parts["BlockTable"])  # fmt: skip
    cache = SlotKVCache(num_blocks, config.block_size, **sizing.cache_shape())
    return manager, cache


def build_paged(config: EngineConfig, sizing: Sizing, parts: dict):
    """Stage 04 on: one pool tensor, lazy block growth, preemption when the pool runs dry.

    Later stages change only the kernels, so they keep stage 04's reference for what they omit.
    """
    parts = {**PAGED_PARTS, **parts}
    num_blocks = num_blocks_for(config, sizing)
    pool = paged.PagedKVPool(num_blocks, config.block_size, **sizing.cache_shape(),
                             prepare_prefill=parts["prepare_prefill"],
                             prepare_decode=parts["prepare_decode"])  # fmt: skip
    return parts["BlockManager"](num_blocks, config.block_size), pool


@dataclass(frozen=True)
class Composition:
    """What the engine of one stage is made of, and what its learner writes."""

    build: Builder  # makes (manager, cache) from the config, the sizing and the resolved parts
    parts: dict  # API name -> reference piece of this stage's engine; components= replaces them
    attention: dict[str, AttentionFactory]  # the backends offered, best first
    learner_api: dict  # API name -> reference: every name the stage's starter.py defines
    parts_run_on: str | None = None  # the one backend that runs the parts (None: every backend)
    captures_decode: bool = False  # stage 08: decode steps replay CUDA graphs (on a GPU)
    shards_model: bool = False  # stage 09: the model may span tensor_parallel_size processes

    def resolve(self, stage: int, components: dict | None, backend: str) -> dict:
        """The reference parts with the learner's components swapped in, every key checked."""
        components = dict(components or {})
        unknown = sorted(set(components) - set(self.parts))
        if unknown:
            raise ValueError(unknown_components_message(stage, unknown, sorted(self.parts)))
        if components and self.parts_run_on not in (None, backend):
            raise ValueError(
                f"components {', '.join(sorted(components))} run only on stage {stage}'s "
                f"{self.parts_run_on!r} backend, but {backend!r} was chosen; pass "
                f"attention_backend={self.parts_run_on!r} (on a CPU with TRITON_INTERPRET=1)"
            )
        return {**self.parts, **components}


def slab_attention(cache, parts: dict):
    """Stage 01's attention: the learner's store_slab / load_slab around the torch oracle."""
    return contiguous.SlabAttention(cache, parts["store_slab"], parts["load_slab"])


def paged_torch_attention(pool, parts: dict):
    """Stage 04's torch backend: the learner's store_kvcache / gather_kv around the oracle."""
    return paged.TorchPagedAttention(pool, parts["store_kvcache"], parts["gather_kv"])


def stage_04_attention(pool, parts: dict):
    """The torch path of later stages: stage 04's reference store and gather, whatever parts."""
    return paged.TorchPagedAttention(pool)


def triton_store_attention(pool, parts: dict):
    """Stage 05: the Triton store kernel writes; torch still gathers and attends."""
    attention = paged.TorchPagedAttention(pool, store=parts["store_kvcache"])
    attention.name = "triton"  # the kernels backend of stage 05: the store only
    return attention


def triton_paged_attention(pool, parts: dict):
    """Stage 06: Triton stores, and Triton reads pages in place (prefill and split-K decode)."""
    from nanoserve.kernels.triton_backend import TritonPagedAttention  # imports triton: lazily

    return TritonPagedAttention(pool, parts["store_kvcache"], parts["paged_attention_prefill"],
                                parts["paged_attention_decode"])  # fmt: skip


def reference_triton_attention(pool, parts: dict):
    """Stages 07-08: stage 06's reference kernels (their learners write other pieces)."""
    return triton_paged_attention(pool, {**STORE_PARTS, **KERNEL_PARTS})


def build_prefix_cached(config: EngineConfig, sizing: Sizing, parts: dict):
    """Stage 07 on: stage 04's pool, with a block manager that shares cached prefixes."""
    return build_paged(config, sizing, {"BlockManager": parts["PrefixBlockManager"]})


def triton_kernel(module: str, name: str):
    """A reference Triton function, imported on its first call (triton is a dev/gpu dependency,
    not a run one: the demo installs no triton, and stages 00-04 never need it)."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"nanoserve.kernels.{module}"), name)(
            *args, **kwargs
        )

    call.__name__ = call.__qualname__ = name
    call.__module__ = f"nanoserve.kernels.{module}"
    return call


MODEL_API = {
    "rms_norm": rms_norm,
    "rotate_half": rotate_half,
    "rope_inv_freq": rope_inv_freq,
    "rope_cos_sin": rope_cos_sin,
    "apply_rotary": apply_rotary,
    "attend": attend,
    "swiglu": swiglu,
    "filter_probs": filter_probs,
    "sample": sample_one,
}
SLAB_PARTS = {
    "SlabManager": SlabManager,
    "store_slab": contiguous.store_slab,
    "load_slab": contiguous.load_slab,
}
TABLE_PARTS = {"BlockAllocator": BlockAllocator, "BlockTable": BlockTable}
PAGED_PARTS = {
    "BlockManager": BlockManager,
    "store_kvcache": paged.store_kvcache,
    "gather_kv": paged.gather_kv,
    "prepare_prefill": prepare_prefill,
    "prepare_decode": prepare_decode,
}

STORE_PARTS = {"store_kvcache": triton_kernel("store", "store_kvcache")}
KERNEL_PARTS = {
    "paged_attention_prefill": triton_kernel("paged_prefill", "paged_attention_prefill"),
    "paged_attention_decode": triton_kernel("paged_decode", "paged_attention_decode"),
}

PREFIX_PARTS = {"PrefixBlockManager": PrefixBlockManager}
GRAPH_API = {
    "graph_buckets": graph_buckets,
    "bucket_for": bucket_for,
    "pad_decode": pad_decode,
    "fill_static": fill_static,
}
PARALLEL_API = {
    "shard_range": shard_range,
    "padded_shard_range": padded_shard_range,
    "ColumnParallelLinear": ColumnParallelLinear,
    "MergedColumnParallelLinear": MergedColumnParallelLinear,
    "QKVParallelLinear": QKVParallelLinear,
    "RowParallelLinear": RowParallelLinear,
    "VocabParallelEmbedding": VocabParallelEmbedding,
    "ParallelLMHead": ParallelLMHead,
}
LATER_BACKENDS = {"triton": reference_triton_attention, "torch": stage_04_attention}

#   stage: Composition(builder, engine parts (replaceable), attention backends, learner API)
COMPOSITIONS: dict[int, Composition] = {
    0: Composition(build_no_cache, {}, {"torch": lambda cache, parts: NoCacheAttention()},
                   MODEL_API),
    1: Composition(build_slabs, SLAB_PARTS, {"torch": slab_attention}, SLAB_PARTS),
    # Stage 02's allocator is graded on its own: its engine is stage 01's, and stage 03's
    # engine is where the allocator is plugged in.
    2: Composition(build_slabs, SLAB_PARTS, {"torch": slab_attention},
                   {"OutOfBlocks": OutOfBlocks, "BlockAllocator": BlockAllocator}),
    3: Composition(build_block_tables, TABLE_PARTS,
                   {"torch": lambda cache, parts: SlotAttention(cache)},
                   {"BlockPosition": BlockPosition, "BlockTable": BlockTable}),
    4: Composition(build_paged, PAGED_PARTS, {"torch": paged_torch_attention}, PAGED_PARTS),
    5: Composition(build_paged, STORE_PARTS,
                   {"triton": triton_store_attention, "torch": stage_04_attention}, STORE_PARTS,
                   parts_run_on="triton"),
    6: Composition(build_paged, {**STORE_PARTS, **KERNEL_PARTS},
                   {"triton": triton_paged_attention, "torch": stage_04_attention}, KERNEL_PARTS,
                   parts_run_on="triton"),
    7: Composition(build_prefix_cached, PREFIX_PARTS, LATER_BACKENDS,
                   {"chain_hash": chain_hash, **PREFIX_PARTS}),
    8: Composition(build_prefix_cached, PREFIX_PARTS, LATER_BACKENDS, GRAPH_API,
                   captures_decode=True),
    # Stage 09's layers are graded on their own, across real gloo ranks; its engine is stage
    # 08's, run by tensor_parallel_size processes.
    9: Composition(build_prefix_cached, PREFIX_PARTS, LATER_BACKENDS, PARALLEL_API,
                   captures_decode=True, shards_model=True),
    # Stage 10 serves stage 09's engine; its learner writes the loop around it (AsyncEngine).
    10: Composition(build_prefix_cached, PREFIX_PARTS, LATER_BACKENDS,
                    {"AsyncEngine": AsyncEngine}, captures_decode=True, shards_model=True),
}  # fmt: skip


def unknown_components_message(stage: int, unknown: list[str], valid: list[str]) -> str:
    """Which keys are wrong, what the stage takes, and where a misplaced key belongs."""
    takes = ", ".join(valid) if valid else "no components"
    homes = [f"{name} is a stage {n} component" for name in unknown
             for n, c in COMPOSITIONS.items() if name in c.parts and n != stage][:1]  # fmt: skip
    hint = f" ({homes[0]})" if homes else ""
    return (f"components {', '.join(map(repr, unknown))} are not parts of stage {stage}'s "
            f"engine{hint}; stage {stage} takes {takes}")  # fmt: skip
