"""Stage 09's engine: stage 08's, run by tensor_parallel_size processes that each hold a shard.

Its learner writes the sharded layers (graded on their own across real gloo ranks); the
processes are started by `nanoserve.parallel`.
"""

from __future__ import annotations

import dataclasses

from nanoserve.recipes import cuda_graphs

RECIPE = dataclasses.replace(
    cuda_graphs.RECIPE,
    api={
        "shard_range": "nanoserve.layers.shards:shard_range",
        "padded_shard_range": "nanoserve.layers.shards:padded_shard_range",
        "ColumnParallelLinear": "nanoserve.layers.linear:ColumnParallelLinear",
        "MergedColumnParallelLinear": "nanoserve.layers.linear:MergedColumnParallelLinear",
        "QKVParallelLinear": "nanoserve.layers.linear:QKVParallelLinear",
        "RowParallelLinear": "nanoserve.layers.linear:RowParallelLinear",
        "VocabParallelEmbedding": "nanoserve.layers.embedding:VocabParallelEmbedding",
        "ParallelLMHead": "nanoserve.layers.embedding:ParallelLMHead",
    },
    shards_model=True,
)
