"""Stage 11 starter: the overlap loop. Rows of the running batch kept on the device, the next step
launched before the last one's tokens reach the host, and the bookkeeping that makes that exact.

Fill in each body (the lesson, stages/11_overlap/README.md, walks through them in task order) in
a copy: `cp stages/11_overlap/starter.py my_overlap.py`, then grade it with
`pytest stages/11_overlap --impl my_overlap.py`; this file itself must keep failing. Every task
runs on a CPU; task 5 also runs your loop with CUDA graphs and skips without a GPU.

    one step of the loop (step N + 1 is launched before step N's tokens are read):

      host    schedule N+1 | launch N+1 | wait N, resolve N | commit N+1 | schedule N+2 | ...
      device  .. step N ........ | step N+1 ........................................ | ...

    the persistent batch, block_size 4: a prompt of 6 tokens, table [5, 2], takes row 0
      first step      send: rows [0], entries (0, 0, 5) and (0, 1, 2)
      decode steps    send: rows [0], no entry ... until the table grows to [5, 2, 9]:
      boundary        send: rows [0], entry (0, 2, 9)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from nanoserve.engine.loop.overlap_base import OverlapEngineBase, OverlapSchedulerBase
from nanoserve.engine.loop.scheduler import finish_reason  # noqa: F401  (given; use it in task 3)
from nanoserve.engine.runner.device_batch import DeviceBatch
from nanoserve.engine.runner.overlap_runner import Launched
from nanoserve.types import Sequence, SequenceStatus  # noqa: F401  (task 3)

# Given (nanoserve/engine/runner/device_batch.py): `DeviceBatch(capacity, table_width, block_size,
# device)` holds the rows' tensors; `grow(capacity)` makes room for more rows (old rows keep
# their values); `write_params(row, params)` writes a request's sampling parameters into its row;
# `upload(rows, changed_rows, columns, blocks)` copies the step's rows to the device in one go and
# sets block_tables[changed_rows[i], columns[i]] = blocks[i] there, returning the rows as a device
# tensor. The runner (overlap_runner.py) calls your `send` once per step, then reads the rows.


class PersistentBatch(DeviceBatch):
    """Rows of the device batch handed to requests, and the table entries each row was sent."""

    def __init__(self, capacity: int, table_width: int, block_size: int, device):
        super().__init__(capacity, table_width, block_size, device)
        # your bookkeeping: which request holds which row, which rows are free, and how many
        # table entries each row's device copy holds (the tensors are DeviceBatch's)

    # ---- task 1: rows ----

    def row_of(self, seq: Sequence) -> int:
        """seq's row, the same one at every step until it is released.

        A request seen for the first time takes a free row (no two running requests share one)
        and writes its sampling parameters there with `self.write_params(row, seq.params)`; its
        row's device table is empty as far as you know. With no free row (more requests run than
        the capacity), `self.grow(...)` to twice the capacity first.
        """
        raise NotImplementedError("task 1: PersistentBatch.row_of")

    def release(self, seq: Sequence) -> None:
        """seq left the running set (finished, preempted or aborted): its row is free again, for
        the next new request. Releasing a sequence that holds no row does nothing."""
        raise NotImplementedError("task 1: PersistentBatch.release")

    # ---- task 2: only what changed ----

    def send(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """The rows of seqs, in the order of seqs, as a device tensor (`self.upload` returns it),
        after sending every entry of each seq.block_table that its row's device copy lacks: the
        whole table at a request's first step, then only the entries a block boundary added.

        Hint: remember per row how many entries were sent; a table only grows at its end (the
        cache manager appends), so the missing entries are table[sent:].
        """
        raise NotImplementedError("task 2: PersistentBatch.send")


class OverlapScheduler(OverlapSchedulerBase):
    """The scheduler, split at the step it does not wait for (the rest is given: schedule,
    preempt, abort, and `self.release(seq)`, which frees seq's row: the next step's plan
    tells the runner, which owns the rows)."""

    # ---- task 3: commit when a step is launched, resolve when its tokens arrive ----

    def commit(self, launched: Launched) -> None:
        """The launched step will store its tokens' K/V, and each sequence that samples owes the
        host a token: for every seq of launched.batch.seqs that is not finished, move
        num_scheduled_tokens into num_cached_tokens (and set it to 0), let a prefix-caching
        manager hash the blocks that just filled (`self.prefix_manager.hash_blocks(seq)` when
        there is one), and count one owed token (`seq.num_pending`) if its index is in
        launched.sampled. A finished seq (it ended while this step was being launched) is
        skipped: that step's token for it is discarded.
        """
        raise NotImplementedError("task 3: OverlapScheduler.commit")

    def resolve(self, launched: Launched, token_ids: list, eos_ids) -> list[Sequence]:
        """The step's tokens arrived (token_ids[i] is batch.seqs[i]'s, None for a prefill chunk):
        append each one a sequence owes it, and finish the sequences that are done, as stage 00's
        postprocess does (`finish_reason`): FINISHED with the reason, memory released with
        `self.manager.deallocate`, out of `self.running`, row freed. A finished seq gets nothing
        (the step after its end). A seq preempted while this step ran sits in `self.waiting`
        and holds no memory: if it finishes, take it out of the waiting queue instead.
        Returns the sequences that finished, in batch order.
        """
        raise NotImplementedError("task 3: OverlapScheduler.resolve")


class OverlapEngine(OverlapEngineBase):
    """The engine loop with one step in flight (given: `_launch`, abort, has_unfinished)."""

    Scheduler = OverlapScheduler
    scheduler: OverlapScheduler

    # ---- task 4: the loop ----

    def step(self) -> list[Sequence]:
        """Launch the next batch, then wait for the one before and finish it; returns the
        sequences that finished.

        `self._launch()` schedules and launches a batch (None when nothing can run until a step
        resolves; do not call it when `self.scheduler.is_finished()`); `self.in_flight` is the
        step launched last and not yet resolved. In order: launch the next step; resolve the one
        in flight with its `token_ids()` (that waits for the device); commit the new one and keep
        it in flight. A step with nothing to launch and nothing in flight is a bug: raise
        RuntimeError.
        """
        raise NotImplementedError("task 4: OverlapEngine.step")
