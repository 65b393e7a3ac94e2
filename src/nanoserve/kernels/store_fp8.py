"""Stage 13: a Triton kernel that quantizes new K/V tokens into the e4m3 pool, run by run.

Introduced in stage 13. It does what `torch_fp8.store_kvcache_fp8` does, bit for bit (codes and
exponents): each run of a sequence's tokens that writes one block grows that block's exponent
per KV head, requantizes the block's older codes when it grew, and stores its own codes. The
e4m3 rounding is integer bit arithmetic, so the interpreter (NumPy has no float8) runs it too.
It never allocates or reads attention; two runs of one call must not share a block (the engine's
sequences own their blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.e4m3 import e4m3_code, e4m3_value, power_of_two, scale_exponent

# Which programs work: grid (T, H_kv, 2); program (t, h, 0) leads when token t starts a run, and
# writes head h of the whole run for K; (t, h, 1) the same for V. Everyone else returns at once.
# Block size 4:
#
#   slot_mapping   5   6   7 |  8   9 | 17 | -1 | 20
#   block/offset  1/1 1/2 1/3| 2/0 2/1| 4/1|    | 5/0
#   leader?        L   .   . |  L   . |  L |  . |  L     (slot 8 follows 7 but starts block 2)
#
# What the leader of a run at `offset` does to one block of k_cache, head h (codes, uint8):
#
#   row 0 .. offset-1        older tokens: requantized when k_scales[block, h] grows
#   row offset .. offset+n-1 this run: amax (pass 1) -> exponent (pass 2) -> codes (pass 3)
#   row offset+n ..          not written yet: left alone
#
# Rows are walked CHUNK at a time; a row is (D,) codes at ((block * bs + row) * H_kv + h) * D.

CHUNK = 16  # run rows handled at once; a longer run (block_size 64) loops


@triton.jit
def _write_run_head(
    x_ptr, stride_t, stride_d, cache_ptr, scale_ptr, slots_ptr, slot, limit, alone,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`fp8.write_run` for one head of K or of V. x_ptr: the head's row of the run's first token,
    slots_ptr: its slot_mapping entry (slot), limit: the most tokens the run may have, alone:
    whether the run is this one token. cache_ptr points at the head's (D,) codes of slot 0,
    scale_ptr at the block's exponent.

    A decode step's runs are one token each, so that case gets a build of its own with one row:
    built for CHUNK rows, a program would load and round 16 rows to write one."""
    if alone:
        _write_rows(x_ptr, stride_t, stride_d, cache_ptr, scale_ptr, slots_ptr, slot, 1,
                    NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK, BLOCK_D, 1)  # fmt: skip
    else:
        _write_rows(x_ptr, stride_t, stride_d, cache_ptr, scale_ptr, slots_ptr, slot, limit,
                    NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK, BLOCK_D, CHUNK)  # fmt: skip


@triton.jit
def _write_rows(
    x_ptr, stride_t, stride_d, cache_ptr, scale_ptr, slots_ptr, slot, limit,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """`_write_run_head`, ROWS of the run at a time (1 or CHUNK); older rows CHUNK at a time.

    A decode step's store is a chain of waits on memory, not arithmetic, so the loads that do
    not depend on each other go out together: the block's old exponent beside the run's rows,
    and the rows beside their slots. When a run fits one load of ROWS rows (one token, or blocks
    of up to CHUNK tokens, the default 16) its rows are loaded once and kept for the codes."""
    old = tl.load(scale_ptr)  # meaningful only if the block already holds tokens (offset > 0)
    offset = slot % BLOCK_SIZE
    ONE_LOAD: tl.constexpr = (ROWS == 1) or (BLOCK_SIZE <= CHUNK)
    if ONE_LOAD:  # pass 1, the run's amax, from the one load it fits in
        x, mask = _load_run_rows(x_ptr, stride_t, stride_d, slots_ptr, slot, 0, limit,
                                 ROWS, HEAD_DIM, BLOCK_D)  # fmt: skip
        amax = tl.maximum(0.0, tl.max(tl.abs(x)))
    else:
        amax = 0.0
        for start in range(0, limit, CHUNK):
            x, _ = _load_run_rows(x_ptr, stride_t, stride_d, slots_ptr, slot, start, limit,
                                  CHUNK, HEAD_DIM, BLOCK_D)  # fmt: skip
            amax = tl.maximum(amax, tl.max(tl.abs(x)))
    new = scale_exponent(amax)  # pass 2: the exponent; the older codes follow it
    if offset > 0:
        if new > old:  # (at an unchanged exponent each code would requantize to itself)
            rows, dims = tl.arange(0, CHUNK), tl.arange(0, BLOCK_D)
            for start in range(0, offset, CHUNK):
                mask_old = (start + rows < offset)[:, None] & (dims < HEAD_DIM)[None, :]
                ptrs = _code_ptrs(cache_ptr, slot - offset + start + rows, NUM_KV_HEADS, HEAD_DIM,
                                  BLOCK_D)  # fmt: skip
                y = e4m3_value(tl.load(ptrs, mask_old)) * power_of_two(old) * power_of_two(-new)
                tl.store(ptrs, e4m3_code(y), mask_old)
        new = tl.maximum(new, old)
    if ONE_LOAD:  # pass 3: the run's own codes
        ptrs = _code_ptrs(cache_ptr, slot + tl.arange(0, ROWS), NUM_KV_HEADS, HEAD_DIM, BLOCK_D)
        tl.store(ptrs, e4m3_code(x * power_of_two(-new)), mask)
    else:
        for start in range(0, limit, CHUNK):
            x, mask = _load_run_rows(x_ptr, stride_t, stride_d, slots_ptr, slot, start, limit,
                                     CHUNK, HEAD_DIM, BLOCK_D)  # fmt: skip
            ptrs = _code_ptrs(cache_ptr, slot + start + tl.arange(0, CHUNK), NUM_KV_HEADS,
                              HEAD_DIM, BLOCK_D)  # fmt: skip
            tl.store(ptrs, e4m3_code(x * power_of_two(-new)), mask)
    tl.store(scale_ptr, new)


@triton.jit
def _load_run_rows(
    x_ptr, stride_t, stride_d, slots_ptr, slot, start, limit,
    CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The run's tokens start..start+CHUNK-1 as float32 (CHUNK, BLOCK_D), and the mask of those
    in the run: before `limit`, at slots slot + start, slot + start + 1, ... (zeros elsewhere).
    The rows are read without waiting for the slots (every row before `limit` is a token of
    this call), then the rows outside the run are zeroed."""
    rows, dims = start + tl.arange(0, CHUNK), tl.arange(0, BLOCK_D)
    in_rows = rows < limit
    in_run = in_rows & (tl.load(slots_ptr + rows, in_rows, other=-1) == slot + rows)
    mask = in_run[:, None] & (dims < HEAD_DIM)[None, :]
    ptrs = x_ptr + rows[:, None] * stride_t + dims[None, :] * stride_d
    x = tl.load(ptrs, in_rows[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    return tl.where(mask, x, 0.0), mask


@triton.jit
def _code_ptrs(
    cache_ptr, slots, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Pointers (len(slots), BLOCK_D) to one head's code rows of `slots`."""
    dims = tl.arange(0, BLOCK_D)
    return cache_ptr + (slots * NUM_KV_HEADS * HEAD_DIM)[:, None] + dims[None, :]


@triton.jit(do_not_specialize=["num_tokens"])  # one build for every batch of tokens
def _store_kvcache_fp8_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, slot_mapping_ptr,
    num_tokens, key_stride_t, key_stride_h, key_stride_d,
    value_stride_t, value_stride_h, value_stride_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,  # BLOCK_D: HEAD_DIM rounded up to a power of two
):  # fmt: skip
    token, head, is_value = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * H_kv * D may pass 2**31
    previous = tl.load(slot_mapping_ptr + token - 1, mask=token > 0, other=-1).to(tl.int64)
    following = tl.load(slot_mapping_ptr + token + 1, mask=token + 1 < num_tokens, other=-1)
    goes_on = (slot % BLOCK_SIZE != 0) & (previous == slot - 1)  # token - 1 leads or went on
    if (slot < 0) | goes_on:  # padding (-1) writes nothing; a run's later tokens are its leader's
        return
    limit = tl.minimum(BLOCK_SIZE - slot % BLOCK_SIZE, num_tokens - token)  # the run's most tokens
    alone = (limit == 1) | (following.to(tl.int64) != slot + 1)  # one token: a decode step's runs
    scale = (slot // BLOCK_SIZE) * NUM_KV_HEADS + head  # this block and head's exponent
    if is_value == 0:
        _write_run_head(key_ptr + token * key_stride_t + head * key_stride_h, key_stride_t,
                        key_stride_d, k_cache_ptr + head * HEAD_DIM, k_scales_ptr + scale,
                        slot_mapping_ptr + token, slot, limit, alone,
                        NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK, BLOCK_D)  # fmt: skip
    else:
        _write_run_head(value_ptr + token * value_stride_t + head * value_stride_h,
                        value_stride_t, value_stride_d, v_cache_ptr + head * HEAD_DIM,
                        v_scales_ptr + scale, slot_mapping_ptr + token, slot, limit, alone,
                        NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK, BLOCK_D)  # fmt: skip


def store_kvcache_fp8(key, value, k_cache, v_cache, slot_mapping, *, k_scales, v_scales) -> None:
    """Quantize key, value (T, H_kv, D) into the code caches (num_blocks, block_size, H_kv, D)
    at slot_mapping (T,) (-1 is skipped), growing the exponents (num_blocks, H_kv) in place.
    (Triton's default 4 warps a program: 1, 2 and 4 took the same time on an H100,
    docs/benchmarks.md.)"""
    _check_fp8_store_args(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kvcache_fp8_kernel[(num_tokens, num_kv_heads, 2)](  # K, then V: one program each
        key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, num_tokens,
        *key.stride(), *value.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], CHUNK=CHUNK,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def _check_fp8_store_args(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales):
    """Raise ValueError on shapes, dtypes or layouts the kernel's indexing does not cover."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be (T, H_kv, D), got {key.shape}, {value.shape}")
    caches_fit = k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:]
    if not caches_fit or not (k_cache.dtype == v_cache.dtype == torch.uint8):
        raise ValueError(f"caches must be (num_blocks, block_size, {key.shape[1:]}) uint8 codes")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (one layer's view of the pool)")
    for scales in (k_scales, v_scales):
        if scales.shape != (k_cache.shape[0], key.shape[1]) or scales.dtype != torch.int32:
            raise ValueError(f"k_scales, v_scales must be (num_blocks, H_kv) int32: {scales.shape}")
        if not scales.is_contiguous():
            raise ValueError("k_scales and v_scales must be contiguous")
    int_dtype = slot_mapping.dtype in (torch.int32, torch.int64)
    if slot_mapping.shape != (key.shape[0],) or not int_dtype:
        raise ValueError(f"slot_mapping must be (T,) int32 or int64, got {slot_mapping.shape}")
