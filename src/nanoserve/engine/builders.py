"""Which cache manager and cache each stage plugs into the one engine loop.

Introduced in stage 00; each stage adds one entry. `build_engine(stage=N)` is how `LLM(stage=N)`
gets "the engine as of stage N", so the equivalence chain between stages is a plain test.
`components` swaps in a learner's implementation of a stage's pieces (by their API names); the
rest of the engine stays the reference.
"""

from __future__ import annotations

import torch

from nanoserve.cache import contiguous
from nanoserve.cache.attention_metadata import prepare_decode, prepare_prefill
from nanoserve.cache.budget import kv_budget_bytes, kv_bytes_per_token
from nanoserve.cache.no_cache import NoCache, NoCacheManager
from nanoserve.cache.paged import PagedKVPool, gather_kv, store_kvcache
from nanoserve.cache.slot_cache import SlotKVCache, build_table_manager
from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.stages import require_implemented


def build_no_cache(config: EngineConfig, model, device: torch.device, components: dict):
    """Stage 00: nothing stored; every step recomputes every token."""
    return NoCacheManager(), NoCache(device)


def units_in_budget(config: EngineConfig, model, tokens_per_unit: int, unit: str) -> int:
    """How many units (slabs, blocks) of tokens_per_unit tokens the KV budget holds, >= 1."""
    unit_bytes = tokens_per_unit * kv_bytes_per_token(model.config, model.dtype)
    fits = kv_budget_bytes(config, model) // unit_bytes
    if fits < 1:
        raise ValueError(
            f"one {unit} of {tokens_per_unit} tokens needs {unit_bytes} bytes, more than the KV "
            "budget; lower max_model_len or block_size, or raise kv_cache_bytes"
        )
    return fits


def num_slabs_for(config: EngineConfig, model) -> int:
    """Slabs that fit the KV budget (at most max_num_seqs), unless config names a number."""
    if config.num_slabs is not None:
        return config.num_slabs
    return min(config.max_num_seqs, units_in_budget(config, model, config.max_model_len, "slab"))


def build_contiguous(config: EngineConfig, model, device: torch.device, components: dict):
    """Stages 01-02: one worst-case slab per running sequence."""
    num_slabs = num_slabs_for(config, model)
    manager = components.get("SlabManager", contiguous.SlabManager)(num_slabs)
    mc = model.config
    cache = contiguous.ContiguousKVCache(
        num_slabs, mc.num_hidden_layers, config.max_model_len, mc.num_key_value_heads,
        mc.head_dim, model.dtype, device,
        store=components.get("store_slab", contiguous.store_slab),
        load=components.get("load_slab", contiguous.load_slab),
    )  # fmt: skip
    return manager, cache


def num_blocks_for(config: EngineConfig, model) -> int:
    """KV blocks that fit the budget, unless config names a number."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return units_in_budget(config, model, config.block_size, "block")


def build_block_tables(config: EngineConfig, model, device: torch.device, components: dict):
    """Stage 03: block tables over an allocator; K/V at flat slots; worst case reserved."""
    num_blocks = num_blocks_for(config, model)
    manager = build_table_manager(config, num_blocks, components)
    mc = model.config
    cache = SlotKVCache(manager, num_blocks, mc.num_hidden_layers, mc.num_key_value_heads,
                        mc.head_dim, model.dtype, device)  # fmt: skip
    return manager, cache


def build_paged(config: EngineConfig, model, device: torch.device, components: dict):
    """Stage 04: one pool tensor, lazy block growth, preemption when the pool runs dry."""
    num_blocks = num_blocks_for(config, model)
    manager_cls = components.get("BlockManager", BlockManager)
    manager = manager_cls(num_blocks, config.block_size)
    mc = model.config
    pool = PagedKVPool(
        num_blocks, config.block_size, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
        model.dtype, device,
        store=components.get("store_kvcache", store_kvcache),
        gather=components.get("gather_kv", gather_kv),
        prepare_prefill=components.get("prepare_prefill", prepare_prefill),
        prepare_decode=components.get("prepare_decode", prepare_decode),
    )  # fmt: skip
    return manager, pool


STAGE_BUILDERS = {
    0: build_no_cache,
    1: build_contiguous,
    2: build_contiguous,  # the allocator is a component; stage 03 wires it into the engine
    3: build_block_tables,
    4: build_paged,
}


def build_engine(stage: int, config: EngineConfig, model, eos_ids, components=None) -> LLMEngine:
    """The engine as of `stage`: the shared loop plus that stage's manager and cache."""
    require_implemented(stage)
    device = next(model.parameters()).device
    manager, cache = STAGE_BUILDERS[stage](config, model, device, dict(components or {}))
    return LLMEngine(config, ModelRunner(model, cache), manager, eos_ids)
