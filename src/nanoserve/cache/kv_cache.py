"""The KV-cache seam: the contract every stage's cache (the data plane) meets.

Introduced when the seams were drawn (before stage 05). A cache owns tensors and turns a
scheduled batch into one step's inputs; it decides nothing (admission and growth are the cache
manager's, in engine/) and computes no attention (the backend's, in kernels/ or beside the cache).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from nanoserve.types import ScheduledBatch, StepInputs


@runtime_checkable
class KVCache(Protocol):
    """Tensors for K/V plus the per-step packing.

    Contract: `prepare(batch)` reads each sequence's tokens, `num_cached_tokens` and where its
    K/V lives (`block_table`, or `slab_id` in stage 01), changes nothing, and returns the step's
    `StepInputs`: packed `input_ids` and `positions` of the tokens to compute (the uncached ones;
    every token at stage 00) and one `AttentionMetadata`. Its tensors are on `device`.
    """

    device: object

    def prepare(self, batch: ScheduledBatch) -> StepInputs: ...
