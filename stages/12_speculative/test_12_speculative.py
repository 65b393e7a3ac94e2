"""Stage 12's graded contract: your n-gram lookup, rejection rule and speculative loop.

Run against any implementation with `pytest stages/12_speculative --impl ref|starter|yours.py`.
Task 1 calls your `propose_ngram` on hand-made token lists. Task 2 calls your `num_accepted` and
`residual` on hand-made probabilities, then draws many tokens through them and demands the
target's distribution (chi-square). Task 3 drives your `SpeculativeScheduler` with hand-made
guesses and verdicts (no model): what each sequence holds, caches and frees after `add_proposal`
and `accept`. Task 4 runs the engine (`LLM(stage=12, components=...)`) with your loop and rule
on a tiny float64 Llama, with guesses that are always right and always wrong, and demands stage
11's greedy tokens; its last test does the same on a GPU (it skips without one).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager
from nanoserve.testing import recorded_releases
from nanoserve.types import ScheduledBatch, Sequence, SequenceStatus

API = ("propose_ngram", "num_accepted", "residual", "SpeculativeScheduler", "SpeculativeEngine")
BLOCK_SIZE = 4


# ---- task 1: the n-gram lookup ----


def lookup(impl, token_ids, k=3, max_n=2, min_n=1) -> list[int]:
    return list(impl.propose_ngram(list(token_ids), k, max_n, min_n))


def test_task_1_proposes_what_followed_the_suffix_earlier(impl):
    got = lookup(impl, [5, 8, 2, 7, 9, 8, 2, 7])
    assert got == [9, 8, 2], (
        f"tokens 5 8 2 7 9 8 2 7, k 3: the suffix [2, 7] occurs at positions 2..3, followed by "
        f"9 8 2; proposed {got}"
    )


def test_task_1_the_newest_earlier_occurrence_wins(impl):
    got = lookup(impl, [1, 2, 3, 6, 1, 2, 4, 6, 1, 2], k=1)
    assert got == [4], (
        f"the suffix [1, 2] occurs at positions 0 and 4 (followed by 3 and 4): the newest, 4, "
        f"wins; proposed {got}"
    )


def test_task_1_a_longer_suffix_wins_over_a_shorter_one(impl):
    tokens = [3, 4, 9, 4, 5, 3, 4]  # [3, 4] at 0 (then 9); [4] newest at 3 (then 5)
    got = lookup(impl, tokens, k=3, max_n=2)
    assert got == [9, 4, 5], f"max_n 2: the 2-token suffix [3, 4] at 0 proposes 9 4 5; got {got}"
    got = lookup(impl, tokens, k=3, max_n=1)
    assert got == [5, 3, 4], f"max_n 1: the suffix [4], newest at 3, proposes 5 3 4; got {got}"


def test_task_1_the_suffix_never_matches_itself(impl):
    got = lookup(impl, [1, 2, 3, 4, 5], k=3, max_n=3)
    assert got == [], f"no token repeats in 1 2 3 4 5, so nothing occurs earlier; proposed {got}"
    got = lookup(impl, [7, 7], k=3, max_n=3)
    assert got == [7], f"tokens 7 7: [7] at position 0 is followed by one 7; proposed {got}"


def test_task_1_at_most_k_tokens_and_fewer_where_the_sequence_ends(impl):
    tokens = [1, 2, 3, 1, 2]  # [1, 2] at 0, followed by 3 1 2 and then the end
    got = lookup(impl, tokens, k=5)
    assert got == [3, 1, 2], f"k 5, but only 3 1 2 follow the match; proposed {got}"
    got = lookup(impl, tokens, k=2)
    assert got == [3, 1], f"k 2: the first 2 followers, 3 1; proposed {got}"


def test_task_1_nothing_shorter_than_min_n_proposes(impl):
    tokens = [1, 2, 3, 4, 2]  # [2] occurs at 1; [4, 2] nowhere earlier
    got = lookup(impl, tokens, k=3, max_n=3, min_n=1)
    assert got == [3, 4, 2], f"min_n 1: the suffix [2] at 1 proposes 3 4 2; got {got}"
    got = lookup(impl, tokens, k=3, max_n=3, min_n=2)
    assert got == [], f"min_n 2: no suffix of 2 or 3 tokens occurs earlier; proposed {got}"


def test_task_1_only_the_newest_2048_tokens_are_searched(impl):
    window, n = 2048, 2098
    distinct = list(range(1000, 1000 + n))  # nothing repeats but what each case plants
    inside = list(distinct)
    inside[n - window] = inside[-1]  # the newest token again, at the window's first position
    got = lookup(impl, inside, k=3, max_n=1)
    want = inside[n - window + 1 : n - window + 4]
    assert got == want, (
        f"{n} tokens whose newest also sits at position {n - window}, the first of the newest "
        f"{window}: the lookup must find it and propose {want}; proposed {got}"
    )
    outside = list(distinct)
    outside[n - window - 1] = outside[-1]  # one token further back: outside the window
    got = lookup(impl, outside, k=3, max_n=1)
    assert got == [], (
        f"{n} tokens whose newest also sits at position {n - window - 1}, just before the newest "
        f"{window}: only those are searched, so nothing is proposed; proposed {got}"
    )


# ---- task 2: the rejection rule ----


def accepted(impl, p, q, u, num_draft) -> list[int]:
    args = [torch.tensor(x, dtype=torch.float64) for x in (p, q, u)]
    got = impl.num_accepted(*args, torch.tensor(num_draft))
    assert got.dtype == torch.int64, f"num_accepted returned {got.dtype}; expected int64 counts"
    return got.tolist()


def test_task_2_only_the_leading_run_of_kept_proposals_counts(impl):
    p = [[0.9, 0.9, 0.9], [0.1, 0.9, 0.9], [0.9, 0.1, 0.9], [0.9, 0.9, 0.9], [0.9, 0.9, 0.9]]
    u = [[0.5, 0.5, 0.5]] * 5
    got = accepted(impl, p, [[1.0] * 3] * 5, u, [3, 3, 3, 2, 0])
    want = [3, 0, 1, 2, 0]
    assert got == want, (
        f"rows (p > u kept): all kept; first rejected; second rejected; all kept but 2 "
        f"proposed; none proposed: expected kept counts {want}, got {got} (a proposal after a "
        "rejection, or in the padding past num_draft, is never kept)"
    )


def test_task_2_a_proposal_is_kept_when_u_times_q_is_at_most_p(impl):
    p = [[0.3], [0.3], [0.0], [0.6]]
    q = [[0.6], [0.9], [0.5], [0.6]]
    u = [[0.4], [0.5], [0.01], [0.99]]
    got = accepted(impl, p, q, u, [1, 1, 1, 1])
    want = [1, 0, 0, 1]
    assert got == want, (
        f"(p, q, u) = (0.3, 0.6, 0.4): 0.24 <= 0.3 kept; (0.3, 0.9, 0.5): 0.45 > 0.3 rejected; "
        f"p 0: rejected; p == q: kept. Expected {want}, got {got}"
    )


def test_task_2_the_residual_is_the_mass_p_has_and_q_has_not_normalised(impl):
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.5, 0.1, 0.2], [0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    p_before, q_before = p.clone(), q.clone()
    got = impl.residual(p, q)
    want = torch.tensor([[0.75, 0.0, 0.25, 0.0], [1 / 7, 2 / 7, 0.0, 4 / 7]], dtype=torch.float64)
    assert torch.equal(p, p_before) and torch.equal(q, q_before), "residual changed its inputs"
    assert got.shape == want.shape, f"residual's shape is {tuple(got.shape)}; expected (2, 4)"
    assert torch.allclose(got, want), (
        f"p {p[0].tolist()}, q {q[0].tolist()}: max(0, p - q) = [0.3, 0, 0.1, 0], normalised "
        f"{want[0].tolist()}; got rows {got.tolist()}"
    )


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= the statistic) for counts against probs, over the tokens probs allows."""
    allowed = probs > 0
    expected = probs[allowed] / probs.sum() * counts.sum()
    statistic = ((counts[allowed] - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((int(allowed.sum()) - 1) / 2), statistic / 2))


def speculative_draws(impl, p: torch.Tensor, q: torch.Tensor, num_draws: int) -> torch.Tensor:
    """Counts per token of num_draws rounds of: guess d ~ q, keep it by your num_accepted, else
    draw from your residual. Speculative sampling promises the counts follow p."""
    generator = torch.Generator().manual_seed(12)
    guesses = torch.multinomial(q, num_draws, replacement=True, generator=generator)
    u = torch.rand(num_draws, 1, generator=generator, dtype=torch.float64).clamp_(min=1e-12)
    kept = impl.num_accepted(p[guesses, None], q[guesses, None], u, torch.ones(num_draws).long())
    residual = impl.residual(p.expand(num_draws, -1), q.expand(num_draws, -1))
    assert torch.all(residual >= 0) and torch.allclose(
        residual.sum(-1), torch.ones(num_draws).double()
    ), (
        f"residual(p, q) must be a distribution; for p {p.tolist()} and q {q.tolist()} it is "
        f"{residual[0].tolist()}"
    )
    replacements = torch.multinomial(residual, 1, generator=generator)[:, 0]
    tokens = torch.where(kept == 1, guesses, replacements)
    return torch.bincount(tokens, minlength=len(p)).double()


@pytest.mark.parametrize("draft", ["one-hot q (an n-gram guess)", "random q (a draft model)"])
def test_task_2_guess_accept_and_resample_reproduce_the_targets_distribution(impl, draft):
    generator = torch.Generator().manual_seed(3)
    p = torch.rand(6, generator=generator, dtype=torch.float64) + 0.05
    p[4] = 0.0  # a token the target never draws
    p /= p.sum()
    if draft.startswith("one-hot"):
        q = torch.zeros(6, dtype=torch.float64)
        q[1] = 1.0
    else:
        q = torch.rand(6, generator=generator, dtype=torch.float64) ** 2
        q /= q.sum()
    counts = speculative_draws(impl, p, q, num_draws=40_000)
    assert counts[4] == 0, f"token 4 has p = 0 but came out {int(counts[4])} times"
    p_value = chi_square_p_value(counts, p)
    assert p_value > 1e-6, (
        f"{draft}: token counts out of guess / accept / resample {counts.tolist()}; the "
        f"target's p expects {[round(x) for x in (p * counts.sum()).tolist()]} (chi-square p "
        f"{p_value:.1e})"
    )


# ---- task 3: guesses in, rollback out ----


class Step(NamedTuple):
    """A launched plain step as the scheduler sees it: its batch and who samples."""

    batch: ScheduledBatch
    inputs: None
    sampled: list[int]


def decoding(impl, prompt_lens, num_blocks=16, manager_cls=BlockManager, **params):
    """A scheduler whose sequences (request i: prompt 20i+1 .. 20i+n, then a token 100+i sampled)
    are scheduled to decode: len = prompt + 1, the newest token not cached, room for it."""
    config = EngineConfig(max_model_len=64, max_num_seqs=4, block_size=BLOCK_SIZE)
    manager = manager_cls(num_blocks, BLOCK_SIZE)
    scheduler = impl.SpeculativeScheduler(config, manager)
    released = recorded_releases(scheduler)  # whose rows it let go of (told in the next plan)
    seqs = [
        Sequence(
            list(range(20 * i + 1, 20 * i + n + 1)), SamplingParams(**{"max_tokens": 16, **params})
        )
        for i, n in enumerate(prompt_lens)
    ]
    for seq in seqs:
        scheduler.add(seq)
    prefill = Step(scheduler.schedule(), None, list(range(len(seqs))))
    scheduler.commit(prefill)
    scheduler.resolve(prefill, [100 + i for i in range(len(seqs))], eos_ids=set())
    batch = scheduler.schedule()
    assert not batch.is_prefill and batch.seqs == seqs
    return scheduler, manager, batch, released


def guess(seq: Sequence, manager, token_ids: list[int]) -> None:
    """Guesses appended as add_proposal appends them (task 3's accept tests need no add_proposal
    of yours)."""
    for token_id in token_ids:
        seq.append_token(token_id)
        seq.num_draft_tokens += 1
        seq.num_scheduled_tokens += 1
        manager.may_append(seq)


def assert_rolled_back(seq: Sequence, manager, want_tokens: list[int]) -> None:
    """seq holds want_tokens, K/V of all but the newest, and no block past that K/V."""
    __tracebackhide__ = True
    assert seq.token_ids == want_tokens, (
        f"request {seq.seq_id} holds tokens {seq.token_ids}; expected {want_tokens} (every guess "
        "dropped, then the kept ones and the drawn token appended)"
    )
    assert (seq.num_draft_tokens, seq.num_scheduled_tokens) == (0, 0), (
        f"request {seq.seq_id}: num_draft_tokens {seq.num_draft_tokens}, num_scheduled_tokens "
        f"{seq.num_scheduled_tokens} after accept; expected 0 and 0"
    )
    assert seq.num_cached_tokens == len(want_tokens) - 1, (
        f"request {seq.seq_id} of {len(want_tokens)} tokens: num_cached_tokens is "
        f"{seq.num_cached_tokens}; expected {len(want_tokens) - 1} (all but the drawn token)"
    )
    want_blocks = -(-seq.num_cached_tokens // BLOCK_SIZE)
    assert len(seq.block_table) == want_blocks, (
        f"request {seq.seq_id} holds blocks {seq.block_table} for {seq.num_cached_tokens} stored "
        f"tokens; expected {want_blocks} (the blocks past them given back: manager.truncate)"
    )
    manager.check_invariants()


def test_task_3_add_proposal_appends_a_guess_and_grows_the_table_at_a_boundary(impl):
    scheduler, manager, batch, _ = decoding(impl, [6])
    (seq,) = batch.seqs
    table, free = list(seq.block_table), manager.num_free_blocks
    assert scheduler.add_proposal(seq, 50) is True, "room in the last block: add_proposal False"
    assert seq.token_ids[-2:] == [100, 50] and len(seq) == 8, f"tokens {seq.token_ids}"
    assert (seq.num_draft_tokens, seq.num_scheduled_tokens) == (1, 2), (
        f"one guess: num_draft_tokens {seq.num_draft_tokens}, num_scheduled_tokens "
        f"{seq.num_scheduled_tokens}; expected 1, and 2 (the newest token and the guess)"
    )
    assert seq.block_table == table, "position 7 fits block 1: no block was needed"
    assert scheduler.add_proposal(seq, 51) is True
    assert seq.block_table[:2] == table and len(seq.block_table) == 3, (
        f"position 8 starts block 2: request {seq.seq_id}'s table {seq.block_table} did not grow"
    )
    assert manager.num_free_blocks == free - 1 and seq.num_draft_tokens == 2
    manager.check_invariants()


def test_task_3_add_proposal_without_room_returns_false_and_changes_nothing(impl):
    scheduler, manager, batch, _ = decoding(impl, [7, 2], num_blocks=3)
    full, other = batch.seqs  # full: 8 tokens in 2 full blocks; other: 3 tokens in 1 block
    before = (list(full.token_ids), list(full.block_table), full.num_scheduled_tokens)
    assert manager.num_free_blocks == 0
    got = scheduler.add_proposal(full, 9)
    assert got is False, f"a guess at position 8 needs a block and none is free: got {got}"
    after = (full.token_ids, full.block_table, full.num_scheduled_tokens)
    assert after == before and full.num_draft_tokens == 0, (
        f"a refused guess changed request {full.seq_id}: (tokens, blocks, scheduled) {before} "
        f"became {after}"
    )
    assert other.status is SequenceStatus.RUNNING and scheduler.num_preemptions == 0, (
        f"request {other.seq_id} was preempted to make room for a guess: a guess never preempts"
    )
    assert list(scheduler.running) == [full, other]
    manager.check_invariants()


def test_task_3_accept_keeps_the_kept_guesses_and_the_drawn_token(impl):
    scheduler, manager, batch, _ = decoding(impl, [6, 3])
    a, b = batch.seqs
    free = manager.num_free_blocks
    guess(a, manager, [50, 51, 52])  # len 10: block 2 pulled for positions 8 and 9
    guess(b, manager, [60, 61])  # len 6: block 1 pulled for positions 4 and 5
    assert manager.num_free_blocks == free - 2
    a_prefix, b_prefix = a.token_ids[:7], b.token_ids[:4]
    finished = scheduler.accept(batch, [[50, 77], [60, 61, 62]], eos_ids=set())
    assert finished == [], f"nobody finished; accept returned {finished}"
    assert_rolled_back(a, manager, [*a_prefix, 50, 77])  # 8 stored: block 2 given back
    assert_rolled_back(b, manager, [*b_prefix, 60, 61, 62])  # both kept, a bonus token drawn
    assert manager.num_free_blocks == free - 1, (
        f"{manager.num_free_blocks} blocks free after accept; expected {free - 1}: request "
        f"{a.seq_id}'s block for rejected guesses comes back, request {b.seq_id} keeps its new one"
    )


def test_task_3_a_rejected_first_guess_leaves_only_the_drawn_token(impl):
    scheduler, manager, batch, _ = decoding(impl, [7])
    (seq,) = batch.seqs
    prefix, free = list(seq.token_ids), manager.num_free_blocks
    guess(seq, manager, [50, 51])
    scheduler.accept(batch, [[33]], eos_ids=set())
    assert_rolled_back(seq, manager, [*prefix, 33])
    assert manager.num_free_blocks == free, "the block pulled for the guesses was not given back"


def test_task_3_a_stop_token_inside_the_kept_run_ends_the_sequence_there(impl):
    scheduler, manager, batch, released = decoding(impl, [6, 3])
    a, b = batch.seqs
    guess(a, manager, [50, 2, 52])
    prefix = a.token_ids[:7]
    finished = scheduler.accept(batch, [[50, 2, 52, 77], [9]], eos_ids={2})
    assert a.token_ids == [*prefix, 50, 2], (
        f"request {a.seq_id} gained 50 2 52 77 with EOS 2: it ends at the 2, yet holds "
        f"{a.token_ids}"
    )
    assert finished == [a] and a.finish_reason == "stop" and a.is_finished, (
        f"accept returned {finished}, request {a.seq_id} finish_reason {a.finish_reason!r}"
    )
    assert a not in scheduler.running and released == [a], "a finished request frees its row"
    assert a.seq_id not in manager.tables, f"request {a.seq_id} finished but holds blocks"
    assert manager.num_free_blocks == 16 - len(b.block_table), "the finished request's blocks"
    manager.check_invariants()


def test_task_3_max_tokens_inside_the_kept_run_ends_the_sequence_there(impl):
    scheduler, manager, batch, released = decoding(impl, [5], max_tokens=3, ignore_eos=True)
    (seq,) = batch.seqs  # one completion token so far
    guess(seq, manager, [50, 51, 52])
    finished = scheduler.accept(batch, [[50, 51, 52, 77]], eos_ids=set())
    assert seq.completion_token_ids == [100, 50, 51], (
        f"max_tokens 3: request {seq.seq_id} must end after 100 50 51; its completion is "
        f"{seq.completion_token_ids}"
    )
    assert finished == [seq] and seq.finish_reason == "length" and released == [seq]
    assert manager.num_free_blocks == 16, "the finished request's blocks were not freed"


def test_task_3_the_prefix_cache_never_hashes_a_block_holding_a_rejected_guess(impl):
    scheduler, manager, batch, _ = decoding(impl, [6, 6], manager_cls=PrefixBlockManager)
    a, b = batch.seqs
    guess(a, manager, [50, 51, 52])  # block 1 = positions 4..7: 5 6 100 50
    guess(b, manager, [50, 51, 52])
    scheduler.accept(batch, [[40], [50, 41]], eos_ids=set())  # a rejects 50, b keeps it
    for seq in (a, b):
        for i, block_id in enumerate(seq.block_table):
            entry = manager.cached.get(block_id)
            if entry is None:
                continue
            stored = seq.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            assert (i + 1) * BLOCK_SIZE <= seq.num_cached_tokens and entry.token_ids == tuple(
                stored
            ), (
                f"request {seq.seq_id}'s block {block_id} (position {i * BLOCK_SIZE} on) is "
                f"indexed as holding {list(entry.token_ids)}; it holds {stored}, "
                f"{seq.num_cached_tokens} tokens of K/V stored"
            )
    hits = manager.cached_prefix(Sequence([*b.token_ids[:8], 1], SamplingParams()))
    assert hits == b.block_table[:2], (
        f"request {b.seq_id} kept its guess 50: its full blocks {b.block_table[:2]} are "
        f"shareable, yet a new request with the same 8 tokens finds {hits}"
    )
    manager.check_invariants()


# ---- task 4: the loop, inside the engine ----

ENGINE = dict(dtype="float64", block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=4)
MAX_TOKENS = 12
MAX_STEPS = 400  # a loop that stops making progress fails, not hangs


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 9, 4, 12, 5))]


@pytest.fixture(scope="module")
def stage_11(tiny_llama_folder):
    """Stage 11's greedy tokens: 12 per prompt, and the same stopped at a stop token."""
    llm = LLM(tiny_llama_folder, stage=11, device="cpu", num_kv_blocks=64, **ENGINE)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plenty = [out.token_ids for out in llm.generate(prompts(), greedy, use_tqdm=False)]
    stop = plenty[1][4]  # the fifth token of the second prompt
    stopped = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop], ignore_eos=True)
    outs = llm.generate(prompts(), stopped, use_tqdm=False)
    return {"plenty": plenty, "stop": stop, "stopped": [out.token_ids for out in outs]}


class Oracle:
    """A proposer that knows stage 11's tokens: `right` guesses them, `wrong` never does."""

    def __init__(self, completions: list[list[int]], right: bool):
        self.full = [p + c for p, c in zip(prompts(), completions)]
        self.right = right

    def __call__(self, token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
        n = len(token_ids)
        known = [f for f in self.full if f[:n] == list(token_ids)]
        if not known:  # the sequence left stage 11's tokens: the test fails on them anyway
            return []
        guesses = known[0][n : n + k]
        return guesses if self.right else [(t + 1) % 256 for t in guesses]


def speculative(folder, impl, lookup, **options) -> LLM:
    parts = {
        "SpeculativeEngine": impl.SpeculativeEngine,
        "propose_ngram": lookup,
        "num_accepted": impl.num_accepted,
        "residual": impl.residual,
    }
    options = {"num_kv_blocks": 64, "num_speculative_tokens": 3, **ENGINE, **options}
    return LLM(folder, stage=12, device="cpu", components=parts, **options)


def run(llm: LLM, params) -> list[list[int]]:
    """Every prompt through the engine, step by step, checking the block books after each."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts())
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts(), params)]
    returned: list[int] = []  # every request is returned by the step that finished it, once
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        returned += [seq.seq_id for seq in engine.step()]
        engine.manager.check_invariants()
        for seq in engine.scheduler.running:
            assert seq.num_draft_tokens == 0, (
                f"request {seq.seq_id} still holds {seq.num_draft_tokens} guesses after a step"
            )
    else:
        pytest.fail(f"the engine did not finish {len(seqs)} requests in {MAX_STEPS} steps")
    assert engine.manager.num_free_blocks == engine.manager.num_blocks, (
        "blocks still held after every request ended"
    )
    assert not engine.runner.state.rows, "rows still held after every request ended"
    want = sorted(seq.seq_id for seq in seqs)
    assert sorted(returned) == want, (
        f"step() returned requests {sorted(returned)} as finished; every request {want} must be "
        "returned once, by the step that finished it (a drained step's too)"
    )
    return [seq.completion_token_ids for seq in seqs]


def assert_same_tokens(got: list[list[int]], want: list[list[int]], when: str) -> None:
    """Each request's completion equals stage 11's; a failure names the first token that differs."""
    __tracebackhide__ = True
    for i, (mine, theirs) in enumerate(zip(got, want)):
        if mine != theirs:
            j = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            where = (
                f"completion token {j} is {mine[j]}, stage 11's is {theirs[j]}"
                if j is not None
                else f"{len(mine)} tokens, stage 11 gives {len(theirs)}"
            )
            raise AssertionError(
                f"{when}: request {i}'s {where} (yours {mine}, stage 11's {theirs})"
            )


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def test_task_4_guesses_always_right_give_stage_11s_tokens_in_fewer_steps(
    impl, tiny_llama_folder, stage_11
):
    llm = speculative(tiny_llama_folder, impl, Oracle(stage_11["plenty"], right=True))
    assert_same_tokens(run(llm, GREEDY), stage_11["plenty"], "guesses always right")
    stats = llm.engine.speculation
    assert stats.num_proposed > 0 and stats.num_accepted == stats.num_proposed, (
        f"every guess was stage 11's next token: {stats.num_accepted} of {stats.num_proposed} "
        "kept (count them with self.verify)"
    )
    assert stats.num_verify_steps > 0 and stats.tokens_per_step > 2, stats
    assert llm.engine.num_steps <= 12, (
        f"{llm.engine.num_steps} steps for 5 requests of 12 tokens; one token per step takes 24, "
        "and right guesses (3 a step) save most of them"
    )


def test_task_4_guesses_always_wrong_still_give_stage_11s_tokens(impl, tiny_llama_folder, stage_11):
    llm = speculative(tiny_llama_folder, impl, Oracle(stage_11["plenty"], right=False))
    assert_same_tokens(run(llm, GREEDY), stage_11["plenty"], "guesses always wrong")
    stats = llm.engine.speculation
    assert stats.num_proposed > 0 and stats.num_accepted == 0, (
        f"no guess was right, yet {stats.num_accepted} of {stats.num_proposed} were kept"
    )


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_task_4_with_preemption_the_tokens_stay_stage_11s(impl, tiny_llama_folder, stage_11, right):
    llm = speculative(tiny_llama_folder, impl, Oracle(stage_11["plenty"], right), num_kv_blocks=9)
    assert_same_tokens(run(llm, GREEDY), stage_11["plenty"], "9 blocks, requests preempted")
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"


def test_task_4_max_tokens_and_a_stop_token_end_requests_as_in_stage_11(
    impl, tiny_llama_folder, stage_11
):
    oracle = Oracle(stage_11["plenty"], right=True)  # it guesses past the stop token
    llm = speculative(tiny_llama_folder, impl, oracle)
    stopped = SamplingParams(
        max_tokens=MAX_TOKENS, stop_token_ids=[stage_11["stop"]], ignore_eos=True
    )
    stop = stage_11["stop"]
    assert_same_tokens(run(llm, stopped), stage_11["stopped"], f"stop token {stop}")
    limits = [1, 2, 5, 7, 12]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in limits]
    want = [tokens[:n] for tokens, n in zip(stage_11["plenty"], limits)]
    assert_same_tokens(run(llm, params), want, f"max_tokens {limits}")


def test_task_4_a_step_without_guesses_is_a_stage_11_step(impl, tiny_llama_folder, stage_11):
    llm = speculative(tiny_llama_folder, impl, lambda token_ids, k, max_n, min_n: [])
    assert_same_tokens(run(llm, GREEDY), stage_11["plenty"], "no guesses")
    stats = llm.engine.speculation
    assert stats.num_verify_steps == 0, (
        f"nobody guessed, yet {stats.num_verify_steps} steps were verify steps: a decode "
        "without guesses runs as a plain step"
    )


def test_task_4_your_whole_stage_with_your_lookup_gives_stage_11s_tokens(
    impl, tiny_llama_folder, stage_11
):
    llm = speculative(tiny_llama_folder, impl, impl.propose_ngram)
    assert_same_tokens(run(llm, GREEDY), stage_11["plenty"], "your propose_ngram's guesses")
    stats = llm.engine.speculation
    assert stats.num_accepted > 0, f"these completions repeat, yet no guess was kept: {stats}"


def test_task_4_a_call_whose_drain_finishes_the_last_request_returns_it(
    impl, tiny_llama_folder, stage_11
):
    # Nothing to guess: the request backs off, so its last token is launched by an overlapped
    # (stage 11) step, and the next call that may guess drains it and finds an empty batch.
    llm = speculative(tiny_llama_folder, impl, lambda token_ids, k, max_n, min_n: [])
    engine = llm.engine
    seq = engine.add_request(prompts()[1], SamplingParams(max_tokens=3, ignore_eos=True))
    calls: list[tuple[list[int], int]] = []  # per call: what it returned, the steps it launched
    while engine.has_unfinished() and len(calls) < 10:
        num_steps = engine.num_steps
        calls.append(([s.seq_id for s in engine.step()], engine.num_steps - num_steps))
    assert seq.completion_token_ids == stage_11["plenty"][1][:3]
    assert calls[-1] == ([seq.seq_id], 0), (
        f"(requests returned, steps launched) per call: {calls}. The last call drains the step "
        f"that made request {seq.seq_id}'s last token; its batch is then empty, and it returns "
        "what the drain finished"
    )


def test_task_4_a_call_that_can_run_nothing_while_a_request_waits_raises(
    impl, tiny_llama_folder, stage_11
):
    llm = speculative(tiny_llama_folder, impl, Oracle(stage_11["plenty"], right=True))
    engine = llm.engine
    seq = engine.add_request(prompts()[1], GREEDY)
    engine.step()  # its prefill; from the next call on it may guess
    engine.scheduler.schedule = lambda: ScheduledBatch([], is_prefill=False)  # as if none could run
    with pytest.raises(RuntimeError):
        engine.step()
        pytest.fail(
            f"the scheduler gave an empty batch, the drain finished nothing and request "
            f"{seq.seq_id} is still running: nothing could ever run it, and step() must raise "
            "RuntimeError instead of returning (a loop would spin forever)"
        )


@pytest.mark.gpu
def test_task_4_on_a_gpu_the_loop_gives_stage_11s_tokens(impl, tiny_llama_folder):
    options = dict(device="cuda", num_kv_blocks=64, attention_backend="triton", **ENGINE)
    want = LLM(tiny_llama_folder, stage=11, **options).generate(prompts(), GREEDY, use_tqdm=False)
    parts = {
        "SpeculativeEngine": impl.SpeculativeEngine,
        "propose_ngram": impl.propose_ngram,
        "num_accepted": impl.num_accepted,
        "residual": impl.residual,
    }
    llm = LLM(tiny_llama_folder, stage=12, components=parts, **options)
    got = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_same_tokens([o.token_ids for o in got], [o.token_ids for o in want], "on a GPU")
    assert llm.engine.speculation.num_accepted > 0
