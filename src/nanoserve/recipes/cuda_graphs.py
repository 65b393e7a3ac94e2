"""Stage 08's engine: stage 07's, whose decode steps replay captured CUDA graphs on a GPU.

Its learner writes the graph bookkeeping (graded on its own); the capture itself is
`assemble.capture_decode_graphs`, run once the pool exists.
"""

from __future__ import annotations

import dataclasses

from nanoserve.recipes import prefix_cache

RECIPE = dataclasses.replace(
    prefix_cache.RECIPE,
    api={
        "graph_buckets": "nanoserve.engine.runner.cuda_graphs:graph_buckets",
        "bucket_for": "nanoserve.engine.runner.cuda_graphs:bucket_for",
        "pad_decode": "nanoserve.engine.runner.input_packer:pad_decode",
        "fill_static": "nanoserve.engine.runner.cuda_graphs:fill_static",
    },
    captures_decode=True,
)
