"""Each stage's learner API: the names its starter.py defines, mapped to the reference objects.

Introduced with the recipes (after stage 10), out of the engine: grading (`--impl ref`),
`nanoserve check` and the mutation self-test read it; no engine code does. The names are the
stage's contract with the learner, so a starter defines exactly these (tests/test_seams.py).
Stages 05 and 06 import Triton, a dev/gpu dependency, so their tables are built on first use.
"""

from __future__ import annotations

from typing import Any

from nanoserve.engine.loop.overlap_engine import OverlapEngine, OverlapScheduler
from nanoserve.engine.memory.allocator import BlockAllocator, OutOfBlocks
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.memory.block_table import BlockPosition, BlockTable
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager, chain_hash
from nanoserve.engine.memory.slab_manager import SlabManager
from nanoserve.engine.runner.cuda_graphs import bucket_for, fill_static, graph_buckets
from nanoserve.engine.runner.input_packer import pad_decode, prepare_decode, prepare_prefill
from nanoserve.engine.runner.persistent_batch import PersistentBatch
from nanoserve.engine.speculation.ngram_proposer import propose_ngram
from nanoserve.engine.speculation.speculative_engine import SpeculativeEngine, SpeculativeScheduler
from nanoserve.kernels.attention import attend
from nanoserve.kernels.slab_attention import load_slab, store_slab
from nanoserve.kernels.torch_paged import gather_kv, store_kvcache
from nanoserve.layers import embedding, linear
from nanoserve.layers.norm import rms_norm
from nanoserve.layers.rotary import apply_rotary, rope_cos_sin, rope_inv_freq, rotate_half
from nanoserve.layers.shards import padded_shard_range, shard_range
from nanoserve.models.decoder import swiglu
from nanoserve.samplers.rejection import num_accepted, residual
from nanoserve.sampling import filter_probs, sample_one
from nanoserve.serving.async_engine import AsyncEngine

_API: dict[int, dict[str, Any]] = {
    0: {
        "rms_norm": rms_norm,
        "rotate_half": rotate_half,
        "rope_inv_freq": rope_inv_freq,
        "rope_cos_sin": rope_cos_sin,
        "apply_rotary": apply_rotary,
        "attend": attend,
        "swiglu": swiglu,
        "filter_probs": filter_probs,
        "sample": sample_one,
    },
    1: {"SlabManager": SlabManager, "store_slab": store_slab, "load_slab": load_slab},
    2: {"OutOfBlocks": OutOfBlocks, "BlockAllocator": BlockAllocator},
    3: {"BlockPosition": BlockPosition, "BlockTable": BlockTable},
    4: {
        "BlockManager": BlockManager,
        "store_kvcache": store_kvcache,
        "gather_kv": gather_kv,
        "prepare_prefill": prepare_prefill,
        "prepare_decode": prepare_decode,
    },
    7: {"chain_hash": chain_hash, "PrefixBlockManager": PrefixBlockManager},
    8: {
        "graph_buckets": graph_buckets,
        "bucket_for": bucket_for,
        "pad_decode": pad_decode,
        "fill_static": fill_static,
    },
    9: {
        "shard_range": shard_range,
        "padded_shard_range": padded_shard_range,
        "ColumnParallelLinear": linear.ColumnParallelLinear,
        "MergedColumnParallelLinear": linear.MergedColumnParallelLinear,
        "QKVParallelLinear": linear.QKVParallelLinear,
        "RowParallelLinear": linear.RowParallelLinear,
        "VocabParallelEmbedding": embedding.VocabParallelEmbedding,
        "ParallelLMHead": embedding.ParallelLMHead,
    },
    10: {"AsyncEngine": AsyncEngine},
    11: {
        "PersistentBatch": PersistentBatch,
        "OverlapScheduler": OverlapScheduler,
        "OverlapEngine": OverlapEngine,
    },
    12: {
        "propose_ngram": propose_ngram,
        "num_accepted": num_accepted,
        "residual": residual,
        "SpeculativeScheduler": SpeculativeScheduler,
        "SpeculativeEngine": SpeculativeEngine,
    },
}


def _triton_api(stage: int) -> dict[str, Any]:
    """Stages 05-06: the Triton kernels, imported here and only here."""
    if stage == 5:
        from nanoserve.kernels.store import store_kvcache as triton_store

        return {"store_kvcache": triton_store}
    from nanoserve.kernels.paged_decode import paged_attention_decode
    from nanoserve.kernels.paged_prefill import paged_attention_prefill

    return {
        "paged_attention_prefill": paged_attention_prefill,
        "paged_attention_decode": paged_attention_decode,
    }


def has_learner_api(stage: int) -> bool:
    """True for a stage whose starter defines an API graded with --impl."""
    return stage in _API or stage in (5, 6)


def learner_api(stage: int) -> dict[str, Any]:
    """API name -> reference object, for every name stage's starter.py defines."""
    if stage in (5, 6):
        return _triton_api(stage)
    return dict(_API[stage])
