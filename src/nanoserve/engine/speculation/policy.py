"""When and how much to guess: the speculation policy the scheduler plans with (stage 12).

Introduced in stage 12, given to its learner. Each decode plan says how many guesses each of its
sequences may take (`ScheduledBatch.guesses`); the runner's proposer takes at most that many. The
policy decides:

- how many: `num_speculative_tokens`, never past max_tokens or max_model_len (a kept guess plus
  the token drawn after the kept ones must still fit), and few enough that the verify step's rows
  still fit the largest captured graph (a batch replaying bucket b: (rows - b) // b each);
- when: a sequence whose guesses all missed (or which found none) backs off (`Backoff`), so the
  steps nobody guesses in run as stage 11's, overlapped;
- what it cost and gained: `SpeculationStats`, read by bench, --trace and /metrics.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from nanoserve.engine.runner.cuda_graphs import bucket_for, graph_buckets
from nanoserve.types import Sequence

# (batch size, guesses per sequence): how many a batch of up to that many sequences may take;
# past the last entry, its count. Measured on the H200 (docs/benchmarks.md, "Stage 12 guessing
# ahead"): alone, 4 guesses paid (the repeat workload, SmolLM2); at 16 sequences 2 guesses lost
# (0.76x stage 11). Batches between are not measured yet, so they do not guess.
GUESSES_BY_BATCH = ((1, 4), (2, 0))


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

    def counted(self, guesses: list[list[int]], tokens: list[list[int]]) -> SpeculationStats:
        """These stats after one verify step (per sequence: what it guessed, what it gained)."""
        return SpeculationStats(
            self.num_verify_steps + 1,
            self.num_verified_seqs + len(tokens),
            self.num_proposed + sum(map(len, guesses)),
            self.num_accepted + sum(len(gained) - 1 for gained in tokens),
        )


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


class Speculation:
    """The scheduler's part of stage 12: each decode plan's guess budgets, and the back-off.

    ahead: the runner verifies guesses while the step before is in flight (n-gram on one GPU),
    so plans guess without waiting for it; else (a draft model) a plan guesses only once every
    token is known. by_batch: (batch size, guesses) steps: a batch of up to that many sequences
    guesses at most that many each (the widest step's count holds past the last)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_model_len: int,
        graph_rows: int | None,
        ahead: bool = False,
        by_batch: tuple[tuple[int, int], ...] = (),
    ):
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.graph_rows = graph_rows  # the largest batch a captured graph replays (None: eager)
        self.ahead = ahead
        self.by_batch = by_batch
        self.backoff = Backoff()

    @classmethod
    def of(cls, config, graph_rows: int | None, ahead: bool) -> Speculation:
        """The policy a config asks for: num_speculative_tokens at every batch size, or, when
        it is None, GUESSES_BY_BATCH's count for each batch size."""
        k = config.num_speculative_tokens
        by_batch = GUESSES_BY_BATCH if k is None else ()
        k = max(g for _, g in GUESSES_BY_BATCH) if k is None else k
        return cls(k, config.max_model_len, graph_rows, ahead, by_batch)

    def may_guess(self, running, step: int) -> bool:
        """True when some running sequence may guess on this step number (see Backoff); when
        none may, the step is stage 11's, launched before the one in flight has landed."""
        return any(self.backoff.is_open(seq, step) for seq in running)

    def budgets(self, seqs: list[Sequence], step: int, ahead=None) -> tuple[int, ...]:
        """How many guesses each sequence of a decode plan may take on this step number; ahead:
        per sequence, the guesses the step in flight may still keep it (None: none)."""
        k = self.guesses_per_sequence(max(1, len(seqs)))
        if k == 0:  # a wide batch: nobody guesses (and the host spends nothing on it)
            return (0,) * len(seqs)
        ahead = ahead or [0] * len(seqs)
        return tuple(
            self.budget(seq, k, a) if self.backoff.is_open(seq, step) else 0
            for seq, a in zip(seqs, ahead)
        )

    def budget(self, seq: Sequence, k: int, ahead: int = 0) -> int:
        """At most k, and few enough that every kept guess plus the token drawn after them stays
        within max_tokens and max_model_len, even when the step in flight keeps `ahead` more.
        A request that asks for logprobs does not guess ahead (its index must be known)."""
        if self.ahead and seq.params.logprobs is not None:
            return 0
        left = seq.params.max_tokens - (seq.num_completion_tokens + seq.num_pending + ahead) - 1
        room = self.max_model_len - (len(seq) + ahead) - 1
        return max(0, min(k, left, room))

    def guesses_per_sequence(self, num_seqs: int) -> int:
        """num_speculative_tokens, or fewer where a graph replays the verify step: a batch of
        B sequences replays the bucket of B (padding sequences included), so it guesses at
        most (largest bucket - bucket) // bucket each and its rows still fit the graphs (256
        of 512 rows: one guess each; 5 sequences of 16 rows replay bucket 8: one). A wide batch
        gains least from guessing anyway: its step already does much work per weight read."""
        k = self.k
        for batch, guesses in self.by_batch:
            k = min(self.k, guesses)
            if num_seqs <= batch:
                break
        if self.graph_rows is None:
            return k
        bucket = bucket_for(num_seqs, graph_buckets(self.graph_rows)) or num_seqs
        return max(0, min(k, (self.graph_rows - bucket) // bucket))

    def judged(self, plan, tokens: list[list[int]] | None) -> None:
        """After a plan with guess budgets ran: a sequence that kept a guess guesses every step
        again; one that was offered guesses and kept none (or found none) waits longer. tokens
        None: nobody found a guess, and the step ran as stage 11's."""
        for i, (seq, budget) in enumerate(zip(plan.seqs, plan.guesses)):
            if tokens is not None and len(tokens[i]) > 1:
                self.backoff.hit(seq)
            elif budget:
                self.backoff.missed(seq)
