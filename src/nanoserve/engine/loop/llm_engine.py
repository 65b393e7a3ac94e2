"""The engine loop: validate and queue requests, then step = schedule, execute, update.

Introduced in stage 00; every stage runs this one loop, and a stage's recipe (recipes/<slug>.py)
only swaps its parts: the cache manager (memory bookkeeping), the cache (tensor layout), the input
packer, the attention backend, the runner (stage 11: one step in flight; stage 12: a proposer and
a verify step inside it) and the scheduler's bookkeeping (stages 11 and 12's learners write it).

    plan = scheduler.schedule()              what runs: sequences, prefill or decode, guesses
    out = runner.execute(plan)               the step (stage 11: launched; the one before lands)
    finished = scheduler.update(plan, out)   tokens appended, K/V counted, requests finished

It does no tokenization: requests arrive as ids.
"""

from __future__ import annotations

from collections.abc import Iterable

from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.loop.trace import StepRecord
from nanoserve.engine.memory.kv_manager import KVCacheManager
from nanoserve.engine.runner.model_runner import ModelRunner
from nanoserve.engine.runner.overlap_runner import OverlapRunner
from nanoserve.engine.speculation.policy import Speculation, SpeculationStats
from nanoserve.kernels.backend import BackendChoice
from nanoserve.kernels.compile_log import CompileLog
from nanoserve.sampling import SamplingParams, clamp
from nanoserve.types import Landed, ScheduledBatch, Sequence, StepOutput


class LLMEngine:
    """One scheduler, one model runner, and the request checks in front of them.

    scheduler: the scheduler class (stages 11 and 12: the learner's bookkeeping, or ours). A
    runner with a proposer (stage 12) gets a speculation policy in the scheduler, and the
    engine counts what its guesses gained (`speculation`)."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        manager: KVCacheManager,
        eos_ids: Iterable[int],
        attention: BackendChoice,
        scheduler: type[Scheduler] = Scheduler,
    ):
        self.config = config
        self.runner = runner
        self.manager = manager
        self.attention = attention  # which backend runs, and why (shown by --trace and bench)
        policy = None
        if isinstance(runner, OverlapRunner) and runner.proposer is not None:
            rows = None if runner.graphs is None else runner.graphs.buckets[-1]
            policy = Speculation.of(config, rows, ahead=runner.ahead)
            runner.plan_guesses(policy.guesses_per_sequence)  # its verify shapes, captured now
        self.scheduler = scheduler(config, manager, eos_ids, policy)
        # stage 12: proposals made and kept (None: the engine does not guess)
        self.speculation = None if policy is None else SpeculationStats()
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
        """One turn of the loop: plan, execute, update; returns the sequences that finished.

        When it leaves nothing waiting or running, a turn with an empty plan follows: the step
        still in flight (stage 11) lands, its every token discarded, and the runner lets go of
        the ended requests' rows, so no call returns with work launched."""
        num_preempted_before = self.scheduler.num_preemptions
        plan = self.scheduler.schedule()
        if not plan.seqs and self.runner.in_flight is None:
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        finished = self.run(plan, num_preempted_before)
        if self.scheduler.is_finished():
            finished += self.run(self.scheduler.schedule())
        return finished

    def run(self, plan: ScheduledBatch, num_preempted_before: int = 0) -> list[Sequence]:
        """Execute one plan and apply its output; a failed step undoes the plan."""
        try:
            out = self.runner.execute(plan)
        except BaseException:  # an error or an interrupt inside the step
            self.scheduler.undo(plan)
            raise
        verdicts = [v for v in verdicts_of(plan, out) if v.guesses is not None]
        for verdict in verdicts:
            if self.speculation is not None and verdict.guesses is not None:
                self.speculation = self.speculation.counted(verdict.guesses, verdict.tokens)
        if plan.seqs:
            self.count_step(plan, out, num_preempted_before, verdicts)
        elif verdicts and self.on_step is not None:  # the last verify step landed in a flush
            self.on_step(StepRecord(self.num_steps, plan, None, 0, tuple(verdicts)))
        return self.scheduler.update(plan, out)

    def count_step(self, plan: ScheduledBatch, out: StepOutput, num_preempted_before: int,
                   verdicts: list[Landed]) -> None:  # fmt: skip
        """One more step run: the counters, and the on_step callback (e.g. --trace) told, with
        the verify steps whose verdicts arrived in it (stage 12)."""
        self.num_steps += 1
        if plan.is_prefill:
            self.num_prefill_tokens += sum(seq.num_scheduled_tokens for seq in plan.seqs)
        if self.on_step is not None:
            num_preempted = self.scheduler.num_preemptions - num_preempted_before
            self.on_step(
                StepRecord(self.num_steps, plan, out.inputs, num_preempted, tuple(verdicts))
            )

    def warm_up(self, prompt_len: int = 32, max_tokens: int = 4) -> CompileLog:
        """Run one short request through the kinds of step the engine takes (a prefill, decode
        steps, sampled tokens; at stage 12 with a proposer, guesses to verify: the prompt
        repeats), so Triton compiles their kernels now, not inside a user's first request.
        Returns what compiled; the engine's counters are left as they were before it.

        One request covers every launch because the kernels do not specialize on the lengths
        and widths that vary from step to step (`do_not_specialize`); CUDA graph capture has
        already compiled the decode kernels of every captured batch size."""
        counters = (self.num_steps, self.num_prefill_tokens, self.speculation)
        length = min(prompt_len, self.config.max_model_len - max_tokens)
        prompt = [n % 8 + 1 for n in range(length)]  # repeats: an n-gram proposer guesses
        params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=max_tokens)
        with CompileLog() as log:
            self.add_request(prompt, params)
            while self.has_unfinished():
                self.step()
        self.num_steps, self.num_prefill_tokens, self.speculation = counters
        return log

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Remove these requests from the queues and free their memory (finished ones: no-op).
        A token the device still owes one is never appended; when nothing is left queued, the
        step in flight lands (all of it discarded) and the runner lets go of their rows."""
        for seq in seqs:
            self.scheduler.abort(seq)
        if self.scheduler.is_finished():
            self.run(self.scheduler.schedule())

    def shutdown(self) -> None:
        """Release what outlives a call: the tensor-parallel workers, if any (idempotent)."""
        self.runner.shutdown()

    def has_unfinished(self) -> bool:
        """True while some request waits or runs, or a launched step has not landed."""
        return not self.scheduler.is_finished() or self.runner.in_flight is not None


def verdicts_of(plan: ScheduledBatch, out: StepOutput) -> list[Landed]:
    """The steps whose tokens a step's output brings: the one before (stage 11), the plan's own
    (when they are already here)."""
    own = [] if out.tokens is None else [Landed(plan, out.tokens, out.guesses)]
    return ([] if out.earlier is None else [out.earlier]) + own
