"""The speculative runner: stage 11's runner plus the verify step, one target forward over every
sequence's newest token and its proposals, with logits at every row.

Introduced in stage 12, given to its learner. A verify step is shaped like a chunked prefill: a
sequence of length L (its newest token t not yet cached) with proposals d_1 .. d_k feeds
[t, d_1, .., d_k] at positions L - 1 .. L - 1 + k over its cached prefix, so the paged prefill
kernel computes it unchanged. Trace, block_size 4, L = 6, table [5, 2], proposals [9, 8]:

    rows    t@5  d1@6  d2@7        slots 2*4+1, 2*4+2, 2*4+3       cu_seqlens_q [0, 3]
    logits  row 0 judges d1, row 1 judges d2, row 2 gives a bonus token if both are kept

The verdict returns to the host (speculative steps are synchronous: the next proposal needs
these tokens), and the device batch learns each row's next token and length, as after a stage
11 step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch

from nanoserve.engine.device_batch import to_device_ints
from nanoserve.engine.kv_manager import blocks_for
from nanoserve.engine.model_runner import forward_logits
from nanoserve.engine.overlap_runner import OverlapRunner, needs_filter
from nanoserve.speculative_sampler import RULE, Rule, verify
from nanoserve.types import ScheduledBatch, StepInputs


class Verified(NamedTuple):
    """A verify step's outcome on the host: per sequence, the tokens it gains (the kept
    proposals, then one the target drew), and the inputs it ran (for --trace)."""

    token_ids: list[list[int]]
    inputs: StepInputs


class SpeculativeRunner(OverlapRunner):
    """An overlap runner that can also verify proposals (the last num_draft_tokens of each
    sequence's token_ids) in one forward."""

    @torch.inference_mode()
    def verify(
        self, batch: ScheduledBatch, draft_probs: torch.Tensor | None, rule: Rule = RULE
    ) -> Verified:
        """Run the target over each sequence's newest token and proposals; judge them."""
        seqs = batch.seqs
        rows = self.state.send(seqs)  # the table entries grown for the proposals included
        prefill = ScheduledBatch(seqs, is_prefill=True)  # rows: num_scheduled_tokens = k + 1
        inputs = self.packer.prepare(prefill)
        fan_out: AbstractContextManager = nullcontext()
        if self.workers is not None:  # every rank runs it; rank 0 gathers every row's logits
            fan_out = self.workers.step(self.packer.rows(prefill)._replace(every_row=True))
        with fan_out:
            logits = forward_logits(self.model, inputs, self.attention, len(seqs), every_row=True)
        assert logits is not None, "rank 0 gathers the logits"
        num_draft = [seq.num_draft_tokens for seq in seqs]
        k = max(num_draft)
        drafts = [seq.token_ids[len(seq) - n :] + [-1] * (k - n) for seq, n in zip(seqs, num_draft)]
        lens = [len(seq) - n for seq, n in zip(seqs, num_draft)]  # L: each first guess's position
        packed = to_device_ints([x for d in drafts for x in d] + num_draft + lens, self.device)
        b = len(seqs)
        draft_ids = packed[: b * k].view(b, k)
        num_draft_t, positions = packed[b * k : b * k + b], packed[b * k + b :]
        filters = any(needs_filter(seq) for seq in seqs)
        tensors = self.state.sampling(rows, positions, filters)
        verdict = verify(logits, inputs.metadata.cu_seqlens_q, draft_ids, num_draft_t,
                         draft_probs, tensors, rule)  # fmt: skip
        self.state.record(rows, verdict.token_ids, positions + verdict.num_accepted + 1)
        accepted, drawn = verdict.num_accepted.tolist(), verdict.token_ids.tolist()
        for seq, length, a in zip(seqs, lens, accepted):
            row = self.state.row_of(seq)
            self.state.sampled[row] = True
            # the rollback keeps the blocks of the L + a tokens whose K/V stays: past them the
            # device's entries are stale, and the next growth must send its block again
            kept = blocks_for(length + a, self.packer.block_size)
            self.state.num_sent[row] = min(self.state.num_sent[row], kept)
        gained = [[*d[:a], t] for d, a, t in zip(drafts, accepted, drawn)]
        return Verified(gained, inputs)
