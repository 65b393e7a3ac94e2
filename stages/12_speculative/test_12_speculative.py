"""Stage 12's graded contract: your n-gram lookup, rejection rule and a guess's bookkeeping.

Run against any implementation with `pytest stages/12_speculative --impl ref|starter|yours.py`.
Task 1 calls your `propose_ngram` on hand-made token lists. Task 2 calls your `num_accepted` and
`residual` on hand-made probabilities, then draws many tokens through them and demands the
target's distribution (chi-square). Task 3 drives your `SpeculativeScheduler` through the loop's
own calls (`schedule`, then `update` with a hand-made step output; no model): the room a plan's
guesses take, what each sequence holds, stores, finishes and gives back after the verdict, and
what the back-off learns. Task 4 runs the engine (`LLM(stage=12, components=...)`) with all your
pieces on a tiny float64 Llama, with guesses that are always right and always wrong, and demands
stage 11's tokens; its last test does the same on a GPU (it skips without one).
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager
from nanoserve.engine.speculation.policy import Speculation
from nanoserve.testing import recorded_releases
from nanoserve.types import Landed, ScheduledBatch, Sequence, SequenceStatus, StepOutput

API = ("propose_ngram", "num_accepted", "residual", "SpeculativeScheduler")
BLOCK_SIZE = 4


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


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


# ---- task 3: room before the verify step, the verdict after it ----


def decoding(impl, prompt_lens, num_blocks=16, manager_cls=BlockManager, k=3, **params):
    """A scheduler with a speculation policy (k guesses) whose sequences (request i: prompt
    20i+1 .. 20i+n, prefilled, then a token 100+i sampled) are planned to decode: returns the
    scheduler, the manager, the plan `schedule()` made (budgets and room: your make_room) and
    the sequences it released from then on."""
    config = EngineConfig(max_model_len=64, max_num_seqs=4, block_size=BLOCK_SIZE)
    manager = manager_cls(num_blocks, BLOCK_SIZE)
    speculation = Speculation(k, config.max_model_len, graph_rows=None, ahead=True)
    scheduler = impl.SpeculativeScheduler(config, manager, (), speculation)
    released = recorded_releases(scheduler)  # whose rows it let go of (told in the next plan)
    for i, n in enumerate(prompt_lens):
        sampling = SamplingParams(**{"max_tokens": 16, "ignore_eos": True, **params})
        seq = Sequence(list(range(20 * i + 1, 20 * i + n + 1)), sampling)
        manager.allocate(seq)  # as the prefill left it: the prompt stored, a token sampled
        seq.num_cached_tokens = n
        seq.append_token(100 + i)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    plan = scheduler.schedule()
    assert not plan.is_prefill and len(plan.seqs) == len(prompt_lens), plan
    return scheduler, manager, plan, released


def verdict(scheduler, plan, gained: list[list[int]]) -> list[Sequence]:
    """The verify step's output as the runner hands it over (each sequence guessed as much as
    its room allows; what it gained: its kept guesses, then the drawn token), applied by the
    loop's `update`; returns the sequences that finished."""
    guesses = [[0] * n for n in plan.guesses]
    out = StepOutput(None, tuple(range(len(plan.seqs))), gained, None, guesses)
    return scheduler.update(plan, out)


def assert_settled(seq: Sequence, manager, want_tokens: list[int]) -> None:
    """seq holds want_tokens, K/V of all but the newest, and no block past that K/V."""
    __tracebackhide__ = True
    assert seq.token_ids == want_tokens, (
        f"request {seq.seq_id} holds tokens {seq.token_ids}; expected {want_tokens} (what it "
        "held, then its kept guesses and the drawn token)"
    )
    assert (seq.num_pending, seq.num_scheduled_tokens) == (0, 0), (
        f"request {seq.seq_id}: num_pending {seq.num_pending}, num_scheduled_tokens "
        f"{seq.num_scheduled_tokens} after its tokens landed; expected 0 and 0"
    )
    assert seq.num_cached_tokens == len(want_tokens) - 1, (
        f"request {seq.seq_id} of {len(want_tokens)} tokens: num_cached_tokens is "
        f"{seq.num_cached_tokens}; expected {len(want_tokens) - 1} (the verify step stored the "
        "K/V of the newest token and of every kept guess; the drawn token's is the next step's)"
    )
    want_blocks = blocks_for(seq.num_cached_tokens)
    assert len(seq.block_table) == want_blocks, (
        f"request {seq.seq_id} holds blocks {seq.block_table} for {seq.num_cached_tokens} stored "
        f"tokens; expected {want_blocks}: the blocks past the stored K/V go back "
        "(give_back(seq, seq.num_cached_tokens))"
    )
    manager.check_invariants()


def test_task_3_make_room_reserves_a_block_for_each_guess_that_needs_one(impl):
    scheduler, manager, plan, _ = decoding(impl, [5, 3])
    a, b = plan.seqs  # a: 6 tokens, the newest at position 5; b: 4 tokens, the newest at 3
    assert plan.guesses == (3, 3), (
        f"16 blocks, budgets of 3: each sequence has room for its 3 guesses; the plan says "
        f"{plan.guesses}"
    )
    for seq in (a, b):
        room = len(seq.block_table) * BLOCK_SIZE
        assert room >= len(seq) + 3, (
            f"request {seq.seq_id} of {len(seq)} tokens guesses 3, at positions {len(seq)} to "
            f"{len(seq) + 2}, yet its blocks {seq.block_table} hold {room} tokens"
        )
    assert (len(a.block_table), len(b.block_table)) == (3, 2), (
        f"tables {a.block_table} and {b.block_table}: 9 and 7 tokens need 3 and 2 blocks; "
        "reserve no more than the guesses need"
    )
    assert manager.num_free_blocks == 11 and scheduler.num_preemptions == 0
    manager.check_invariants()


def test_task_3_make_room_takes_free_blocks_only_and_never_preempts(impl):
    scheduler, manager, plan, _ = decoding(impl, [7, 2], num_blocks=3)
    full, other = plan.seqs  # full: 8 tokens in 2 full blocks; other: 3 tokens in 1 block
    assert manager.num_free_blocks == 0
    assert plan.guesses == (0, 1), (
        f"no block is free: request {full.seq_id}'s blocks are full (no guess fits), request "
        f"{other.seq_id}'s block has one free slot (one guess fits); the plan says {plan.guesses}"
    )
    assert scheduler.num_preemptions == 0 and other.status is SequenceStatus.RUNNING, (
        f"request {other.seq_id} was preempted to make room for a guess: a guess never preempts"
    )
    assert list(scheduler.running) == [full, other] and not scheduler.waiting
    assert (full.block_table, other.block_table) == ([0, 1], [2]), "no table may change"
    manager.check_invariants()


def test_task_3_the_verdict_appends_kept_guesses_then_the_drawn_token(impl):
    scheduler, manager, plan, _ = decoding(impl, [5, 3])
    a, b = plan.seqs
    a_tokens, b_tokens = list(a.token_ids), list(b.token_ids)
    finished = verdict(scheduler, plan, [[50, 51, 77], [60, 61, 62, 63]])
    assert finished == [], f"nobody finished; update returned {finished}"
    assert_settled(a, manager, [*a_tokens, 50, 51, 77])  # 8 stored: block 2 goes back
    assert_settled(b, manager, [*b_tokens, 60, 61, 62, 63])  # all 3 kept, a bonus drawn
    assert manager.num_free_blocks == 16 - 2 - 2, (
        f"{manager.num_free_blocks} blocks free after the verdict; expected 12: request "
        f"{a.seq_id}'s third block holds no stored K/V and goes back, request {b.seq_id} keeps "
        "its second (its 7 stored tokens reach into it)"
    )


def test_task_3_a_rejected_first_guess_leaves_only_the_drawn_token(impl):
    scheduler, manager, plan, _ = decoding(impl, [6])
    (seq,) = plan.seqs
    tokens = list(seq.token_ids)
    assert len(seq.block_table) == 3, "7 tokens and 3 guesses: 10 positions, 3 blocks"
    verdict(scheduler, plan, [[33]])
    assert_settled(seq, manager, [*tokens, 33])
    assert manager.num_free_blocks == 14, "the block reserved for the guesses was not given back"


def test_task_3_a_stop_token_inside_the_kept_run_ends_the_sequence_there(impl):
    scheduler, manager, plan, released = decoding(impl, [5, 3], ignore_eos=False)
    a, b = plan.seqs
    scheduler.eos_ids = frozenset({2})
    a_tokens = list(a.token_ids)
    finished = verdict(scheduler, plan, [[50, 2, 52, 77], [9]])
    assert a.token_ids == [*a_tokens, 50, 2], (
        f"request {a.seq_id} gained 50 2 52 77 with EOS 2: it ends at the 2, yet holds "
        f"{a.token_ids}"
    )
    assert finished == [a] and a.finish_reason == "stop" and a.is_finished, (
        f"update returned {finished}, request {a.seq_id} finish_reason {a.finish_reason!r}"
    )
    assert a.num_cached_tokens <= len(a), (
        f"request {a.seq_id} holds {len(a)} tokens but counts {a.num_cached_tokens} as stored: "
        "tokens past its end are never its own"
    )
    assert a not in scheduler.running and released == [a], "a finished request frees its row"
    assert a.seq_id not in manager.tables, f"request {a.seq_id} finished but holds blocks"
    assert_settled(b, manager, [*b.token_ids[:4], 9])
    assert manager.num_free_blocks == 16 - len(b.block_table), "the finished request's blocks"


def test_task_3_max_tokens_inside_the_kept_run_ends_the_sequence_there(impl):
    scheduler, manager, plan, released = decoding(impl, [5], max_tokens=4)
    (seq,) = plan.seqs  # one completion token so far: budget 2 (a kept run + a drawn token)
    assert plan.guesses == (2,), plan.guesses
    finished = verdict(scheduler, plan, [[50, 51, 77]])
    assert seq.completion_token_ids == [100, 50, 51, 77], seq.completion_token_ids
    assert finished == [seq] and seq.finish_reason == "length" and released == [seq], (
        f"max_tokens 4: request {seq.seq_id} ends with its 4th token; update returned "
        f"{finished}, finish_reason {seq.finish_reason!r}"
    )
    assert manager.num_free_blocks == 16, "the finished request's blocks were not freed"


def test_task_3_blocks_full_of_kept_tokens_are_shareable_at_once(impl):
    scheduler, manager, plan, _ = decoding(impl, [6, 6], manager_cls=PrefixBlockManager)
    a, b = plan.seqs  # block 1 of each = positions 4..7: two prompt tokens, 100 + i, a guess
    verdict(scheduler, plan, [[40], [50, 41]])  # a rejects its first guess, b keeps it
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
        f"request {b.seq_id} kept its guess 50: its 8 stored tokens fill blocks "
        f"{b.block_table[:2]}, shareable as soon as the verdict lands, yet a new request with "
        f"the same 8 tokens finds {hits} (hash the blocks that filled)"
    )
    manager.check_invariants()


def test_task_3_a_sequence_preempted_while_it_was_verified_keeps_its_tokens_not_its_blocks(impl):
    scheduler, manager, plan, _ = decoding(impl, [6, 6], manager_cls=PrefixBlockManager)
    _, b = plan.seqs
    scheduler.update(plan, StepOutput(None, (0, 1), None))  # launched; its verdict is on the way
    scheduler.preempt(b)  # the next plan took b's blocks while b's verify step was in flight
    landed = Landed(plan, [[40], [50, 41]], [[0] * n for n in plan.guesses])  # b kept 50, drew 41
    try:
        scheduler.land(landed)
        scheduler.settle_guesses(landed, None)
    except KeyError as err:
        pytest.fail(
            f"landing a kept guess of request {b.seq_id}, preempted while its step ran, raised "
            f"KeyError {err}: count and hash kept guesses only for a sequence still RUNNING (a "
            "preempted one holds no blocks; readmission recomputes it)"
        )
    assert b.token_ids[-2:] == [50, 41] and b in scheduler.waiting and not b.block_table, (
        f"request {b.seq_id} preempted in flight: tokens {b.token_ids}, blocks {b.block_table}, "
        f"waiting: {b in scheduler.waiting}; expected its kept guess and drawn token appended, "
        "no blocks, and its place in waiting"
    )
    manager.check_invariants()


def test_task_3_a_verdict_landing_under_the_next_step_keeps_that_steps_room(impl):
    scheduler, manager, plan, _ = decoding(impl, [5, 3])
    a, b = plan.seqs
    scheduler.update(plan, StepOutput(None, (0, 1), None))  # launched; its verdict is on the way
    later = scheduler.schedule()  # launched too: it may guess 3 more each, past 3 kept ones
    assert later.seqs == [a, b] and later.guesses == (3, 3), later
    gained, guesses = [[50, 77], [60]], [[50, 51, 52], [61, 62, 63]]
    scheduler.update(later, StepOutput(None, (0, 1), None, Landed(plan, gained, guesses)))
    for seq, kept in ((a, 1), (b, 0)):
        n = len(seq) - 1 + 3  # the later step writes its newest token and 3 guesses
        assert len(seq.block_table) == blocks_for(n), (
            f"request {seq.seq_id} kept {kept} guess(es) while the next step ran: that step "
            f"writes its newest token and 3 guesses (positions {len(seq) - 2} to {n - 1}), so "
            f"it keeps {blocks_for(n)} blocks; it holds {seq.block_table} "
            "(give_back(seq, len(seq) + that step's budget))"
        )
    manager.check_invariants()


def test_task_3_a_plain_step_in_flight_keeps_its_tokens_block(impl):
    scheduler, manager, plan, _ = decoding(impl, [5])
    (seq,) = plan.seqs  # 6 tokens, 3 guesses: the table holds 9 tokens' room, 3 blocks
    scheduler.commit(plan, (0,))
    landed = Landed(plan, [[50, 51, 77]], [[50, 51, 52]])
    scheduler.land(landed)  # 9 tokens, 8 stored: the newest, 77, sits at position 8, block 2
    scheduler.settle_guesses(landed, ScheduledBatch([seq], is_prefill=False))  # no guesses
    assert len(seq.block_table) == 3, (
        f"the step in flight feeds 77 at position 8, in the third block, guessing nothing "
        f"(its guesses are ()); request {seq.seq_id} must keep 9 tokens' room, 3 blocks, yet "
        f"holds {seq.block_table}"
    )
    manager.check_invariants()


def test_task_3_the_back_off_learns_who_kept_a_guess(impl):
    scheduler, _, plan, _ = decoding(impl, [5, 3])
    a, b = plan.seqs
    verdict(scheduler, plan, [[50, 77], [60]])  # a kept a guess, b kept none
    backoff = scheduler.speculation.backoff
    step = scheduler.num_plans + 1
    assert all(backoff.is_open(a, s) for s in (step, step + 1)), (
        f"request {a.seq_id} kept a guess: it may guess at every step (self.speculation.judged)"
    )
    assert not all(backoff.is_open(b, s) for s in (step, step + 1)), (
        f"request {b.seq_id} kept none of its guesses: it backs off, and may not guess at both "
        "of the next two steps (self.speculation.judged)"
    )


def test_task_3_a_finished_sequence_gains_nothing_more(impl):
    scheduler, _, plan, _ = decoding(impl, [5])
    (seq,) = plan.seqs
    scheduler.abort(seq)  # it ended while its step ran
    tokens = list(seq.token_ids)
    finished = scheduler.land(Landed(plan, [[50, 77]]))
    assert finished == [] and seq.token_ids == tokens, (
        f"request {seq.seq_id} was finished already: the step after its end gives it nothing, "
        f"yet it holds {seq.token_ids} (it held {tokens}) and land returned {finished}"
    )


def test_task_3_a_request_preempted_in_flight_may_still_finish(impl):
    scheduler, manager, plan, _ = decoding(impl, [5], k=0, ignore_eos=False)
    (seq,) = plan.seqs
    scheduler.eos_ids = frozenset({2})
    scheduler.commit(plan, (0,))  # launched: the token is owed
    scheduler.running.remove(seq)
    scheduler.preempt(seq)  # the pool ran dry before it landed
    finished = scheduler.land(Landed(plan, [[2]]))
    assert finished == [seq] and seq.finish_reason == "stop", (
        f"request {seq.seq_id}'s owed token is EOS: it finishes even though it waits, "
        f"preempted; land returned {finished}"
    )
    assert not scheduler.waiting and manager.num_free_blocks == 16, (
        "a request that finished while preempted leaves the waiting queue (it holds no blocks)"
    )


# ---- task 4: your pieces inside the engine ----

ENGINE = dict(dtype="float64", block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=4)
MAX_TOKENS = 12
MAX_STEPS = 400  # a loop that stops making progress fails, not hangs


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 9, 4, 12, 5))]


def seeded() -> list[SamplingParams]:
    options = dict(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, ignore_eos=True)
    return [SamplingParams(**options, seed=5 + i) for i in range(len(prompts()))]


@pytest.fixture(scope="module")
def stage_11(tiny_llama_folder):
    """Stage 11's tokens: 12 greedy per prompt, the same stopped at a stop token, and 12 seeded
    samples per prompt."""
    llm = LLM(tiny_llama_folder, stage=11, device="cpu", num_kv_blocks=64, **ENGINE)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plenty = [out.token_ids for out in llm.generate(prompts(), greedy, use_tqdm=False)]
    stop = plenty[1][4]  # the fifth token of the second prompt
    stopped = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop], ignore_eos=True)
    outs = llm.generate(prompts(), stopped, use_tqdm=False)
    sampled = [out.token_ids for out in llm.generate(prompts(), seeded(), use_tqdm=False)]
    return {
        "plenty": plenty,
        "stop": stop,
        "stopped": [out.token_ids for out in outs],
        "seeded": sampled,
    }


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


def parts(impl, lookup) -> dict:
    return {
        "SpeculativeScheduler": impl.SpeculativeScheduler,
        "propose_ngram": lookup,
        "num_accepted": impl.num_accepted,
        "residual": impl.residual,
    }


def speculative(folder, impl, lookup, **options) -> LLM:
    options = {"num_kv_blocks": 64, "num_speculative_tokens": 3, **ENGINE, **options}
    return LLM(folder, stage=12, device="cpu", components=parts(impl, lookup), **options)


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
        for seq in engine.scheduler.running:  # (and room for the guesses of a step in flight)
            room = len(seq) + engine.scheduler.guessing.get(seq.seq_id, 0)
            assert len(seq.block_table) <= blocks_for(room), (
                f"request {seq.seq_id} of {len(seq)} tokens holds blocks {seq.block_table} "
                "after a step: the room reserved for guesses was not given back"
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
        "returned once, by the step that finished it"
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
        f"every guess was stage 11's next token: {stats.num_accepted} of {stats.num_proposed} kept"
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


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_task_4_seeded_sampling_gives_stage_11s_tokens(impl, tiny_llama_folder, stage_11, right):
    # n-gram guesses are sure (q one-hot): the verdict keeps a guess exactly when it equals the
    # token stage 11 draws at that position, with stage 11's own random numbers
    llm = speculative(tiny_llama_folder, impl, Oracle(stage_11["seeded"], right))
    assert_same_tokens(run(llm, seeded()), stage_11["seeded"], "seeded sampling, T 0.8, top-p")
    stats = llm.engine.speculation
    assert stats.num_proposed > 0 and (stats.num_accepted > 0) == right, stats


def test_task_4_a_step_with_nothing_to_run_raises(impl, tiny_llama_folder, stage_11):
    llm = speculative(tiny_llama_folder, impl, Oracle(stage_11["plenty"], right=True))
    engine = llm.engine
    with pytest.raises(RuntimeError, match="scheduler produced an empty batch"):
        engine.step()
        pytest.fail("step() on an engine with no request returned instead of raising")
    seq = engine.add_request(prompts()[1], GREEDY)
    while not seq.completion_token_ids:
        engine.step()  # its prefill, and the step that lands its first token
    engine.scheduler.schedule = lambda: ScheduledBatch([], is_prefill=False)  # none can run
    if engine.runner.in_flight is not None:
        engine.step()  # an empty plan: the step in flight lands
    assert not seq.is_finished
    with pytest.raises(RuntimeError, match="scheduler produced an empty batch"):
        engine.step()
        pytest.fail(
            f"the scheduler planned nothing while request {seq.seq_id} runs: nothing could "
            "ever run it, and step() must raise RuntimeError (a loop would spin forever)"
        )


@pytest.mark.gpu
def test_task_4_on_a_gpu_your_pieces_give_stage_11s_tokens(impl, tiny_llama_folder):
    options = dict(device="cuda", num_kv_blocks=64, attention_backend="triton", **ENGINE)
    want = LLM(tiny_llama_folder, stage=11, **options).generate(prompts(), GREEDY, use_tqdm=False)
    right = Oracle([o.token_ids for o in want], right=True)  # a batch of 4 fills the graphs:
    llm = LLM(tiny_llama_folder, stage=12, components=parts(impl, right),  # the last one guesses
              num_speculative_tokens=3, **options)  # fmt: skip
    got = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_same_tokens([o.token_ids for o in got], [o.token_ids for o in want], "on a GPU")
    assert llm.engine.speculation.num_accepted > 0
