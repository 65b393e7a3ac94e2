"""The given parts of stage 11's loop: what the overlap scheduler and engine share with stage 10's.

Introduced in stage 11, given to its learner (who writes `commit`, `resolve` and `step`, in
engine/loop/overlap_engine.py). Here: a sequence whose owed token ends it by length is not
scheduled again; `_launch` schedules a batch and hands it to the runner (undoing the schedule if
the launch fails); the engine has work while a step is in flight, and a step that leaves nothing
queued resolves the one in flight (`settled`). Rows are the runner's: a sequence that leaves the
running set is `release`d by the scheduler, and the next step's plan tells the runner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from nanoserve.engine.loop.llm_engine import LLMEngine
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.runner.overlap_runner import Launched, OverlapRunner
from nanoserve.types import ScheduledBatch, Sequence


def owes_its_last_token(seq: Sequence, max_model_len: int) -> bool:
    """True when the token the device owes seq ends it by length: no step may follow."""
    if seq.num_pending == 0:
        return False
    completion = seq.num_completion_tokens + seq.num_pending
    return completion >= seq.params.max_tokens or len(seq) >= max_model_len


class OverlapSchedulerBase(Scheduler):
    """Stage 10's scheduler, not decoding what owes its last token."""

    def _schedule_decode(self) -> list[Sequence]:
        """Decode the running sequences, except those whose owed token already ends them."""
        done = [s for s in self.running if owes_its_last_token(s, self.config.max_model_len)]
        for seq in done:
            self.running.remove(seq)
        try:
            return super()._schedule_decode()
        finally:
            self.running.extend(done)  # still running until their last token resolves

    def resolve(self, launched: Launched, token_ids: list, eos_ids) -> list[Sequence]:
        """Append a step's owed tokens and finish what is done (the learner's, in
        overlap_engine.py); returns the sequences that finished."""
        raise NotImplementedError


class OverlapEngineBase(LLMEngine):
    """The engine with a step in flight: `Scheduler` names the scheduler class it runs. A
    subclass's `step` (the learner's loop) runs inside `settled`."""

    runner: OverlapRunner
    scheduler: OverlapSchedulerBase
    Scheduler: type[OverlapSchedulerBase] = OverlapSchedulerBase

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduler = self.Scheduler(self.config, self.manager)
        self.in_flight: Launched | None = None  # the step launched last, not yet resolved

    def __init_subclass__(cls, **kwargs):
        """A subclass that defines `step` gets it wrapped in `settled`."""
        super().__init_subclass__(**kwargs)
        if "step" in vars(cls):
            cls.step = settled(vars(cls)["step"])

    def _launch(self) -> Launched | None:
        """Schedule a batch and launch it; None when nothing can run until a step resolves."""
        num_preempted_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        if not batch.seqs:  # everything running waits for its last token
            return None
        return self._launch_batch(batch, num_preempted_before)

    def _launch_batch(self, batch: ScheduledBatch, num_preempted_before: int) -> Launched:
        """Hand a scheduled batch to the runner; a failed launch undoes the schedule."""
        try:
            launched = self.runner.launch(batch)
        except BaseException:
            self.scheduler.undo(batch)  # a prefill's sequences wait again, their rows released
            raise
        self.count_step(batch, launched.inputs, num_preempted_before)
        return launched

    def settle(self) -> list[Sequence]:
        """Nothing waits or runs: resolve the step in flight (all of it discarded) and hand the
        runner the rows of the requests that ended; returns what the step finished (nothing)."""
        finished = self.drain()
        self.runner.forget(self.scheduler.take_freed())
        return finished

    def drain(self) -> list[Sequence]:
        """Resolve the step in flight, if any (wait for its tokens); returns the sequences it
        finished."""
        if self.in_flight is None:
            return []
        done, self.in_flight = self.in_flight, None
        return self.scheduler.resolve(done, done.token_ids(), self.eos_ids)

    def abort(self, seqs) -> None:
        """As ever; a token the device still owes an aborted sequence is never appended. When
        nothing is left queued, the step in flight (all of it discarded) is resolved."""
        super().abort(seqs)
        if self.scheduler.is_finished():
            self.settle()

    def has_unfinished(self) -> bool:
        """True while some request waits or runs, or a launched step is not yet resolved."""
        return super().has_unfinished() or self.in_flight is not None


def settled(step: Callable[[OverlapEngineBase], list[Sequence]]):
    """`step`, then, when it leaves nothing waiting or running, the step in flight resolved too:
    its every token belongs to a finished request and is discarded, and no later call of step()
    need come for it. The engine is idle (has_unfinished() False) once the last request ends."""

    @functools.wraps(step)
    def settled_step(engine: OverlapEngineBase) -> list[Sequence]:
        finished = step(engine)
        if engine.scheduler.is_finished():
            finished = finished + engine.settle()  # nothing: every request of it has finished
        return finished

    return settled_step
