"""The model runner: builds the model from a spec, then turns each batch into one model call.

Introduced in stage 00. It owns the model, the stage's KV cache and attention backend (bound
once the cache is sized) and the sampler; it makes no scheduling decisions and keeps no
per-request state. Building from a `ModelSpec` is what lets a stage-09 worker build its own shard.
"""

from __future__ import annotations

import torch

from nanoserve.cache.attention_metadata import pack_step
from nanoserve.cache.kv_cache import KVCache
from nanoserve.config import EngineConfig
from nanoserve.kernels.attention import NoCacheAttention
from nanoserve.kernels.backend import AttentionBackend
from nanoserve.models.decoder import CausalLM
from nanoserve.models.loader import load_model
from nanoserve.sampling import Sampler, SamplingParams
from nanoserve.types import ModelSpec, ScheduledBatch, Sequence, StepInputs


def completes_prompt(seq: Sequence) -> bool:
    """True when this step computes seq's newest token (not an earlier chunk of its prompt)."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens >= len(seq)


class ModelRunner:
    """Build the model; then per step: prepare, forward, sample."""

    def __init__(self, spec: ModelSpec, model: CausalLM | None = None):
        """Load the model `spec` names (or reuse `model`, already built from that spec)."""
        self.spec = spec
        self.model = model if model is not None else load_model(spec.source, spec.device,
                                                                spec.dtype)  # fmt: skip
        self.device, self.dtype = spec.device, spec.dtype
        self.sampler = Sampler()
        self.cache: KVCache | None = None  # bound by `bind` once the pool is sized
        self.attention: AttentionBackend | None = None
        self.last_inputs: StepInputs | None = None  # kept for --trace
        self.graphs = None  # stage 08: DecodeGraphs, replayed for decode steps that fit

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

    def forward(self, inputs: StepInputs, attention, num_seqs: int) -> torch.Tensor:
        """Logits (num_seqs, vocab) at the last packed row of each of the first num_seqs."""
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
