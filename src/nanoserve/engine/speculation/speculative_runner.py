"""The speculative runner: stage 11's runner plus the verify step, one target forward over every
sequence's newest token and its guesses, with logits at every one of them.

Introduced in stage 12, given to its learner. A sequence of length L (its newest token t not
yet cached) with guesses d_1 .. d_k feeds [t, d_1, .., d_k] at positions L - 1 .. L - 1 + k.
Trace, block_size 4, L = 6, table [5, 2], guesses [9, 8]:

    as decode rows (a graph replays them)        as one chunk (eager, and the CPU's)
    row 0: t  @5  slot 9   context 6             rows t@5 d1@6 d2@7, slots 9 10 11
    row 1: d1 @6  slot 10  context 7             cu_seqlens_q [0, 3], context 8, causal
    row 2: d2 @7  slot 11  context 8             inside the chunk (stage 06's prefill kernel)

The same arithmetic either way: each row sees exactly its own prefix (the rows' K/V is stored
before attention reads it). Decode rows let stage 08's graphs replay the step, which is what a
small model's step is made of on a GPU, but read each context once per row; the chunk reads it
once per sequence. Row 0's logits judge d1, row 1's d2, row 2's give a bonus token if both are
kept. The verdict returns to the host (a guessing step is synchronous: the next guesses need
these tokens), and the device batch learns each row's next token and length, as after a stage
11 step.
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch

from nanoserve.engine.memory.kv_manager import blocks_for
from nanoserve.engine.runner.cuda_graphs import bucket_for
from nanoserve.engine.runner.device_batch import to_device_ints
from nanoserve.engine.runner.model_runner import forward_logits
from nanoserve.engine.runner.overlap_runner import OverlapRunner, needs_filter
from nanoserve.logprobs import PendingLogprobs, logprob_tensors
from nanoserve.samplers.speculative_sampler import RULE, Rule, verify
from nanoserve.types import ScheduledBatch, Sequence, StepInputs, StepMessage, StepRow


class Verified(NamedTuple):
    """A verify step's outcome on the host: per sequence, the tokens it gains (the kept
    proposals, then one the target drew), and the inputs it ran (for --trace)."""

    token_ids: list[list[int]]
    inputs: StepInputs


class SpeculativeRunner(OverlapRunner):
    """An overlap runner that can also verify proposals (the last num_draft_tokens of each
    sequence's token_ids) in one forward."""

    def verify_message(self, seqs: list[Sequence]) -> StepMessage:
        """Decode rows when a captured graph can replay that many (no eager launches: what a
        small model's step is made of); else a chunk per sequence, which reads each context
        once, not once per row (an eager step, and the CPU's)."""
        num_rows = sum(len(seq) - seq.num_cached_tokens for seq in seqs)
        fits = self.graphs is not None and bucket_for(num_rows, self.graphs.buckets) is not None
        return verify_rows(seqs, as_decode=fits)

    @torch.inference_mode()
    def verify(
        self, batch: ScheduledBatch, draft_probs: torch.Tensor | None, rule: Rule = RULE
    ) -> Verified:
        """Run the target over each sequence's newest token and proposals; judge them."""
        seqs = batch.seqs
        self.forget(batch.freed)
        rows = self.state.send(seqs)  # the table entries grown for the proposals included
        message = self.verify_message(seqs)
        inputs = self.packer.prepare_rows(message)
        fan_out: AbstractContextManager = nullcontext()
        if self.workers is not None:  # every rank runs the same step
            fan_out = self.workers.step(message)
        with fan_out:
            logits = forward_logits(self.model, inputs, self.attention, message.num_seqs,
                                    self.graphs, every_row=message.every_row)  # fmt: skip
        assert logits is not None, "rank 0 gathers the logits"
        guesses = Guesses.of(seqs, self.device)
        tensors = self.state.sampling(rows, guesses.positions, any(map(needs_filter, seqs)))
        verdict = verify(logits, guesses.cu_seqlens_q, guesses.draft_ids, guesses.num_draft,
                         draft_probs, tensors, rule)  # fmt: skip
        self.state.record(rows, verdict.token_ids, guesses.positions + verdict.num_accepted + 1)
        accepted, drawn = verdict.num_accepted.tolist(), verdict.token_ids.tolist()
        self.cut_sent_tables(seqs, guesses.lens, accepted)
        gained = [[*d[:a], t] for d, a, t in zip(guesses.drafts, accepted, drawn)]
        record_logprobs(seqs, logits, guesses.cu_rows, guesses.lens, gained)
        return Verified(gained, inputs)

    def cut_sent_tables(self, seqs: list[Sequence], lens: list[int], accepted: list[int]):
        """The rollback keeps the blocks of the L + a tokens whose K/V stays: past them the
        device's table entries are stale, and the next growth must send its block again."""
        for seq, length, a in zip(seqs, lens, accepted):
            row = self.state.row_of(seq)
            self.state.sampled[row] = True  # its next token and length are on the device
            kept = blocks_for(length + a, self.packer.block_size)
            self.state.num_sent[row] = min(self.state.num_sent[row], kept)


class Guesses(NamedTuple):
    """A verify step's guesses: on the host, and packed for the verdict (one copy up)."""

    drafts: list[list[int]]  # per sequence, its guesses padded with -1 to the most any made
    lens: list[int]  # L: each sequence's length before its guesses (its first guess's position)
    cu_rows: list[int]  # where each sequence's logits rows start (k + 1 rows each)
    draft_ids: torch.Tensor  # (B, K) the drafts on the device
    num_draft: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,) the lens
    cu_seqlens_q: torch.Tensor  # (B + 1,) the cu_rows

    @classmethod
    def of(cls, seqs: list[Sequence], device) -> Guesses:
        """The guesses of seqs (the last num_draft_tokens of each one's token_ids)."""
        num_draft = [seq.num_draft_tokens for seq in seqs]
        k, b = max(num_draft), len(seqs)
        drafts = [seq.token_ids[len(seq) - n :] + [-1] * (k - n) for seq, n in zip(seqs, num_draft)]
        lens = [len(seq) - n for seq, n in zip(seqs, num_draft)]
        cu_rows = list(itertools.accumulate((n + 1 for n in num_draft), initial=0))
        flat = [x for d in drafts for x in d]
        packed = to_device_ints(flat + num_draft + lens + cu_rows, device)
        draft_ids, num_draft_t, lens_t, cu = packed.split([b * k, b, b, b + 1])
        return cls(drafts, lens, cu_rows, draft_ids.view(b, k), num_draft_t, lens_t, cu)


def verify_rows(seqs: list[Sequence], as_decode: bool) -> StepMessage:
    """The verify step's rows: what each sequence computes (its newest token, then its guesses),
    as one decode row per token (each at its own position over the sequence's table, so it
    reads exactly its own prefix: the rows before it in the step are stored first), or as one
    prefill-shaped chunk per sequence (causal among its rows), with logits at every row."""
    if not as_decode:
        rows = [StepRow(s.token_ids[s.num_cached_tokens :], s.num_cached_tokens, s.block_table)
                for s in seqs]  # fmt: skip
        return StepMessage(True, rows, len(rows), every_row=True)
    rows = []
    for seq in seqs:
        start, table = seq.num_cached_tokens, seq.block_table
        rows += [StepRow([t], start + j, table) for j, t in enumerate(seq.token_ids[start:])]
    return StepMessage(False, rows, len(rows))


def record_logprobs(seqs, logits: torch.Tensor, cu_rows: list[int], lens: list[int], gained):
    """For the sequences that ask (SamplingParams.logprobs): each gained token's logprobs, from
    the row that judged it (row j of a sequence scores the token at position L + j)."""
    asking = [b for b, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not asking:
        return
    owners, indices, rows, tokens = [], [], [], []
    for b in asking:
        first = lens[b] - seqs[b].num_prompt_tokens  # the completion index of L
        for j, token_id in enumerate(gained[b]):
            owners.append(seqs[b])
            indices.append(first + j)
            rows.append(cu_rows[b] + j)
            tokens.append(token_id)
    k = max(seqs[b].params.logprobs for b in asking)
    picked = torch.tensor(rows, device=logits.device)
    tensors = logprob_tensors(logits[picked], torch.tensor(tokens, device=logits.device), k)
    PendingLogprobs(owners, indices, tensors).record()
