"""Stage 12's verify step, the parts that are not the runner's loop: how the guesses of a verify
step are packed for the verdict (`Guesses`, the synchronous verify), the step that judges guesses
looked up ahead (`pack_ahead`, `verify_ahead`, with `resolve_ahead` picking them on the device),
read back from the host copy of a verdict (`verdict_of`), and the logprobs of kept tokens
(`record_logprobs`). The runner that uses them is engine/runner/overlap_runner.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from nanoserve.engine.runner.device_batch import DeviceBatch, to_device_ints
from nanoserve.logprobs import PendingLogprobs, logprob_tensors
from nanoserve.samplers.speculative_sampler import Rule, verify
from nanoserve.types import HostMetadata, Landed, ScheduledBatch, Sequence, StepInputs


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


def most_lens(seqs: list[Sequence], ahead: list[int]) -> list[int]:
    """The most tokens each sequence may hold once the step in flight lands: its length, plus
    the guesses that step may keep (ahead - 1 of the tokens it may gain)."""
    return [len(seq) + max(a - 1, 0) for seq, a in zip(seqs, ahead)]


class AheadShape(NamedTuple):
    """The shape of a verify step judging guesses looked up ahead: num_seqs sequences (padding
    ones included), k guesses each at most (k + 1 decode rows per sequence: row j feeds the token
    the step before drew, j = 0, or guess j - 1), and width proposal tokens per sequence. A
    captured graph is recorded per shape; a sequence with fewer guesses pads its rows."""

    num_seqs: int
    k: int
    width: int

    @property
    def num_rows(self) -> int:
        """Decode rows of the step: k + 1 per sequence."""
        return self.num_seqs * (self.k + 1)


def pack_ahead(
    seqs: list[Sequence], proposals: list[list[int]], budgets: tuple[int, ...], shape: AheadShape
) -> list[int]:
    """A verify step's host ints, one copy to the device: [proposals (S, W), -1 padded | their
    lengths (S) | tokens the host knows (S) | guess budgets (S)]; a padding sequence has none."""
    pad = shape.num_seqs - len(seqs)
    flat = [x for p in proposals for x in p + [-1] * (shape.width - len(p))]
    flat += [-1] * (pad * shape.width)
    lens = [len(p) for p in proposals] + [0] * pad
    known = [len(seq.token_ids) for seq in seqs] + [0] * pad
    return flat + lens + known + list(budgets) + [0] * pad


class AheadVerdict(NamedTuple):
    """What a verify step judging guesses looked up ahead leaves on the device."""

    inputs: StepInputs  # its decode rows, k + 1 per sequence (rows past a budget: padding)
    logits: torch.Tensor  # (S * (k + 1), V)
    drawn: torch.Tensor  # (S,) the token drawn after the kept guesses
    accepted: torch.Tensor  # (S,) guesses kept
    guesses: torch.Tensor  # (S, k) the guesses judged, -1 padded


def verify_ahead(
    state: DeviceBatch,
    forward: Callable[[StepInputs], torch.Tensor],
    seq_rows: torch.Tensor,
    packed: torch.Tensor,
    shape: AheadShape,
    sampling: tuple[bool, bool, Rule],
    host: HostMetadata,
    out: StepInputs | None = None,
) -> AheadVerdict:
    """Stage 12, guessing ahead: judge each sequence's guesses, all on the device, in shapes
    fixed by `shape` (so that a CUDA graph can record it: engine/runner/step_graphs.py).

    seq_rows (S,): each sequence's device row (padding: the batch's padding row, context 0);
    packed: `pack_ahead`'s ints; forward: decode rows -> logits (every row); sampling:
    (every row greedy, any row filters, the rejection rule); host: the rows' host lists (not
    read inside a graph); out: the static buffers to write the rows into (None: fresh).

    The device keeps the proposals' tokens that follow what the step in flight gained
    (`resolve_ahead`), feeds row (s, j) at position ctx + j - 1 where ctx = seq_lens[row],
    runs the forward and the verdict (`verify`), and records each row's next token and length.
    Row (s, j) is padding (stores and reads nothing) past the sequence's budget.

        ctx 7, budget 2 of k 3, guesses [9, 4]: rows feed (next, 9, 4, pad) at 6, 7, 8, -
    """
    s, k, w = shape
    greedy, filters, rule = sampling
    device = seq_rows.device
    proposals, lens, known, budgets = packed.split([s * w, s, s, s])
    ctx = state.seq_lens[seq_rows].long()  # each sequence's first guess sits at ctx
    guesses, num_draft = resolve_ahead(proposals.view(s, w), lens, ctx - known, budgets, k)
    owner = torch.arange(s, device=device).repeat_interleave(k + 1)  # row -> its sequence
    j = torch.arange(k + 1, device=device).repeat(s)  # row -> its place in the sequence
    rows = seq_rows[owner]
    guess = guesses[owner, (j - 1).clamp(min=0)].clamp(min=0)  # -1 (none) feeds token 0
    ids = torch.where(j == 0, state.next_token_ids[rows], guess)
    live = (j <= budgets[owner]) & (ctx[owner] > 0)
    inputs = state.fill_rows(rows, torch.where(live, ctx[owner] + j, 0).int(), ids, host, out)
    logits = forward(inputs)
    cu = torch.arange(0, s * (k + 1) + 1, k + 1, device=device)
    tensors = state.sampling(seq_rows, ctx, filters)
    verdict = verify(logits, cu, guesses, num_draft, None, tensors, rule, greedy)
    accepted, drawn = verdict.num_accepted, verdict.token_ids
    state.record(seq_rows, drawn, torch.where(ctx > 0, ctx + accepted + 1, 0))
    return AheadVerdict(inputs, logits, drawn, accepted, guesses)


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
