"""The model runner: turns a scheduled batch into one model call and one sampled token per sequence.

Introduced in stage 00. It owns the model, the stage's cache (which builds the inputs) and the
sampler; it makes no scheduling decisions and keeps no per-request state.
"""

import torch

from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.sampling import Sampler


class ModelRunner:
    """Prepare, forward, sample."""

    def __init__(self, model, cache, sampler: Sampler | None = None):
        self.model = model
        self.cache = cache
        self.sampler = sampler or Sampler()
        self.device = next(model.parameters()).device
        self.last_inputs = None  # kept for --trace: what the last step fed the model

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """The next token id of every sequence in the batch."""
        inputs = self.cache.prepare(batch)
        self.last_inputs = inputs
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        params = [seq.params for seq in batch.seqs]
        generators = [seq.generator for seq in batch.seqs]
        return self.sampler(logits, params, generators)
