"""The model runner: builds the model from a spec, then turns each batch into one model call.

Introduced in stage 00. It owns the model, the stage's KV cache and attention backend (bound
once the cache is sized) and the sampler; it makes no scheduling decisions and keeps no
per-request state. Building from a `ModelSpec` is what lets a stage-09 worker build its own shard;
on rank 0 the runner also hands each step to the workers (`StepFanout`), on a worker `execute`
runs the step rank 0 sent.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

import torch

from nanoserve.cache.attention_metadata import pack_rows, pack_step, step_row
from nanoserve.cache.kv_cache import KVCache
from nanoserve.config import EngineConfig
from nanoserve.kernels.attention import NoCacheAttention
from nanoserve.kernels.backend import AttentionBackend
from nanoserve.layers.tensor_parallel import TensorParallel
from nanoserve.models.decoder import CausalLM
from nanoserve.models.loader import load_model
from nanoserve.sampling import Sampler, SamplingParams
from nanoserve.types import ModelSpec, ScheduledBatch, Sequence, StepInputs, StepMessage


@runtime_checkable
class StepFanout(Protocol):
    """Stage 09: the tensor-parallel workers, as rank 0's runner sees them.

    Contract: `step(message)` returns a context manager. Entering it sends the message to every
    worker, which packs the same inputs and runs the same forward (their collectives meet rank
    0's inside it). An exception leaving it is re-raised as `WorkerDied` when a worker is gone or
    the group can no longer agree (the group is then shut down); otherwise unchanged.
    """

    def step(self, message: StepMessage) -> AbstractContextManager: ...


def completes_prompt(seq: Sequence) -> bool:
    """True when this step computes seq's newest token (not an earlier chunk of its prompt)."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens >= len(seq)


class ModelRunner:
    """Build the model; then per step: prepare, forward, sample."""

    def __init__(self, spec: ModelSpec, model: CausalLM | None = None):
        """Load the model `spec` names (or reuse `model`, already built from that spec)."""
        self.spec = spec
        tp = TensorParallel(spec.tp_rank, spec.tp_size)
        self.model = model if model is not None else load_model(spec.source, spec.device,
                                                                spec.dtype, tp)  # fmt: skip
        self.device, self.dtype = spec.device, spec.dtype
        self.sampler = Sampler()
        self.cache: KVCache | None = None  # bound by `bind` once the pool is sized
        self.attention: AttentionBackend | None = None
        self.last_inputs: StepInputs | None = None  # kept for --trace
        self.graphs = None  # stage 08: DecodeGraphs, replayed for decode steps that fit
        self.workers: StepFanout | None = None  # stage 09, on rank 0 of several

    def bind(self, cache: KVCache, attention: AttentionBackend) -> None:
        """Attach the stage's cache and the backend that attends over it."""
        self.cache, self.attention = cache, attention

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """The next token id of every sequence in the batch (None: a prefill chunk, no sample).

        Only sequences whose last token this step computes are sampled, so a seeded request
        draws the same numbers whether its prompt was prefilled whole or in chunks.
        """
        inputs = self.cache.prepare(batch)
        self.last_inputs = inputs
        with self.fan_out(batch):
            logits = self.forward(inputs, self.attention, len(batch.seqs))
        rows = [i for i, seq in enumerate(batch.seqs) if completes_prompt(seq)]
        seqs = [batch.seqs[i] for i in rows]
        if len(rows) < len(batch.seqs):
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        sampled = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        token_ids: list[int | None] = [None] * len(batch.seqs)
        for i, token_id in zip(rows, sampled):
            token_ids[i] = token_id
        return token_ids

    def fan_out(self, batch: ScheduledBatch) -> AbstractContextManager:
        """Stage 09: the workers run this step beside rank 0 (nothing to do with one rank)."""
        if self.workers is None:
            return nullcontext()
        rows = [step_row(seq, seq.block_table) for seq in batch.seqs]
        return self.workers.step(StepMessage(batch.is_prefill, rows, len(batch.seqs)))

    @torch.inference_mode()
    def execute(self, message: StepMessage) -> None:
        """A tensor-parallel worker's step: pack rank 0's rows as rank 0 did, run the forward."""
        inputs = pack_rows(message.rows, self.cache.block_size, self.device,
                           is_prefill=message.is_prefill)  # fmt: skip
        self.forward(inputs, self.attention, message.num_seqs)

    def forward(self, inputs: StepInputs, attention, num_seqs: int) -> torch.Tensor | None:
        """Logits (num_seqs, vocab) at the last packed row of each of the first num_seqs (None
        on a tensor-parallel worker: rank 0 gathers the logits and samples)."""
        md = inputs.metadata
        if self.graphs is not None and self.graphs.can_replay(inputs):
            return self.model.compute_logits(self.graphs.replay(inputs))  # one row per sequence
        hidden = self.model(inputs.input_ids, inputs.positions, attention, md)
        last_rows = md.cu_seqlens_q[1 : num_seqs + 1].long() - 1
        return self.model.compute_logits(hidden[last_rows])

    @torch.inference_mode()
    def warmup_peak_bytes(self, config: EngineConfig) -> int:
        """CUDA memory one full prefill batch takes beyond what is allocated now (no cache)."""
        seq_len = config.max_model_len
        num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // seq_len))
        params = SamplingParams(max_tokens=1)
        seqs = [Sequence([0] * seq_len, params, self.device) for _ in range(num_seqs)]
        inputs = pack_step(seqs, [[] for _ in seqs], 1, self.device, is_prefill=True)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        current = torch.cuda.memory_allocated(self.device)
        self.forward(inputs, NoCacheAttention(), num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak - current
