"""The KV-cache seam: the contract every stage's cache (the data plane) meets.

Introduced in stage 04, when a second cache layout arrived. A cache owns K/V tensors and nothing
else: it decides nothing (admission and growth are the cache manager's, in engine/), packs no
inputs (the model runner's `InputPacker`) and computes no attention (the backends, in kernels/).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCache(Protocol):
    """K/V tensors on `device`, addressed in units of `block_size` tokens.

    Contract: `block_size` is how many tokens one block-table entry covers (a stage-01 slab:
    max_model_len; stage 00's NoCache: 1, it stores nothing), so flat slot = entry * block_size +
    offset. The tensors are allocated once, at construction, and never reallocated: CUDA graphs
    (stage 08) record their addresses.
    """

    device: torch.device
    block_size: int
