"""Stage 11 starter: overlap scheduling. Rows of the running batch kept on the device, the next step
launched before the last one's tokens reach the host, and the scheduler's bookkeeping that keeps
that exact.

Fill in each body (the lesson, stages/11_overlap/README.md, walks through them in task order) in
a copy: `cp stages/11_overlap/starter.py my_overlap.py`, then grade it with
`pytest stages/11_overlap --impl my_overlap.py`; this file itself must keep failing. Every task
runs on a CPU; task 5 also runs your classes with CUDA graphs and skips without a GPU.

    the loop is every stage's: plan = schedule(); out = runner.execute(plan); update(plan, out)
    stage 11's runner (given) launches the plan, then waits for the step before it:

      host    schedule N+1 | launch N+1 | wait N | update: land N, commit N+1 | schedule N+2 ...
      device  .. step N ......................... | step N+1 ..................................

    the persistent batch, block_size 4: a prompt of 6 tokens, table [5, 2], takes row 0
      first step      send: rows [0], entries (0, 0, 5) and (0, 1, 2)
      decode steps    send: rows [0], no entry ... until the table grows to [5, 2, 9]:
      boundary        send: rows [0], entry (0, 2, 9)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from nanoserve.engine.loop.scheduler import Scheduler, finish_reason  # noqa: F401  (task 4)
from nanoserve.engine.runner.device_batch import DeviceBatch
from nanoserve.types import Landed, ScheduledBatch, Sequence

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
        # table entries each row's device copy holds (the tensors are DeviceBatch's). Two names
        # are read from outside, so keep them: `self.rows`, a dict seq_id -> row, and
        # `self.num_sent`, a list with one count per row (stage 12's runner lowers a count when
        # the scheduler cuts a table: `OverlapRunner.forget_trimmed`).

    # ---- task 1: rows ----

    def row_of(self, seq: Sequence) -> int:
        """seq's row, the same one at every step until it is released.

        A request seen for the first time takes a free row (no two running requests share one)
        and writes its sampling parameters there with `self.write_params(row, seq.params)`; its
        row's device table is empty as far as you know. With no free row (more requests run than
        the capacity), `self.grow(...)` to twice the capacity first: the rows it adds are free,
        and each needs its count of sent entries too.
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


class OverlapScheduler(Scheduler):
    """The scheduler, with its update split at the step it does not wait for.

    Given (engine/loop/scheduler.py): schedule, preempt, abort, `self.release(seq)` (the next
    plan tells the runner, which owns the rows, to free seq's row) and `update(plan, out)`, which
    the engine calls once per step and which calls yours in this order:

        land(out.earlier)            the step before landed during this call (the runner waited)
        commit(plan, out.sampled)    this plan was launched; its tokens are still on the device
        land(Landed(plan, tokens))   only when the plan's tokens are already here (no overlap)
    """

    # ---- task 3: commit, when a step is launched ----

    def commit(self, plan: ScheduledBatch, sampled: tuple[int, ...]) -> None:
        """The plan's step will store its tokens' K/V, and each sequence that samples owes the
        host a token. For every seq of plan.seqs that is not finished: move num_scheduled_tokens
        into num_cached_tokens (and set num_scheduled_tokens to 0), let a prefix-caching manager
        hash the blocks that just filled (`self.prefix_manager.hash_blocks(seq)` when
        self.prefix_manager is not None), and count one owed token (`seq.num_pending += 1`) if
        its index in plan.seqs is in `sampled` (a prefill chunk that does not end its prompt
        samples nothing). A finished seq (it ended when the step before landed, after this plan
        was launched) only gets num_scheduled_tokens = 0: this step's token for it is discarded.
        """
        raise NotImplementedError("task 3: OverlapScheduler.commit")

    # ---- task 4: land, when a step's tokens arrive ----

    def land(self, landed: Landed) -> list[Sequence]:
        """A step's tokens arrived: landed.tokens[i] is what landed.plan.seqs[i] gains, a list
        ([] for a prefill chunk that sampled nothing, [t] after a plain step).

        Skip a seq whose list is empty, and a finished one (the step after its end: its token is
        discarded). Otherwise its owed token lands: `seq.num_pending -= 1`, then append the
        tokens in order (`seq.append_token`), up to and including the first one for which
        `finish_reason(seq, token_id, self.eos_ids, self.config.max_model_len)` is not None
        (append, then ask: it counts max_tokens from the tokens appended).
        (Stage 12 lands several tokens per seq: the guesses the model kept, then one it drew.
        If none of them finishes seq, the kept guesses' K/V is stored: num_cached_tokens grows
        by len(tokens) - 1, and a prefix-caching manager hashes seq's blocks. With one token
        that is + 0.)

        A seq that finished: `seq.finish(reason)`; if it sits in `self.waiting` (preempted while
        this step ran: it holds no memory and no row) take it out of the waiting queue; else
        `self.manager.deallocate(seq)`, remove it from `self.running` and `self.release(seq)`.
        Returns the sequences that finished, in the order of plan.seqs.
        """
        raise NotImplementedError("task 4: OverlapScheduler.land")
