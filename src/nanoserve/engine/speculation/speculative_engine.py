"""The speculative loop: guess k tokens per sequence, verify them in one forward, keep the
longest run the target agrees with, and roll the rest back.

Introduced in stage 12. A decode step of stage 11 gains one token per sequence per forward;
here a sequence whose next tokens are easy to guess gains up to k + 1:

    schedule (decode)  ->  propose: guesses appended as tentative tokens, blocks grown for them
                       ->  verify:  one forward over [newest, guesses]; a verdict per sequence
                       ->  accept:  drop every guess, append the kept ones and the drawn token;
                                    K/V of what was dropped sits past the length (unread, and
                                    overwritten next step); blocks past the kept tokens freed

Rollback is arithmetic on a length plus, at most, a block or two given back: that is what the
block table buys. A guess needs every token before it, so a step that may guess first resolves
the step in flight and runs synchronously; a batch with no guesses (and every prefill) runs as
a stage 11 step, resolved at once. Where guessing does not pay, sequences back off (Backoff, in
speculative_base.py) and the steps between their guesses are stage 11's, overlapped.
"""

from __future__ import annotations

from nanoserve.engine.loop.scheduler import finish_reason
from nanoserve.engine.speculation.speculative_base import (
    SpeculativeEngineBase,
    SpeculativeSchedulerBase,
)
from nanoserve.types import ScheduledBatch, Sequence


class SpeculativeScheduler(SpeculativeSchedulerBase):
    """Stage 11's scheduler plus tentative tokens: `add_proposal` before the verify step,
    `accept` (the rollback) after it."""

    def add_proposal(self, seq: Sequence, token_id: int) -> bool:
        """Append one guess to seq if its K/V has room (a guess never preempts anyone); the
        verify step computes it, so it is scheduled too. False: no room, nothing changed."""
        if not self.manager.can_append(seq):
            return False
        seq.append_token(token_id)
        seq.num_draft_tokens += 1
        seq.num_scheduled_tokens += 1
        self.manager.may_append(seq)
        return True

    def accept(self, batch: ScheduledBatch, token_ids: list[list[int]], eos_ids) -> list[Sequence]:
        """Replace each sequence's guesses by what the verify step gave it (the kept guesses and
        a drawn token), stop at a finish, and give back the blocks past its stored K/V."""
        finished = []
        for seq, gained in zip(batch.seqs, token_ids):
            del seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
            seq.num_draft_tokens = seq.num_scheduled_tokens = 0
            reason = None
            for token_id in gained:
                seq.append_token(token_id)
                reason = finish_reason(seq, token_id, eos_ids, self.config.max_model_len)
                if reason is not None:
                    break
            seq.num_cached_tokens = len(seq) - 1  # stored: all but the newest (drawn) token
            if reason is not None:
                seq.finish(reason)
                self.manager.deallocate(seq)
                self.running.remove(seq)
                self.release(seq)
                finished.append(seq)
                continue
            self.manager.truncate(seq, seq.num_cached_tokens)  # rejected guesses' blocks
            if self.prefix_manager is not None:  # blocks full of kept tokens become shareable
                self.prefix_manager.hash_blocks(seq)
        return finished


class SpeculativeEngine(SpeculativeEngineBase):
    """The loop: a decode batch with guesses is verified; anything else runs as in stage 11."""

    Scheduler = SpeculativeScheduler
    scheduler: SpeculativeScheduler

    def step(self) -> list[Sequence]:
        """Stage 11's overlapped step while nobody may guess; else resolve the step in flight,
        schedule, guess for a decode batch, then verify and accept, or run a plain step."""
        if not self.may_guess():
            return super().step()
        finished = self.drain()
        num_preempted_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if finished or self.scheduler.is_finished():
                return finished
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        if not batch.is_prefill:
            draft_probs = self.propose(batch)
            if any(seq.num_draft_tokens for seq in batch.seqs):
                verified = self.verify(batch, draft_probs, num_preempted_before)
                return finished + self.scheduler.accept(batch, verified.token_ids, self.eos_ids)
        launched = self._launch_batch(batch, num_preempted_before)
        self.scheduler.commit(launched)
        return finished + self.scheduler.resolve(launched, launched.token_ids(), self.eos_ids)
