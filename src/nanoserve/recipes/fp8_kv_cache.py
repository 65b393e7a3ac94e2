"""Stage 13's engine: stage 12's, whose KV pool may hold e4m3 codes (`kv_cache_dtype="fp8"`).

Its learner writes the scale arithmetic (`scale_exponent`, `quantize`, `dequantize`), a block's
write (`write_run`) and the torch backend's store and gather (`store_kvcache_fp8`,
`gather_kv_fp8`); given to them: the Triton store kernel and the kernels' dequantizing reads.
With `kv_cache_dtype="auto"` (the default, as vLLM's) the engine is stage 12's, exactly.
"""

from __future__ import annotations

import dataclasses

from nanoserve.recipes import speculative

RECIPE = dataclasses.replace(
    speculative.RECIPE,
    api={
        "scale_exponent": "nanoserve.cache.fp8:scale_exponent",
        "quantize": "nanoserve.cache.fp8:quantize",
        "dequantize": "nanoserve.cache.fp8:dequantize",
        "write_run": "nanoserve.cache.fp8:write_run",
        "store_kvcache_fp8": "nanoserve.kernels.torch_fp8:store_kvcache_fp8",
        "gather_kv_fp8": "nanoserve.kernels.torch_fp8:gather_kv_fp8",
    },
    # the torch backend runs the learner's store and gather (the Triton backend its own kernel);
    # stage 12's parts stay replaceable
    parts=("store_kvcache_fp8", "gather_kv_fp8", *speculative.RECIPE.parts),
    kv_cache_dtypes=("auto", "fp8"),
)
