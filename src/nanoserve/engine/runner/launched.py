"""A step on its way: what the overlap runner hands itself between launching a step and its
tokens reaching the host, and the proposer a stage 12 runner asks for guesses.

Introduced in stage 11 (moved out of engine/runner/overlap_runner.py, which launches and waits).
`Launched` is one step the device runs or has run; `landed()` waits for its event and reads the
tokens back (a plain step: one token per sampling sequence; stage 12's verify step: its verdict,
[drawn | accepted | guesses], through `verdict_of`). `to_host` starts the copy into pinned memory
that `landed()` waits for. `Proposer`, `guesses_ahead` and `needs_filter` are what the runner asks
of a stage 12 proposer and of a sequence's sampling.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from nanoserve.engine.runner.verify_step import verdict_of
from nanoserve.logprobs import LogprobTensors, PendingLogprobs
from nanoserve.types import Landed, ScheduledBatch, Sequence, StepInputs


class Launched(NamedTuple):
    """A step the device is running (or has run): its batch and its tokens, once they land."""

    batch: ScheduledBatch
    inputs: StepInputs
    sampled: list[int]  # which of batch.seqs sample a token (a prefill chunk does not)
    tokens: torch.Tensor  # (len(sampled),) on the host; pinned and filled late on a GPU
    ready: torch.cuda.Event | None  # fires when `tokens` holds the step's tokens (None: CPU)
    logprobs: PendingLogprobs | None = None  # host copies beside `tokens`, when some row asked
    num_columns: int = 0  # a verify step's (stage 12): tokens = [drawn | accepted | guesses]

    def landed(self) -> Landed:
        """Wait for the step's tokens: per sequence of the batch, [its token], or [] for a
        prefill chunk that sampled nothing; after a verify step, its kept guesses then the drawn
        token (and what it guessed). The logprobs asked for are stored first."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.logprobs is not None:
            self.logprobs.record()
        values = self.tokens.tolist()
        if self.num_columns:
            return verdict_of(self.batch, values, self.num_columns)
        out: list[list[int]] = [[] for _ in self.batch.seqs]
        for i, token_id in zip(self.sampled, values):
            out[i] = [token_id]
        return Landed(self.batch, out)


class Proposer(Protocol):
    """Stage 12: what guesses (engine/speculation/): up to budgets[b] tokens for seqs[b], and
    the distribution each guess was drawn from ((B, K, V), or None when every guess is sure)."""

    def propose(
        self, seqs: list[Sequence], budgets: tuple[int, ...]
    ) -> tuple[list[list[int]], torch.Tensor | None]: ...


def guesses_ahead(proposer) -> bool:
    """True for a proposer that may guess while the step before is still in flight: it looks
    its guesses up from the tokens the host knows (n-gram), and the device keeps the ones that
    follow what that step gained (`resolve_ahead`). A draft model needs every token first."""
    return bool(getattr(proposer, "guesses_ahead", False))


def needs_filter(seq: Sequence) -> bool:
    """True when seq's sampling cuts the distribution (top-k or top-p)."""
    return seq.params.top_k is not None or seq.params.top_p < 1.0


def to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Start copying tensors to the host: (the host tensors, an event that fires when they are
    there). The tokens alone unless some row asked for logprobs."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for source, target in zip(tensors, host):
        target.copy_(source, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def send_up(
    values: torch.Tensor, logprobs: PendingLogprobs | None
) -> tuple[torch.Tensor, torch.cuda.Event | None, PendingLogprobs | None]:
    """Start copying a launched step's values (and the logprobs asked for) to the host: (the
    host values, the event `landed()` waits for, the logprobs now pointing at host copies)."""
    host, ready = to_host([values, *(logprobs.tensors if logprobs is not None else ())])
    if logprobs is not None:
        logprobs = logprobs._replace(tensors=LogprobTensors(*host[1:]))
    return host[0], ready, logprobs
