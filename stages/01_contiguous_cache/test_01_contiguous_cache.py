"""Stage 01's graded contract: slab bookkeeping, slab reads and writes, and the engine they make.

Run against any implementation with `pytest stages/01_contiguous_cache --impl ref|starter|yours.py`.
Tasks 1-3 test each piece alone, through its public API only. Task 4 plugs your pieces into the
reference engine (`LLM(stage=1, components=...)`) with three slabs for eight requests, so most
requests must wait for a slab, and demands exactly the tokens of stage 00's engine, which keeps
no cache at all.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.types import Sequence


def new_seq(num_tokens: int = 3) -> Sequence:
    return Sequence(list(range(num_tokens)), SamplingParams(max_tokens=8))


def assert_fields(what: str, got: dict, expected: dict) -> None:
    """Compare named values one by one, so a failure names the one that differs."""
    for name, want in expected.items():
        assert got[name] == want, f"{what}: {name} is {got[name]!r}, expected {want!r}"


# ---- task 1: handing out slabs ----


def test_task_1_a_fresh_manager_hands_out_slabs_0_1_2_in_order(impl):
    manager = impl.SlabManager(3)
    assert manager.num_slabs == 3, f"SlabManager(3).num_slabs is {manager.num_slabs}, expected 3"
    seqs = [new_seq() for _ in range(3)]
    for seq in seqs:
        answer = manager.allocate(seq)
        assert answer == 0, (
            f"allocate returned {answer!r}, expected 0: a fresh slab holds none of seq's K/V"
        )
    got = [seq.slab_id for seq in seqs]
    assert got == [0, 1, 2], f"three sequences admitted in turn got slabs {got}, expected [0, 1, 2]"


def test_task_1_can_allocate_and_num_free_slabs_follow_the_admissions(impl):
    manager = impl.SlabManager(2)
    for num_admitted, can_allocate in [(0, True), (1, True), (2, False)]:
        got = {
            "num_free_slabs": manager.num_free_slabs,
            "can_allocate": manager.can_allocate(new_seq()),
        }
        want = {"num_free_slabs": 2 - num_admitted, "can_allocate": can_allocate}
        assert_fields(f"with {num_admitted} of 2 slabs handed out", got, want)
        if can_allocate:
            manager.allocate(new_seq())


@pytest.mark.parametrize(("num_prompt_tokens", "max_num_tokens"), [(1, 2), (50, 114), (127, 128)])
def test_task_1_every_request_within_max_model_len_fits_a_slab(
    impl, num_prompt_tokens, max_num_tokens
):
    # the engine caps max_num_tokens at max_model_len, and a slab holds max_model_len tokens
    got = impl.SlabManager(1).check_fits(num_prompt_tokens, max_num_tokens)
    assert got is None, (
        f"check_fits({num_prompt_tokens}, {max_num_tokens}) returned {got!r}: a request of at "
        "most max_model_len tokens fits a slab, and a request that fits gets None"
    )


# ---- task 2: growth and giving slabs back ----


def test_task_2_allocate_answers_that_a_fresh_slab_holds_none_of_the_sequence(impl):
    manager = impl.SlabManager(2)
    first, again = new_seq(5), new_seq(5)
    got = manager.allocate(first)
    assert got == 0, (
        f"allocate returned {got!r}, expected 0: it answers how many of seq's tokens already "
        "have K/V stored (the scheduler makes that seq.num_cached_tokens), and a slab just "
        "handed out holds none of them"
    )
    manager.deallocate(first)
    got = manager.allocate(again)  # the slab the first one filled: its bytes are not again's
    assert got == 0, f"allocate of a returned slab answered {got!r}, expected 0"
    assert again.num_cached_tokens == 0, "allocate writes seq.slab_id only, never the count"


def test_task_2_a_sequence_holding_a_slab_can_always_append_and_nothing_moves(impl):
    manager = impl.SlabManager(2)
    seq, other = new_seq(5), new_seq()
    manager.allocate(seq)
    manager.allocate(other)  # the pool is exhausted now; seq's own slab still has room
    seq.num_cached_tokens = 5
    for step in range(40):  # forty decode steps: the slab already has room for all of them
        assert manager.can_append(seq) is True, f"decode step {step}, with no slab free"
        manager.may_append(seq)
        seq.append_token(7)
    got = {
        "seq.slab_id": seq.slab_id,
        "seq.num_cached_tokens": seq.num_cached_tokens,
        "num_free_slabs": manager.num_free_slabs,
    }
    want = {"seq.slab_id": 0, "seq.num_cached_tokens": 5, "num_free_slabs": 0}
    assert_fields("after 40 decode steps", got, want)


def test_task_2_deallocate_returns_the_slab_and_writes_nothing_else_of_the_sequence(impl):
    manager = impl.SlabManager(1)
    seq = new_seq(5)
    manager.allocate(seq)
    seq.num_cached_tokens = 5  # the scheduler sets this after each step
    manager.deallocate(seq)
    assert seq.slab_id is None, f"after deallocate, seq.slab_id is {seq.slab_id}, expected None"
    got = seq.num_cached_tokens
    assert got == 5, (
        f"after deallocate, seq.num_cached_tokens is {got}, expected 5 as it was: the scheduler "
        "keeps that count (it zeroes it itself); a manager writes only seq.slab_id"
    )
    got = manager.num_free_slabs
    assert got == 1, f"after deallocate, num_free_slabs is {got} of 1: the slab must be free again"
    assert manager.can_allocate(new_seq()), "the freed slab must be admissible"


def test_task_2_a_returned_slab_goes_to_the_next_sequence(impl):
    manager = impl.SlabManager(2)
    a, b, c = new_seq(), new_seq(), new_seq()
    manager.allocate(a)
    manager.allocate(b)
    manager.deallocate(a)  # slab 0 is the only free one now
    manager.allocate(c)
    got = {"b.slab_id": b.slab_id, "c.slab_id": c.slab_id, "num_free_slabs": manager.num_free_slabs}
    assert_fields(
        "after a, b in, a out, c in", got, {"b.slab_id": 1, "c.slab_id": 0, "num_free_slabs": 0}
    )
    manager.deallocate(b)
    manager.deallocate(c)
    got = manager.num_free_slabs
    assert got == 2, f"after b and c are deallocated too, num_free_slabs is {got}, expected 2"


def test_task_2_no_interleaving_of_admissions_and_releases_hands_one_slab_to_two_sequences(impl):
    rng = random.Random(0)
    manager = impl.SlabManager(4)
    holding: list[Sequence] = []
    for _ in range(300):
        if holding and (rng.random() < 0.5 or not manager.can_allocate(new_seq())):
            manager.deallocate(holding.pop(rng.randrange(len(holding))))
        else:
            seq = new_seq()
            manager.allocate(seq)
            holding.append(seq)
        slab_ids = [seq.slab_id for seq in holding]
        assert len(set(slab_ids)) == len(slab_ids), f"two sequences share a slab: {slab_ids}"
        assert set(slab_ids) <= {0, 1, 2, 3}, f"slab ids {slab_ids} outside 0..3 of 4 slabs"
        got = manager.num_free_slabs
        assert got == 4 - len(holding), (
            f"num_free_slabs is {got} while {len(holding)} of 4 slabs are held ({slab_ids})"
        )


# ---- task 3: writing and reading a slab ----

NUM_SLABS, MAX_LEN, NUM_KV_HEADS, HEAD_DIM = 3, 16, 2, 4


def random_cache() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    shape = (NUM_SLABS, MAX_LEN, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, dtype=torch.float64, generator=generator)


def random_values(num_tokens: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, dtype=torch.float64, generator=generator)


@pytest.mark.parametrize(("start", "num_tokens"), [(0, 5), (6, 5), (5, 1), (15, 1), (0, MAX_LEN)])
def test_task_3_store_writes_exactly_the_given_positions_of_one_slab(impl, start, num_tokens):
    cache, values = random_cache(), random_values(num_tokens)
    expected = cache.clone()
    for i in range(num_tokens):  # token i of values goes to position start + i of slab 1
        expected[1, start + i] = values[i]
    impl.store_slab(cache, 1, start, values)
    if torch.equal(cache, random_cache()):
        pytest.fail("store_slab changed nothing: write into the cache it is given, in place")
    wrong = sorted({(s, p) for s, p, *_ in (cache != expected).nonzero().tolist()})
    assert not wrong, (
        f"store_slab(cache, 1, {start}, {num_tokens} tokens) must write slab 1 at positions "
        f"{start} .. {start + num_tokens - 1} and nothing else; (slab, position) pairs that "
        f"differ: {wrong[:6]}"
    )


def test_task_3_store_writes_through_a_view_of_the_engines_whole_cache(impl):
    kv = torch.zeros(2, 2, NUM_SLABS, MAX_LEN, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float64)
    values = random_values(4)
    impl.store_slab(kv[1, 0], 2, 3, values)  # layer 0's values, as the engine calls it
    assert torch.equal(kv[1, 0, 2, 3:7], values), "the write must land in the engine's tensor"
    kv[1, 0, 2, 3:7] = 0
    assert not kv.any(), "nothing outside slab 2, positions 3..6 of layer 0's values may change"


@pytest.mark.parametrize("end", [1, 7, MAX_LEN])
def test_task_3_load_returns_positions_zero_to_end_of_one_slab_in_order(impl, end):
    cache = random_cache()
    loaded = impl.load_slab(cache, 2, end)
    got = (tuple(loaded.shape), loaded.dtype)
    want = ((end, NUM_KV_HEADS, HEAD_DIM), torch.float64)
    assert got == want, f"load_slab(cache, 2, {end}) gave (shape, dtype) {got}, expected {want}"
    for p in range(end):
        assert torch.equal(loaded[p], cache[2, p]), f"position {p} of slab 2"


@pytest.mark.parametrize("prompt_len", [1, 4, 9])
def test_task_3_a_prefill_then_decode_writes_read_back_as_one_history(impl, prompt_len):
    cache = torch.zeros(NUM_SLABS, MAX_LEN, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float64)
    other = random_values(MAX_LEN, seed=9)
    impl.store_slab(cache, 0, 0, other)  # a neighbour's history, which must stay out of ours
    history = random_values(MAX_LEN - 1, seed=2)
    impl.store_slab(cache, 1, 0, history[:prompt_len])  # prefill: the whole prompt from 0
    for p in range(prompt_len, MAX_LEN - 1):  # decode: one token per step, at its own position
        impl.store_slab(cache, 1, p, history[p : p + 1])
        torch.testing.assert_close(impl.load_slab(cache, 1, p + 1), history[: p + 1])
    torch.testing.assert_close(impl.load_slab(cache, 1, MAX_LEN - 1), history, rtol=0, atol=0)
    torch.testing.assert_close(impl.load_slab(cache, 0, MAX_LEN), other, rtol=0, atol=0)


def test_task_3_a_slab_holds_max_model_len_positions(impl):
    cache = random_cache()
    history = random_values(MAX_LEN)
    impl.store_slab(cache, 0, 0, history[:-1])
    impl.store_slab(cache, 0, MAX_LEN - 1, history[-1:])  # the very last position
    torch.testing.assert_close(impl.load_slab(cache, 0, MAX_LEN), history, rtol=0, atol=0)
    torch.testing.assert_close(cache[1:], random_cache()[1:], rtol=0, atol=0)


# ---- task 4: your pieces in the engine ----

MAX_MODEL_LEN = 96
ENGINE_SLABS = 3
PROMPT_LENGTHS = [1, 3, 4, 5, 8, 9, 17, 60]  # eight requests for three slabs


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight prompts of different lengths; each generates 32 to 46 greedy tokens.

    Different max_tokens make the requests finish at different steps, so a freed slab is handed
    to a waiting request while the others are mid-decode. The 60-token prompt runs into
    max_model_len (96) and stops there, after 36 tokens, at the far end of its slab.
    """
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]
    params = [SamplingParams(max_tokens=32 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def build(folder: str, stage: int, components=None, **options) -> LLM:
    return LLM(
        folder,
        stage=stage,
        device="cpu",
        dtype="float64",
        components=components,
        max_model_len=MAX_MODEL_LEN,
        **options,
    )


@pytest.fixture(scope="module")
def stage_00_tokens(tiny_llama_folder):
    """The oracle: stage 00's engine, which recomputes every token at every step."""
    prompts, params = requests()
    outputs = build(tiny_llama_folder, stage=0).generate(prompts, params, use_tqdm=False)
    return [out.token_ids for out in outputs]


PIECES = {
    "your-slab-manager": ("SlabManager",),
    "your-store-and-load": ("store_slab", "load_slab"),
    "all-three-yours": ("SlabManager", "store_slab", "load_slab"),
}


@pytest.mark.parametrize("names", PIECES.values(), ids=PIECES.keys())
def test_task_4_the_engine_with_your_pieces_reproduces_stage_00_greedy_tokens(
    impl, tiny_llama_folder, stage_00_tokens, names
):
    components = {name: getattr(impl, name) for name in names}
    llm = build(tiny_llama_folder, stage=1, components=components, num_slabs=ENGINE_SLABS)
    prompts, params = requests()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outputs, stage_00_tokens)):
        assert out.token_ids == expected, f"request {i} ({PROMPT_LENGTHS[i]}-token prompt)"


def test_task_4_running_sequences_hold_distinct_slabs_and_the_rest_wait_their_turn(
    impl, tiny_llama_folder
):
    components = {
        "SlabManager": impl.SlabManager,
        "store_slab": impl.store_slab,
        "load_slab": impl.load_slab,
    }
    llm = build(tiny_llama_folder, stage=1, components=components, num_slabs=ENGINE_SLABS)
    engine, scheduler = llm.engine, llm.engine.scheduler
    seqs = [engine.add_request(p, sp) for p, sp in zip(*requests())]
    num_steps_with_a_queue = 0
    while engine.has_unfinished():  # what LLM.generate does, one step at a time
        engine.step()
        slab_ids = [seq.slab_id for seq in scheduler.running]
        assert None not in slab_ids and len(set(slab_ids)) == len(slab_ids), (
            f"running sequences hold slabs {slab_ids}: each needs one of its own"
        )
        assert len(slab_ids) <= ENGINE_SLABS, f"{len(slab_ids)} running on {ENGINE_SLABS} slabs"
        got = engine.manager.num_free_slabs
        assert got == ENGINE_SLABS - len(slab_ids), (
            f"num_free_slabs is {got} while the running sequences hold {slab_ids}"
        )
        num_steps_with_a_queue += bool(scheduler.waiting)
    assert all(seq.slab_id is None for seq in seqs), "a finished sequence must give its slab back"
    got = engine.manager.num_free_slabs
    assert got == ENGINE_SLABS, f"after every request finished, {got} of {ENGINE_SLABS} slabs free"
    assert num_steps_with_a_queue > 0, "with 3 slabs for 8 requests, some must have waited"
