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

from nanoserve.engine.forward_inputs import ForwardInputs, pack_tokens, to_forward_inputs
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels.attention import attend


class SlabManager:
    """Hands out whole slabs: admission needs one free slab, growth never needs more."""

    def __init__(self, num_slabs: int):
        self.num_slabs = num_slabs
        self.free_slab_ids = list(range(num_slabs - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free_slabs(self) -> int:
        """Slabs no sequence owns."""
        return len(self.free_slab_ids)

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Every request fits: a slab holds max_model_len tokens, the engine's own limit."""

    def can_allocate(self, seq: Sequence) -> bool:
        """True when a slab is free."""
        return self.num_free_slabs > 0

    def allocate(self, seq: Sequence) -> None:
        """Give seq a slab; it keeps it until it finishes."""
        seq.slab_id = self.free_slab_ids.pop()

    def can_append(self, seq: Sequence) -> bool:
        """Always: the slab already has room for max_model_len tokens."""
        return True

    def may_append(self, seq: Sequence) -> None:
        """Nothing to do: growth stays inside the slab."""

    def deallocate(self, seq: Sequence) -> None:
        """Return seq's slab; its K/V bytes stay but nobody reads them."""
        self.free_slab_ids.append(seq.slab_id)
        seq.slab_id, seq.num_cached_tokens = None, 0


def store_slab(cache: torch.Tensor, slab_id: int, start: int, values: torch.Tensor) -> None:
    """Write values (n, H_kv, D) at positions start .. start+n-1 of one slab of cache."""
    cache[slab_id, start : start + values.shape[0]] = values


def load_slab(cache: torch.Tensor, slab_id: int, end: int) -> torch.Tensor:
    """Positions 0 .. end-1 of one slab of cache, (end, H_kv, D)."""
    return cache[slab_id, :end]


class ContiguousKVCache:
    """The slab tensor, and the inputs that feed only each sequence's new tokens."""

    def __init__(self, num_slabs, num_layers, max_model_len, num_kv_heads, head_dim, dtype,
                 device, store=store_slab, load=load_slab):  # fmt: skip
        shape = (2, num_layers, num_slabs, max_model_len, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.store, self.load = store, load

    def prepare(self, batch: ScheduledBatch) -> ForwardInputs:
        """New tokens only: the whole uncached prompt at prefill, the last token at decode."""
        packed = pack_tokens(batch.seqs)
        spans = [(seq.slab_id, seq.num_cached_tokens, len(seq)) for seq in batch.seqs]
        attn = ContiguousAttention(self, spans, packed.cu_seqlens_q)
        return to_forward_inputs(packed, attn, self.device)


class ContiguousAttention:
    """Per sequence: store the new K/V in its slab, then attend over the slab's prefix."""

    def __init__(self, cache: ContiguousKVCache, spans, cu_seqlens_q: list[int]):
        self.cache = cache
        self.spans = spans  # (slab_id, start, end) per sequence: new tokens are start .. end-1
        self.cu_seqlens_q = cu_seqlens_q

    def forward(self, layer_id: int, q, k, v, scale: float) -> torch.Tensor:
        """(T, H, D) outputs for the packed new tokens of every sequence."""
        k_cache, v_cache = self.cache.kv[0, layer_id], self.cache.kv[1, layer_id]
        outputs = []
        for i, (slab_id, start, end) in enumerate(self.spans):
            s, e = self.cu_seqlens_q[i], self.cu_seqlens_q[i + 1]
            self.cache.store(k_cache, slab_id, start, k[s:e])
            self.cache.store(v_cache, slab_id, start, v[s:e])
            keys = self.cache.load(k_cache, slab_id, end)
            values = self.cache.load(v_cache, slab_id, end)
            outputs.append(attend(q[s:e], keys, values, scale))
        return torch.cat(outputs)
