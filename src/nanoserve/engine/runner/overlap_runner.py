"""The overlap runner: launch a step on the device and return at once; its tokens come later.

Introduced in stage 11. `ModelRunner.run` returns token ids, so the host waits for the device at
every step. `launch` returns a `Launched` step instead: inputs sent (only what changed, through
the persistent batch), forward and sampling queued on the device, the sampled tokens on their
way to pinned host memory behind an event. Nothing in it waits for the device, so the engine can
schedule the next step while this one runs, and read these tokens afterwards.

    launch(batch):  rows = send(seqs)            one small copy: rows + new table entries
                    inputs: prefill from host lists (the prompt is on the host)
                            decode on the device (ids = the tokens the step before sampled)
                    forward (a graph replay for decode), sample on the device (device_sampler)
                    record tokens in the rows; copy them to the host without waiting
                    (with their logprobs, computed on the device, if a row asks)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from nanoserve.engine.runner.cuda_graphs import bucket_for
from nanoserve.engine.runner.device_batch import to_device_ints
from nanoserve.engine.runner.graph_buffers import view_rows
from nanoserve.engine.runner.model_runner import ModelRunner, completes_prompt
from nanoserve.engine.runner.persistent_batch import PersistentBatch
from nanoserve.logprobs import LogprobTensors, PendingLogprobs, pending_logprobs
from nanoserve.samplers.device_sampler import sample
from nanoserve.types import ScheduledBatch, Sequence, StepInputs, StepMessage, StepRow


class Launched(NamedTuple):
    """A step the device is running (or has run): its batch and its tokens, once they land."""

    batch: ScheduledBatch
    inputs: StepInputs
    sampled: list[int]  # which of batch.seqs sample a token (a prefill chunk does not)
    tokens: torch.Tensor  # (len(sampled),) on the host; pinned and filled late on a GPU
    ready: torch.cuda.Event | None  # fires when `tokens` holds the step's tokens (None: CPU)
    logprobs: PendingLogprobs | None = None  # host copies beside `tokens`, when some row asked

    def token_ids(self) -> list[int | None]:
        """Wait for the step's tokens; one per sequence of the batch (None: nothing sampled).
        The logprobs asked for are stored on their sequences first."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.logprobs is not None:
            self.logprobs.record()
        out: list[int | None] = [None] * len(self.batch.seqs)
        for i, token_id in zip(self.sampled, self.tokens.tolist()):
            out[i] = token_id
        return out


def needs_filter(seq: Sequence) -> bool:
    """True when seq's sampling cuts the distribution (top-k or top-p)."""
    return seq.params.top_k is not None or seq.params.top_p < 1.0


class OverlapRunner(ModelRunner):
    """A model runner whose steps run on the device while the host goes on."""

    def __init__(self, *args, state: PersistentBatch, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = state

    def forget(self, seqs) -> None:
        """Let go of the rows of sequences that left the running set (a plan's `freed`); a
        sequence holding no row is skipped, so a plan may be applied twice."""
        for seq in seqs:
            self.state.release(seq)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> Launched:
        """Queue the batch's forward and sampling on the device; wait for nothing."""
        seqs = batch.seqs
        self.forget(batch.freed)  # before any row is handed out: theirs may be reused
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
