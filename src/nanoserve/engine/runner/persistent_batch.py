"""The persistent batch: which running request holds which device row, and what the device lacks.

Introduced in stage 11 (overlap scheduling); its learner writes this class. Up to stage 10 every
step re-sends each sequence's whole block table. Here a request holds a row of the device batch
(engine/runner/device_batch.py, given) from its first step to its last, and a step sends only what
changed:

    first step         row r := a free row (lowest first); its sampling parameters written once
    every step         the table entries the device lacks: all of them on the first step, then
                       one per block boundary, none in between
    finish / preempt   row r back on the free list (its device values are overwritten later)

Seed trace, block_size 4: a prompt of 6 tokens with table [5, 2] takes row 0 and sends (0, 0, 5)
and (0, 1, 2); three decode steps later its table is [5, 2, 9] and the step sends (0, 2, 9) only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from nanoserve.engine.runner.device_batch import DeviceBatch
from nanoserve.types import Sequence


class PersistentBatch(DeviceBatch):
    """Rows of the device batch handed to requests, and the table entries each row was sent."""

    def __init__(self, capacity: int, table_width: int, block_size: int, device):
        super().__init__(capacity, table_width, block_size, device)
        self.rows: dict[int, int] = {}  # seq_id -> its row
        self.num_sent = [0] * capacity  # per row: how many table entries the device holds
        self.free_rows = list(reversed(range(capacity)))  # pop() hands out the lowest first

    # ---- rows: assigned at a request's first step, freed when it leaves the running set ----

    def row_of(self, seq: Sequence) -> int:
        """seq's row; a request seen for the first time takes a free row and writes its sampling
        parameters there (an unseeded one draws a seed now: its stream, keyed by position)."""
        row = self.rows.get(seq.seq_id)
        if row is not None:
            return row
        if not self.free_rows:  # more requests run than max_num_seqs: twice the rows
            old = self.capacity
            self.grow(2 * old)
            self.num_sent += [0] * old
            self.free_rows += reversed(range(old, 2 * old))
        row = self.rows[seq.seq_id] = self.free_rows.pop()
        self.num_sent[row] = 0
        self.write_params(row, seq.params)
        return row

    def release(self, seq: Sequence) -> None:
        """seq left the running set (finished, preempted or aborted): its row is free again."""
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free_rows.append(row)

    # ---- one step: the host's changes in, the device's inputs out ----

    def send(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """The rows of seqs as a device tensor, after writing every table entry the device lacks.

        One host-to-device copy per step: [rows | changed rows | their columns | their blocks].
        Between block boundaries nothing but the row indices travels.
        """
        rows = [self.row_of(seq) for seq in seqs]
        changed_rows: list[int] = []
        columns: list[int] = []
        blocks: list[int] = []
        for row, seq in zip(rows, seqs):
            table, sent = seq.block_table, self.num_sent[row]
            if len(table) > sent:  # admission sends the whole table, a boundary one entry
                changed_rows += [row] * (len(table) - sent)
                columns += range(sent, len(table))
                blocks += table[sent:]
                self.num_sent[row] = len(table)
        return self.upload(rows, changed_rows, columns, blocks)
