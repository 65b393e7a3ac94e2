"""Stage 13 mutants: the scale and the codes (scale_exponent, quantize), a block's write
(write_run: fresh block, grown exponent, older codes), and the torch backend's store and gather
(store_kvcache_fp8 with its runs, gather_kv_fp8), one learner bug each."""

from __future__ import annotations

from tests.mutants import maker

AMAX = "scale_exponent(rows.float().abs().amax(dim=(0, 2)))"
WRITE = "block[offset : offset + rows.shape[0]] = quantize(rows, new)"
CAST = "scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)"


mutant = maker(13)


MUTANTS = (
    # ---- the scale and the codes ----
    mutant(
        "exponent_rounded_down",
        "the exponent is floor(log2(amax / 448)), not the ceiling: the largest values do not fit",
        "scale_exponent",
        ("exponent - 8 + above", "exponent - 9 + above"),
    ),
    mutant(
        "exponent_exact_fit_rejected",
        "an amax of exactly 448 * 2**e (mantissa 1.75) gets e + 1: a strict comparison",
        "scale_exponent",
        ("(bits & 0x7FFFFF) > 0x600000", "(bits & 0x7FFFFF) >= 0x600000"),
    ),
    mutant(
        "log2_in_float32",
        "e = ceil(log2(amax / 448)) in float32: one float32 step above 448 * 2**k, log2 rounds to "
        "exactly k and the amax does not fit",
        "scale_exponent",
        (
            "torch.clamp(exponent - 8 + above, min=SMALLEST_EXPONENT)",
            "torch.clamp(torch.ceil(torch.log2(amax.float() / E4M3_MAX)).to(torch.int32), "
            "min=SMALLEST_EXPONENT)",
        ),
    ),
    mutant(
        "clamped_at_e4m3fnuzs_240",
        "the clamp at 240, the largest value of e4m3fnuz (the variant without -0), not 448",
        "quantize",
        (CAST, "scaled.clamp(-240.0, 240.0).to(torch.float8_e4m3fn)"),
    ),
    mutant(
        "truncated_not_rounded",
        "the mantissa is cut to 3 bits (toward zero) instead of rounded to nearest, ties to even",
        "quantize",
        (
            CAST,
            "(scaled.clamp(-E4M3_MAX, E4M3_MAX).view(torch.int32) & ~0xFFFFF)"
            ".view(torch.float32).to(torch.float8_e4m3fn)",
        ),
    ),
    # ---- a block's write ----
    mutant(
        "scale_over_all_heads",
        "one amax over every head of the rows: a quiet head shares a loud head's scale",
        "write_run",
        (AMAX, "scale_exponent(rows.float().abs().amax().repeat(rows.shape[1]))"),
    ),
    # A forgotten clamp alone is not a mutant here: with the right exponent nothing passes 448,
    # and torch 2.13's cast (CI's) saturates anything that does to 448 as the clamp would, so no
    # test can tell them apart on it. test_task_1_a_value_past_the_range_clamps_to_448_never_nan
    # holds the contract where a cast makes NaN instead (NumPy's ml_dtypes, past 464).
    mutant(
        "floor_exponent_and_no_clamp",
        "the exponent rounded down and the codes cast without a clamp: the amax does not fit "
        "(torch 2.13 saturates it to 448; a cast that does not, to NaN)",
        "write_run",
        (AMAX, f"{AMAX} - 1"),
        (
            WRITE,
            "block[offset : offset + rows.shape[0]] = "
            "(rows.float() * power_of_two(-new)[:, None])"
            ".to(torch.float8_e4m3fn).view(torch.uint8)",
        ),
    ),
    mutant(
        "amax_of_the_last_row",
        "the amax of the run's last row only, as if every token were larger than the one before",
        "write_run",
        (AMAX, "scale_exponent(rows[-1:].float().abs().amax(dim=(0, 2)))"),
    ),
    mutant(
        "stale_exponent_at_offset_0",
        "a fresh block keeps the larger of its previous owner's exponent and its own",
        "write_run",
        ("offset > 0", "True"),
    ),
    mutant(
        "amax_of_the_whole_block",
        "the amax is taken over the whole block (its stale slots included), not the rows written",
        "write_run",
        (
            AMAX,
            "scale_exponent(torch.cat([dequantize(block, exponents, torch.float32), rows.float()])"
            ".abs().amax(dim=(0, 2)))",
        ),
    ),
    mutant(
        "older_codes_not_requantized",
        "the exponent grows but the block's older codes are left at the old scale",
        "write_run",
        ("block[:offset] = quantize(dequantize(block[:offset], old, torch.float32), new)", "pass"),
    ),
    # ---- the store and the gather ----
    mutant(
        "v_stored_with_k_exponents",
        "V's runs are written with K's exponents (k_scales), V's own never set",
        "store_kvcache_fp8",
        (
            "write_run(v[start:end], v_cache[block], v_scales[block], offset)",
            "write_run(v[start:end], v_cache[block], k_scales[block], offset)",
        ),
    ),
    mutant(
        "one_write_per_token",
        "write_run once per token, not once per run: a token coded alone is requantized (rounded "
        "twice) when the next token grows the exponent",
        "store_kvcache_fp8",
        (
            "runs(slot_mapping, block_size)",
            "[(t, t + 1, b, o + t - s) for s, e, b, o in runs(slot_mapping, block_size) "
            "for t in range(s, e)]",
        ),
    ),
    mutant(
        "run_crosses_into_the_next_block",
        "a run goes on while slots are consecutive, across a block's end into the next block",
        "runs",
        (
            "end == t and last_block == block and first_offset + t - first == offset",
            "end == t and last_block * block_size + first_offset + t - first == slot",
        ),
        host="store_kvcache_fp8",
    ),
    mutant(
        "gather_without_the_scale",
        "the gather reads the e4m3 values without multiplying by their block's 2**e",
        "gather_kv_fp8",
        ("dequantize(cache[b], scales[b], dtype)", "dequantize(cache[b], 0 * scales[b], dtype)"),
    ),
    mutant(
        "gather_blocks_sorted",
        "the table's blocks are read in id order, not the table's order",
        "gather_kv_fp8",
        ("block_table[:num_blocks].long()", "block_table[:num_blocks].long().sort().values"),
    ),
)
