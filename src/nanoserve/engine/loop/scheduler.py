"""The scheduler: which sequences run in the next step, and whether it is a prefill or a decode.

Introduced in stage 00; unchanged in spirit since. Memory is the cache manager's business
(`can_allocate/allocate/can_append/may_append/deallocate`); the scheduler asks, and keeps
`num_cached_tokens` itself (from allocate's answer). A step is all-prefill or all-decode, as in
nano-vLLM; with enable_chunked_prefill a long prompt is prefilled over several steps.
"""

from __future__ import annotations

from collections import deque

from nanoserve.config import EngineConfig
from nanoserve.engine.memory.kv_manager import KVCacheManager, PrefixCachingManager
from nanoserve.types import ScheduledBatch, Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues; admits by the manager's memory, preempts the newest."""

    def __init__(self, config: EngineConfig, manager: KVCacheManager):
        self.config = config
        self.manager = manager
        # stage 07: a manager that shares blocks hears about every block that fills
        self.prefix_manager = manager if isinstance(manager, PrefixCachingManager) else None
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.freed: list[Sequence] = []  # left the running set since the last plan (`release`)

    def add(self, seq: Sequence) -> None:
        """Queue a new request (already validated by the engine)."""
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        """True when nothing waits and nothing runs."""
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """Prefill newly admitted sequences if any fit, else decode the running ones."""
        prefill = self._schedule_prefill()
        if prefill:
            return self._plan(prefill, is_prefill=True)
        return self._plan(self._schedule_decode(), is_prefill=False)

    def _plan(self, seqs: list[Sequence], is_prefill: bool) -> ScheduledBatch:
        """The step; a step that runs carries the sequences released since the last one (an
        empty one runs nothing, so they wait for the next)."""
        if not seqs:
            return ScheduledBatch(seqs, is_prefill)
        return ScheduledBatch(seqs, is_prefill, self.take_freed())

    def take_freed(self) -> tuple[Sequence, ...]:
        """The sequences released since they were last taken (for a plan, or for the runner
        once the engine is idle)."""
        freed, self.freed = tuple(self.freed), []
        return freed

    def release(self, seq: Sequence) -> None:
        """seq left the running set (finished, preempted or aborted): the next step's plan tells
        the runner, which lets go of anything it holds for seq (stage 11: its device row)."""
        self.freed.append(seq)

    def _schedule_prefill(self) -> list[Sequence]:
        """Chunks of prefills in progress first, then newly admitted sequences, within budget."""
        budget = self.config.max_num_batched_tokens
        scheduled = [seq for seq in self.running if is_prefilling(seq)]  # chunked, unfinished
        for seq in scheduled:
            budget -= self._schedule_chunk(seq, budget)
        while self.waiting and len(scheduled) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.config.enable_chunked_prefill and len(seq) > budget:
                break  # whole prompts only: it waits for the next step's budget
            if not self.manager.can_allocate(seq):
                break
            seq.num_cached_tokens = self.manager.allocate(seq)  # stage 07: a cached prefix
            budget -= self._schedule_chunk(seq, budget)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    @staticmethod
    def _schedule_chunk(seq: Sequence, budget: int) -> int:
        """Schedule as many of seq's uncomputed tokens as the budget allows; returns how many."""
        seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
        return seq.num_scheduled_tokens

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.config.max_num_seqs:
            seq = self.running.popleft()
            while not self.manager.can_append(seq):
                if self.running:  # free the newest sequence's memory and retry
                    self.preempt(self.running.pop())
                else:  # seq is the only one left: it waits for memory itself
                    self.preempt(seq)
                    break
            else:
                self.manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Drop seq's cache and send it to the front of the queue; it is recomputed later."""
        seq.status = SequenceStatus.WAITING
        self.free(seq)
        self.release(seq)  # a re-admission takes a fresh row
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def free(self, seq: Sequence) -> None:
        """Give seq's memory back to the manager: none of its K/V is stored any more."""
        self.manager.deallocate(seq)
        seq.num_cached_tokens = 0

    def undo(self, batch: ScheduledBatch) -> None:
        """Forget a step whose forward pass failed or was interrupted (the exception propagates).

        A prefill's K/V may be half written, so its sequences give their memory back and wait to
        be recomputed, at the front of the queue in their order. A decode step needs nothing: its
        token was never appended, and growth made by may_append is reused by the next decode.
        """
        if not batch.is_prefill:
            return
        for seq in reversed(batch.seqs):
            if seq in self.running:
                self.running.remove(seq)
                self.free(seq)
                self.release(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a waiting or running sequence for good and release its memory; finished: no-op.
        A token the device still owes it (stage 11) is never appended."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)  # a waiting sequence holds no memory
        self.release(seq)  # a preempted one may still hold a row until the next step
        seq.num_pending = 0
        seq.finish("abort")

    def postprocess(self, batch: ScheduledBatch, token_ids: list, eos_ids) -> list[Sequence]:
        """Append each sampled token; finish and release sequences that are done.

        token_ids[i] is None for a sequence whose prefill chunk did not reach its last token:
        it samples nothing yet and goes on prefilling next step.
        """
        finished = []
        for seq, token_id in zip(batch.seqs, token_ids):
            seq.num_cached_tokens += seq.num_scheduled_tokens  # this step stored their K/V
            seq.num_scheduled_tokens = 0
            if self.prefix_manager is not None:  # blocks that just filled become shareable
                self.prefix_manager.hash_blocks(seq)
            if token_id is None:
                continue
            seq.append_token(token_id)
            reason = finish_reason(seq, token_id, eos_ids, self.config.max_model_len)
            if reason is not None:
                seq.finish(reason)
                self.manager.deallocate(seq)
                self.running.remove(seq)
                self.release(seq)
                finished.append(seq)
        return finished


def is_prefilling(seq: Sequence) -> bool:
    """True for a running sequence whose prompt is only partly computed (chunked prefill).

    A decode-ready sequence lacks K/V for exactly one token, its newest; one that lacks more is
    still prefilling. (Lacking exactly one is also the last chunk of a prefill: a decode step
    computes it the same way, and samples from it.)
    """
    return len(seq) - seq.num_cached_tokens > 1


def finish_reason(seq: Sequence, token_id: int, eos_ids, max_model_len: int) -> str | None:
    """ "stop" on an EOS or stop token, "length" at max_tokens or max_model_len, else None."""
    params = seq.params
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_ids):
        return "stop"
    if seq.num_completion_tokens >= params.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None
