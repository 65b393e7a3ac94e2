"""A call owns its requests: however `generate` or `stream` ends (an error, an interrupt, a
stream closed early), nothing is left queued or holding memory, and the next call's tokens are
those of a fresh engine."""

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.testing import ENGINE_MAX_MODEL_LEN, engine_requests

NUM_BLOCKS = 40


def paged_llm(folder) -> LLM:
    return LLM(
        str(folder),
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=ENGINE_MAX_MODEL_LEN,
    )


def tokens(llm: LLM, requests) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(*requests, use_tqdm=False)]


@pytest.fixture(scope="module")
def folder(tiny_checkpoints):
    return tiny_checkpoints["llama"][0]


@pytest.fixture(scope="module")
def fresh_tokens(folder):
    return tokens(paged_llm(folder), engine_requests())


def assert_clean_and_serving(llm: LLM, fresh_tokens) -> None:
    engine = llm.engine
    assert engine.scheduler.is_finished(), "requests were left queued or running"
    assert engine.manager.num_free_blocks == NUM_BLOCKS, "blocks were left held"
    engine.manager.check_invariants()
    assert tokens(llm, engine_requests()) == fresh_tokens


def interrupt_on_call(monkeypatch, obj, name: str, when) -> None:
    """Make obj.name raise KeyboardInterrupt on the first call for which when(*args) is true."""
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            monkeypatch.setattr(obj, name, original)  # once
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


def test_an_interrupt_between_steps_aborts_the_calls_requests(folder, fresh_tokens, monkeypatch):
    llm = paged_llm(folder)
    steps = iter(range(1000))
    interrupt_on_call(monkeypatch, llm.engine, "step", lambda: next(steps) == 5)
    with pytest.raises(KeyboardInterrupt):
        tokens(llm, engine_requests())
    assert_clean_and_serving(llm, fresh_tokens)


@pytest.mark.parametrize("in_prefill", [True, False], ids=["prefill", "decode"])
def test_an_interrupt_inside_a_forward_pass_leaves_nothing_behind(
    folder, fresh_tokens, monkeypatch, in_prefill
):
    llm = paged_llm(folder)
    attention = llm.engine.runner.attention
    layer_calls = iter(range(10_000))

    def inside_the_step(layer_id, q, k, v, scale, metadata):  # layer 1: layer 0 already wrote
        return metadata.is_prefill == in_prefill and layer_id == 1 and next(layer_calls) > 2

    interrupt_on_call(monkeypatch, attention, "forward", inside_the_step)
    with pytest.raises(KeyboardInterrupt):
        tokens(llm, engine_requests())
    assert_clean_and_serving(llm, fresh_tokens)


def test_an_exception_from_the_model_propagates_and_the_llm_is_clean(
    folder, fresh_tokens, monkeypatch
):
    llm = paged_llm(folder)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(llm.engine.runner, "run", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tokens(llm, engine_requests())
    monkeypatch.undo()
    assert_clean_and_serving(llm, fresh_tokens)


def test_a_stream_closed_after_two_pieces_aborts_its_request(folder, fresh_tokens):
    llm = paged_llm(folder)
    pieces = llm.stream([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    next(pieces), next(pieces)
    assert llm.engine.manager.num_free_blocks < NUM_BLOCKS  # it holds blocks while it runs
    pieces.close()
    assert_clean_and_serving(llm, fresh_tokens)


def test_a_prefill_undone_by_an_interrupt_is_recomputed_for_a_request_of_another_call(
    folder, fresh_tokens, monkeypatch
):
    llm = paged_llm(folder)
    other = llm.stream([9, 8, 7, 6, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    interrupt_on_call(
        monkeypatch,
        llm.engine.runner.attention,
        "forward",
        lambda layer_id, *rest: layer_id == 1 and rest[-1].is_prefill,
    )
    with pytest.raises(KeyboardInterrupt):
        next(other)  # the stream's own prefill is interrupted: its request goes back to waiting
    assert not llm.engine.scheduler.running and llm.engine.manager.num_free_blocks == NUM_BLOCKS
    other.close()
    assert_clean_and_serving(llm, fresh_tokens)
