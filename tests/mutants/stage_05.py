"""Stage 05 mutants: the Triton store kernel and its launch (store_kvcache), one learner bug
each. Every one must change some byte of the pool that stage 04's torch scatter leaves, or touch
memory outside the tensors the kernel was given (the graded tests watch every lane)."""

from __future__ import annotations

from tests.mutants import maker

KERNEL = "_store_kvcache_kernel"  # the launch's kernel, beside store_kvcache
K_STORE = "tl.store(k_cache_ptr + slot * ROW_SIZE + offs, key, mask)"
V_STORE = "tl.store(v_cache_ptr + slot * ROW_SIZE + offs, value, mask)"

KEY_LOAD = (
    "key = tl.load(key_ptr + token * key_stride_t + head * key_stride_h + dim * key_stride_d, mask)"
)

mutant = maker(5)


MUTANTS = (
    mutant(
        "padding_not_skipped",
        "the kernel forgets the slot -1 check: a padding row writes one row before the cache",
        KERNEL,
        ("if slot < 0:\n    return", ""),
    ),
    mutant(
        "slot_zero_taken_for_padding",
        "the check is slot <= 0, so the token of slot 0 is dropped",
        KERNEL,
        ("slot < 0", "slot <= 0"),
    ),
    mutant(
        "no_row_mask",
        "lanes are masked to the padded power of two, not the row: a 192-wide row "
        "writes 64 values into the next slot",
        KERNEL,
        ("mask = offs < ROW_SIZE", "mask = offs < BLOCK_ROW"),
    ),
    mutant(
        "row_mask_off_by_one",
        "the row mask is offs <= ROW_SIZE: one value too many",
        KERNEL,
        ("mask = offs < ROW_SIZE", "mask = offs <= ROW_SIZE"),
    ),
    mutant(
        "key_assumed_contiguous",
        "the key is read as a contiguous (T, H_kv * D) tensor, ignoring "
        "its strides (a view of the fused QKV output is not)",
        KERNEL,
        (
            "key_ptr + token * key_stride_t + head * key_stride_h + dim * key_stride_d",
            "key_ptr + token * ROW_SIZE + offs",
        ),
    ),
    mutant(
        "value_read_with_the_keys_strides",
        "the value is addressed with the key's strides: the same when both are views of one "
        "fused QKV output, wrong for a value of its own layout",
        KERNEL,
        (
            "value_ptr + token * value_stride_t + head * value_stride_h + dim * value_stride_d",
            "value_ptr + token * key_stride_t + head * key_stride_h + dim * key_stride_d",
        ),
    ),
    mutant(
        "heads_assumed_head_dim_apart",
        "a head's values are taken to start HEAD_DIM after the previous head's (head * HEAD_DIM), "
        "not at the tensor's head stride",
        KERNEL,
        (
            "value_ptr + token * value_stride_t + head * value_stride_h + dim * value_stride_d",
            "value_ptr + token * value_stride_t + head * HEAD_DIM + dim * value_stride_d",
        ),
    ),
    mutant(
        "loads_unmasked",
        "only the stores are masked: the loads of a 192-wide row read 64 values past it (past "
        "the tensor's end on the last token)",
        KERNEL,
        (KEY_LOAD, KEY_LOAD.replace(", mask)", ")")),
    ),
    mutant(
        "head_and_dim_swapped",
        "the flat lane index is split as (dim, head), not (head, dim)",
        KERNEL,
        (
            "head, dim = offs // HEAD_DIM, offs % HEAD_DIM",
            "dim, head = offs // HEAD_DIM, offs % HEAD_DIM",
        ),
    ),
    mutant(
        "writes_k_into_v",
        "the value cache is written with the key tile",
        KERNEL,
        (V_STORE, V_STORE.replace(", value,", ", key,")),
    ),
    mutant(
        "slot_scaled_by_head_dim",
        "a slot's row is placed at slot * HEAD_DIM, as if one token owned one head",
        KERNEL,
        (K_STORE, K_STORE.replace("ROW_SIZE", "HEAD_DIM")),
        (V_STORE, V_STORE.replace("ROW_SIZE", "HEAD_DIM")),
    ),
    mutant(
        "copy_through_float32",
        "the values pass through float32 on their way: float64 loses bits",
        KERNEL,
        (K_STORE, K_STORE.replace(", key,", ", key.to(tl.float32),")),
        (V_STORE, V_STORE.replace(", value,", ", value.to(tl.float32),")),
    ),
    mutant(
        "row_not_padded_to_a_power_of_two",
        "BLOCK_ROW is the row size itself: tl.arange refuses 192",
        "store_kvcache",
        ("block_row = triton.next_power_of_2(row_size)", "block_row = row_size"),
    ),
)
