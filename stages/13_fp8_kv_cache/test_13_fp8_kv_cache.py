"""Stage 13's graded contract: your e4m3 scale and codes, a block's write, the store and gather.

Run against any implementation with `pytest stages/13_fp8_kv_cache --impl ref|starter|yours.py`.
Task 1 calls your `scale_exponent`, `quantize` and `dequantize` on hand-made values and demands
torch's float8_e4m3fn rounding. Task 2 calls your `write_run` on one block: a fresh block, an
exponent that grows (older codes requantized) or does not (older codes untouched), and a stale
exponent left by the block's previous owner. Task 3 calls your `store_kvcache_fp8` on one step's
slot_mapping (several sequences, padding) and your `gather_kv_fp8` on a block table. Task 4 runs
the engine (`LLM(stage=13, kv_cache_dtype="fp8", components=...)`) with your store and gather on
a tiny float64 Llama and demands the reference's tokens, and stage 11's tokens when stage 11
stores the values your store's codes stand for.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.torch_fp8 import DequantizedStore

API = (
    "scale_exponent",
    "quantize",
    "dequantize",
    "write_run",
    "store_kvcache_fp8",
    "gather_kv_fp8",
)
BLOCK_SIZE = 4
E4M3 = torch.float8_e4m3fn


def exponent_of(impl, *amax: float) -> list[int]:
    got = impl.scale_exponent(torch.tensor(amax, dtype=torch.float32))
    assert not got.is_floating_point(), f"scale_exponent returned {got.dtype}; expected integers"
    return got.tolist()


def torch_codes(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """What torch's own float8 cast makes of x / 2**e (x within range): the codes to match."""
    scaled = x.double() / torch.pow(2.0, exponent.double())[:, None]
    return scaled.to(E4M3).view(torch.uint8)


def values_of(codes: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """What codes (..., H, D) stand for at 2**exponent (H,), in float64 (torch's own float8)."""
    return codes.view(E4M3).double() * torch.pow(2.0, exponent.double())[:, None]


def heads(*per_head: list[float]) -> torch.Tensor:
    """(n, H, D) rows from H lists of n * D values each (D = 2): head h's values are per_head[h]."""
    return torch.tensor(per_head, dtype=torch.float64).reshape(len(per_head), -1, 2).transpose(0, 1)


# ---- task 1: the scale and the codes ----


def test_task_1_the_exponent_is_the_smallest_that_fits_448(impl):
    got = exponent_of(impl, 3.1, 3.5, 3.6, 448.0, 449.0, 1.0, 0.004)
    want = [-7, -7, -6, 0, 1, -8, -16]
    assert got == want, (
        f"amax 3.1, 3.5, 3.6, 448, 449, 1, 0.004: the smallest e with amax <= 448 * 2**e is "
        f"{want} (3.5 = 448 * 2**-7 exactly fits; 3.6 does not); got {got}"
    )


def test_task_1_an_all_zero_head_gets_the_smallest_exponent(impl):
    got = exponent_of(impl, 0.0, 1e-30)
    assert got == [-64, -64], f"amax 0 and 1e-30: the exponent never goes below -64; got {got}"


def test_task_1_the_exponent_is_exact_over_many_magnitudes(impl):
    fits = (448.0 * 2.0 ** torch.arange(-20, 21)).float()  # exactly 448 * 2**k: e is k
    above = torch.nextafter(fits, torch.tensor(float("inf")))  # one float32 step more: k + 1
    amax = torch.cat([torch.logspace(-12, 12, 4001, base=2.0), fits.double(), above.double()])
    got = impl.scale_exponent(amax.float()).double()
    fits = amax.double() <= 448.0 * torch.pow(2.0, got)
    tight = amax.double() > 448.0 * torch.pow(2.0, got - 1)
    bad = torch.nonzero(~(fits & tight)).flatten()
    assert len(bad) == 0, (
        f"{len(bad)} of {len(amax)} amax values get an exponent that is not the smallest fitting "
        f"one, e.g. amax {amax[bad[0]].item()!r} -> e {int(got[bad[0]])} (a float32 log2 of an "
        f"amax one step above 448 * 2**k can round to exactly k: decide from the bits, or check "
        f"the fit by multiplying)"
    )


def test_task_1_hand_codes_round_to_the_nearest_e4m3_value(impl):
    x = torch.tensor([[[1.3, -3.1, 0.0, 3.5]]], dtype=torch.float64)  # (1 token, 1 head, D 4)
    codes = impl.quantize(x, torch.tensor([-7], dtype=torch.int32))
    assert codes.dtype == torch.uint8, f"quantize returned {codes.dtype}; expected uint8 codes"
    got = [hex(c) for c in codes.flatten().tolist()]
    want = ["0x72", "0xfc", "0x0", "0x7e"]
    assert got == want, (
        f"at e -7: 1.3 -> 166.4 -> 160 (0x72); -3.1 -> -396.8 -> -384 (0xFC); 0 -> 0x00; "
        f"3.5 -> 448 (0x7E): expected {want}, got {got}"
        + (
            "; every code is at the range's end: is your 2**e 0 or inf? (2 ** e on an integer "
            "tensor of negative e is 0; compute the scale in floating point)"
            if set(got) <= {"0x7e", "0xfe", "0x7f", "0xff"}
            else ""
        )
    )


def test_task_1_codes_are_torchs_float8_rounding_ties_to_even(impl):
    torch.manual_seed(0)
    exponent = torch.tensor([-7, 0, 5], dtype=torch.int32)
    scale = torch.pow(2.0, exponent.double())[:, None]
    x = (torch.randn(64, 3, 8, dtype=torch.float64) * 100.0).clamp(-440.0, 440.0) * scale
    ties = torch.tensor([[[1.0625, 1.1875, 17.0, 19.0, 0.0068359375, -1.0625, -17.0, 304.0]]] * 3)
    x = torch.cat([x, ties.double() * scale])
    got = impl.quantize(x, exponent)
    want = torch_codes(x, exponent)
    wrong = torch.nonzero(got != want)
    assert len(wrong) == 0, (
        f"{len(wrong)} codes differ from torch's float8_e4m3fn cast (round to nearest, ties to "
        f"even), e.g. x {x[tuple(wrong[0])].item()!r} at e {int(exponent[wrong[0][1]])}: "
        f"code {int(got[tuple(wrong[0])]):#x}, torch's {int(want[tuple(wrong[0])]):#x}"
    )


def test_task_1_each_head_is_scaled_by_its_own_exponent(impl):
    x = heads([1.0, 2.0], [1.0, 2.0])  # the same values in two heads
    codes = impl.quantize(x, torch.tensor([0, 3], dtype=torch.int32))
    want = torch_codes(x, torch.tensor([0, 3]))
    assert torch.equal(codes, want), (
        f"heads of exponents 0 and 3: expected codes {want.flatten().tolist()}, got "
        f"{codes.flatten().tolist()} (exponent[h] scales head h, the second-to-last dimension)"
    )


def test_task_1_a_value_past_the_range_clamps_to_448_never_nan(impl):
    x = torch.tensor([[[500.0, -1000.0, 448.0, 1e9]]], dtype=torch.float64)
    got = impl.quantize(x, torch.tensor([0], dtype=torch.int32)).flatten().tolist()
    want = [0x7E, 0xFE, 0x7E, 0x7E]
    assert got == want, (
        f"at e 0, 500, -1000, 448 and 1e9 clamp to +-448 (0x7E, 0xFE); a cast that does not "
        f"saturate makes NaN (0x7F) of what it cannot hold: expected {[hex(c) for c in want]}, got "
        f"{[hex(c) for c in got]}"
    )


def test_task_1_dequantize_is_every_codes_value_times_its_scale_exactly(impl):
    codes = torch.arange(256, dtype=torch.int64)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8).reshape(-1, 2, 1)  # NaN codes out
    exponent = torch.tensor([-9, 4], dtype=torch.int32)
    for dtype in (torch.float64, torch.float32):
        got = impl.dequantize(codes, exponent, dtype)
        assert got.dtype == dtype, f"dequantize(..., {dtype}) returned {got.dtype}"
        want = values_of(codes, exponent).to(dtype)
        wrong = torch.nonzero(got != want)
        assert len(wrong) == 0, (
            f"{len(wrong)} values differ from e4m3(code) * 2**e, e.g. code "
            f"{int(codes[tuple(wrong[0])]):#x} -> {got[tuple(wrong[0])].item()!r}, expected "
            f"{want[tuple(wrong[0])].item()!r}"
        )


def test_task_1_the_round_trip_error_is_at_most_one_sixteenth_for_normal_values(impl):
    torch.manual_seed(1)
    x = torch.randn(256, 2, 16, dtype=torch.float64) * torch.tensor([0.3, 30.0])[:, None]
    exponent = impl.scale_exponent(x.abs().amax(dim=(0, 2)).float())
    back = impl.dequantize(impl.quantize(x, exponent), exponent, torch.float64)
    normal = x.abs() >= 2.0**-6 * torch.pow(2.0, exponent.double())[:, None]
    error = ((back - x).abs() / x.abs())[normal].max().item()
    assert error <= 2.0**-4, f"relative error {error:.4f} past 2**-4 for a normal e4m3 value"


# ---- task 2: one block's write ----


def empty_block(num_heads: int = 2, stale: int = -64) -> tuple[torch.Tensor, torch.Tensor]:
    """A block of codes (BLOCK_SIZE, H, 2) and its exponents (H,), as a previous owner left it."""
    codes = torch.full((BLOCK_SIZE, num_heads, 2), 0x5A, dtype=torch.uint8)
    return codes, torch.full((num_heads,), stale, dtype=torch.int32)


def test_task_2_a_fresh_block_takes_each_heads_own_exponent(impl):
    block, exponents = empty_block()
    rows = heads([1.3, -0.5, 0.2, 3.1], [100.0, 7.0, -250.0, 0.5])
    assert impl.write_run(rows, block, exponents, 0) is None, "write_run returns nothing"
    assert exponents.tolist() == [-7, 0], (
        f"head 0's amax 3.1 -> e -7, head 1's amax 250 -> e 0 (one exponent per head, from that "
        f"head's values only); got {exponents.tolist()}"
    )
    want = torch_codes(rows, exponents)
    assert torch.equal(block[:2], want), (
        f"codes of the two rows: expected {want.tolist()}, got {block[:2].tolist()}"
    )
    assert values_of(block[:2], exponents)[:, 0].flatten().tolist() == [1.25, -0.5, 0.203125, 3.0]


def test_task_2_a_fresh_block_ignores_its_previous_owners_exponent(impl):
    block, exponents = empty_block(stale=9)  # an earlier sequence's large values
    rows = heads([3.1, -0.5, 1.3, 0.2], [0.02, 0.01, 0.005, 0.001])  # amax in the first row
    impl.write_run(rows, block, exponents, 0)
    assert exponents.tolist() == [-7, -14], (
        f"offset 0 starts the block: its exponents come from all the rows' values (amax 3.1 and "
        f"0.02, both in the first row), -7 and -14, whatever the block held before (9); got "
        f"{exponents.tolist()}"
    )
    assert torch.equal(block[:2], torch_codes(rows, exponents))


def test_task_2_a_grown_exponent_requantizes_the_older_codes(impl):
    block, exponents = empty_block()
    impl.write_run(heads([1.3, -0.5, 0.2, 3.1], [1.0, 2.0, 3.0, 1.5]), block, exponents, 0)
    older = values_of(block[:2], exponents)
    impl.write_run(heads([6.0, -1.0], [0.5, 0.25]), block, exponents, 2)
    assert exponents.tolist() == [-6, -7], (
        f"head 0: old -7, the new row's amax 6 needs -6 -> -6; head 1: old -7, the new row needs "
        f"only -9 -> stays -7 (an exponent never shrinks while the block is in use); got "
        f"{exponents.tolist()}"
    )
    now = values_of(block[:2], exponents)
    assert torch.equal(now, older), (
        f"the older tokens must still stand for the same values at the grown scale (halving a "
        f"code's value is exact here): they were {older[:, 0].flatten().tolist()}, now "
        f"{now[:, 0].flatten().tolist()}; requantize block[:offset] when a head's exponent grows"
    )
    assert values_of(block[2:3], exponents).flatten().tolist() == [6.0, -1.0, 0.5, 0.25]


def test_task_2_an_exponent_that_does_not_grow_leaves_the_older_codes_alone(impl):
    block, exponents = empty_block()
    impl.write_run(heads([1.3, -0.5, 0.2, 3.1], [1.0, 2.0, 3.0, 1.5]), block, exponents, 0)
    before = block[:2].clone()
    impl.write_run(heads([0.001, -1.0, 0.2, 0.3], [0.5, 0.25, 0.1, 0.1]), block, exponents, 2)
    assert exponents.tolist() == [-7, -7], f"no head's exponent grows; got {exponents.tolist()}"
    assert torch.equal(block[:2], before), "older codes changed though no exponent grew"
    new = heads([0.001, -1.0, 0.2, 0.3], [0.5, 0.25, 0.1, 0.1])
    assert torch.equal(block[2:4], torch_codes(new, exponents)), (
        "the new rows are coded at the block's exponents, not their own"
    )


def test_task_2_requantizing_rounds_what_falls_below_the_normal_range(impl):
    block, exponents = empty_block(num_heads=1)
    tiny = 2.0**-12 * 1.125  # at e -8 a normal code (1.125 * 2**-4); at e 0, 0 (below 2**-10)
    impl.write_run(torch.tensor([[[tiny, 1.0]]], dtype=torch.float64), block, exponents, 0)
    assert exponents.tolist() == [-8], f"amax 1.0 -> e -8; got {exponents.tolist()}"
    impl.write_run(torch.tensor([[[400.0, 0.0]]], dtype=torch.float64), block, exponents, 1)
    assert exponents.tolist() == [0], f"400 at offset 1 grows e -8 to 0; got {exponents.tolist()}"
    got = values_of(block[:1], exponents).flatten().tolist()
    want = [0.0, 1.0]  # 1.125 * 2**-12 at 2**0 is below e4m3's smallest subnormal, 2**-9
    assert got == want, (
        f"at e 0 the older value 1.125 * 2**-12 rounds to {want[0]} and 1.0 stays 1.0 (requantize "
        f"the values, rounding as quantize does); got {got}"
    )


# ---- task 3: the store and the gather of the torch backend ----

NUM_BLOCKS, NUM_HEADS, HEAD_DIM = 6, 2, 4


def empty_caches():
    codes = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype=torch.uint8)] * 2
    scales = [torch.full((NUM_BLOCKS, NUM_HEADS), -64, dtype=torch.int32)] * 2
    return [c.clone() for c in codes], [s.clone() for s in scales]


def step_values(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    size = (num_tokens, NUM_HEADS, HEAD_DIM)
    magnitude = torch.tensor([0.5, 40.0], dtype=torch.float64)[:, None]  # heads differ
    return torch.randn(size, dtype=torch.float64) * magnitude, torch.randn(size).double() * 3.0


def store(impl, caches, k, v, slots: list[int]) -> None:
    (k_cache, v_cache), (k_scales, v_scales) = caches
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    impl.store_kvcache_fp8(
        k, v, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales
    )


def stored(caches, which: int, slots: list[int]) -> torch.Tensor:
    """The values at these slots, (len(slots), H, D) float64, read with torch's own float8."""
    codes, scales = caches[0][which], caches[1][which]
    return torch.stack([values_of(codes[s // BLOCK_SIZE, s % BLOCK_SIZE][None],
                                  scales[s // BLOCK_SIZE])[0] for s in slots])  # fmt: skip


def first_difference(got: torch.Tensor, want: torch.Tensor, rows: list) -> str:
    """Where two (n, H, D) tensors first differ, naming the row (a slot or a position) and head."""
    i, h, d = torch.nonzero(got != want)[0].tolist()
    return f"at {rows[i]}, head {h}, d {d}: got {got[i, h, d].item()!r}, expected " + repr(
        want[i, h, d].item()
    )


def expected(rows_by_block: dict[int, torch.Tensor]) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Per block: its exponents and values when exactly these rows (offsets 0..) were written in
    one run, computed here with torch's own float8."""
    out = {}
    for block, rows in rows_by_block.items():
        amax = rows.abs().amax(dim=(0, 2))
        e = torch.ceil(torch.log2(amax / 448.0)).to(torch.int32)
        e = torch.where(amax > 448.0 * torch.pow(2.0, e.double()), e + 1, e)
        e = torch.where(amax <= 448.0 * torch.pow(2.0, (e - 1).double()), e - 1, e)
        out[block] = (e.tolist(), values_of(torch_codes(rows, e), e))
    return out


def test_task_3_a_step_of_several_sequences_and_padding_is_written_run_by_run(impl):
    caches = empty_caches()
    slots = [5, 6, 7, 8, -1, 12, 13, -1]  # seq A: block 1 at 1..3, block 2 at 0; seq B: block 3
    k, v = step_values(len(slots), seed=2)
    store(impl, caches, k, v, slots)
    for which, x in ((0, k), (1, v)):
        name = "kv"[which]
        want = expected({1: x[0:3], 2: x[3:4], 3: x[5:7]})  # block 1's slot 0 held nothing
        for block, (exps, _) in want.items():
            got = caches[1][which][block].tolist()
            assert got == exps, (
                f"{name}: block {block}'s exponents per head should come from the tokens written "
                f"there this step ({exps}); got {got} (runs of slots [5, 6, 7, 8, -1, 12, 13, -1] "
                f"with block_size 4: tokens 0..2 -> block 1, 3 -> block 2, 5..6 -> block 3)"
            )
        slots_written = [5, 6, 7, 8, 12, 13]
        got = stored(caches, which, slots_written)
        want_values = torch.cat([want[1][1], want[2][1], want[3][1]])
        assert torch.equal(got, want_values), (
            f"{name}: the value stored "
            f"{first_difference(got, want_values, [f'slot {s}' for s in slots_written])} "
            f"(each run's rows quantized at its block's exponents)"
        )
    untouched = [0, 4, 5]
    for block in untouched:
        assert caches[1][0][block].tolist() == [-64, -64], f"block {block} was written"
        assert not caches[0][0][block].any(), f"padding or nobody's slot wrote block {block}"


def test_task_3_decode_steps_append_to_a_block_and_grow_its_exponent(impl):
    caches = empty_caches()
    k, v = step_values(3, seed=3)
    store(impl, caches, k, v, [8, 9, 10])  # a prompt of 3 tokens into block 2
    before = stored(caches, 0, [8, 9, 10])
    k2, v2 = step_values(1, seed=4)
    k2[0, 0] *= 50.0  # head 0's new key is far larger than the prompt's
    store(impl, caches, k2, v2, [11])  # one decode token at offset 3
    e_prompt = expected({2: k})[2][0]
    e_new = expected({2: k2})[2][0]
    want = [max(a, b) for a, b in zip(e_prompt, e_new)]
    assert caches[1][0][2].tolist() == want, (
        f"after the decode token, block 2's K exponents are the larger of the prompt's "
        f"{e_prompt} and the token's {e_new} per head: {want}; got {caches[1][0][2].tolist()}"
    )
    assert want[0] > e_prompt[0], "the test means head 0's exponent to grow"
    after = stored(caches, 0, [8, 9, 10])
    step = torch.pow(2.0, torch.tensor(want, dtype=torch.float64))[:, None] * 2.0**-9
    assert torch.all((after - before).abs() <= step), (
        "the prompt's keys moved by more than half a step of the grown scale: requantize them"
    )


def test_task_3_a_run_is_written_at_once_each_value_rounded_once(impl):
    caches = empty_caches()
    k = torch.zeros(2, NUM_HEADS, HEAD_DIM, dtype=torch.float64)
    k[0, 0, 0] = 1.47 * 2.0**-9  # alone: e -17, 376.3 -> 384 (1.5 * 2**8), a code of 1.5 * 2**-9
    k[1, 0, 0] = 400.0  # the run's amax: e 0, where 1.47 * 2**-9 is a subnormal, 1 * 2**-9
    store(impl, caches, k, k.clone(), [4, 5])  # one prompt of 2 tokens: one run, block 1
    got = stored(caches, 0, [4])[0, 0, 0].item()
    assert caches[1][0][1, 0].item() == 0, "block 1, head 0: the run's amax 400 -> e 0"
    assert got == 2.0**-9, (
        f"slot 4 holds {got!r} (as {got / 2.0**-9} * 2**-9); expected 2**-9: the run's tokens are "
        f"quantized once, at the run's exponent (0). Written a token at a time, 1.47 * 2**-9 is "
        f"first coded at its own exponent as 1.5 * 2**-9, then requantized when the next token "
        f"grows the exponent: a tie, rounded to even, 2 * 2**-9. Call write_run once per run"
    )


def test_task_3_gather_dequantizes_the_tables_blocks_in_order(impl):
    torch.manual_seed(5)
    cache = torch.randint(0, 0x7F, (NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), dtype=torch.uint8)
    scales = torch.randint(-12, 4, (NUM_BLOCKS, NUM_HEADS), dtype=torch.int32)
    table = torch.tensor([4, 0, 3, -1, -1], dtype=torch.int32)
    got = impl.gather_kv_fp8(cache, scales, table, 10, torch.float64)
    want = torch.cat([values_of(cache[b], scales[b]) for b in (4, 0, 3)])[:10]
    assert got.shape == (10, NUM_HEADS, HEAD_DIM), f"expected (10, H, D), got {tuple(got.shape)}"
    assert got.dtype == torch.float64, f"gather returned {got.dtype}; asked for float64"
    wrong = torch.nonzero((got != want).any(dim=(1, 2))).flatten().tolist()
    assert not wrong, (
        f"table [4, 0, 3], 10 positions: positions {wrong} differ from blocks 4, 0, 3 dequantized "
        "each at its own exponents (scales[block], per head)"
    )


def test_task_3_what_the_store_wrote_the_gather_reads_back(impl):
    caches = empty_caches()
    k, v = step_values(6, seed=6)
    store(impl, caches, k, v, [20, 21, 22, 23, 0, 1])  # table [5, 0], 6 positions
    table = torch.tensor([5, 0], dtype=torch.int32)
    for which, x in ((0, k), (1, v)):
        got = impl.gather_kv_fp8(caches[0][which], caches[1][which], table, 6, torch.float64)
        want = stored(caches, which, [20, 21, 22, 23, 0, 1])
        assert got.shape == want.shape, f"gather gave {tuple(got.shape)}; expected (6, H, D)"
        assert torch.equal(got, want), (
            f"{'kv'[which]}: table [5, 0], the gather "
            f"{first_difference(got, want, [f'position {p}' for p in range(6)])} (what the store "
            f"wrote at slots 20-23 and 0-1, read with torch's own float8)"
        )
        error = (got - x).abs() - (x.abs() * 2.0**-4 + 2.0**-9 * 2.0**7)
        assert (error <= 0).all(), (
            f"{'kv'[which]}: a value read back is further from what was stored than e4m3 allows "
            f"(2**-4 of it, plus a loose 0.25 for subnormal codes): the store and the gather "
            f"agree with each other but not with the values"
        )


# ---- task 4: your store and gather inside the engine ----

ENGINE = dict(
    device="cpu", dtype="float64", block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=4,
    num_kv_blocks=48,
)  # fmt: skip
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [[(11 * i + 5 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 9, 4, 14, 6))]


def yours(impl) -> dict:
    return {"store_kvcache_fp8": impl.store_kvcache_fp8, "gather_kv_fp8": impl.gather_kv_fp8}


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    manager = llm.engine.manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks still held after every request"
    return [out.token_ids for out in outs]


@pytest.fixture(scope="module")
def reference_fp8(tiny_llama_folder):
    """The reference stage 13 engine's greedy tokens on an e4m3 pool."""
    return greedy(LLM(tiny_llama_folder, stage=13, kv_cache_dtype="fp8", **ENGINE))


def test_task_4_your_store_and_gather_give_the_reference_fp8_tokens(
    impl, tiny_llama_folder, reference_fp8
):
    llm = LLM(tiny_llama_folder, stage=13, kv_cache_dtype="fp8", components=yours(impl), **ENGINE)
    got = greedy(llm)
    assert got == reference_fp8, f"your pieces: {got}; the reference's e4m3 pool: {reference_fp8}"


def test_task_4_stage_11_on_your_dequantized_values_gives_the_same_tokens(
    impl, tiny_llama_folder, reference_fp8
):
    oracle = LLM(tiny_llama_folder, stage=11, **ENGINE)
    oracle.engine.runner.attention.store = DequantizedStore(store=impl.store_kvcache_fp8)
    got = greedy(oracle)
    assert got == reference_fp8, (
        f"stage 11 storing the values your codes stand for gives {got}; the fp8 engine "
        f"{reference_fp8}: the loss must be confined to quantize"
    )
