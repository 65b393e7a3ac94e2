"""Which sequences the next step runs: prefill admission within the token budget, and decode
with preemption when memory runs out.

Introduced in stage 00 with the scheduler (scheduler.py calls these from `schedule`). They move
sequences between the scheduler's queues and ask the cache manager for memory; the scheduler
owns the queues and everything a step's output does to a request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from nanoserve.config import EngineConfig
from nanoserve.engine.loop.request_rules import is_prefilling, owes_its_last_token
from nanoserve.engine.memory.kv_manager import KVCacheManager
from nanoserve.types import Sequence, SequenceStatus


def select_prefill(
    running: deque[Sequence],
    waiting: deque[Sequence],
    manager: KVCacheManager,
    config: EngineConfig,
) -> list[Sequence]:
    """Chunks of prefills in progress first, then newly admitted sequences (moved from waiting
    to running), within max_num_batched_tokens and max_num_seqs."""
    budget = config.max_num_batched_tokens
    scheduled = [seq for seq in running if is_prefilling(seq)]  # chunked, unfinished
    for seq in scheduled:
        budget -= schedule_chunk(seq, budget)
    while waiting and len(scheduled) < config.max_num_seqs and budget > 0:
        seq = waiting[0]
        if not config.enable_chunked_prefill and len(seq) > budget:
            break  # whole prompts only: it waits for the next step's budget
        if not manager.can_allocate(seq):
            break
        seq.num_cached_tokens = manager.allocate(seq)  # stage 07: a cached prefix
        budget -= schedule_chunk(seq, budget)
        seq.status = SequenceStatus.RUNNING
        waiting.popleft()
        running.append(seq)
        scheduled.append(seq)
    return scheduled


def schedule_chunk(seq: Sequence, budget: int) -> int:
    """Schedule as many of seq's uncomputed tokens as the budget allows; returns how many."""
    seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
    return seq.num_scheduled_tokens


def select_decode(
    running: deque[Sequence],
    manager: KVCacheManager,
    config: EngineConfig,
    guessing: dict[int, int],
    preempt: Callable[[Sequence], None],
) -> tuple[list[Sequence], deque[Sequence]]:
    """(the sequences to decode, the running queue after): every running sequence except those
    whose owed token already ends them (stage 11: no step may run past a length limit; guessing:
    stage 12's budgets in flight); `preempt` the newest when memory runs out. The queue after
    holds the scheduled, then the unscheduled, then the ending ones; the preempted are gone."""
    limit = config.max_model_len
    done = [s for s in running if owes_its_last_token(s, limit, guessing.get(s.seq_id, 0))]
    queue = deque(seq for seq in running if seq not in done)
    scheduled: list[Sequence] = []
    while queue and len(scheduled) < config.max_num_seqs:
        seq = queue.popleft()
        while not manager.can_append(seq):
            if queue:  # free the newest sequence's memory and retry
                preempt(queue.pop())
            else:  # seq is the only one left: it waits for memory itself
                preempt(seq)
                break
        else:
            manager.may_append(seq)
            seq.num_scheduled_tokens = 1
            scheduled.append(seq)
    return scheduled, deque([*scheduled, *queue, *done])
