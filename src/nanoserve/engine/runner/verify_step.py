"""Stage 12's verify step, the parts that are not the runner's loop: how the guesses of a verify
step are packed for the verdict (`Guesses`, the synchronous verify), picked on the device when
they were looked up ahead (`resolve_ahead`), read back from the host copy of a verdict
(`verdict_of`), and the logprobs of kept tokens (`record_logprobs`). The runner that uses them
is engine/runner/overlap_runner.py.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from nanoserve.engine.runner.device_batch import to_device_ints
from nanoserve.logprobs import PendingLogprobs, logprob_tensors
from nanoserve.types import Landed, ScheduledBatch, Sequence


def verdict_of(batch: ScheduledBatch, values: list[int], k: int) -> Landed:
    """A verify step's tokens from its host copy [drawn (B) | accepted (B) | guesses (B, k)]:
    per sequence its kept guesses then its drawn token, and what it guessed (-1: none)."""
    b = len(batch.seqs)
    drawn, accepted, flat = values[:b], values[b : 2 * b], values[2 * b :]
    guesses = [[g for g in flat[i * k : (i + 1) * k] if g >= 0] for i in range(b)]
    gained = [[*g[:a], t] for g, a, t in zip(guesses, accepted, drawn)]
    return Landed(batch, gained, guesses)


def resolve_ahead(
    proposals: torch.Tensor, lens: torch.Tensor, gained: torch.Tensor, budgets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 12, guessing ahead: each sequence's guesses, picked on the device.

    proposals (B, W): what the host looked up after the tokens it knows (lens[b] of them real,
    -1 after); the step in flight gained[b] tokens past those (the device's length minus the
    host's). The guesses are the proposal's tokens after those, at most budgets[b]: the first
    ones stood for the tokens in flight. Returns the guesses (B, k), -1 padded, and how many
    each has (B,).

        host knows ... 5 8, proposal [2, 7, 9, 8, 2], the step in flight gained 2 tokens:
        guesses [9, 8, 2] (kept only if 2 and 7 were what it gained, and the target agrees)
    """
    steps = torch.arange(k, device=proposals.device)[None, :]
    picked = proposals.gather(1, (gained[:, None] + steps).clamp(max=proposals.shape[1] - 1))
    num = torch.minimum(lens - gained, budgets).clamp(min=0)
    return torch.where(steps < num[:, None], picked, -1), num


class Guesses(NamedTuple):
    """A verify step's guesses packed for the verdict (one copy up)."""

    cu_rows: list[int]  # where each sequence's logits rows start (k + 1 rows each)
    draft_ids: torch.Tensor  # (B, K) the guesses, padded with -1 to the most any made
    num_draft: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,) L: each sequence's length, its first guess's position
    cu_seqlens_q: torch.Tensor  # (B + 1,) the cu_rows

    @classmethod
    def of(cls, seqs: list[Sequence], guesses: list[list[int]], device) -> Guesses:
        num_draft = [len(g) for g in guesses]
        k, b = max(num_draft), len(seqs)
        flat = [x for g in guesses for x in g + [-1] * (k - len(g))]
        cu_rows = list(itertools.accumulate((n + 1 for n in num_draft), initial=0))
        packed = to_device_ints(flat + num_draft + [len(s) for s in seqs] + cu_rows, device)
        draft_ids, num_draft_t, lens_t, cu = packed.split([b * k, b, b, b + 1])
        return cls(cu_rows, draft_ids.view(b, k), num_draft_t, lens_t, cu)


def record_logprobs(seqs, logits: torch.Tensor, cu_rows: list[int], gained) -> None:
    """For the sequences that ask (SamplingParams.logprobs): each gained token's logprobs, from
    the row that judged it (row j of a sequence scores the token at position L + j)."""
    asking = [b for b, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not asking:
        return
    owners, indices, rows, tokens = [], [], [], []
    for b in asking:
        first = len(seqs[b]) - seqs[b].num_prompt_tokens  # the completion index of L
        for j, token_id in enumerate(gained[b]):
            owners.append(seqs[b])
            indices.append(first + j)
            rows.append(cu_rows[b] + j)
            tokens.append(token_id)
    k = max(seqs[b].params.logprobs for b in asking)
    picked = torch.tensor(rows, device=logits.device)
    tensors = logprob_tensors(logits[picked], torch.tensor(tokens, device=logits.device), k)
    PendingLogprobs(owners, indices, tensors).record()
