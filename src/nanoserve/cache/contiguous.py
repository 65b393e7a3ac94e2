"""Stage 01: a contiguous K/V slab per running sequence, each sized for `max_model_len`.

Introduced in stage 01. A sequence gets one whole slab at admission, whatever its real length,
so capacity is counted in worst-case sequences: that waste is what paging (stage 04) removes.
There is no sharing and no preemption: a slab never runs out (generation stops at max_model_len).

    cache tensor  [2, L, num_slabs, max_model_len, H_kv, D]
                   |  |      |            |
                   |  |      |            +-- position inside the sequence
                   |  |      +-- slab id (one per running sequence)
                   |  +-- layer
                   +-- 0 = K, 1 = V
    slab 0: | A0 A1 A2 A3 A4 . . . . . . . . . . |   A has 5 tokens, the rest sits idle
    slab 1: | B0 B1 . . . . . . . . . . . . . . |
"""

from __future__ import annotations

import torch

from nanoserve.cache.attention_metadata import pack_step
from nanoserve.kernels.attention import attend
from nanoserve.types import AttentionMetadata, ScheduledBatch, StepInputs


def store_slab(cache: torch.Tensor, slab_id: int, start: int, values: torch.Tensor) -> None:
    """Write values (n, H_kv, D) at positions start .. start+n-1 of one slab of cache."""
    cache[slab_id, start : start + values.shape[0]] = values


def load_slab(cache: torch.Tensor, slab_id: int, end: int) -> torch.Tensor:
    """Positions 0 .. end-1 of one slab of cache, (end, H_kv, D)."""
    return cache[slab_id, :end]


class ContiguousKVCache:
    """The slab tensor, and the inputs that feed only each sequence's new tokens.

    In the metadata a slab is one block of max_model_len tokens: sequence i's block table is
    [slab_id], so slot_mapping reads slab_id * max_model_len + position.
    """

    def __init__(self, num_slabs, num_layers, max_model_len, num_kv_heads, head_dim, dtype,
                 device):  # fmt: skip
        shape = (2, num_layers, num_slabs, max_model_len, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.max_model_len = max_model_len
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """New tokens only: the whole uncached prompt at prefill, the last token at decode."""
        tables = [[seq.slab_id] for seq in batch.seqs]
        return pack_step(batch.seqs, tables, self.max_model_len, self.device,
                         is_prefill=batch.is_prefill)  # fmt: skip


class SlabAttention:
    """Per sequence: store the new K/V in its slab, then attend over the slab's prefix."""

    name = "torch"

    def __init__(self, cache: ContiguousKVCache, store=store_slab, load=load_slab):
        self.cache = cache
        self.store, self.load = store, load

    def forward(self, layer_id: int, q, k, v, scale: float, metadata: AttentionMetadata):
        """(T, H, D) outputs for the packed new tokens of every sequence."""
        k_cache, v_cache = self.cache.kv[0, layer_id], self.cache.kv[1, layer_id]
        host, outputs = metadata.host, []
        for i, ((slab_id,), end) in enumerate(zip(host.block_tables, host.context_lens)):
            s, e = host.cu_seqlens_q[i], host.cu_seqlens_q[i + 1]
            start = end - (e - s)  # the new tokens are the last e - s of the context
            self.store(k_cache, slab_id, start, k[s:e])
            self.store(v_cache, slab_id, start, v[s:e])
            keys = self.load(k_cache, slab_id, end)
            values = self.load(v_cache, slab_id, end)
            outputs.append(attend(q[s:e], keys, values, scale))
        return torch.cat(outputs)
