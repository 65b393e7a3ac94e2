"""The device batch: per-row tensors of the running requests on the device, and what a step reads.

Introduced in stage 11, given to its learner (who writes `PersistentBatch`, which decides which
request holds which row and which table entries the device still lacks). Rows hold:

    block_tables (R, W) int32    the request's block ids, -1 past its end
    seq_lens     (R,)   int32    tokens its next decode step attends over (the fed token included)
    next_token_ids (R,) int64    the token its next decode step feeds (sampled by the step before)
    temperature, top_k, top_p, seeds (R,)   its sampling parameters, written once at admission

A decode step reads them by row (`decode_inputs`): input ids, positions, slots and context
lengths are computed here on the device, so no token and no table leaves it. Seed trace,
block_size 4: row 0 with table [5, 2] and seq_lens 7 feeds next_token_ids[0] at position 6, slot
2 * 4 + 2 = 10, and reads 7 tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import numpy as np
import torch

from nanoserve.engine.runner.graph_buffers import static_decode_inputs
from nanoserve.engine.runner.step_tensors import to_device
from nanoserve.samplers.device_sampler import SamplingTensors
from nanoserve.sampling import SamplingParams
from nanoserve.types import HostMetadata, Sequence, StepInputs


class DeviceBatch:
    """Per-row device tensors for up to `capacity` running requests (grown when more run), and
    what a step reads from them; which request holds which row is `PersistentBatch`'s business."""

    def __init__(self, capacity: int, table_width: int, block_size: int, device):
        self.block_size, self.device = block_size, torch.device(device)
        self.width = table_width
        self.capacity = 0
        self.sampled: list[bool] = []  # per row: its owner has sampled on the device (see prime)
        self._seeds = random.Random()  # an unseeded request gets a fresh seed (see write_params)
        self.block_tables = torch.empty(0, table_width, dtype=torch.int32, device=self.device)
        self.seq_lens = self._ints(0, torch.int32)  # tokens the row's next decode attends over
        self.next_token_ids = self._ints(0, torch.int64)  # the token the next decode feeds
        self.temperature = torch.empty(0, device=self.device)
        self.top_k = self._ints(0, torch.int64)
        self.top_p = torch.empty(0, device=self.device)
        self.seeds = self._ints(0, torch.int64)
        self.grow(capacity)

    def _ints(self, n: int, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def grow(self, capacity: int) -> None:
        """Room for `capacity` rows; rows below the old capacity keep their values. One row more
        is kept past them, never handed out: `padding_row`."""
        old = self.capacity

        def grown(x: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((capacity + 1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
            out[:old] = x[:old]
            return out

        self.block_tables = grown(self.block_tables, -1)
        self.seq_lens, self.next_token_ids = grown(self.seq_lens, 0), grown(self.next_token_ids, 0)
        self.temperature, self.top_p = grown(self.temperature, 0.0), grown(self.top_p, 1.0)
        self.top_k, self.seeds = grown(self.top_k, 0), grown(self.seeds, 0)
        self.sampled += [False] * (capacity - old)
        self.capacity = capacity

    @property
    def padding_row(self) -> int:
        """The row past the last one handed out: a captured step's padding rows read it (its
        context length stays 0, its table -1) and write their draws there (stage 11's
        `StepGraphs`)."""
        return self.capacity

    def write_params(self, row: int, params: SamplingParams) -> None:
        """Row's sampling parameters; an unseeded request draws its seed here (its draws are
        then keyed by position, like a seeded one's)."""
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        self.temperature[row] = 0.0 if params.is_greedy else params.temperature
        self.top_k[row] = params.top_k or 0
        self.top_p[row] = params.top_p
        self.seeds[row] = seed - 2**64 if seed >= 2**63 else seed  # the same 64 bits, signed
        self.sampled[row] = False  # a new owner: nothing of it on the device yet

    def prime(self, rows: list[int], seqs: Seq[Sequence]) -> None:
        """Before a decode step: a row whose owner never sampled on the device (the last token of
        a chunked prompt is computed by a decode step) gets its next token and length from the
        host, which knows them. A row that sampled already holds both."""
        fresh = [(row, seq) for row, seq in zip(rows, seqs) if not self.sampled[row]]
        if not fresh:
            return
        values = [r for r, _ in fresh] + [s.last_token_id for _, s in fresh]
        packed = to_device_ints(values + [len(s) for _, s in fresh], self.device)
        n = len(fresh)
        self.next_token_ids[packed[:n]] = packed[n : 2 * n]
        self.seq_lens[packed[:n]] = packed[2 * n :].to(torch.int32)

    def upload(
        self, rows: list[int], changed_rows: list[int], columns: list[int], blocks: list[int]
    ) -> torch.Tensor:
        """The step's rows on the device, after block_tables[changed_rows[i], columns[i]] =
        blocks[i] for every i; one host-to-device copy of [rows | changed | columns | blocks]."""
        packed = to_device_ints(rows + changed_rows + columns + blocks, self.device)
        n, u = len(rows), len(changed_rows)
        if u:
            where = (packed[n : n + u], packed[n + u : n + 2 * u])
            self.block_tables.index_put_(where, packed[n + 2 * u :].to(torch.int32))
        return packed[:n]

    def decode_inputs(
        self,
        seqs: Seq[Sequence],
        rows: torch.Tensor,
        out: StepInputs | None = None,
        lens: list[int] | None = None,
    ) -> StepInputs:
        """A decode step's inputs computed on the device from the rows (no token leaves it).

        out: tensors to write into (stage 08's static graph buffers, `bucket` rows); rows past
        len(seqs) become padding (slot -1, context length 0). None: fresh tensors of len(seqs).
        lens: the host's lengths (stage 12: bounds, while a verify step is in flight); None:
        len(seq), which counts the tokens the host has not seen yet.
        """
        lens = [len(seq) for seq in seqs] if lens is None else lens
        tables = [seq.block_table for seq in seqs]
        host = HostMetadata(list(range(len(seqs) + 1)), lens, tables)
        ids = self.next_token_ids[rows]
        return self.fill_rows(rows, self.seq_lens[rows], ids, host, out)

    def fill_rows(
        self,
        rows: torch.Tensor,
        ctx: torch.Tensor,
        ids: torch.Tensor,
        host: HostMetadata,
        out: StepInputs | None,
    ) -> StepInputs:
        """Decode rows: row i feeds ids[i] at position ctx[i] - 1 of the sequence at device row
        rows[i], stores it in that position's slot and reads ctx[i] tokens. Written into out
        (the graphs' static buffers; rows past len(rows) become padding: slot -1, context 0),
        or into fresh tensors as wide as the longest table. A row of ctx 0 (`padding_row`, in
        a captured step) is padding too: it stores nothing and reads nothing."""
        n = len(host.context_lens)
        if out is None:  # as wide as the longest table (the torch paths gather every column)
            width = max(map(len, host.block_tables), default=0)
            out = static_decode_inputs(n, width, self.device)
        bucket, width = out.metadata.block_tables.shape
        md = out.metadata
        positions = (ctx.long() - 1).clamp_(min=0)  # a padding row (ctx 0) feeds position 0
        out.input_ids[:n] = ids
        out.positions[:n] = positions
        md.context_lens[:n] = ctx
        md.cu_seqlens_k[1 : n + 1] = torch.cumsum(ctx, 0)
        torch.index_select(self.block_tables[:, :width], 0, rows, out=md.block_tables[:n])
        blocks = md.block_tables[:n].gather(1, (positions // self.block_size)[:, None])[:, 0]
        slots = blocks.long() * self.block_size + positions % self.block_size
        md.slot_mapping[:n] = torch.where(ctx > 0, slots, -1)
        if bucket > n:  # padding rows: feed token 0 at position 0, write nothing, read nothing
            md.slot_mapping[n:] = -1
            md.context_lens[n:] = 0
            md.cu_seqlens_k[n + 1 :] = md.cu_seqlens_k[n]
        metadata = md._replace(max_seqlen_k=max(host.context_lens, default=0), host=host)
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
