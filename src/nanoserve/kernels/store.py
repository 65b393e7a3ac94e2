"""Stage 05: a Triton kernel that writes each new token's K and V into its slot of the paged pool.

Introduced in stage 05. It does what stage 04's torch scatter does, byte for byte: one program per
token copies that token's H_kv * D values of K and of V to its flat slot, or does nothing when the
slot is -1 (a padding row). It only copies; it never allocates, reads the pool, or attends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One layer's cache, as the kernel sees it: slot s is one contiguous row of H_kv * D values.
#
#   k_cache (num_blocks, block_size, H_kv, D), contiguous
#   ┌───────── block 0 ─────────┐┌───────── block 1 ─────────┐
#   │ slot 0 │ slot 1 │ ... │ bs-1 ││ slot bs │ ...              │   slot = block * bs + offset
#   └──────────────────────────────┘└──────────────────────────────┘
#   each slot: [h0 d0..d(D-1) | h1 d0..d(D-1) | ... ]  = H_kv * D values
#
#   key (T, H_kv, D), possibly a strided view of a fused QKV output:
#   token t's row starts at t * stride(0); its heads sit stride(1) apart.
#
#   grid = (T,): program t reads slot_mapping[t] and copies key[t] -> k_cache slot, same for v.


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_t,
    key_stride_h,
    key_stride_d,
    value_stride_t,
    value_stride_h,
    value_stride_d,
    HEAD_DIM: tl.constexpr,
    ROW_SIZE: tl.constexpr,  # H_kv * D, the values one token owns in one cache
    BLOCK_ROW: tl.constexpr,  # ROW_SIZE rounded up to a power of two (tl.arange needs one)
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * ROW_SIZE may pass 2**31
    if slot < 0:  # a padding row owns no slot: write nothing
        return
    offs = tl.arange(0, BLOCK_ROW)  # flat index into the token's (H_kv, D) row
    # Lanes past the row (192..255 for SmolLM2's 3 x 64) are masked: they touch no memory.
    mask = offs < ROW_SIZE
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    key = tl.load(key_ptr + token * key_stride_t + head * key_stride_h + dim * key_stride_d, mask)
    value = tl.load(
        value_ptr + token * value_stride_t + head * value_stride_h + dim * value_stride_d, mask
    )
    # A load followed by a store of the same dtype is a copy of the bits: no arithmetic, so the
    # pool ends up bitwise equal to the torch scatter.
    tl.store(k_cache_ptr + slot * ROW_SIZE + offs, key, mask)
    tl.store(v_cache_ptr + slot * ROW_SIZE + offs, value, mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key, value (T, H_kv, D) into k_cache, v_cache at slot_mapping (T,); -1 is skipped."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row_size = num_kv_heads * head_dim
    block_row = triton.next_power_of_2(row_size)
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        HEAD_DIM=head_dim,
        ROW_SIZE=row_size,
        BLOCK_ROW=block_row,
        num_warps=max(1, min(8, block_row // 256)),  # 8 values a thread: 16-byte accesses in bf16
    )


def _check_store_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Raise ValueError on shapes or layouts the kernel's index arithmetic does not cover."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be (T, H_kv, D), got {key.shape}, {value.shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"caches {tuple(k_cache.shape)} must be (num_blocks, block_size, H_kv, D) "
            f"with (H_kv, D) = {tuple(key.shape[1:])}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (one layer's view of the pool)")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("key, value and the caches must share one dtype (the copy is bitwise)")
    int_dtype = slot_mapping.dtype in (torch.int32, torch.int64)
    if slot_mapping.shape != (key.shape[0],) or not int_dtype:
        raise ValueError(f"slot_mapping must be (T,) int32 or int64, got {slot_mapping.shape}")
