"""The given parts of stage 12's loop: proposal budgets, the proposer, the verify step's
bookkeeping and the acceptance counters.

Introduced in stage 12, given to its learner (who writes `add_proposal`, `accept` and `step`,
in engine/speculation/speculative_engine.py). Here: how many guesses a sequence may take (never past
max_tokens or max_model_len, nor past what a captured graph replays), the back-off that lets
the steps nobody guesses in overlap (`may_guess`; `drain` is stage 11's), which proposer
guesses (n-gram or a draft), a failed step's proposals taken back, and what `bench`,
`--trace` and `/metrics` report.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from nanoserve.engine.loop.overlap_engine import OverlapEngine, OverlapScheduler
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.speculation.draft_proposer import Draft, DraftProposer
from nanoserve.engine.speculation.ngram_proposer import NgramProposer, propose_ngram
from nanoserve.engine.speculation.speculative_runner import SpeculativeRunner, Verified
from nanoserve.samplers.speculative_sampler import RULE, Rule
from nanoserve.types import ScheduledBatch, Sequence


class SpeculationStats(NamedTuple):
    """Proposals made and kept since the engine started."""

    num_verify_steps: int = 0  # steps that verified proposals
    num_verified_seqs: int = 0  # sequence-steps inside them
    num_proposed: int = 0  # guesses judged
    num_accepted: int = 0  # guesses kept

    @property
    def acceptance_rate(self) -> float:
        """Kept guesses per guess (0 before the first)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verified sequence gains per step: kept guesses plus the one drawn."""
        seqs = self.num_verified_seqs
        return (self.num_accepted + seqs) / seqs if seqs else 0.0


class Backoff:
    """When guessing does not pay: a sequence whose guesses all missed (or which found none)
    waits 2, then 4, ... up to MAX_WAIT steps before it guesses again; a kept guess resets it.

    A sequence waiting w steps may guess only on steps that are multiples of w, so the waiting
    sequences guess on the same steps and the steps between them run as stage 11's, overlapped.
    Where guesses never hit (random text), one step in MAX_WAIT is a speculative one.
    """

    MAX_WAIT = 64

    def __init__(self):
        self.wait: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def is_open(self, seq: Sequence, step: int) -> bool:
        """True when seq may guess on this step number."""
        return step % self.wait.get(seq, 1) == 0

    def missed(self, seq: Sequence) -> None:
        """seq guessed nothing that was kept: wait twice as long (at most MAX_WAIT)."""
        self.wait[seq] = min(2 * self.wait.get(seq, 1), self.MAX_WAIT)

    def hit(self, seq: Sequence) -> None:
        """seq kept a guess: it guesses every step again."""
        self.wait.pop(seq, None)


class SpeculativeSchedulerBase(OverlapScheduler):
    """Stage 11's scheduler, with budgets for guesses and a way to take them back."""

    manager: BlockManager  # stage 12 runs on blocks (stage 04's or stage 07's manager)

    def add_proposal(self, seq: Sequence, token_id: int) -> bool:
        """Append one guess to seq if memory allows (the learner's, in speculative_engine.py)."""
        raise NotImplementedError

    def budget(self, seq: Sequence, k: int) -> int:
        """How many guesses seq may take: at most k, and few enough that every kept one plus
        the token drawn after them stays within max_tokens and max_model_len."""
        left = seq.params.max_tokens - seq.num_completion_tokens - 1
        room = self.config.max_model_len - len(seq) - 1
        return max(0, min(k, left, room))

    def discard_proposals(self, seqs: list[Sequence]) -> None:
        """A step that failed: its guesses leave the sequences and their blocks (if any grew)."""
        for seq in seqs:
            if seq.num_draft_tokens:
                del seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
                seq.num_scheduled_tokens -= seq.num_draft_tokens
                seq.num_draft_tokens = 0
                self.manager.truncate(seq, len(seq))


class SpeculativeEngineBase(OverlapEngine):
    """Stage 11's engine with a proposer and a verify step: a step that may guess is
    synchronous (it drains the step in flight first), the others overlap as in stage 11."""

    runner: SpeculativeRunner
    scheduler: SpeculativeSchedulerBase
    Scheduler: type[SpeculativeSchedulerBase] = SpeculativeSchedulerBase

    def __init__(
        self, *args, lookup=propose_ngram, rule: Rule = RULE, draft: Draft | None = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        config = self.config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.rule = (
            rule  # the rejection rule's two functions (a learner's, or samplers/rejection.py's)
        )
        self.proposer: NgramProposer | DraftProposer
        if speculative_method(config) == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min,
                                          lookup)  # fmt: skip
        elif draft is not None:  # a separate model, its own pages (the recipe built them)
            self.proposer = DraftProposer(self.runner, draft, shares_pages=False)
        else:  # self-speculation: the target's first layers, on the target's pages
            num_layers = config.draft_num_layers or self.runner.model.config.num_hidden_layers // 2
            own = Draft(self.runner.model, self.runner.attention, max(1, num_layers))
            self.proposer = DraftProposer(self.runner, own, shares_pages=True)
        self.speculation = SpeculationStats()
        self.backoff = Backoff()

    def may_guess(self) -> bool:
        """True when some running sequence may guess on the next step (see Backoff); when none
        may, the next step is stage 11's, launched before the one in flight is resolved."""
        step = self.num_steps + 1
        return any(self.backoff.is_open(seq, step) for seq in self.scheduler.running)

    def propose(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Let the proposer guess for every sequence of a decode batch (each guess appended by
        the scheduler's add_proposal); the draft's distributions, or None for n-gram guesses."""
        self.runner.forget(batch.freed)  # a draft model takes rows for the batch's sequences
        k, step = self.guesses_per_sequence(len(batch.seqs)), self.num_steps + 1
        budgets = [
            self.scheduler.budget(seq, k) if self.backoff.is_open(seq, step) else 0
            for seq in batch.seqs
        ]
        try:
            draft_probs = self.proposer.propose(batch.seqs, budgets, self.scheduler.add_proposal)
        except BaseException:
            self.scheduler.discard_proposals(batch.seqs)
            raise
        for seq, budget in zip(batch.seqs, budgets):
            if budget and not seq.num_draft_tokens:  # it looked and found nothing to guess
                self.backoff.missed(seq)
        return draft_probs

    def guesses_per_sequence(self, num_seqs: int) -> int:
        """num_speculative_tokens, or fewer where a graph replays the verify step: a batch of
        B sequences then guesses at most (largest bucket - B) // B each, so its rows still fit
        the graphs (B = 256 of 512 rows: one guess each). A wide batch gains least from
        guessing anyway: its step already does much work per weight read."""
        graphs = self.runner.graphs
        if graphs is None:
            return self.num_speculative_tokens
        room = (graphs.buckets[-1] - num_seqs) // num_seqs
        return max(0, min(self.num_speculative_tokens, room))

    def verify(
        self, batch: ScheduledBatch, draft_probs: torch.Tensor | None, num_preempted_before: int
    ) -> Verified:
        """Run the verify step; count what it proposed and kept, and tell --trace."""
        try:
            verified = self.runner.verify(batch, draft_probs, self.rule)
        except BaseException:
            self.scheduler.discard_proposals(batch.seqs)
            raise
        proposed = sum(seq.num_draft_tokens for seq in batch.seqs)
        kept = sum(len(gained) - 1 for gained in verified.token_ids)
        for seq, gained in zip(batch.seqs, verified.token_ids):
            if len(gained) > 1:
                self.backoff.hit(seq)
            elif seq.num_draft_tokens:
                self.backoff.missed(seq)
        s = self.speculation
        self.speculation = SpeculationStats(
            s.num_verify_steps + 1,
            s.num_verified_seqs + len(batch.seqs),
            s.num_proposed + proposed,
            s.num_accepted + kept,
        )
        self.count_step(batch, verified.inputs, num_preempted_before, verified.token_ids)
        return verified


def speculative_method(config) -> str:
    """The proposer a config asks for: its speculative_method, else draft when it names a
    speculative_model, else ngram (as vLLM infers the method from the options given)."""
    return config.speculative_method or ("draft" if config.speculative_model else "ngram")
