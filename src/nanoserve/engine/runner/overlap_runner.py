"""The overlap runner: one step in flight. `execute(plan)` launches the plan's step on the
device, then waits for the step launched before it and hands back those tokens.

Introduced in stage 11. `ModelRunner.execute` returns the plan's own tokens, so the host waits
for the device at every step. Here `launch` returns a `Launched` step instead: inputs sent (only
what changed, through the persistent batch), forward and sampling queued on the device, the
sampled tokens on their way to pinned host memory behind an event. Nothing in it waits for the
device, so the host's work for the next step runs while this one computes:

    host:    schedule N+1 | launch N+1 | wait N -> update (N lands, N+1 commits) | schedule N+2
    device:  ...  step N  ...........  | step N+1 ...................................... |

Stage 12 adds a proposer and a verify step (engine/runner/verifier.py). With the n-gram
proposer on one device a verify step is launched like any other (`Verifier.launch_ahead`): the
host looks its guesses up past the tokens still in flight, the device picks them, judges them
and records the gain, and the verdict lands with the next step, so guessing steps overlap too:

    host:    schedule V+1 | look up, launch V+1 | wait V -> update (V's verdict lands, V+1 commits)
    device:  ... verify V (guesses, verdict) ... | verify V+1 ...........................

A draft model needs every token before its guesses, so with one (or across ranks) the scheduler
plans guesses once the step in flight has landed, and `Verifier.verify_now` returns its verdict
at once.

    launch(batch):  rows = send(seqs)            one small copy: rows + new table entries
                    inputs: prefill from host lists (the prompt is on the host)
                            decode on the device (ids = the tokens the step before sampled)
                    forward (a graph replay for decode), sample on the device (device_sampler)
                    record tokens in the rows; copy them to the host without waiting
                    (with their logprobs, computed on the device, if a row asks)

On one GPU a decode step from its inputs to its record is a single graph replay
(engine/runner/step_graphs.py), and so is a verify step of guesses looked up ahead; a prefill,
a batch wider than every graph and a step across GPUs launch their kernels one by one
(`eager_step`; a verify step's `verify_ahead`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from nanoserve.engine.runner.cuda_graphs import bucket_for
from nanoserve.engine.runner.device_batch import to_device_ints
from nanoserve.engine.runner.graph_buffers import view_rows
from nanoserve.engine.runner.launched import (
    Launched,
    Proposer,
    guesses_ahead,
    needs_filter,
    send_up,
)
from nanoserve.engine.runner.model_runner import ModelRunner, completes_prompt
from nanoserve.engine.runner.persistent_batch import PersistentBatch
from nanoserve.engine.runner.step_graphs import StepGraphs
from nanoserve.engine.runner.verifier import Verifier
from nanoserve.engine.runner.verify_step import most_lens
from nanoserve.logprobs import pending_logprobs
from nanoserve.samplers.device_sampler import sample
from nanoserve.samplers.speculative_sampler import RULE, Rule
from nanoserve.types import (
    HostMetadata,
    ScheduledBatch,
    Sequence,
    StepInputs,
    StepMessage,
    StepOutput,
    StepRow,
)


class OverlapRunner(ModelRunner):
    """A model runner whose steps run on the device while the host goes on; it owns the device
    batch (`state`) and, at stage 12, the proposer and the verify step.

    proposer: builds the stage 12 proposer from this runner (a draft model reads its device
    batch and packer); rule: the rejection rule's two functions."""

    def __init__(
        self,
        *args,
        state: PersistentBatch,
        proposer: Callable[[OverlapRunner], Proposer] | None = None,
        rule: Rule = RULE,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.state = state
        self.in_flight: Launched | None = None  # the step launched last, not yet landed
        self.proposer = None if proposer is None else proposer(self)
        # stage 12: verify steps launched while the step before is in flight (one GPU, n-gram)
        self.ahead = guesses_ahead(self.proposer) and self.workers is None
        self.steps = None  # decode steps captured whole (one GPU with graphs)
        if self.graphs is not None and self.workers is None:
            self.steps = StepGraphs(self.model, self.graphs, self.state)
            self.steps.capture()
        self.verifier = Verifier(self.model, self.attention, self.packer, self.state, rule,
                                 self.graphs, self.steps, self.workers)  # fmt: skip

    def execute(self, plan: ScheduledBatch) -> StepOutput:
        """Launch the plan's step, then wait for the step in flight before it: its tokens come
        back in `earlier`, the plan's own stay on the device until the next call. A plan with
        guess budgets launches a verify step the same way (guessing ahead); with a draft model
        (or across GPUs) it is proposed for and verified at once (nothing is in flight then)."""
        self.forget(plan.freed)  # before any row is handed out: theirs may be reused
        self.forget_trimmed(plan.trimmed)
        if any(plan.guesses) and not self.ahead:
            assert self.in_flight is None, "guesses are planned once the step in flight landed"
            assert self.proposer is not None, "a plan with guesses needs a proposer"
            guesses, draft_probs = self.proposer.propose(plan.seqs, plan.guesses)
            if any(guesses):
                return self.verifier.verify_now(plan, guesses, draft_probs)
            plan = plan._replace(guesses=())  # nobody guessed: a stage 11 step
        launched = self.launch(plan) if plan.seqs else None
        earlier, self.in_flight = self.in_flight, launched
        landed = None if earlier is None else earlier.landed()
        if launched is None:
            return StepOutput(None, (), [], landed)
        return StepOutput(launched.inputs, tuple(launched.sampled), None, landed)

    def plan_guesses(self, guesses_for: Callable[[int], int]) -> None:
        """Stage 12: the speculation policy's guesses per sequence by batch size; where verify
        steps guessed ahead are captured whole, their shapes are fixed and captured now."""
        if self.steps is not None and self.ahead:
            self.steps.plan_verify(guesses_for, self.verifier.rule)

    def forget(self, seqs) -> None:
        """Let go of the rows of sequences that left the running set (a plan's `freed`); a
        sequence holding no row is skipped, so a plan may be applied twice."""
        for seq in seqs:
            self.state.release(seq)

    def forget_trimmed(self, trimmed) -> None:
        """The scheduler cut these tables (a rollback, or room for guesses that went unused):
        past the blocks each kept, the device's table entries are stale, so the next growth
        must send its blocks again."""
        for seq, num_blocks in trimmed:
            row = self.state.rows.get(seq.seq_id)
            if row is not None:
                self.state.num_sent[row] = min(self.state.num_sent[row], num_blocks)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> Launched:
        """Queue the batch's forward and sampling on the device; wait for nothing. A batch with
        guess budgets is a verify step, unless nobody's lookup reaches past the tokens in flight
        (then it runs as this plain step, and its room goes back when it lands)."""
        if any(batch.guesses):
            ahead = self.gains_in_flight(batch.seqs)
            asks = tuple(a + b if b else 0 for a, b in zip(ahead, batch.guesses))
            proposals, _ = self.proposer.propose(batch.seqs, asks)  # type: ignore[union-attr]
            if any(len(p) > a for p, a in zip(proposals, ahead)):
                return self.verifier.launch_ahead(batch, proposals, ahead)
        seqs = batch.seqs
        rows = self.state.send(seqs)
        host_rows = [self.state.row_of(seq) for seq in seqs]
        sampled = [i for i, seq in enumerate(seqs) if completes_prompt(seq)]
        filters = any(needs_filter(seqs[i]) for i in sampled)
        if not batch.is_prefill:
            self.state.prime(host_rows, seqs)
        if not batch.is_prefill and self.steps is not None and self.steps.fits(len(seqs)):
            # the whole step is one graph: inputs, forward, sampler and record
            inputs, logits, tokens = self.steps.run(rows, filters, self.decode_host(seqs))
        else:
            inputs, logits, tokens = self.eager_step(batch, rows, sampled, filters)
        for i in sampled:
            self.state.sampled[host_rows[i]] = True
        logprobs = pending_logprobs([seqs[i] for i in sampled], logits, tokens)  # None: no work
        values, ready, logprobs = send_up(tokens, logprobs)
        return Launched(batch, inputs, sampled, values, ready, logprobs)

    def eager_step(
        self, batch: ScheduledBatch, rows: torch.Tensor, sampled: list[int], filters: bool
    ) -> tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """A step not captured whole (a prefill, a batch wider than every graph, or across
        GPUs): its inputs, forward (a graph replay for decode when a bucket fits), sampler and
        record launched one by one. Returns (inputs, logits of the sampled rows, tokens)."""
        seqs = batch.seqs
        replay = False
        if batch.is_prefill:
            inputs = self.packer.prepare(batch)
        else:
            inputs, replay = self.decode_inputs(seqs, rows)
        with self.fan_out(batch):
            if self.workers is not None and not batch.is_prefill:
                dist.broadcast(inputs.input_ids[: len(seqs)], src=0)  # the workers' input ids
            if replay and self.graphs is not None:  # inputs already in the static buffers
                logits = self.model.compute_logits(self.graphs.replay_filled(len(seqs)))
            else:
                logits = self.forward(inputs, self.attention, len(seqs))
        assert logits is not None, "rank 0 gathers the logits"
        if batch.is_prefill:  # positions of the sampled tokens: each prompt's length
            lens = to_device_ints([len(seqs[i]) for i in sampled], self.device)
            if len(sampled) < len(seqs):
                picked = to_device_ints(sampled, self.device)
                logits, rows = logits[picked], rows[picked]
            positions = lens
        else:  # decode: the token sampled sits right after the context
            positions = inputs.metadata.context_lens[: len(seqs)].long()
        tokens = sample(logits, self.state.sampling(rows, positions, filters))
        self.state.record(rows, tokens, positions + 1)
        return inputs, logits, tokens

    def decode_lens(self, seqs: list[Sequence]) -> list[int] | None:
        """The host's lengths of a decode step's sequences when they are only bounds (a verify
        step in flight: `most_lens`); None when len(seq) is right."""
        flight = self.in_flight
        if not (self.ahead and flight is not None and any(flight.batch.guesses)):
            return None
        return most_lens(seqs, self.gains_in_flight(seqs))

    def decode_host(self, seqs: list[Sequence]) -> HostMetadata:
        """A captured decode step's host lists (for --trace): lengths (`decode_lens`), tables."""
        lens = self.decode_lens(seqs) or [len(seq) for seq in seqs]
        return HostMetadata(list(range(len(seqs) + 1)), lens, [s.block_table for s in seqs])

    def decode_inputs(self, seqs: list[Sequence], rows: torch.Tensor) -> tuple[StepInputs, bool]:
        """The decode step built on the device, and whether a graph replays it: then it is
        written straight into the graphs' static buffers (the bucket's rows, padding included).
        The host's lengths are bounds when a verify step is in flight (`most_lens`)."""
        bucket = None if self.graphs is None else bucket_for(len(seqs), self.graphs.buckets)
        lens = self.decode_lens(seqs)
        if bucket is None:
            return self.state.decode_inputs(seqs, rows, lens=lens), False
        static = view_rows(self.graphs.static, bucket)  # type: ignore[union-attr]
        return self.state.decode_inputs(seqs, rows, static, lens), True

    def gains_in_flight(self, seqs: list[Sequence]) -> list[int]:
        """Per sequence, the most tokens the step in flight may still gain it: 1 plus its guess
        budget there, or 0 when nothing of it is in flight."""
        flight = self.in_flight
        if flight is None:
            return [0] * len(seqs)
        budgets = dict(zip(map(id, flight.batch.seqs), flight.batch.guesses or ()))
        return [1 + budgets.get(id(seq), 0) if seq.num_pending else 0 for seq in seqs]

    def fan_out(self, batch: ScheduledBatch):
        """Stage 09's fan-out; a decode step's ids are not on the host, so rank 0 broadcasts
        them inside the step (the rows carry a placeholder token at the right position)."""
        if self.workers is None or batch.is_prefill:
            return super().fan_out(batch)
        rows = [StepRow([0], len(seq) - 1, seq.block_table) for seq in batch.seqs]
        return self.workers.step(StepMessage(False, rows, len(rows), ids_from_first_rank=True))
