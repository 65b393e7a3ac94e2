"""What admitting a request promises its batch-mates, at every stage: whatever SamplingParams
validation accepts runs (clamped once, at admission, to what every sampler can hold) and changes
no other request's tokens; and a generate call returns with nothing left in flight.

Tiny random float64 checkpoint, prompts as ids: a different batch cannot flip a greedy token, and
a seeded request draws the same tokens in any batch (stage 04 from its own generator, stage 11
and 12 from a hash of seed and position), so the neighbours' tokens must not move at all.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.sampling import MAX_TEMPERATURE, SEED_LIMIT, clamp
from nanoserve.stages import implemented_stages

ENGINE = dict(device="cpu", dtype="float64", block_size=4, max_model_len=24, num_kv_blocks=96)
PROMPTS = [[5, 9, 2], [17, 3, 8, 1, 4], [40, 41]]  # neighbour, odd request, neighbour
NEIGHBOURS = [
    SamplingParams(max_tokens=5, ignore_eos=True),  # greedy
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=5, ignore_eos=True),
]
HUGE = 10**20  # an int no int64 holds


@pytest.fixture(scope="module")
def folder(tiny_checkpoints):
    return str(tiny_checkpoints["llama"][0])


@pytest.fixture(scope="module")
def llms(folder):
    """One engine per stage the property runs at, and each neighbour's tokens without the odd
    request: {stage: (llm, [tokens of neighbour 1, tokens of neighbour 2])}."""
    out = {}
    for stage in (4, 7, 11, 12):
        llm = LLM(folder, stage=stage, **ENGINE)
        alone = llm.generate([PROMPTS[0], PROMPTS[2]], NEIGHBOURS, use_tqdm=False)
        out[stage] = (llm, [o.token_ids for o in alone])
    return out


def neighbours_with(llm: LLM, odd: SamplingParams) -> list[list[int]]:
    """The neighbours' tokens with the odd request batched between them."""
    params = [NEIGHBOURS[0], odd, NEIGHBOURS[1]]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert not llm.engine.has_unfinished(), "generate returned with work left in the engine"
    return [outs[0].token_ids, outs[2].token_ids]


# ---- the clamp ----


def test_clamp_leaves_params_every_sampler_holds_as_they_are():
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=2**64 - 1, logprobs=5)
    assert clamp(params, vocab_size=256) == params


def test_clamp_gives_each_value_no_sampler_holds_its_meaning():
    vocab = 256
    assert clamp(SamplingParams(top_k=HUGE), vocab).top_k is None  # no limit
    assert clamp(SamplingParams(top_k=vocab), vocab).top_k is None
    assert clamp(SamplingParams(top_k=vocab - 1), vocab).top_k == vocab - 1
    tiny = clamp(SamplingParams(temperature=1e-300, top_k=5), vocab)
    assert tiny.temperature == 0.0 and tiny.is_greedy  # the limit of T -> 0: argmax
    assert clamp(SamplingParams(temperature=1e300), vocab).temperature == MAX_TEMPERATURE
    assert clamp(SamplingParams(temperature=1.0, top_p=1e-300), vocab).top_p == 0.5 / vocab
    assert clamp(SamplingParams(logprobs=20), vocab_size=16).logprobs == 16


ODD_PARAMS = [
    dict(temperature=1.0, top_k=HUGE),
    dict(temperature=1.0, top_k=2**63),
    dict(temperature=1e300),
    dict(temperature=1e300, top_k=3, logprobs=20),
    dict(temperature=1e-300),
    dict(temperature=1.0, top_p=1e-300),
    dict(temperature=1.0, seed=SEED_LIMIT - 1, max_tokens=HUGE, stop_token_ids=[HUGE]),
]


@pytest.mark.parametrize("stage", (4, 11, 12))
@pytest.mark.parametrize("odd", ODD_PARAMS, ids=repr)
def test_a_request_with_extreme_params_leaves_its_neighbours_tokens_alone(llms, stage, odd):
    llm, alone = llms[stage]
    assert neighbours_with(llm, SamplingParams(**{"max_tokens": 3, **odd})) == alone


@pytest.mark.parametrize("odd", [dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-300)])
def test_a_temperature_or_top_p_too_small_for_float32_draws_the_greedy_tokens(llms, odd):
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    tiny = SamplingParams(max_tokens=4, ignore_eos=True, **odd)
    for stage, (llm, _) in llms.items():
        (want,), (got,) = (llm.generate([PROMPTS[1]], p, use_tqdm=False) for p in (greedy, tiny))
        assert got.token_ids == want.token_ids, f"stage {stage}"


# ---- the property: any accepted params, at stages 04, 07, 11 and 12 ----

BIG_INTS = st.integers(1, 2**80)
accepted_params = st.builds(
    SamplingParams,
    temperature=st.just(0.0) | st.floats(0.0, 1e308, allow_nan=False, allow_infinity=False),
    top_k=st.none() | BIG_INTS,
    top_p=st.floats(0.0, 1.0, exclude_min=True, allow_nan=False),
    max_tokens=st.integers(1, 4) | BIG_INTS,
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, 300) | st.integers(0, 2**80), max_size=3),
    seed=st.none() | st.integers(0, SEED_LIMIT - 1),
    n=st.integers(1, 3),
    logprobs=st.none() | st.integers(0, 20),
)


@pytest.mark.parametrize("stage", (4, 7, 11, 12))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(odd=accepted_params)
def test_no_accepted_params_change_a_neighbours_tokens(llms, stage, odd):
    llm, alone = llms[stage]
    assert neighbours_with(llm, odd) == alone


# ---- nothing left in flight ----


def stops_at_each_token(token_ids: list[int]) -> list[tuple[SamplingParams, list[int]]]:
    """(params that stop at a token of token_ids, the tokens up to it) for each distinct token."""
    firsts = sorted({token_ids.index(t) for t in token_ids})
    return [
        (SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[token_ids[i]]),
         token_ids[: i + 1])
        for i in firsts
    ]  # fmt: skip


@pytest.mark.parametrize("stage", [s.number for s in implemented_stages()])
def test_generate_returns_with_the_engine_idle_at_every_stage(folder, stage):
    llm = LLM(folder, stage=stage, **ENGINE)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    (first,) = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    for stops, want in stops_at_each_token(first.token_ids):  # the call ends on a stop token
        (alone,) = llm.generate([PROMPTS[1]], stops, use_tqdm=False)
        assert alone.token_ids == want
        assert not llm.engine.has_unfinished(), f"work left after a stop at token {len(want)}"
    stops, want = stops_at_each_token(first.token_ids)[-1]
    outs = llm.generate(PROMPTS, [greedy, stops, stops], use_tqdm=False)
    assert outs[1].token_ids == want and not llm.engine.has_unfinished()


@pytest.mark.parametrize("stage", (11, 12))
def test_the_step_that_finishes_the_last_request_on_a_stop_token_leaves_nothing_in_flight(
    folder, stage
):
    engine = LLM(folder, stage=stage, **ENGINE).engine
    first = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for stops, want in stops_at_each_token(first.completion_token_ids):
        seq = engine.add_request(PROMPTS[1], stops)
        finished = []
        while not finished:
            finished = engine.step()
        assert finished == [seq] and seq.completion_token_ids == want
        assert not engine.has_unfinished() and engine.runner.in_flight is None, (
            f"a stop at token {len(want)}: the step after it, all of it discarded, is still in "
            "flight"
        )
        assert engine.manager.num_free_blocks == engine.manager.num_blocks
        assert not engine.runner.state.rows
