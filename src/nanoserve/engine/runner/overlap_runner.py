"""The overlap runner: one step in flight. `execute(plan)` launches the plan's step on the
device, then waits for the step launched before it and hands back those tokens.

Introduced in stage 11. `ModelRunner.execute` returns the plan's own tokens, so the host waits
for the device at every step. Here `launch` returns a `Launched` step instead: inputs sent (only
what changed, through the persistent batch), forward and sampling queued on the device, the
sampled tokens on their way to pinned host memory behind an event. Nothing in it waits for the
device, so the host's work for the next step runs while this one computes:

    host:    schedule N+1 | launch N+1 | wait N -> update (N lands, N+1 commits) | schedule N+2
    device:  ...  step N  ...........  | step N+1 ...................................... |

Stage 12 adds a proposer and a verify step: a plan with guess budgets is proposed for (every
token before the guesses is known: the scheduler plans guesses only once the step in flight has
landed) and verified in one forward; its verdict comes back at once.

    launch(batch):  rows = send(seqs)            one small copy: rows + new table entries
                    inputs: prefill from host lists (the prompt is on the host)
                            decode on the device (ids = the tokens the step before sampled)
                    forward (a graph replay for decode), sample on the device (device_sampler)
                    record tokens in the rows; copy them to the host without waiting
                    (with their logprobs, computed on the device, if a row asks)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from nanoserve.engine.memory.kv_manager import blocks_for
from nanoserve.engine.runner.cuda_graphs import bucket_for
from nanoserve.engine.runner.device_batch import to_device_ints
from nanoserve.engine.runner.graph_buffers import view_rows
from nanoserve.engine.runner.input_packer import verify_rows
from nanoserve.engine.runner.model_runner import ModelRunner, completes_prompt, forward_logits
from nanoserve.engine.runner.persistent_batch import PersistentBatch
from nanoserve.logprobs import LogprobTensors, PendingLogprobs, logprob_tensors, pending_logprobs
from nanoserve.samplers.device_sampler import sample
from nanoserve.samplers.speculative_sampler import RULE, Rule, verify
from nanoserve.types import (
    Landed,
    ScheduledBatch,
    Sequence,
    StepInputs,
    StepMessage,
    StepOutput,
    StepRow,
)


class Launched(NamedTuple):
    """A step the device is running (or has run): its batch and its tokens, once they land."""

    batch: ScheduledBatch
    inputs: StepInputs
    sampled: list[int]  # which of batch.seqs sample a token (a prefill chunk does not)
    tokens: torch.Tensor  # (len(sampled),) on the host; pinned and filled late on a GPU
    ready: torch.cuda.Event | None  # fires when `tokens` holds the step's tokens (None: CPU)
    logprobs: PendingLogprobs | None = None  # host copies beside `tokens`, when some row asked

    def landed(self) -> Landed:
        """Wait for the step's tokens: per sequence of the batch, [its token], or [] for a
        prefill chunk that sampled nothing. The logprobs asked for are stored first."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.logprobs is not None:
            self.logprobs.record()
        out: list[list[int]] = [[] for _ in self.batch.seqs]
        for i, token_id in zip(self.sampled, self.tokens.tolist()):
            out[i] = [token_id]
        return Landed(self.batch, out)


class Proposer(Protocol):
    """Stage 12: what guesses (engine/speculation/): up to budgets[b] tokens for seqs[b], and
    the distribution each guess was drawn from ((B, K, V), or None when every guess is sure)."""

    def propose(
        self, seqs: list[Sequence], budgets: tuple[int, ...]
    ) -> tuple[list[list[int]], torch.Tensor | None]: ...


def needs_filter(seq: Sequence) -> bool:
    """True when seq's sampling cuts the distribution (top-k or top-p)."""
    return seq.params.top_k is not None or seq.params.top_p < 1.0


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
        self.rule = rule

    def execute(self, plan: ScheduledBatch) -> StepOutput:
        """Launch the plan's step, then wait for the step in flight before it: its tokens come
        back in `earlier`, the plan's own stay on the device until the next call. A plan with
        guess budgets is proposed for and verified at once (nothing is in flight then)."""
        self.forget(plan.freed)  # before any row is handed out: theirs may be reused
        proposer = self.proposer if any(plan.guesses) else None
        guessing = proposer is not None
        if proposer is not None:
            assert self.in_flight is None, "guesses are planned once the step in flight landed"
            guesses, draft_probs = proposer.propose(plan.seqs, plan.guesses)
            if any(guesses):
                return self.verify(plan, guesses, draft_probs)
        launched = self.launch(plan) if plan.seqs else None
        if guessing:  # nobody guessed: a stage 11 step, and the room goes back
            self.forget_sent_past(plan.seqs, [len(seq) for seq in plan.seqs])
        earlier, self.in_flight = self.in_flight, launched
        landed = None if earlier is None else earlier.landed()
        if launched is None:
            return StepOutput(None, (), [], landed)
        none: list[list[int]] | None = [[] for _ in plan.seqs] if plan.guesses else None
        return StepOutput(launched.inputs, tuple(launched.sampled), None, landed, none)

    def forget(self, seqs) -> None:
        """Let go of the rows of sequences that left the running set (a plan's `freed`); a
        sequence holding no row is skipped, so a plan may be applied twice."""
        for seq in seqs:
            self.state.release(seq)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> Launched:
        """Queue the batch's forward and sampling on the device; wait for nothing."""
        seqs = batch.seqs
        rows = self.state.send(seqs)
        host_rows = [self.state.row_of(seq) for seq in seqs]
        replay = False
        if batch.is_prefill:
            inputs = self.packer.prepare(batch)
        else:
            self.state.prime(host_rows, seqs)
            inputs, replay = self.decode_inputs(seqs, rows)
        with self.fan_out(batch):
            if self.workers is not None and not batch.is_prefill:
                dist.broadcast(inputs.input_ids[: len(seqs)], src=0)  # the workers' input ids
            if replay and self.graphs is not None:  # inputs already in the static buffers
                logits = self.model.compute_logits(self.graphs.replay_filled(len(seqs)))
            else:
                logits = self.forward(inputs, self.attention, len(seqs))
        assert logits is not None, "rank 0 gathers the logits"
        sampled = [i for i, seq in enumerate(seqs) if completes_prompt(seq)]
        if batch.is_prefill:  # positions of the sampled tokens: each prompt's length
            lens = to_device_ints([len(seqs[i]) for i in sampled], self.device)
            if len(sampled) < len(seqs):
                picked = to_device_ints(sampled, self.device)
                logits, rows = logits[picked], rows[picked]
            positions = lens
        else:  # decode: the token sampled sits right after the context
            positions = inputs.metadata.context_lens[: len(seqs)].long()
        filters = any(needs_filter(seqs[i]) for i in sampled)
        tokens = sample(logits, self.state.sampling(rows, positions, filters))
        self.state.record(rows, tokens, positions + 1)
        for i in sampled:
            self.state.sampled[host_rows[i]] = True
        logprobs = pending_logprobs([seqs[i] for i in sampled], logits, tokens)  # None: no work
        host, ready = to_host([tokens, *(logprobs.tensors if logprobs is not None else ())])
        if logprobs is not None:
            logprobs = logprobs._replace(tensors=LogprobTensors(*host[1:]))
        return Launched(batch, inputs, sampled, host[0], ready, logprobs)

    def decode_inputs(self, seqs: list[Sequence], rows: torch.Tensor) -> tuple[StepInputs, bool]:
        """The decode step built on the device, and whether a graph replays it: then it is
        written straight into the graphs' static buffers (the bucket's rows, padding included)."""
        bucket = None if self.graphs is None else bucket_for(len(seqs), self.graphs.buckets)
        if bucket is None:
            return self.state.decode_inputs(seqs, rows), False
        static = view_rows(self.graphs.static, bucket)  # type: ignore[union-attr]
        return self.state.decode_inputs(seqs, rows, static), True

    @torch.inference_mode()
    def verify(
        self, plan: ScheduledBatch, guesses: list[list[int]], draft_probs: torch.Tensor | None
    ) -> StepOutput:
        """Stage 12's verify step: the target over each sequence's newest token and guesses,
        in one forward; the verdict (kept guesses, then a drawn token) comes back at once."""
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
        for seq in seqs:  # each row's next token and length are on the device now
            self.state.sampled[self.state.row_of(seq)] = True
        self.forget_sent_past(seqs, [len(seq) + a for seq, a in zip(seqs, accepted)])
        record_logprobs(seqs, logits, packed.cu_rows, gained)
        return StepOutput(inputs, tuple(range(len(seqs))), gained, None, guesses)

    def verify_as_decode(self, num_rows: int) -> bool:
        """Decode rows when a captured graph can replay that many (no eager launches: what a
        small model's step is made of); else a chunk per sequence, which reads each context
        once, not once per row (an eager step, and the CPU's)."""
        return self.graphs is not None and bucket_for(num_rows, self.graphs.buckets) is not None

    def forget_sent_past(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        """The scheduler keeps only the blocks of each sequence's first num_tokens tokens (a
        rollback, or room for guesses that went unused): past them the device's table entries
        are stale, so the next growth must send its block again."""
        for seq, n in zip(seqs, num_tokens):
            row = self.state.row_of(seq)
            self.state.num_sent[row] = min(
                self.state.num_sent[row], blocks_for(n, self.packer.block_size)
            )

    def fan_out(self, batch: ScheduledBatch):
        """Stage 09's fan-out; a decode step's ids are not on the host, so rank 0 broadcasts
        them inside the step (the rows carry a placeholder token at the right position)."""
        if self.workers is None or batch.is_prefill:
            return super().fan_out(batch)
        rows = [StepRow([0], len(seq) - 1, seq.block_table) for seq in batch.seqs]
        return self.workers.step(StepMessage(False, rows, len(rows), ids_from_first_rank=True))


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
