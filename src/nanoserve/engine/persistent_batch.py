"""The persistent batch: the running requests' state kept on the device, one row per request.

Introduced in stage 11 (overlap scheduling). Up to stage 10 every step re-sends each sequence's
whole block table and rebuilds its positions and slots on the host. Here a request holds a row of
device tensors from its first step to its last, and a step sends only what changed:

    admission          row r := a free row; its sampling parameters written once
    block boundary     block_tables[r, len(table) - 1] := the new block   (one entry)
    decode step        input_ids = next_token_ids[rows]   (sampled by the step before, on device)
                       positions = seq_lens[rows] - 1, slots from block_tables[rows], all on device
    after sampling     next_token_ids[rows] := tokens, seq_lens[rows] += 1
    finish / preempt   row r back on the free list (its device values are simply overwritten later)

The host stays the source of truth (the cache manager's tables, the scheduler's progress); these
tensors are a cache of it that only this class writes. Seed trace, block_size 4: a prompt of 6
tokens with table [5, 2] gets row 0; its prefill samples token t at position 6 and leaves
seq_lens[0] = 7, next_token_ids[0] = t; the decode step feeds t at position 6, slot 2 * 4 + 2 = 10.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import numpy as np
import torch

from nanoserve.device_sampler import SamplingTensors
from nanoserve.engine.step_tensors import to_device
from nanoserve.types import AttentionMetadata, HostMetadata, Sequence, StepInputs


class PersistentBatch:
    """Per-row device tensors for up to `capacity` running requests (grown when more run)."""

    def __init__(self, capacity: int, table_width: int, block_size: int, device):
        self.block_size, self.device = block_size, torch.device(device)
        self.width = table_width
        self.rows: dict[int, int] = {}  # seq_id -> its row
        self.num_sent: list[int] = []  # per row: how many table entries the device holds
        self.free_rows: list[int] = []
        self._seeds = random.Random()  # an unseeded request gets a fresh seed (see row_of)
        self.block_tables = torch.empty(0, table_width, dtype=torch.int32, device=self.device)
        self.seq_lens = self._ints(0, torch.int32)  # tokens the row's next decode attends over
        self.next_token_ids = self._ints(0, torch.int64)  # the token the next decode feeds
        self.temperature = torch.empty(0, device=self.device)
        self.top_k = self._ints(0, torch.int64)
        self.top_p = torch.empty(0, device=self.device)
        self.seeds = self._ints(0, torch.int64)
        self._grow(capacity)

    def _ints(self, n: int, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` rows: old rows keep their values, new ones go on the free list."""
        old = len(self.num_sent)

        def grown(x: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((capacity, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
            out[:old] = x
            return out

        self.block_tables = grown(self.block_tables, -1)
        self.seq_lens, self.next_token_ids = grown(self.seq_lens, 0), grown(self.next_token_ids, 0)
        self.temperature, self.top_p = grown(self.temperature, 0.0), grown(self.top_p, 1.0)
        self.top_k, self.seeds = grown(self.top_k, 0), grown(self.seeds, 0)
        self.num_sent += [0] * (capacity - old)
        self.free_rows += reversed(range(old, capacity))  # pop() hands out the lowest first

    # ---- rows: assigned at a request's first step, freed when it leaves the running set ----

    def row_of(self, seq: Sequence) -> int:
        """seq's row; a request seen for the first time takes a free row and writes its sampling
        parameters there (an unseeded one draws a seed now: its stream, keyed by position)."""
        row = self.rows.get(seq.seq_id)
        if row is not None:
            return row
        if not self.free_rows:
            self._grow(2 * len(self.num_sent))
        row = self.rows[seq.seq_id] = self.free_rows.pop()
        self.num_sent[row] = 0
        p = seq.params
        seed = p.seed if p.seed is not None else self._seeds.getrandbits(64)
        self.temperature[row] = 0.0 if p.is_greedy else p.temperature
        self.top_k[row] = p.top_k or 0
        self.top_p[row] = p.top_p
        self.seeds[row] = seed - 2**64 if seed >= 2**63 else seed  # the same 64 bits, signed
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
        packed = to_device_ints(rows + changed_rows + columns + blocks, self.device)
        n, u = len(rows), len(changed_rows)
        if u:
            where = (packed[n : n + u], packed[n + u : n + 2 * u])
            self.block_tables.index_put_(where, packed[n + 2 * u :].to(torch.int32))
        return packed[:n]

    def decode_inputs(
        self, seqs: Seq[Sequence], rows: torch.Tensor, out: StepInputs | None = None
    ) -> StepInputs:
        """A decode step's inputs computed on the device from the rows (no token leaves it).

        out: tensors to write into (stage 08's static graph buffers, `bucket` rows); rows past
        len(seqs) become padding (slot -1, context length 0). None: fresh tensors of len(seqs).
        """
        n = len(seqs)
        lens = [len(seq) for seq in seqs]  # the host knows lengths (tokens it has not seen count)
        host = HostMetadata(list(range(n + 1)), lens, [seq.block_table for seq in seqs])
        if out is None:  # as wide as the longest table (the torch paths gather every column)
            width = max(map(len, host.block_tables), default=0)
            out = empty_decode_inputs(n, width, self.device)
        bucket, width = out.metadata.block_tables.shape
        md = out.metadata
        ctx = self.seq_lens[rows]
        positions = ctx.long() - 1
        torch.index_select(self.next_token_ids, 0, rows, out=out.input_ids[:n])
        out.positions[:n] = positions
        md.context_lens[:n] = ctx
        md.cu_seqlens_k[1 : n + 1] = torch.cumsum(ctx, 0)
        torch.index_select(self.block_tables[:, :width], 0, rows, out=md.block_tables[:n])
        blocks = md.block_tables[:n].gather(1, (positions // self.block_size)[:, None])[:, 0]
        md.slot_mapping[:n] = blocks.long() * self.block_size + positions % self.block_size
        if bucket > n:  # padding rows: feed token 0 at position 0, write nothing, read nothing
            md.slot_mapping[n:] = -1
            md.context_lens[n:] = 0
            md.cu_seqlens_k[n + 1 :] = md.cu_seqlens_k[n]
        metadata = md._replace(max_seqlen_k=max(lens, default=0), host=host)
        return StepInputs(out.input_ids, out.positions, metadata)

    def sampling(
        self, rows: torch.Tensor, positions: torch.Tensor, filters: bool
    ) -> SamplingTensors:
        """The sampler's per-row parameters, gathered on the device by row."""
        return SamplingTensors(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.seeds[rows],
            positions,
            filters,
        )

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """After sampling: what each row feeds next, and how long its context is then."""
        self.next_token_ids[rows] = tokens
        self.seq_lens[rows] = seq_lens.to(torch.int32)


def to_device_ints(values: list[int], device) -> torch.Tensor:
    """A list of ints as an int64 tensor on device (through pinned memory, without waiting)."""
    return to_device(np.asarray(values, dtype=np.int64), device)


def empty_decode_inputs(n: int, width: int, device) -> StepInputs:
    """Uninitialised decode inputs of n rows (decode_inputs writes every element it reads)."""
    ints = dict(dtype=torch.int32, device=device)
    metadata = AttentionMetadata(
        is_prefill=False,
        cu_seqlens_q=torch.arange(n + 1, **ints),
        cu_seqlens_k=torch.zeros(n + 1, **ints),
        max_seqlen_q=1,
        max_seqlen_k=0,
        slot_mapping=torch.empty(n, dtype=torch.int64, device=device),
        context_lens=torch.empty(n, **ints),
        block_tables=torch.empty(n, width, **ints),
        host=HostMetadata([], [], []),
    )
    longs = dict(dtype=torch.int64, device=device)
    return StepInputs(torch.empty(n, **longs), torch.empty(n, **longs), metadata)
