"""Stage 12 starter: speculative decoding. Guess a few tokens cheaply, let the target check them
all in one forward, keep the run it agrees with, and give back the room of the rest.

Fill in each body (the lesson, stages/12_speculative/README.md, walks through them in task order)
in a copy: `cp stages/12_speculative/starter.py my_speculative.py`, then grade it with
`pytest stages/12_speculative --impl my_speculative.py`; this file itself must keep failing.
Every task runs on a CPU.

    one turn of the loop that guesses, block_size 4, a sequence of 7 tokens (its newest, t, not
    yet cached), table [5, 2]:

      schedule  a decode plan: t scheduled, budget 3 -> make_room(seq, 3)
                reserve(seq, 7 + 3) grows the table to [5, 2, 7]; 3 guesses have room
      execute   the proposer guesses [9, 8, 2], beside token_ids (never appended to them);
                verify: one forward over [t 9 8 2] at positions 6..9, the target's verdict
      update    commit: num_cached_tokens 6 -> 7 (t's K/V)
      (a turn later, its verdict lands while the next step runs)
                land: gained [9, 4] (kept 9, rejected 8, drew 4)
                      tokens  a b c d | e f t 9 | 4     num_cached_tokens 8 (9's K/V stays)
                settle_guesses: the back-off hears that 9 was kept; the table keeps what the
                      step in flight writes: 4 at position 8, and its own 2 guesses at 9, 10:
                      len(seq) + 2 = 11 tokens -> table [5, 2, 7] (nothing in flight for it:
                      the 8 stored tokens -> table [5, 2], block 7 back to the pool)
"""

from __future__ import annotations

import torch

from nanoserve.engine.loop.scheduler import Scheduler, finish_reason  # noqa: F401  (task 3)
from nanoserve.types import (  # noqa: F401  (task 3)
    Landed,
    ScheduledBatch,
    Sequence,
    SequenceStatus,
    StepOutput,
)

# Given (nanoserve/engine/loop/scheduler.py, engine/speculation/, engine/runner/overlap_runner.py,
# samplers/speculative_sampler.py): the one loop, plan = scheduler.schedule(), out =
# runner.execute(plan), finished = scheduler.update(plan, out). `schedule` asks the speculation
# policy (`self.speculation`) for each decode sequence's budget and calls your `make_room`; the
# runner's proposer guesses within the room you found, and its verify step judges the guesses
# with your `num_accepted` and `residual` in one forward, launched like stage 11's steps: its
# verdict lands one turn later. `update` lands the step before (your `land`, with what each
# sequence gained: its kept guesses, then one drawn token; then your `settle_guesses`, told the
# plan just launched, now in flight) and commits the new one (stage 11's `commit`). Also given:
# `self.room.reserve(seq, num_tokens)` / `self.give_back(seq, num_tokens)` (the block manager's
# reserve and truncate), `self.release(seq)` and `self.prefix_manager` (None without one).


# ---- task 1: the n-gram lookup ----

LOOKUP_WINDOW = 2048  # only the newest tokens are searched: the host's cost stays bounded


def propose_ngram(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the newest earlier occurrence of the sequence's last n tokens,
    trying n from max_n down to min_n; [] when no such suffix occurs earlier.

    "Earlier" means the occurrence starts before the suffix itself does (the suffix always
    matches itself, and nothing follows it). The newest occurrence wins; a longer suffix wins
    over a shorter one. Fewer than k tokens come back when the sequence ends first.

    Only the newest LOOKUP_WINDOW (2,048) tokens are searched, `token_ids[-LOOKUP_WINDOW:]`, the
    suffix included: an occurrence that starts before them does not count, so the host's work
    per step stays bounded however long the sequence grows.

        tokens 5 8 2 7 9 8 2 7, k = 3, n = 2: suffix [2, 7] also at 2..3 -> propose [9, 8, 2]
    """
    raise NotImplementedError("task 1: propose_ngram")


# ---- task 2: the rejection rule ----


def num_accepted(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    num_draft: torch.Tensor,
) -> torch.Tensor:
    """(B,) int64: how many leading proposals of each row are kept.

    target_probs (B, K): p_i(d_i), the target's probability of proposal i; draft_probs (B, K):
    q_i(d_i), the proposer's; uniforms (B, K) in (0, 1); num_draft (B,): row b proposed
    num_draft[b] tokens, the columns past it are padding and never kept. Proposal i is kept when
    u_i * q_i(d_i) <= p_i(d_i) (u < p / q, without dividing: p may be 0) and every proposal
    before it was kept: the count stops at the first rejection.

    Hint: compare all B * K at once, mask the padding, and count the run of Trues from the left
    (a cumulative product of 0/1 is 1 until the first 0).
    """
    raise NotImplementedError("task 2: num_accepted")


def residual(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """(B, V): norm(max(0, p - q)) for each row p of target and q of draft, the distribution a
    replacement is drawn from after a rejection (the mass p has and q has not). Each row sums to
    1; the inputs are left as they were."""
    raise NotImplementedError("task 2: residual")


# ---- task 3: room before the verify step, the verdict after it ----


class SpeculativeScheduler(Scheduler):
    """The one scheduler (given: schedule, commit, preempt, free, give_back, release) with your
    three pieces of a guess: the room it takes, the tokens it gains, the room it gives back."""

    def make_room(self, seq: Sequence, budget: int) -> int:
        """Grow seq's blocks for up to `budget` guesses past its tokens, with free blocks only,
        and return how many guesses have room (0 .. budget).

        Called by `schedule` for each decode sequence with a budget, after every sequence of the
        plan has its block for its own newest token. (When seq's step before is still in flight
        with guesses of its own, `schedule` adds those to the budget: they may all be kept.) A
        guess never preempts anyone: ask the block manager to reserve,
        `self.room.reserve(seq, num_tokens)`, which grows seq's table toward num_tokens tokens
        with free blocks only and returns how many tokens it has room for.

            len 7, block_size 4, table [5, 2], 1 free block: budget 3 -> table [5, 2, 7], 3
            the same with no free block: budget 3 -> table [5, 2], 1 (position 7 fits block 2)
        """
        raise NotImplementedError("task 3: SpeculativeScheduler.make_room")

    def land(self, landed: Landed) -> list[Sequence]:
        """A step's tokens arrived: stage 11's land, where a sequence may gain several tokens.

        landed.tokens[i] is what landed.plan.seqs[i] gained: [] for a prefill chunk that samples
        nothing, [t] after a plain step, its kept guesses then the drawn token after a verify
        step. Skip a sequence that gained nothing or is finished already (the step after its
        end). Otherwise it no longer owes the host a token (`num_pending -= 1`); append the
        gained tokens one by one, stopping at the first that finishes it (`finish_reason`). If
        none does and seq is still RUNNING, the kept guesses' K/V (stored by the verify step)
        counts as stored too: num_cached_tokens grows by len(gained) - 1 (the drawn token's K/V
        is the next step's), and a prefix-caching manager (`self.prefix_manager`) hashes the
        blocks that filled (a sequence preempted meanwhile holds no blocks to hash).

        A finished sequence is finished with its reason (`seq.finish`); if it was preempted
        while its token was in flight it leaves `self.waiting`, else its memory is deallocated
        (`self.manager.deallocate`), it leaves `self.running` and its row is released
        (`self.release`). Returns the sequences that finished, in batch order.
        """
        raise NotImplementedError("task 3: SpeculativeScheduler.land")

    def settle_guesses(self, landed: Landed, in_flight: ScheduledBatch | None) -> None:
        """After a plan with guess budgets landed (`landed.plan.guesses[i]` for
        `landed.plan.seqs[i]`, `landed.tokens[i]` what it gained, already appended by `land`):
        the back-off learns what was kept (`self.speculation.judged(landed.plan,
        landed.tokens)`), and each sequence that had a budget (above 0) and is still RUNNING
        gives back the blocks past what it still needs (`self.give_back(seq, num_tokens)`): the
        room of rejected guesses and the room nobody used. A finished sequence holds nothing.

        What it still needs: in_flight is the step launched after the landed one, still on the
        device (None when nothing is). If it runs seq (in_flight.seqs[j], with budget
        in_flight.guesses[j]; guesses is () when that step guesses nothing), it writes seq's
        newest token and then its guesses: keep len(seq) + that budget tokens. Otherwise keep
        the stored K/V, seq.num_cached_tokens.
        """
        raise NotImplementedError("task 3: SpeculativeScheduler.settle_guesses")
