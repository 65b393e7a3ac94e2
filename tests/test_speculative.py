"""Stage 12 on a CPU: whatever the proposer guesses, greedy tokens are stage 11's; the verdict
draws from the target's distribution (chi-square); rollback leaves nothing behind under chunked
prefill, prefix caching, preemption and abort; the device batch mirrors the managers' tables.
Float64 tiny checkpoints, as the rest of the equivalence chain.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.speculation.proposers import speculative_method
from nanoserve.samplers.device_sampler import SamplingTensors
from nanoserve.samplers.speculative_sampler import verify
from nanoserve.testing import engine_requests

from .conftest import TINY_FAMILIES
from .test_device_sampler import chi_square_p_value
from .test_equivalence import greedy_tokens, random_prompts
from .test_overlap import CHUNKED_PREFIX_OPTIONS, PARAMS_14, SHARED_PREFIXES
from .test_tensor_parallel import CPU, GREEDY, nothing_left_behind, tiny_sharded_model

__all__ = ["nothing_left_behind"]  # the tensor-parallel test below leaves no process behind
# num_speculative_tokens fixed: these tests guess at every batch size (the default guesses alone)
SMALL = dict(device="cpu", dtype="float64", max_model_len=128, max_num_seqs=6, block_size=4)
SMALL["num_speculative_tokens"] = 4


class Scripted:
    """A proposer lookup that knows each request's true continuation (stage 11's tokens) and
    guesses it right for `right` tokens, then wrong, so every length of kept run happens."""

    def __init__(self, prompts, continuations, vocab_size: int, right=None, seed: int = 0):
        self.futures = {tuple(p): c for p, c in zip(prompts, continuations)}
        self.vocab_size, self.right, self.rng = vocab_size, right, random.Random(seed)

    def __call__(self, token_ids, k, max_n, min_n):
        for prompt, future in self.futures.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                truth = future[done : done + k]
                right = self.rng.randrange(k + 1) if self.right is None else self.right
                right = k if right == "all" else right  # (asked ahead, k covers tokens in flight)
                return truth[:right] + [(t + 1) % self.vocab_size for t in truth[right:]]
        raise AssertionError(f"a sequence no prompt starts: {token_ids[:8]}")


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("right", [0, "all", None], ids=["always-wrong", "always-right", "mixed"])
def test_stage12_gives_stage11s_greedy_tokens_whatever_the_guesses(tiny_checkpoints, family, right):
    folder, _ = tiny_checkpoints[family]
    prompts = random_prompts(256)
    want = greedy_tokens(LLM(str(folder), stage=11, **SMALL), prompts, 30)
    lookup = Scripted(prompts, want, 256, right)
    llm = LLM(str(folder), stage=12, components={"propose_ngram": lookup}, **SMALL)
    assert greedy_tokens(llm, prompts, 30) == want
    stats = llm.engine.speculation
    assert stats.num_proposed > 0
    if right == 0:
        assert stats.num_accepted == 0
    if right == "all":  # every guess kept: about five tokens per verify step
        assert stats.num_accepted == stats.num_proposed and stats.tokens_per_step > 3
    assert not llm.engine.runner.state.rows and llm.engine.manager.num_free_blocks == (
        llm.engine.manager.num_blocks
    )


@pytest.mark.parametrize(
    "options, method",
    [
        ({}, None),
        ({"num_speculative_tokens": 3}, "ngram"),
        ({"speculative_method": "ngram"}, "ngram"),
        ({"speculative_method": "draft"}, "draft"),
        ({"speculative_model": "tiny-llama"}, "draft"),
    ],
    ids=["nothing-asked", "a-count", "ngram", "draft", "a-draft-model"],
)
def test_stage12_guesses_only_when_asked(options, method):
    """Guessing is opt-in (as vLLM's): a method, a draft model or a count asks for it."""
    assert speculative_method(EngineConfig(**options)) == method


def test_stage12_asked_for_nothing_runs_stage11s_steps(tiny_checkpoints):
    """No proposer, no policy, no guess: the default engine is stage 11's, step for step."""
    folder, _ = tiny_checkpoints["llama"]
    options = {k: v for k, v in SMALL.items() if k != "num_speculative_tokens"}
    prompts = [[5, 6, 7, 8] * 6, [3, 9] * 11]  # text an n-gram lookup would guess
    eleven = LLM(str(folder), stage=11, **options)
    twelve = LLM(str(folder), stage=12, **options)
    assert greedy_tokens(twelve, prompts, 24) == greedy_tokens(eleven, prompts, 24)
    engine = twelve.engine
    assert engine.runner.proposer is None and engine.speculation is None
    assert engine.num_steps == eleven.engine.num_steps


def test_the_ngram_and_draft_proposers_give_stage11s_greedy_tokens(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    prompts = [[5, 6, 7, 8] * 6, list(range(10, 40)), [3, 9] * 11]
    want = greedy_tokens(LLM(str(folder), stage=11, **SMALL), prompts, 24)
    ngram = LLM(str(folder), stage=12, **SMALL)
    assert greedy_tokens(ngram, prompts, 24) == want and ngram.engine.speculation.num_proposed
    draft = LLM(str(folder), stage=12, speculative_method="draft", draft_num_layers=1, **SMALL)
    assert greedy_tokens(draft, prompts, 24) == want
    assert draft.engine.speculation.num_proposed > 0


def test_rollback_with_chunks_a_prefix_cache_and_preemption_leaves_nothing_behind(
    tiny_checkpoints,
):
    folder, _ = tiny_checkpoints["llama"]
    prompts, params, options = SHARED_PREFIXES, PARAMS_14, CHUNKED_PREFIX_OPTIONS
    want = [o.token_ids for o in LLM(str(folder), stage=11, **options).generate(prompts, params)]
    lookup = Scripted(prompts, want, 256)
    llm = LLM(
        str(folder),
        stage=12,
        components={"propose_ngram": lookup},
        num_speculative_tokens=3,
        **options,
    )
    checks = []

    def check(record):
        engine = llm.engine
        engine.manager.check_invariants()
        state = engine.runner.state
        for seq in engine.scheduler.running:  # the device copy of every sent table entry
            row = state.rows.get(seq.seq_id)
            if row is not None and state.num_sent[row]:
                sent = state.block_tables[row, : state.num_sent[row]].tolist()
                checks.append(sent == seq.block_table[: state.num_sent[row]])
        for block_id in engine.manager.cached:  # no hashed block holds a guess
            holders = [s for s in engine.scheduler.running if block_id in s.block_table]
            for seq in holders:
                i = seq.block_table.index(block_id)
                checks.append((i + 1) * 4 <= seq.num_cached_tokens)

    llm.engine.on_step = check
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    manager = llm.engine.manager
    assert llm.engine.scheduler.num_preemptions > 0 and manager.num_hit_tokens > 0
    assert llm.engine.speculation.num_accepted > 0
    assert manager.num_free_blocks == 30 and checks and all(checks)


def test_a_random_workload_with_aborts_and_a_small_pool_leaks_nothing(tiny_checkpoints):
    folder, _ = tiny_checkpoints["qwen3"]
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True) for _ in prompts]
    options = {**SMALL, "num_kv_blocks": 24, "max_num_seqs": 8}
    lookup = Scripted(prompts, [[rng.randrange(256) for _ in range(40)] for _ in prompts], 256)
    llm = LLM(
        str(folder),
        stage=12,
        components={"propose_ngram": lookup},
        **options,
    )
    engine = llm.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.manager.check_invariants()
        steps += 1
        if steps in (3, 6):  # abort a running request between steps
            running = list(engine.scheduler.running)
            if running:
                engine.abort([running[-1]])
    assert all(s.is_finished for s in seqs)
    for seq, sp in zip(seqs, params):
        if seq.finish_reason != "abort":
            assert seq.num_completion_tokens == sp.max_tokens, seq.seq_id
    assert engine.manager.num_free_blocks == 24 and not engine.runner.state.rows


def verdicts(logits, guess, draft_probs, n: int, temperature=1.0, top_k=0, top_p=1.0):
    """n independent verify steps of one guess over the same logits (V,) and what follows."""
    v = logits.shape[-1]
    k = 1
    tensors = SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        seeds=torch.arange(n, dtype=torch.int64) * 7919,
        positions=torch.full((n,), 11, dtype=torch.int64),
        filters=top_k > 0 or top_p < 1,
    )
    rows = logits.expand(n * (k + 1), v)  # both rows of every step score the same logits
    cu = torch.arange(0, n * (k + 1) + 1, k + 1, dtype=torch.int32)
    guesses = guess.view(n, k)
    q = None if draft_probs is None else draft_probs.expand(n, k, v)
    return verify(rows, cu, guesses, torch.ones(n, dtype=torch.int64), q, tensors)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
@pytest.mark.parametrize("top_k", [0, 4])
def test_the_first_token_of_a_verify_step_follows_the_targets_distribution(proposer, top_k):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, generator=gen) * 1.5
    n = 40000
    if proposer == "ngram":  # the same sure guess every time: token 2
        guess, q = torch.full((n,), 2, dtype=torch.int64), None
        q_row = None
    else:  # guesses drawn from a draft distribution q
        q_row = torch.softmax(torch.randn(8, generator=gen), -1)
        guess = torch.multinomial(q_row, n, replacement=True, generator=gen)
        q = q_row[None, None, :]
    verdict = verdicts(logits, guess, q, n, top_k=top_k)
    first = torch.where(verdict.num_accepted > 0, guess, verdict.token_ids)
    p = torch.softmax(logits, -1)
    if top_k:
        p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
    counts = torch.bincount(first, minlength=8).double()
    assert chi_square_p_value(counts, p.double()) > 1e-4, (counts.tolist(), p.tolist())


def test_greedy_verdicts_keep_the_argmax_run_and_draw_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    tensors = SamplingTensors(
        temperature=torch.zeros(1),
        top_k=torch.zeros(1, dtype=torch.int64),
        top_p=torch.ones(1),
        seeds=torch.zeros(1, dtype=torch.int64),
        positions=torch.tensor([5]),
        filters=False,
    )
    cu = torch.tensor([0, 4], dtype=torch.int32)
    guesses = torch.tensor([[1, 0, 1]])  # right, right, wrong (argmax there is 2)
    verdict = verify(logits, cu, guesses, torch.tensor([3]), None, tensors)
    assert verdict.num_accepted.tolist() == [2] and verdict.token_ids.tolist() == [2]
    verdict = verify(logits, cu, guesses, torch.tensor([1]), None, tensors)  # one guess only
    assert verdict.num_accepted.tolist() == [1] and verdict.token_ids.tolist() == [0]


def test_two_ranks_verify_and_give_one_ranks_tokens(tmp_path):
    model = tiny_sharded_model(tmp_path, "qwen3", 300, 4, 2)
    prompts, _ = engine_requests(lengths=(5, 17, 33, 9), vocab_size=300)
    prompts = [p * 2 for p in prompts]  # repeats give the n-gram lookup something to find
    with LLM(model, stage=11, **CPU) as llm:
        want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model, stage=12, tensor_parallel_size=2, num_speculative_tokens=4, **CPU) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.speculation.num_proposed > 0
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_logprobs_of_a_speculative_request_are_stage11s(tiny_checkpoints, method):
    """A draft verifies guesses of a request that asks for logprobs (each kept token's entry
    comes from the row that judged it); n-gram guessing ahead leaves such a request unguessed
    (its logprobs' index must be known when its step is launched)."""
    folder, _ = tiny_checkpoints["llama"]
    prompts = [[5, 6, 7, 8] * 6, list(range(10, 40))]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)
    want = LLM(str(folder), stage=11, **SMALL).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(folder), stage=12, speculative_method=method, **SMALL)
    got = llm.generate(prompts, params, use_tqdm=False)
    if method == "draft":
        assert llm.engine.speculation.num_accepted > 0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and len(b.logprobs) == 16
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            for token_id in x:
                assert abs(x[token_id].logprob - y[token_id].logprob) < 1e-9


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_the_verify_step_as_decode_rows_gives_stage11s_tokens(
    tiny_checkpoints, family, monkeypatch
):
    # a draft's verify step (not ahead): on a GPU a graph replays it as decode rows, one per
    # token; here, forced (n-gram guessing ahead builds decode rows everywhere)
    from nanoserve.engine.runner.verifier import Verifier

    monkeypatch.setattr(Verifier, "verify_as_decode", lambda self, num_rows: True)
    folder, _ = tiny_checkpoints[family]
    prompts = random_prompts(256)
    want = greedy_tokens(LLM(str(folder), stage=11, **SMALL), prompts, 20)
    llm = LLM(str(folder), stage=12, speculative_method="draft", **SMALL)
    assert greedy_tokens(llm, prompts, 20) == want
    assert llm.engine.speculation.num_proposed > 0


@pytest.mark.parametrize("shape", ["exact", "wider"])
def test_seeded_sampling_with_ngram_guesses_gives_stage11s_tokens(
    tiny_checkpoints, monkeypatch, shape
):
    # a sure guess is kept exactly when it equals the token stage 11 draws at its position.
    # wider: as on a GPU, where a verify step replays its bucket's shape captured at start-up
    # (StepGraphs.plan_verify), the op by op step gets a padding sequence and two rows more per
    # sequence than its guesses need; the host must read the verdict at the shape's stride
    from nanoserve.engine.runner.verifier import Verifier
    from nanoserve.engine.runner.verify_step import AheadShape

    if shape == "wider":
        wider = lambda self, num_seqs, k, w: AheadShape(num_seqs + 1, k + 2, w + 3)  # noqa: E731
        monkeypatch.setattr(Verifier, "eager_shape", wider)
    folder, _ = tiny_checkpoints["qwen3"]
    prompts = random_prompts(256)[:8]
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 == 2 else 0.8,
            top_k=[None, 20][i % 2],
            seed=i,
            max_tokens=24,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    want = [o.token_ids for o in LLM(str(folder), stage=11, **SMALL).generate(prompts, params)]
    lookup = Scripted(prompts, want, 256)
    llm = LLM(str(folder), stage=12, components={"propose_ngram": lookup}, **SMALL)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.speculation
    assert 0 < stats.num_accepted < stats.num_proposed
    state = llm.engine.runner.state
    assert state.seq_lens[state.padding_row].item() == 0, "padding sequences write nothing"


def test_a_separate_draft_model_on_pages_of_its_own_gives_stage11s_tokens(tiny_checkpoints):
    # the target as its own separate draft guesses right every time, unless the draft's own
    # K/V were stale: chunks, a shared prefix and preemption all move the blocks under it
    target, _ = tiny_checkpoints["llama"]
    prompts, params, options = SHARED_PREFIXES, PARAMS_14, CHUNKED_PREFIX_OPTIONS
    want = [o.token_ids for o in LLM(str(target), stage=11, **options).generate(prompts, params)]
    llm = LLM(
        str(target), stage=12, speculative_model=str(target), num_speculative_tokens=4, **options
    )
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    stats, engine = llm.engine.speculation, llm.engine
    assert stats.num_proposed > 0 and stats.num_accepted == stats.num_proposed, stats
    assert engine.scheduler.num_preemptions > 0 and engine.manager.num_free_blocks == 30
    other, _ = tiny_checkpoints["qwen3"]  # another model of the same vocabulary
    llm = LLM(
        str(target), stage=12, speculative_model=str(other), num_speculative_tokens=4, **options
    )
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.speculation.num_proposed > 0


def test_a_draft_model_of_another_vocabulary_is_refused_naming_it(tiny_checkpoints):
    target, _ = tiny_checkpoints["llama"]  # 256 tokens; the tiny-llama preset has 512
    with pytest.raises(ValueError, match=r"speculative_model='tiny-llama' has a vocabulary of 512"):
        LLM(str(target), stage=12, speculative_model="tiny-llama", **SMALL)
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(str(target), stage=12, speculative_model="tiny-llama", speculative_method="ngram")


def test_the_reference_lookup_is_the_newest_occurrence_of_the_longest_suffix_that_recurs():
    # the definition, by brute force: n from max_n down to min_n, the newest occurrence of the
    # last n tokens that starts before they do, inside the newest LOOKUP_WINDOW tokens
    from nanoserve.engine.speculation.ngram_proposer import LOOKUP_WINDOW, propose_ngram

    def by_definition(token_ids, k, max_n, min_n):
        ids = token_ids[-LOOKUP_WINDOW:]
        for n in range(min(max_n, len(ids) - 1), max(min_n, 1) - 1, -1):
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == ids[-n:]:
                    return ids[start + n : start + n + k]
        return []

    rng = random.Random(12)
    for _ in range(1000):
        vocab, length = rng.randrange(1, 7), rng.choice([rng.randrange(1, 40), 2050])
        ids = [rng.randrange(vocab) for _ in range(length)]
        k, max_n = rng.randrange(6), rng.randrange(1, 6)
        min_n = rng.randrange(0, max_n + 1)
        assert propose_ngram(ids, k, max_n, min_n) == by_definition(ids, k, max_n, min_n), (
            ids[-12:],
            k,
            max_n,
            min_n,
        )
