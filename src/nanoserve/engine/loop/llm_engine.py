"""The engine loop: validate and queue requests, then step = schedule, run, postprocess.

Introduced in stage 00; every stage reuses it and only swaps the cache manager (memory
bookkeeping), the cache (tensor layout), the input packer and the attention backend (each stage's
recipe, recipes/<slug>.py). It does no tokenization: requests arrive as ids.
"""

from __future__ import annotations

from collections.abc import Iterable

from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.loop.trace import StepRecord
from nanoserve.engine.memory.kv_manager import KVCacheManager
from nanoserve.engine.runner.model_runner import ModelRunner
from nanoserve.kernels.backend import BackendChoice
from nanoserve.sampling import SamplingParams, clamp
from nanoserve.types import Sequence


class LLMEngine:
    """One scheduler, one model runner, and the request checks in front of them."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        manager: KVCacheManager,
        eos_ids: Iterable[int],
        attention: BackendChoice,
    ):
        self.config = config
        self.runner = runner
        self.manager = manager
        self.attention = attention  # which backend runs, and why (shown by --trace and bench)
        self.scheduler = Scheduler(config, manager)
        self.eos_ids = frozenset(eos_ids)
        self.vocab_size = runner.model.config.vocab_size
        self.on_step = None  # optional callback(StepRecord), e.g. the --trace printer
        self.num_steps = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (a cached prefix is not computed)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request; raises ValueError and queues nothing if it is bad.
        The sequence carries its params clamped to what every sampler runs (`sampling.clamp`)."""
        self.check_request(prompt_token_ids, params)
        params = clamp(params, self.vocab_size)
        seq = Sequence(prompt_token_ids, params, device=self.runner.device)
        self.scheduler.add(seq)
        return seq

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request; queue nothing."""
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty; it needs at least one token")
        if params.n != 1:
            raise ValueError(
                f"SamplingParams.n = {params.n}: the engine runs one completion per request; "
                "run sampling.child_params(params), one request each (LLM.generate does)"
            )
        bad = [
            t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ValueError(
                f"prompt has token id {bad[0]!r}; ids must be integers in [0, {self.vocab_size})"
            )
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                f"{self.config.max_model_len}, which must leave room for one generated token"
            )
        longest = min(len(prompt_token_ids) + params.max_tokens, self.config.max_model_len)
        self.manager.check_fits(len(prompt_token_ids), longest)

    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that finished in it."""
        num_preempted_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        try:
            inputs = self.runner.prepare(batch)
            token_ids = self.runner.run(batch, inputs)
        except BaseException:  # an error or an interrupt inside the forward pass
            self.scheduler.undo(batch)
            raise
        self.count_step(batch, inputs, num_preempted_before)
        return self.scheduler.postprocess(batch, token_ids, self.eos_ids)

    def count_step(self, batch, inputs, num_preempted_before: int, gained=None) -> None:
        """One more step run: the counters, and the on_step callback (e.g. --trace) told;
        gained: what a stage 12 verify step gave each sequence (kept guesses, drawn token)."""
        self.num_steps += 1
        if batch.is_prefill:
            self.num_prefill_tokens += sum(seq.num_scheduled_tokens for seq in batch.seqs)
        if self.on_step is not None:
            num_preempted = self.scheduler.num_preemptions - num_preempted_before
            self.on_step(StepRecord(self.num_steps, batch, inputs, num_preempted, gained))

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Remove these requests from the queues and free their memory (finished ones: no-op)."""
        for seq in seqs:
            self.scheduler.abort(seq)

    def shutdown(self) -> None:
        """Release what outlives a call: the tensor-parallel workers, if any (idempotent)."""
        self.runner.shutdown()

    def has_unfinished(self) -> bool:
        """True while some request waits or runs."""
        return not self.scheduler.is_finished()
