"""Stage 12 starter: speculative decoding. Guess a few tokens cheaply, let the target check them
all in one forward, keep the run it agrees with, and roll the rest back.

Fill in each body (the lesson, stages/12_speculative/README.md, walks through them in task order)
in a copy: `cp stages/12_speculative/starter.py my_speculative.py`, then grade it with
`pytest stages/12_speculative --impl my_speculative.py`; this file itself must keep failing.
Every task runs on a CPU.

    one speculative step, block_size 4, a sequence of 7 tokens (its newest, t, not yet cached):

      propose   tokens  a b c d | e f t 9 | 8 2        guesses 9 8 2 appended, table [5, 2, 7]
      verify    one forward over [t 9 8 2] at positions 6..9: the target's verdict per guess
      accept    kept 9, rejected 8, drew 4:  a b c d | e f t 9 | 4     table [5, 2, 7]
                num_cached_tokens 8 (K/V of t and 9 stays), block 7 holds only the drawn 4's
                slot: truncate to the 8 stored tokens gives it back -> table [5, 2]
"""

from __future__ import annotations

import torch

from nanoserve.engine.loop.scheduler import finish_reason  # noqa: F401  (given; use it in task 3)
from nanoserve.engine.speculation.speculative_base import (
    SpeculativeEngineBase,
    SpeculativeSchedulerBase,
)
from nanoserve.types import ScheduledBatch, Sequence, SequenceStatus  # noqa: F401  (task 3)

# Given (nanoserve/engine/speculation/speculative_base.py and speculative_runner.py,
# nanoserve/samplers/speculative_sampler.py):
# the scheduler's `budget(seq, k)` (how many guesses seq may take) and `discard_proposals`; the
# engine's `propose(batch)`, which offers each decode sequence its guesses through your
# `add_proposal` and returns the draft's distributions (None for n-gram guesses), and
# `verify(batch, draft_probs, num_preempted_before)`, which runs the target over every guess in
# one forward, judges them with your `num_accepted` and `residual`, counts the speculation stats
# and returns a `Verified` whose `token_ids[i]` is what batch.seqs[i] gains (its kept guesses,
# then one drawn token). Stage 11's `_launch_batch`, `commit` and `resolve` run a plain step.


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


# ---- task 3: guesses in, rollback out ----


class SpeculativeScheduler(SpeculativeSchedulerBase):
    """Stage 11's scheduler (given: schedule, preempt, commit, resolve, budget, and
    `self.release(seq)`, which frees seq's row: the next plan tells the runner) plus tentative
    tokens."""

    def add_proposal(self, seq: Sequence, token_id: int) -> bool:
        """Append one guess to seq, which the verify step will compute: it grows seq's token_ids,
        its `num_draft_tokens` and its `num_scheduled_tokens` by one, and its blocks to cover it
        (`self.manager.may_append(seq)`). Only if `self.manager.can_append(seq)`: a guess never
        preempts anyone. Returns False, with nothing changed, when there is no room.
        """
        raise NotImplementedError("task 3: SpeculativeScheduler.add_proposal")

    def accept(self, batch: ScheduledBatch, token_ids: list[list[int]], eos_ids) -> list[Sequence]:
        """The verify step's outcome: token_ids[i] is what batch.seqs[i] gains (its kept guesses,
        then a drawn token). For each sequence: drop all its guesses (the last num_draft_tokens
        of token_ids; reset num_draft_tokens and num_scheduled_tokens to 0), then append the
        gained tokens one by one, stopping at the first that finishes it (`finish_reason`, as in
        stage 11's resolve). Every token but the newest now has K/V stored: num_cached_tokens is
        len(seq) - 1.

        A finished sequence is FINISHED with its reason, its memory deallocated, out of
        `self.running` and its row released. Any other gives back the blocks past its stored
        K/V (`self.manager.truncate(seq, num_tokens)`) and, with a prefix-caching manager
        (`self.prefix_manager`, None without one), has its newly full blocks hashed: only
        blocks of kept tokens, never one that held a rejected guess. Returns the sequences that
        finished, in batch order.
        """
        raise NotImplementedError("task 3: SpeculativeScheduler.accept")


# ---- task 4: the loop ----


class SpeculativeEngine(SpeculativeEngineBase):
    """The engine loop: stage 11's overlapped step while nobody may guess, else one step resolved
    before the next is scheduled (the next guesses need this step's tokens). Given: `may_guess`,
    `drain`, `propose`, `verify`, `_launch_batch`, abort, has_unfinished."""

    Scheduler = SpeculativeScheduler
    scheduler: SpeculativeScheduler

    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished.

        While `self.may_guess()` is False (every running sequence is backing off), run stage 11's
        step: `return super().step()`. Otherwise resolve the step in flight first (`finished =
        self.drain()`), and return what it finished with this step's. Note
        `self.scheduler.num_preemptions` before scheduling (the trace counts the step's
        preemptions), then `self.scheduler.schedule()`. An empty batch returns what the drain
        finished (it may have finished the last requests); if the drain finished nothing and
        requests still wait or run (`self.scheduler.is_finished()` is False), nothing could
        ever run them: raise RuntimeError. A decode batch gets its guesses
        (`self.propose(batch)`); if any sequence took one, verify the batch (`self.verify(...)`:
        it also counts the stats) and accept what it gained. Anything else (a prefill, or a
        decode where nobody guessed) runs as a stage 11 step that is resolved at once:
        `launched = self._launch_batch(...)`, commit it, then resolve it with
        `launched.token_ids()`.
        """
        raise NotImplementedError("task 4: SpeculativeEngine.step")
