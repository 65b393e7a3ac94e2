"""Offline sampling options beyond the sampler's own: stop strings, n completions, logprobs.

A tiny random float64 model with a character tokenizer (`save_tiny_chat_model`): one token per
character, so a two-character stop string spans two tokens, and the transformers model it was
saved from is the logprob oracle (log_softmax of its logits, float64).
"""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.serving.limits import ServerLimits
from nanoserve.testing import save_tiny_chat_model, tiny_hf_model

ENGINE = dict(device="cpu", dtype="float64", max_model_len=96, block_size=4, num_kv_blocks=160)
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def llms(folder):
    """One LLM per stage these tests compare: 04 (host sampler), 09, 11 (device sampler)."""
    return {stage: LLM(folder, stage=stage, **ENGINE) for stage in (4, 9, 11)}


def generate(llm: LLM, prompt=PROMPT, **sampling):
    (out,) = llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
    return out


def tokens_until(llm: LLM, token_ids: list[int], stop: str) -> int:
    """How many of token_ids it takes for their text to contain stop."""
    decode = llm.tokenizer.decode
    return next(
        k
        for k in range(1, len(token_ids) + 1)
        if stop in decode(token_ids[:k], skip_special_tokens=True)
    )


# ---- validation ----


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", [""]),
        ("stop", [3]),
        ("stop", ["a"] * 17),
        ("stop", ["x" * 257]),
        ("stop", 5),
        ("include_stop_str_in_output", 1),
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 2.0),
        ("logprobs", True),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} ="):
        SamplingParams(**{field: value})


def test_stop_takes_one_string_or_many_and_keeps_a_tuple():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def test_the_stop_limits_are_the_servers_defaults():
    from nanoserve.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS

    limits = ServerLimits()
    assert (limits.max_stop_strings, limits.max_stop_chars) == (MAX_STOP_STRINGS, MAX_STOP_CHARS)
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)  # the limits themselves pass


def test_the_engine_refuses_n_above_one_as_llm_expands_it(llms):
    with pytest.raises(ValueError, match="n = 2"):
        llms[4].engine.add_request([1, 2, 3], SamplingParams(n=2))


# ---- stop strings ----


@pytest.mark.parametrize("stage", [4, 11])
def test_a_stop_string_over_two_tokens_cuts_the_text_and_the_tokens(llms, stage):
    llm = llms[stage]
    whole = generate(llm, max_tokens=40)
    stop = whole.text[9:11]
    k = tokens_until(llm, whole.token_ids, stop)
    assert llm.tokenizer.decode(whole.token_ids[k - 1 : k]) != stop, "one token must not hold it"
    got = generate(llm, max_tokens=40, stop=[stop, "never seen \x01"])
    assert got.finish_reason == "stop"
    assert got.text == whole.text[: whole.text.index(stop)]
    assert got.token_ids == whole.token_ids[:k]


@pytest.mark.parametrize("stage", [4, 11])
def test_include_stop_str_in_output_keeps_the_stop_string(llms, stage):
    llm = llms[stage]
    whole = generate(llm, max_tokens=40)
    stop = whole.text[12:15]
    cut = whole.text.index(stop) + len(stop)
    got = generate(llm, max_tokens=40, stop=stop, include_stop_str_in_output=True)
    assert (got.text, got.finish_reason) == (whole.text[:cut], "stop")


def test_a_stop_string_never_reached_changes_nothing(llms):
    whole = generate(llms[11], max_tokens=20)
    got = generate(llms[11], max_tokens=20, stop=["\x01\x02"])
    assert (got.text, got.token_ids, got.finish_reason) == (
        whole.text,
        whole.token_ids,
        whole.finish_reason,
    )


def test_stream_stops_at_a_stop_string_as_generate_does(llms):
    llm = llms[11]
    whole = generate(llm, max_tokens=40)
    params = SamplingParams(max_tokens=40, stop=whole.text[9:11])
    want = generate(llm, max_tokens=40, stop=whole.text[9:11])
    pieces = llm.stream(PROMPT, params)
    streamed = []
    while True:
        try:
            streamed.append(next(pieces))
        except StopIteration as done:
            out = done.value
            break
    assert "".join(streamed) == want.text == out.text
    assert out.token_ids == want.token_ids and out.finish_reason == "stop"


# ---- n ----


@pytest.mark.parametrize("stage", [4, 11])
def test_n_seeded_completions_differ_and_reproduce(llms, stage):
    llm = llms[stage]
    params = dict(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    first = generate(llm, n=3, **params)
    again = generate(llm, n=3, **params)
    texts = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len(set(map(tuple, texts))) == 3, "children draw from different seeds"
    assert texts == [c.token_ids for c in again.outputs]
    assert texts[0] == generate(llm, **params).token_ids, "child 0 keeps the request's seed"


def test_n_greedy_gives_n_equal_completions(llms):
    one = generate(llms[11], max_tokens=15)
    got = generate(llms[11], max_tokens=15, n=3)
    assert [c.token_ids for c in got.outputs] == [one.token_ids] * 3
    assert (got.text, got.token_ids) == (one.text, one.token_ids), "the first, as before"


def test_n_with_several_prompts_keeps_their_order(llms):
    prompts = ["Hi", "Hello there, a longer one"]
    alone = [generate(llms[4], p, max_tokens=8).token_ids for p in prompts]
    params = SamplingParams(max_tokens=8, n=2)
    outs = llms[4].generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[a, a] for a in alone]


def test_n_children_share_the_prompts_cached_blocks(folder):
    llm = LLM(folder, stage=7, **ENGINE)
    prompt = list(range(1, 30))  # 7 full blocks of 4
    llm.generate([prompt], SamplingParams(max_tokens=4, n=3), use_tqdm=False)
    assert llm.engine.manager.num_hit_tokens == 2 * 28, "children 1 and 2 reuse 7 blocks each"


# ---- logprobs ----


def oracle_logprobs(prompt_ids: list[int], token_ids: list[int]) -> list[torch.Tensor]:
    """log_softmax of the transformers model's float64 logits before each generated token (its
    rotary tables are computed otherwise than nanoserve's: they agree to about 1e-8)."""
    model = tiny_hf_model("llama", 0)  # the weights save_tiny_chat_model saved
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0]
    start = len(prompt_ids) - 1
    return [logits[start + t].log_softmax(-1) for t in range(len(token_ids))]


def test_greedy_logprobs_are_the_models_log_softmax_and_its_top_k(llms):
    out = generate(llms[4], max_tokens=10, logprobs=5, ignore_eos=True)
    (completion,) = out.outputs
    assert completion.logprobs is not None and len(completion.logprobs) == 10
    want = oracle_logprobs(out.prompt_token_ids, out.token_ids)
    for token_id, entry, lp in zip(out.token_ids, completion.logprobs, want):
        top = lp.topk(5)
        assert list(entry) == top.indices.tolist(), "the sampled (argmax) token first, then 4"
        assert entry[token_id].rank == 1 and token_id == int(lp.argmax())
        for i, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[i].logprob == pytest.approx(value, abs=1e-6)
        assert sum(math.exp(e.logprob) for e in entry.values()) <= 1 + 1e-12
    total = sum(entry[t].logprob for t, entry in zip(out.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(total)


def test_sampled_logprobs_are_the_raw_distributions_not_the_tempered_one(llms):
    out = generate(llms[11], max_tokens=8, logprobs=2, temperature=1.7, top_k=40, seed=3)
    want = oracle_logprobs(out.prompt_token_ids, out.token_ids)
    for token_id, entry, lp in zip(out.token_ids, out.outputs[0].logprobs, want):
        assert entry[token_id].logprob == pytest.approx(lp[token_id].item(), abs=1e-6)
        assert entry[token_id].rank == 1 + int((lp > lp[token_id]).sum())
        assert set(lp.topk(2).indices.tolist()) <= set(entry), "the top 2, and the sampled one"


def test_greedy_logprobs_agree_across_stages_04_09_and_11(llms):
    prompts = ["Hi", "Hello there, a longer one", "abc"]
    params = SamplingParams(max_tokens=12, logprobs=3, ignore_eos=True)
    runs = {s: llm.generate(prompts, params, use_tqdm=False) for s, llm in llms.items()}
    for outs in zip(*runs.values()):
        want = outs[0].outputs[0]
        for other in outs[1:]:
            got = other.outputs[0]
            assert got.token_ids == want.token_ids
            for a, b in zip(got.logprobs, want.logprobs):
                assert list(a) == list(b)
                assert [x.logprob for x in a.values()] == pytest.approx(
                    [x.logprob for x in b.values()], abs=1e-9
                )


def test_logprobs_zero_gives_the_sampled_token_alone_and_none_gives_none(llms):
    out = generate(llms[11], max_tokens=5, logprobs=0)
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in out.token_ids]
    plain = generate(llms[11], max_tokens=5)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_logprobs_are_cut_with_the_tokens_at_a_stop_string(llms):
    whole = generate(llms[11], max_tokens=40)
    stop = whole.text[9:11]
    got = generate(llms[11], max_tokens=40, stop=stop, logprobs=1)
    assert len(got.outputs[0].logprobs) == len(got.token_ids)


def test_stage11_computes_no_logprobs_when_no_row_asks(llms, monkeypatch):
    import nanoserve.logprobs

    def refuse(*args, **kwargs):
        raise AssertionError("logprobs computed for a batch that asked for none")

    monkeypatch.setattr(nanoserve.logprobs, "logprob_tensors", refuse)
    assert len(generate(llms[11], max_tokens=6, ignore_eos=True).token_ids) == 6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stage11_on_cuda_brings_logprobs_back_with_its_tokens(folder, llms, dtype):
    cuda = LLM(folder, stage=11, **{**ENGINE, "device": "cuda", "dtype": dtype})
    prompts = ["Hi", "Hello there, a longer one", "abc"]
    params = SamplingParams(max_tokens=12, logprobs=4, ignore_eos=True)
    want = llms[4].generate(prompts, params, use_tqdm=False)
    got = cuda.generate(prompts, params, use_tqdm=False)
    tolerance = 1e-3 if dtype == "float32" else 0.1
    for w, g in zip(want, got):
        assert len(g.outputs[0].logprobs) == len(g.token_ids) == 12
        for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)):
            entry = g.outputs[0].logprobs[i]
            values = [x.logprob for x in entry.values()]
            assert values == sorted(values, reverse=True) and values[0] <= 0
            assert entry[b].rank == 1, "greedy: the sampled token is the most likely"
            if a != b:  # bf16 may diverge: the rest compares other prefixes
                break
            assert entry[b].logprob == pytest.approx(
                w.outputs[0].logprobs[i][a].logprob, abs=tolerance
            )
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=1, n=2)
    (twice,) = cuda.generate(["Hi"], seeded, use_tqdm=False)
    assert [c.token_ids for c in twice.outputs] == [
        c.token_ids for c in cuda.generate(["Hi"], seeded, use_tqdm=False)[0].outputs
    ]
    assert all(len(c.logprobs) == 8 for c in twice.outputs)
    plain = cuda.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in plain] == [6, 6, 6] and plain[0].logprobs is None
