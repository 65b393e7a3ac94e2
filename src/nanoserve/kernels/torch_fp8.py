"""Stage 13's attention backend in plain torch: quantize K/V into an e4m3 pool, dequantize pages.

Introduced in stage 13 (its learner writes `store_kvcache_fp8` and `gather_kv_fp8`, on top of the
scale arithmetic in `cache/fp8.py`). The store writes each run of a sequence's new tokens into
its block as e4m3 codes (`write_run`: the block's exponents grow, older codes follow them); the
gather dequantizes a sequence's blocks in table order and the torch oracle attends, as stage 04's
does. The Triton kernels (`store_fp8.py`, the fp8 path of `paged_tiles.load_kv_tile`) do the same
on a GPU, bit for bit.

`DequantizedStore` is the proof's other half: stage 11's store, writing into a pool of the
model's dtype the values an e4m3 pool would hold. An engine with it computes stage 11's attention
over exactly the numbers stage 13 reads, so the two must give the same tokens.
"""

from __future__ import annotations

import torch

from nanoserve.cache.fp8 import dequantize, write_run
from nanoserve.cache.fp8_pool import Fp8KVPool, power_of_two, runs
from nanoserve.kernels.attention import attend, attend_decode_padded
from nanoserve.kernels.torch_paged import TorchPagedAttention
from nanoserve.types import AttentionMetadata


def store_kvcache_fp8(k, v, k_cache, v_cache, slot_mapping, *, k_scales, v_scales) -> None:
    """Quantize k, v (T, H_kv, D) into the code caches (num_blocks, block_size, H_kv, D) at
    slot_mapping (T,), run by run, growing the blocks' exponents (num_blocks, H_kv)."""
    block_size = k_cache.shape[1]
    for start, end, block, offset in runs(slot_mapping, block_size):
        write_run(k[start:end], k_cache[block], k_scales[block], offset)
        write_run(v[start:end], v_cache[block], v_scales[block], offset)


def gather_kv_fp8(cache, scales, block_table, context_len: int, dtype) -> torch.Tensor:
    """One sequence's first context_len positions, dequantized: (context_len, H_kv, D)."""
    num_blocks = -(-context_len // cache.shape[1])
    blocks = block_table[:num_blocks].long()
    rows = [dequantize(cache[b], scales[b], dtype) for b in blocks.tolist()]
    if not rows:
        return torch.empty((0, *cache.shape[2:]), dtype=dtype, device=cache.device)
    return torch.cat(rows)[:context_len]


class TorchFp8Attention(TorchPagedAttention):
    """Stage 04's torch backend over an e4m3 pool: a quantizing store, dequantizing reads.

    Prefill gathers each sequence's pages, dequantized; decode dequantizes every block of every
    table at once. The Triton backend dequantizes inside its kernels instead."""

    name = "torch"

    def __init__(self, pool, store=store_kvcache_fp8, gather=gather_kv_fp8):
        super().__init__(pool)
        self.store, self.gather = store, gather

    def forward(self, layer_id: int, q, k, v, scale: float, metadata: AttentionMetadata):
        """(T, H, D) outputs for the packed new tokens."""
        k_cache, v_cache = self.pool.layer_caches(layer_id)
        scales = self.pool.layer_scales(layer_id)
        k_scales, v_scales = scales["k_scales"], scales["v_scales"]
        md = metadata
        self.store(k, v, k_cache, v_cache, md.slot_mapping, **scales)
        if not md.is_prefill:
            tables = md.block_tables.clamp(min=0).long()  # -1 padding reads block 0, then masked
            keys = dequantize_blocks(k_cache[tables], k_scales[tables], q.dtype)
            values = dequantize_blocks(v_cache[tables], v_scales[tables], q.dtype)
            return attend_decode_padded(q, keys, values, md.context_lens, scale)
        outputs = []
        for i, context_len in enumerate(md.host.context_lens):
            s, e = md.host.cu_seqlens_q[i], md.host.cu_seqlens_q[i + 1]
            table = md.block_tables[i]
            keys = self.gather(k_cache, k_scales, table, context_len, q.dtype)
            values = self.gather(v_cache, v_scales, table, context_len, q.dtype)
            outputs.append(attend(q[s:e], keys, values, scale))
        return torch.cat(outputs)


def dequantize_blocks(codes: torch.Tensor, exponents: torch.Tensor, dtype) -> torch.Tensor:
    """Codes (B, W, block_size, H, D) of B tables' blocks at exponents (B, W, H): the values,
    (B, W * block_size, H, D)."""
    values = codes.view(torch.float8_e4m3fn).float() * power_of_two(exponents)[:, :, None, :, None]
    return values.to(dtype).flatten(1, 2)


class DequantizedStore:
    """Stage 11's store for the proof: keeps an e4m3 shadow of each layer's cache (found by
    the cache tensor it is called with), stores there as stage 13 does, and writes the touched
    blocks' dequantized values into the real, model-dtype cache."""

    def __init__(self, store=store_kvcache_fp8):
        self.store = store
        self.shadows: dict[int, Fp8KVPool] = {}  # one single-layer e4m3 pool per layer's cache

    def __call__(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        shadow = self.shadows.get(k_cache.data_ptr())
        if shadow is None:
            num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
            shadow = Fp8KVPool(num_blocks, block_size, 1, num_kv_heads, head_dim, k_cache.dtype,
                               k_cache.device)  # fmt: skip
            self.shadows[k_cache.data_ptr()] = shadow
        (k_codes, v_codes), scales = shadow.layer_caches(0), shadow.layer_scales(0)
        self.store(k, v, k_codes, v_codes, slot_mapping, **scales)
        for block in {b for _, _, b, _ in runs(slot_mapping, k_cache.shape[1])}:
            k_cache[block] = dequantize(k_codes[block], scales["k_scales"][block], k_cache.dtype)
            v_cache[block] = dequantize(v_codes[block], scales["v_scales"][block], v_cache.dtype)
