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

from nanoserve.engine.loop.overlap_base import OverlapEngineBase, OverlapSchedulerBase
from nanoserve.engine.loop.scheduler import finish_reason
from nanoserve.engine.runner.overlap_runner import Launched
from nanoserve.types import Sequence


class OverlapScheduler(OverlapSchedulerBase):
    """The scheduler, split at the step it does not wait for: `commit` when a step is launched
    (progress and owed tokens), `resolve` when its tokens arrive (append, finish, free)."""

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
            seq.finish(reason)
            if seq in self.waiting:  # preempted while its last token was in flight
                self.waiting.remove(seq)
            else:
                self.manager.deallocate(seq)
                self.running.remove(seq)
                self.release(seq)
            finished.append(seq)
        return finished


class OverlapEngine(OverlapEngineBase):
    """The engine loop with one step in flight: `step` launches the next and finishes the last."""

    Scheduler = OverlapScheduler
    scheduler: OverlapScheduler

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
