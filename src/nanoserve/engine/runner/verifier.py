"""Stage 12's verify steps, as the overlap runner launches them: ahead of the step in flight
(`launch_ahead`, the n-gram proposer on one GPU) or once everything has landed (`verify_now`, a
draft model, or across GPUs).

Introduced in stage 12, given to its learner. The runner (engine/runner/overlap_runner.py) owns
the loop and the step in flight; it hands a plan with guesses here. The pieces of a verify step
that are not about launching it (packing, resolving guesses ahead, reading a verdict back) are
in engine/runner/verify_step.py.

    launch_ahead(batch, proposals, ahead):
        host:    pack the proposals, lengths, known tokens and budgets: one copy up
        device:  resolve_ahead -> k + 1 rows per sequence -> forward -> verdict -> record
                 (one graph replay when a captured shape holds it: StepGraphs.run_verify)
        host:    start copying [drawn | accepted | guesses] up; it lands with the next step
    verify_now(plan, guesses, draft_probs):
        each sequence's newest token and its guesses in one forward (decode rows when a graph
        replays them, else a chunk per sequence), the verdict, read back at once
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from nanoserve.engine.runner.cuda_graphs import DecodeGraphs, bucket_for
from nanoserve.engine.runner.device_batch import to_device_ints
from nanoserve.engine.runner.input_packer import InputPacker, verify_rows
from nanoserve.engine.runner.launched import Launched, needs_filter, send_up
from nanoserve.engine.runner.model_runner import StepFanout, forward_logits
from nanoserve.engine.runner.persistent_batch import PersistentBatch
from nanoserve.engine.runner.step_graphs import StepGraphs
from nanoserve.engine.runner.verify_step import (
    AheadShape,
    Guesses,
    most_lens,
    pack_ahead,
    record_logprobs,
    verify_ahead,
)
from nanoserve.logprobs import pending_logprobs
from nanoserve.samplers.speculative_sampler import Rule, verify
from nanoserve.types import HostMetadata, ScheduledBatch, Sequence, StepInputs, StepOutput


class Verifier:
    """The runner's parts a verify step needs, and the two ways to run one."""

    def __init__(
        self,
        model,
        attention,
        packer: InputPacker,
        state: PersistentBatch,
        rule: Rule,
        graphs: DecodeGraphs | None = None,
        steps: StepGraphs | None = None,
        workers: StepFanout | None = None,
    ):
        self.model, self.attention, self.packer, self.state = model, attention, packer, state
        self.rule, self.graphs, self.steps, self.workers = rule, graphs, steps, workers
        self.device = state.device

    @torch.inference_mode()
    def launch_ahead(
        self, batch: ScheduledBatch, proposals: list[list[int]], ahead: list[int]
    ) -> Launched:
        """A verify step queued while the step before may still run (guessing ahead).

        The host looked each sequence's guesses up from the tokens it knows, asking for as many
        more as the step in flight may still gain (`ahead`, the runner's `gains_in_flight`);
        the device keeps those that follow what that step did gain, feeds k + 1 decode rows per
        sequence, runs the forward and the verdict, and records each row's gain
        (`verify_ahead`): one graph replay where a captured shape holds the step, else launched
        op by op. Nothing waits: the verdict reaches the host with the next step's."""
        seqs, budgets = batch.seqs, batch.guesses
        rows = self.state.send(seqs)
        self.state.prime([self.state.row_of(seq) for seq in seqs], seqs)
        b, width = len(seqs), max(map(len, proposals), default=0) + 1
        sampling = (all(s.params.is_greedy for s in seqs), any(map(needs_filter, seqs)), self.rule)
        captured = None if self.steps is None else self.steps.verify_shape(b, max(budgets), width)
        shape = captured or self.eager_shape(b, max(budgets), width)
        k = shape.k  # rows per sequence: k + 1, past each budget padding (a captured bucket's)
        packed = to_device_ints(pack_ahead(seqs, proposals, budgets, shape), self.device)
        if captured is not None and self.steps is not None:  # one replay
            verdict = self.steps.run_verify(rows, packed, shape, sampling)
        else:
            padding = rows.new_full((shape.num_seqs - b,), self.state.padding_row)
            host = self.verify_host(seqs, ahead, budgets, shape)
            verdict = verify_ahead(self.state, self.every_row_logits, torch.cat([rows, padding]),
                                   packed, shape, sampling, host)  # fmt: skip
        self.mark_sampled(seqs)
        first_rows = verdict.logits[:: k + 1][:b]  # who asks logprobs guesses nothing
        logprobs = pending_logprobs(seqs, first_rows, verdict.drawn[:b])
        verdict_ints = torch.cat([verdict.drawn[:b], verdict.accepted[:b],
                                  verdict.guesses[:b].flatten()])  # fmt: skip
        values, ready, logprobs = send_up(verdict_ints, logprobs)
        bounds = list(range(0, b * (k + 1) + 1, k + 1))  # each sequence's rows, for --trace
        lens, tables = most_lens(seqs, ahead), [seq.block_table for seq in seqs]
        metadata = verdict.inputs.metadata._replace(host=HostMetadata(bounds, lens, tables))
        inputs = verdict.inputs._replace(metadata=metadata)
        return Launched(batch, inputs, list(range(b)), values, ready, logprobs, k)

    def every_row_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits at every decode row of a verify step, run eagerly."""
        num_rows = len(inputs.input_ids)
        logits = forward_logits(self.model, inputs, self.attention, num_rows, every_row=True)
        assert logits is not None, "one rank: the logits are here"
        return logits

    @staticmethod
    def eager_shape(num_seqs: int, k: int, width: int) -> AheadShape:
        """The shape of a verify step launched op by op: just what its guesses need."""
        return AheadShape(num_seqs, k, width)

    @staticmethod
    def verify_host(
        seqs: list[Sequence], ahead: list[int], budgets: tuple[int, ...], shape: AheadShape
    ) -> HostMetadata:
        """A verify step's host lists, k + 1 rows per sequence of the shape: each row's bound on
        its context (`most_lens` + j), or 0 and no table for a row past the sequence's budget
        and for the rows of padding sequences."""
        k, lens, tables = shape.k, [], []
        for seq, bound, budget in zip(seqs, most_lens(seqs, ahead), budgets):
            lens += [bound + j if j <= budget else 0 for j in range(k + 1)]
            tables += [seq.block_table if j <= budget else [] for j in range(k + 1)]
        lens += [0] * (shape.num_rows - len(lens))
        tables += [[]] * (shape.num_rows - len(tables))
        return HostMetadata(list(range(len(lens) + 1)), lens, tables)

    @torch.inference_mode()
    def verify_now(
        self, plan: ScheduledBatch, guesses: list[list[int]], draft_probs: torch.Tensor | None
    ) -> StepOutput:
        """The target over each sequence's newest token and guesses, in one forward; the
        verdict (kept guesses, then a drawn token) comes back at once."""
        seqs = plan.seqs
        rows = self.state.send(seqs)  # the table entries grown for the guesses included
        as_decode = self.verify_as_decode(sum(1 + len(g) for g in guesses))
        message = verify_rows(seqs, guesses, as_decode)
        inputs = self.packer.prepare_rows(message)
        with self.workers.step(message) if self.workers is not None else nullcontext():
            logits = forward_logits(self.model, inputs, self.attention, message.num_seqs,
                                    self.graphs, every_row=message.every_row)  # fmt: skip
        assert logits is not None, "rank 0 gathers the logits"
        packed = Guesses.of(seqs, guesses, self.device)
        tensors = self.state.sampling(rows, packed.positions, any(map(needs_filter, seqs)))
        verdict = verify(logits, packed.cu_seqlens_q, packed.draft_ids, packed.num_draft,
                         draft_probs, tensors, self.rule)  # fmt: skip
        self.state.record(rows, verdict.token_ids, packed.positions + verdict.num_accepted + 1)
        accepted, drawn = verdict.num_accepted.tolist(), verdict.token_ids.tolist()
        gained = [[*g[:a], t] for g, a, t in zip(guesses, accepted, drawn)]
        self.mark_sampled(seqs)
        record_logprobs(seqs, logits, packed.cu_rows, gained)
        return StepOutput(inputs, tuple(range(len(seqs))), gained, None, guesses)

    def verify_as_decode(self, num_rows: int) -> bool:
        """Decode rows when a captured graph can replay that many (no eager launches: what a
        small model's step is made of); else a chunk per sequence, which reads each context
        once, not once per row (an eager step, and the CPU's)."""
        return self.graphs is not None and bucket_for(num_rows, self.graphs.buckets) is not None

    def mark_sampled(self, seqs: list[Sequence]) -> None:
        """Each row's next token and length are on the device now (see DeviceBatch.prime)."""
        for seq in seqs:
            self.state.sampled[self.state.row_of(seq)] = True
