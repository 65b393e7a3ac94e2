"""The overlap loop: schedule and launch step N + 1, then wait for step N's tokens and finish it.

Introduced in stage 11. Up to stage 10 a step is schedule -> prepare -> forward -> sample ->
postprocess, one after the other, and the device idles while the host does its part. Here the
host's work for the next step runs while the device computes the current one:

    host:    schedule N+1 | launch N+1 | wait N, resolve N | commit N+1 | schedule N+2 | ...
    device:  ...  step N  ...........  | step N+1 .................................. | ...

What that changes, and how each consequence is handled:
- The host schedules N + 1 before it knows N's tokens. Each sequence owes the host one token
  (`Sequence.num_pending`): lengths, block growth and positions count it, token ids do not.
- A sequence whose token N was EOS is in step N + 1 too: that step's token is discarded, and
  its blocks are freed one step late (when N resolves, after N + 1 was launched).
- A sequence that reaches max_tokens or max_model_len with token N is known to finish without
  seeing the token: it is not scheduled again, so no step runs past a length limit.
- Preemption and abort free the rows and blocks at once; a token still owed to a preempted
  sequence is appended when its step resolves, before the sequence can be prefilled again.
"""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine.kv_manager import KVCacheManager
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.overlap_runner import Launched, OverlapRunner
from nanoserve.engine.scheduler import Scheduler, finish_reason
from nanoserve.engine.trace import StepRecord
from nanoserve.types import Sequence, SequenceStatus


def owes_its_last_token(seq: Sequence, max_model_len: int) -> bool:
    """True when the token the device owes seq ends it by length: no step may follow."""
    if seq.num_pending == 0:
        return False
    completion = seq.num_completion_tokens + seq.num_pending
    return completion >= seq.params.max_tokens or len(seq) >= max_model_len


class OverlapScheduler(Scheduler):
    """The scheduler, split at the step it does not wait for: `commit` when a step is launched
    (progress and owed tokens), `resolve` when its tokens arrive (append, finish, free)."""

    def __init__(self, config: EngineConfig, manager: KVCacheManager, release):
        super().__init__(config, manager)
        self.release = release  # called with each sequence that leaves the running set

    def _schedule_decode(self) -> list[Sequence]:
        """Decode the running sequences, except those whose owed token already ends them."""
        done = [s for s in self.running if owes_its_last_token(s, self.config.max_model_len)]
        for seq in done:
            self.running.remove(seq)
        try:
            return super()._schedule_decode()
        finally:
            self.running.extend(done)  # still running until their last token resolves

    def preempt(self, seq: Sequence) -> None:
        """As ever, and the sequence's row is freed (a re-admission takes a fresh one)."""
        super().preempt(seq)
        self.release(seq)

    def commit(self, launched: Launched) -> None:
        """The launched step's K/V will be stored and each sampling sequence owes a token."""
        sampled = set(launched.sampled)
        for i, seq in enumerate(launched.batch.seqs):
            if seq.is_finished:  # it finished while the step was launched: discarded
                seq.num_scheduled_tokens = 0
                continue
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if self.prefix_manager is not None:  # blocks that just filled become shareable
                self.prefix_manager.hash_blocks(seq)
            seq.num_pending += i in sampled

    def resolve(self, launched: Launched, token_ids: list, eos_ids) -> list[Sequence]:
        """Append each token the step owed; finish (and free) the sequences that are done."""
        finished = []
        for seq, token_id in zip(launched.batch.seqs, token_ids):
            if token_id is None or seq.is_finished:  # a chunk, or the step after its end
                continue
            seq.num_pending -= 1
            seq.append_token(token_id)
            reason = finish_reason(seq, token_id, eos_ids, self.config.max_model_len)
            if reason is None:
                continue
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            if seq in self.waiting:  # preempted while its last token was in flight
                self.waiting.remove(seq)
            else:
                self.manager.deallocate(seq)
                self.running.remove(seq)
                self.release(seq)
            finished.append(seq)
        return finished


class OverlapEngine(LLMEngine):
    """The engine loop with one step in flight: `step` launches the next and finishes the last."""

    runner: OverlapRunner

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduler = OverlapScheduler(self.config, self.manager, self.runner.state.release)
        self.in_flight: Launched | None = None

    def step(self) -> list[Sequence]:
        """Launch the next batch (if any), then wait for the one before and finish it."""
        launched = self._launch() if not self.scheduler.is_finished() else None
        if launched is None and self.in_flight is None:
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        finished = []
        if self.in_flight is not None:
            done, self.in_flight = self.in_flight, None
            finished = self.scheduler.resolve(done, done.token_ids(), self.eos_ids)
        if launched is not None:
            self.scheduler.commit(launched)
            self.in_flight = launched
        return finished

    def _launch(self) -> Launched | None:
        num_preempted_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        if not batch.seqs:  # everything running waits for its last token
            return None
        try:
            launched = self.runner.launch(batch)
        except BaseException:
            self.scheduler.undo(batch)
            for seq in batch.seqs:
                if seq.status is SequenceStatus.WAITING:
                    self.runner.state.release(seq)
            raise
        self.num_steps += 1
        if batch.is_prefill:
            self.num_prefill_tokens += sum(seq.num_scheduled_tokens for seq in batch.seqs)
        if self.on_step is not None:
            num_preempted = self.scheduler.num_preemptions - num_preempted_before
            self.on_step(StepRecord(self.num_steps, batch, launched.inputs, num_preempted))
        return launched

    def abort(self, seqs) -> None:
        """As ever; a token the device still owes an aborted sequence is never appended."""
        for seq in seqs:
            was_finished = seq.is_finished
            self.scheduler.abort(seq)
            if not was_finished:
                seq.num_pending = 0
                self.runner.state.release(seq)

    def has_unfinished(self) -> bool:
        """True while some request waits or runs, or a launched step is not yet finished."""
        return super().has_unfinished() or self.in_flight is not None
