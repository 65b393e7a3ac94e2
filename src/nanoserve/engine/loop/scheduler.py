"""The scheduler: which sequences run in the next step, and what a step's output does to them.

Introduced in stage 00. Every stage runs one loop (engine/loop/llm_engine.py):

    plan = scheduler.schedule()     which sequences, prefill or decode (stage 12: guess budgets)
    out = runner.execute(plan)      the forward and the sampling (stage 11: one step in flight)
    finished = scheduler.update(plan, out)

`update` is the only code that moves a request on: it appends tokens, counts stored K/V
(`num_cached_tokens`), finishes requests (`Sequence.finish`) and frees them. Memory is the cache
manager's business (`can_allocate/allocate/can_append/may_append/deallocate`); the scheduler asks.
A step is all-prefill or all-decode, as in nano-vLLM; with enable_chunked_prefill a long prompt is
prefilled over several steps. Which sequences a step takes is batch_selection.py's.

Two words from stage 11 on, where a step's tokens reach the host one step late: `commit` (when a
step is launched: its K/V will be stored, and each sequence that samples owes the host a token,
`num_pending`) and `land` (when its tokens arrive). Up to stage 10 both happen in one `update`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from nanoserve.config import EngineConfig
from nanoserve.engine.loop.batch_selection import select_decode, select_prefill
from nanoserve.engine.loop.request_rules import finish_reason
from nanoserve.engine.memory.kv_manager import (
    KVCacheManager,
    PrefixCachingManager,
    ReservesRoom,
)
from nanoserve.engine.speculation.policy import Speculation
from nanoserve.types import Landed, ScheduledBatch, Sequence, SequenceStatus, StepOutput


class Scheduler:
    """Waiting and running queues; admits by the manager's memory, preempts the newest."""

    def __init__(
        self,
        config: EngineConfig,
        manager: KVCacheManager,
        eos_ids: Iterable[int] = (),
        speculation: Speculation | None = None,
    ):
        self.config = config
        self.manager = manager
        self.eos_ids = frozenset(eos_ids)  # the model's end tokens (a request may ignore them)
        # stage 07: a manager that shares blocks hears about every block that fills
        self.prefix_manager = manager if isinstance(manager, PrefixCachingManager) else None
        self.speculation = speculation  # stage 12: guess budgets in decode plans (None: never)
        # stage 12: guesses need a block manager that reserves room and gives it back
        self.room = manager if isinstance(manager, ReservesRoom) else None
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_plans = 0  # plans that ran something (stage 12's back-off counts steps)
        self.freed: list[Sequence] = []  # left the running set since the last plan (`release`)
        # stage 12: tables cut since the last plan (seq_id -> (seq, blocks kept)), and the guess
        # budgets of the step in flight (seq_id -> budget), whose gains the host has not seen
        self.trimmed: dict[int, tuple[Sequence, int]] = {}
        self.guessing: dict[int, int] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a new request (already validated by the engine)."""
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        """True when nothing waits and nothing runs."""
        return not self.waiting and not self.running

    # ---- the plan ----

    def schedule(self) -> ScheduledBatch:
        """Prefill newly admitted sequences if any fit, else decode the running ones. Empty when
        nothing can run until the step in flight lands (stage 11 on)."""
        step = self.num_plans + 1
        spec = self.speculation
        if (
            spec is not None
            and not spec.ahead
            and spec.may_guess(self.running, step)
            and any(seq.num_pending for seq in self.running)
        ):
            return self._plan([], is_prefill=False)  # a draft needs every token before it
        prefill = select_prefill(self.running, self.waiting, self.manager, self.config)
        if prefill:
            return self._plan(prefill, is_prefill=True)
        seqs, self.running = select_decode(
            self.running, self.manager, self.config, self.guessing, self.preempt
        )
        if spec is None:
            return self._plan(seqs, is_prefill=False)
        guessing = self.guessing
        ahead = [guessing.get(seq.seq_id, 0) for seq in seqs] if guessing else [0] * len(seqs)
        budgets = spec.budgets(seqs, step, ahead)  # after each has its room
        if not any(budgets) and not any(ahead):
            return self._plan(seqs, is_prefill=False)
        return self._plan_guesses(seqs, budgets, ahead)

    def _plan_guesses(self, seqs: list[Sequence], budgets, ahead: list[int]) -> ScheduledBatch:
        """Stage 12: room for each sequence's guesses, past the most tokens the step in flight
        may still gain it (`ahead`: guesses it may keep there); a sequence whose in-flight gains
        find no room sits this step out (its step lands first, and then it is known)."""
        planned, guesses = [], []
        for seq, budget, a in zip(seqs, budgets, ahead):
            room = self.make_room(seq, a + budget) - a if a or budget else 0
            if room < 0:
                seq.num_scheduled_tokens = 0
                continue
            planned.append(seq)
            guesses.append(room)
        return self._plan(planned, is_prefill=False, guesses=tuple(guesses))

    def _plan(self, seqs: list[Sequence], is_prefill: bool, guesses=()) -> ScheduledBatch:
        """The step, carrying the sequences released and the tables cut since the last plan."""
        self.num_plans += bool(seqs)
        trimmed, self.trimmed = tuple(self.trimmed.values()), {}
        return ScheduledBatch(seqs, is_prefill, self.take_freed(), guesses, trimmed)

    def take_freed(self) -> tuple[Sequence, ...]:
        """The sequences released since they were last taken (for a plan)."""
        freed, self.freed = tuple(self.freed), []
        return freed

    def release(self, seq: Sequence) -> None:
        """seq left the running set (finished, preempted or aborted): the next plan tells the
        runner, which lets go of anything it holds for seq (stage 11: its device row)."""
        self.freed.append(seq)

    def make_room(self, seq: Sequence, budget: int) -> int:
        """Stage 12: grow seq's blocks for up to `budget` guesses past its tokens, with free
        blocks only (a guess never preempts anyone); returns how many guesses have room."""
        assert self.room is not None, "guesses need a block manager (stage 04's or 07's)"
        return self.room.reserve(seq, len(seq) + budget) - len(seq)

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

    def undo(self, plan: ScheduledBatch) -> None:
        """Forget a plan whose step failed or was interrupted (the exception propagates).

        A prefill's K/V may be half written, so its sequences give their memory back and wait to
        be recomputed, at the front of the queue in their order. A decode step needs nothing: its
        token was never appended, and growth made by may_append is reused by the next decode
        (room reserved for this plan's guesses is given back; the step in flight keeps its own).
        """
        for seq in plan.seqs:
            seq.num_scheduled_tokens = 0
        if not plan.is_prefill:
            for seq, budget in zip(plan.seqs, plan.guesses):
                if budget and seq.status is SequenceStatus.RUNNING:  # keep what is in flight
                    self.give_back(seq, len(seq) + self.guessing.get(seq.seq_id, 0))
            return
        for seq in reversed(plan.seqs):
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
        seq.finish("abort")

    # ---- the update ----

    def update(self, plan: ScheduledBatch, out: StepOutput) -> list[Sequence]:
        """Apply a step's output: the tokens of the step before, if they landed only now (stage
        11), then this plan's progress, then its tokens if they are here. The only writer of
        token_ids, num_cached_tokens, num_scheduled_tokens, num_pending and the finish.
        Returns the sequences that finished, in the order they did."""
        finished = []
        if out.earlier is not None:
            finished += self.land(out.earlier)
            if out.earlier.plan.guesses:  # stage 12: the plan just launched is in flight
                self.settle_guesses(out.earlier, plan)
        self.commit(plan, out.sampled)
        self.guessing = {}  # stage 12: the budgets of the step in flight, if it guessed
        if out.tokens is not None:
            landed = Landed(plan, out.tokens, out.guesses)
            finished += self.land(landed)
            if plan.guesses:
                self.settle_guesses(landed, None)
        elif plan.guesses:
            self.guessing = {seq.seq_id: b for seq, b in zip(plan.seqs, plan.guesses) if b}
        return finished

    def commit(self, plan: ScheduledBatch, sampled: tuple[int, ...]) -> None:
        """The plan's step will store its tokens' K/V, and each sequence that samples owes the
        host a token until it lands. A sequence that finished meanwhile (while the step was
        being launched) is skipped: the step's token for it is discarded."""
        sampling = set(sampled)
        for i, seq in enumerate(plan.seqs):
            if seq.is_finished:
                seq.num_scheduled_tokens = 0
                continue
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if self.prefix_manager is not None:  # blocks that just filled become shareable
                self.prefix_manager.hash_blocks(seq)
            seq.num_pending += i in sampling

    def land(self, landed: Landed) -> list[Sequence]:
        """A step's tokens arrived: each sequence that owes one takes what it gained (a stage 12
        verify step's kept guesses, whose K/V it stored, then the drawn token), up to the first
        token that finishes it; finished ones are freed. Returns those, in batch order.

        A sequence that finished already gets nothing (the step after its end); one preempted
        while the step ran (stage 11) sits in `waiting`, holding no memory."""
        finished = []
        for seq, gained in zip(landed.plan.seqs, landed.tokens):
            if not gained or seq.is_finished:  # a prefill chunk, or the step after its end
                continue
            seq.num_pending -= 1
            reason = None
            for token_id in gained:
                seq.append_token(token_id)
                reason = finish_reason(seq, token_id, self.eos_ids, self.config.max_model_len)
                if reason is not None:
                    break
            if reason is None:
                # stage 12: the kept guesses' K/V stays (unless seq was preempted meanwhile: it
                # holds no blocks, and readmission recomputes it)
                if len(gained) > 1 and seq.status is SequenceStatus.RUNNING:
                    seq.num_cached_tokens += len(gained) - 1
                    if self.prefix_manager is not None:  # blocks full of kept tokens
                        self.prefix_manager.hash_blocks(seq)
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

    def settle_guesses(self, landed: Landed, in_flight: ScheduledBatch | None) -> None:
        """Stage 12, after a plan with guess budgets landed: the back-off learns what was kept,
        and each sequence gives back the blocks past what it still needs (rejected guesses,
        unused room): its stored K/V; or, when in_flight (the step launched after the landed
        one, still running) runs it too, the len(seq) + budget tokens that step writes."""
        if self.speculation is not None:
            self.speculation.judged(landed.plan, landed.tokens)
        later: dict[Sequence, int] = {}
        if in_flight is not None:  # its guesses are () when it guesses nothing
            later = dict(zip(in_flight.seqs, in_flight.guesses or [0] * len(in_flight.seqs)))
        for seq, budget in zip(landed.plan.seqs, landed.plan.guesses):
            if not budget or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq in later:  # that step writes seq's newest token, then its own guesses
                self.give_back(seq, len(seq) + later[seq])
            else:
                self.give_back(seq, seq.num_cached_tokens)

    def give_back(self, seq: Sequence, num_tokens: int) -> None:
        """Stage 12: seq's blocks past its first num_tokens tokens go back to the pool; the next
        plan tells the runner (`trimmed`), whose device copy of the table is stale past them."""
        assert self.room is not None, "guesses need a block manager (stage 04's or 07's)"
        self.room.truncate(seq, num_tokens)
        _, kept = self.trimmed.get(seq.seq_id, (seq, len(seq.block_table)))
        self.trimmed[seq.seq_id] = (seq, min(kept, len(seq.block_table)))
