"""Stage 05 starter: a Triton kernel that writes this step's keys and values into the paged pool.

Fill in the kernel and its launch wrapper (the lesson, stages/05_triton_store/README.md, walks
through them task by task) in a copy: `cp stages/05_triton_store/starter.py my_store.py`, then
grade it with `pytest stages/05_triton_store --impl my_store.py`; this file itself must keep
failing. Without a GPU the kernel runs through Triton's interpreter: the repository's conftest.py
sets TRITON_INTERPRET=1 for pytest; anywhere else, export it before Python starts.

    one layer's k_cache (num_blocks, block_size, H_kv, D), contiguous: one row per flat slot

      slot:   0          1          2        ...   slot s starts at s * (H_kv * D)
            [h0 d0..D-1 | h1 ... ][h0 ... | h1 ... ][ ...
             '------ H_kv * D ------'

    key (T, H_kv, D), maybe a strided view: token t's value (h, d) sits at
      key_ptr + t * stride(0) + h * stride(1) + d * stride(2)

    grid = (T,): program t reads slot = slot_mapping[t]; if slot is -1 it returns;
    else it copies key[t] to k_cache row `slot` and value[t] to v_cache row `slot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    HEAD_DIM: tl.constexpr,  # D
    ROW_SIZE: tl.constexpr,  # H_kv * D: the values one token owns in one cache
    BLOCK_ROW: tl.constexpr,  # ROW_SIZE rounded up to a power of two (tl.arange needs one)
):
    """Program t copies token t's (H_kv, D) row of key and of value into its slot.

    Hints, in order (tasks 1-4 of the lesson):
      token = tl.program_id(0); slot = tl.load(slot_mapping_ptr + token)
      task 2: a slot < 0 is a padding row: `return` before touching memory. Cast the slot to
              tl.int64 first: slot * ROW_SIZE passes 2**31 in a large pool.
      task 1: offs = tl.arange(0, BLOCK_ROW) numbers the row's values; value i is head
              i // HEAD_DIM, dim i % HEAD_DIM. Load key and value at those (use the strides),
              store them at k_cache_ptr + slot * ROW_SIZE + offs (the cache is contiguous).
      task 3: when ROW_SIZE is not a power of two, lanes offs >= ROW_SIZE must touch nothing:
              pass mask=offs < ROW_SIZE to every tl.load and tl.store.
      Load and store in the inputs' dtype: no arithmetic, so the bits are copied exactly.
    """
    pass  # tasks 1-3: your kernel body


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key, value (T, H_kv, D) into k_cache, v_cache at slot_mapping (T,); -1 is skipped.

    The caches are views of the pool (pool[0, layer], pool[1, layer]): write into them, return
    nothing. The result must equal stage 04's torch scatter bit for bit.

    Hints:
      - T == 0 (nothing to write) returns at once: a grid of 0 programs is not a launch.
      - row_size = H_kv * D; BLOCK_ROW = triton.next_power_of_2(row_size).
      - Launch `_store_kvcache_kernel[(T,)](key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), HEAD_DIM=..., ROW_SIZE=..., BLOCK_ROW=...)`: passing
        the strides (task 4) lets key and value be views of a fused QKV output, uncopied.
      - Do not call .contiguous() on key or value: that is a copy per layer per step.
    """
    raise NotImplementedError("store_kvcache: write the kernel and launch it (tasks 1-4)")
