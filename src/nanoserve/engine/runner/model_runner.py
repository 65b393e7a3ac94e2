"""The model runner: per step, pack the batch's inputs, run the model, sample.

Introduced in stage 00. It is built whole: the model, the stage's KV cache, the attention backend
over it, the input packer, and (stage 08) the decode graphs and (stage 09) the tensor-parallel
workers all arrive at construction (`recipes/assemble.py` builds them). It makes no scheduling
decisions and keeps no per-request state. On rank 0 of several it hands each step to the workers
(`StepFanout`); on a worker `execute_rows` runs the step rank 0 sent.

    execute(plan):  prepare(plan) -> StepInputs  ->  run(plan, inputs) -> token ids
                    (host lists -> device tensors)   (forward or graph replay, then the sampler)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from nanoserve.cache.kv_cache import KVCache
from nanoserve.config import EngineConfig
from nanoserve.engine.runner.cuda_graphs import DecodeGraphs
from nanoserve.engine.runner.input_packer import InputPacker, pack_step
from nanoserve.kernels.attention import NoCacheAttention
from nanoserve.kernels.backend import AttentionBackend
from nanoserve.logprobs import pending_logprobs
from nanoserve.models.decoder import CausalLM
from nanoserve.sampling import Sampler, SamplingParams
from nanoserve.types import ScheduledBatch, Sequence, StepInputs, StepMessage, StepOutput


@runtime_checkable
class StepFanout(Protocol):
    """Stage 09: the tensor-parallel workers, as rank 0's runner sees them.

    Contract: `step(message)` returns a context manager. Entering it sends the message to every
    worker, which packs the same inputs and runs the same forward (their collectives meet rank
    0's inside it). An exception leaving it is re-raised as `WorkerDied` when a worker is gone or
    the group can no longer agree (the group is then shut down); otherwise unchanged.
    `shutdown()` stops every worker (idempotent).
    """

    def step(self, message: StepMessage) -> AbstractContextManager: ...
    def shutdown(self) -> None: ...


def completes_prompt(seq: Sequence) -> bool:
    """True when this step computes seq's newest token (not an earlier chunk of its prompt)."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens >= len(seq)


class ModelRunner:
    """The model and everything a step needs; per step: prepare, forward, sample."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        attention: AttentionBackend,
        packer: InputPacker,
        graphs: DecodeGraphs | None = None,
        workers: StepFanout | None = None,
    ):
        self.model = model
        self.device, self.dtype = cache.device, model.dtype
        self.cache, self.attention, self.packer = cache, attention, packer
        self.graphs = graphs  # stage 08: replayed for decode steps that fit a bucket
        self.workers = workers  # stage 09, on rank 0 of several: the other ranks
        self.sampler = Sampler()

    in_flight: object | None = None  # a step launched, not yet landed: never here (stage 11: one)

    def execute(self, plan: ScheduledBatch) -> StepOutput:
        """Run the plan's step and return its tokens (an empty plan runs nothing)."""
        if not plan.seqs:
            return StepOutput(None, (), [])
        inputs = self.prepare(plan)
        return StepOutput.of(self.run(plan, inputs), inputs)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's device tensors, packed from the batch's host lists."""
        return self.packer.prepare(batch)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, inputs: StepInputs) -> list[int | None]:
        """The next token id of every sequence in the batch (None: a prefill chunk, no sample).

        Only sequences whose last token this step computes are sampled, so a seeded request
        draws the same numbers whether its prompt was prefilled whole or in chunks.
        """
        with self.fan_out(batch):
            logits = self.forward(inputs, self.attention, len(batch.seqs))
        assert logits is not None, "rank 0 gathers the logits"
        rows = [i for i, seq in enumerate(batch.seqs) if completes_prompt(seq)]
        seqs = [batch.seqs[i] for i in rows]
        if len(rows) < len(batch.seqs):
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        sampled = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        logprobs = pending_logprobs(seqs, logits, sampled)
        if logprobs is not None:  # only when a request asks (SamplingParams.logprobs)
            logprobs.record()
        token_ids: list[int | None] = [None] * len(batch.seqs)
        for i, token_id in zip(rows, sampled):
            token_ids[i] = token_id
        return token_ids

    def fan_out(self, batch: ScheduledBatch) -> AbstractContextManager:
        """Stage 09: the workers run this step beside rank 0 (nothing to do with one rank)."""
        if self.workers is None:
            return nullcontext()
        return self.workers.step(self.packer.rows(batch))

    @torch.inference_mode()
    def execute_rows(self, message: StepMessage) -> None:
        """A tensor-parallel worker's step: pack rank 0's rows as rank 0 did, run the forward.

        Stage 11 sends decode rows without their token ids (rank 0's host has not seen them):
        rank 0 broadcasts them from its device first.
        """
        inputs = self.packer.prepare_rows(message)
        if message.ids_from_first_rank:
            dist.broadcast(inputs.input_ids, src=0)
        if message.every_row:  # stage 12's verify step: rank 0 gathers every row's logits
            forward_logits(self.model, inputs, self.attention, message.num_seqs, every_row=True)
        else:
            self.forward(inputs, self.attention, message.num_seqs)

    def forward(self, inputs: StepInputs, attention, num_seqs: int) -> torch.Tensor | None:
        """Logits (num_seqs, vocab) at the last packed row of each of the first num_seqs (on a
        tensor-parallel worker the gather leaves them to rank 0, which samples)."""
        return forward_logits(self.model, inputs, attention, num_seqs, self.graphs)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (one rank: nothing to do)."""
        if self.workers is not None:
            self.workers.shutdown()


def forward_logits(
    model: CausalLM,
    inputs: StepInputs,
    attention,
    num_seqs: int,
    graphs: DecodeGraphs | None = None,
    every_row: bool = False,
) -> torch.Tensor | None:
    """One model call: a graph replay for a decode step that fits one, else eager. every_row:
    logits at every packed row (stage 12 verifies each proposal), not each sequence's last."""
    if graphs is not None and graphs.can_replay(inputs):
        return model.compute_logits(graphs.replay(inputs))  # one row per sequence
    hidden = model(inputs.input_ids, inputs.positions, attention, inputs.metadata)
    if every_row:
        return model.compute_logits(hidden)
    last_rows = inputs.metadata.cu_seqlens_q[1 : num_seqs + 1].long() - 1
    return model.compute_logits(hidden[last_rows])


@torch.inference_mode()
def warmup_peak_bytes(model: CausalLM, config: EngineConfig, device: torch.device) -> int:
    """CUDA memory one full prefill batch takes beyond what is allocated now (no cache)."""
    seq_len = config.max_model_len
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // seq_len))
    params = SamplingParams(max_tokens=1)
    seqs = [Sequence([0] * seq_len, params, device) for _ in range(num_seqs)]
    inputs = pack_step(seqs, [[] for _ in seqs], 1, device, is_prefill=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    current = torch.cuda.memory_allocated(device)
    forward_logits(model, inputs, NoCacheAttention(), num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return peak - current
