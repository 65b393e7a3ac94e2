"""The input packer: a scheduled batch in, one step's `StepInputs` (device tensors) out.

Introduced in stage 04 (`prepare_prefill` / `prepare_decode` are that learner's verbs). The model
runner owns one `InputPacker`, the only code that packs a step: for every stage (00-03 included),
for the tensor-parallel workers and for the CUDA graphs. It reads each sequence's tokens, progress
and block table (decided earlier by a cache manager) and serializes them; it decides nothing.
Seed trace, block_size 4, prompt A of 11 tokens with table [0, 1, 2]: prefill slot_mapping =
0..10; decode at length 12 writes slot 2 * 4 + 3 = 11.

    host lists (per sequence)          ->  device tensors (one step, packed on one axis)
    token_ids[start:end], start, table     input_ids, positions, slot_mapping (T,)
                                           cu_seqlens_q/k (B + 1,), context_lens (B,)
                                           block_tables (B, W) padded with -1
"""

from __future__ import annotations

import torch

from nanoserve.engine.runner.step_tensors import step_inputs_from_lists
from nanoserve.types import (
    ScheduledBatch,
    Sequence,
    StepInputs,
    StepMessage,
    StepRow,
)


def slots_for(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat slots of positions start .. end-1: table[p // bs] * bs + p % bs; -1 with no table."""
    if not table:  # nothing is stored (stage 00): every row is padding as far as writes go
        return [-1] * (end - start)
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def pack_step(
    seqs: list[Sequence],
    tables: list[list[int]],
    block_size: int,
    device,
    *,
    is_prefill: bool,
    from_start: bool = False,
) -> StepInputs:
    """Each sequence's tokens of this step (all of them when from_start) on one axis, no padding.

    Prefill packs the uncached prompt, decode the one newest token: both are
    `token_ids[num_cached_tokens:]`, cut at `num_scheduled_tokens` when a long prompt is
    prefilled in chunks (0 means "all"). tables[i] is where sequence i's K/V lives, in blocks of
    block_size tokens (a stage-01 slab is one block of max_model_len tokens).
    """
    rows = [step_row(seq, table, from_start) for seq, table in zip(seqs, tables)]
    return pack_rows(rows, block_size, device, is_prefill=is_prefill)


def step_row(seq: Sequence, table: list[int], from_start: bool = False) -> StepRow:
    """What this step computes of seq: its tokens from num_cached_tokens (or 0) to chunk_end."""
    start = 0 if from_start else seq.num_cached_tokens
    return StepRow(seq.token_ids[start : chunk_end(seq)], start, table)


def pack_rows(rows: list[StepRow], block_size: int, device, *, is_prefill: bool) -> StepInputs:
    """The step's rows on one axis: ids, positions, slots, cu_seqlens, context lengths, tables.

    A tensor-parallel worker packs the rows rank 0 sent it here, so every rank builds the same
    inputs from the same code.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    context_lens: list[int] = []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
    for token_ids, start, table in rows:
        end = start + len(token_ids)
        input_ids.extend(token_ids)
        positions.extend(range(start, end))
        slot_mapping.extend(slots_for(table, start, end, block_size))
        cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)
        context_lens.append(end)
    return step_inputs_from_lists(
        is_prefill,
        input_ids,
        positions,
        slot_mapping,
        cu_seqlens_q,
        cu_seqlens_k,
        context_lens,
        [r.block_table for r in rows],
        device,
    )


def chunk_end(seq: Sequence) -> int:
    """Where this step's tokens of seq end: len(seq), or earlier for a prefill chunk."""
    if seq.num_scheduled_tokens:
        return min(len(seq), seq.num_cached_tokens + seq.num_scheduled_tokens)
    return len(seq)


def prepare_prefill(seqs: list[Sequence], block_size: int, device) -> StepInputs:
    """Every uncached token of each sequence; cu_seqlens_k also counts the cached prefix."""
    return pack_step(seqs, [s.block_table for s in seqs], block_size, device, is_prefill=True)


def prepare_decode(
    seqs: list[Sequence],
    block_size: int,
    device,
    *,
    batch_size: int | None = None,
    table_width: int | None = None,
) -> StepInputs:
    """One token per sequence, its last; it attends over its whole history.

    batch_size and table_width pad the step to fixed shapes (stage 08's CUDA graphs replay on
    static buffers): extra rows get token 0 at position 0, slot -1 (nothing written) and
    context length 0 (nothing read), and every block table is padded with -1 to table_width.
    """
    step = pack_step(seqs, [s.block_table for s in seqs], block_size, device, is_prefill=False)
    if batch_size is None and table_width is None:
        return step
    return pad_decode(step, batch_size or len(seqs), table_width or step_width(step))


def step_width(step: StepInputs) -> int:
    """How many block ids each row of the step's block_tables holds."""
    return step.metadata.block_tables.shape[1]


def pad_decode(step: StepInputs, batch_size: int, table_width: int) -> StepInputs:
    """The decode step grown to batch_size rows and table_width table columns (see above)."""
    md, num_seqs = step.metadata, step.metadata.num_seqs
    if batch_size < num_seqs or table_width < step_width(step):
        raise ValueError(
            f"cannot pad a decode step of {num_seqs} sequences and {step_width(step)} table "
            f"columns to batch_size {batch_size} and table_width {table_width}"
        )

    def grow(x: torch.Tensor, fill: int, *shape: int) -> torch.Tensor:
        out = torch.full(shape, fill, dtype=x.dtype, device=x.device)
        out[tuple(slice(0, n) for n in x.shape)] = x  # real rows first, padding after
        return out

    metadata = md._replace(
        cu_seqlens_q=torch.arange(batch_size + 1, dtype=torch.int32, device=md.cu_seqlens_q.device),
        cu_seqlens_k=grow(md.cu_seqlens_k, sum(md.host.context_lens), batch_size + 1),
        slot_mapping=grow(md.slot_mapping, -1, batch_size),
        context_lens=grow(md.context_lens, 0, batch_size),
        block_tables=grow(md.block_tables, -1, batch_size, table_width),
    )
    return StepInputs(
        grow(step.input_ids, 0, batch_size), grow(step.positions, 0, batch_size), metadata
    )


def no_table(seq: Sequence) -> list[int]:
    """Stage 00: nothing is stored, so no sequence has a table (every slot is -1)."""
    return []


def slab_table(seq: Sequence) -> list[int]:
    """Stages 01-02: a slab is one block of max_model_len tokens, so its table is [slab_id]."""
    return [] if seq.slab_id is None else [seq.slab_id]


def block_table(seq: Sequence) -> list[int]:
    """Stage 03 on: the block ids the cache manager recorded, in logical order."""
    return seq.block_table


class InputPacker:
    """The model runner's packer: per step, the batch's rows and then their device tensors.

    block_size is how many tokens one table entry covers (a slab: max_model_len; no cache: 1);
    table_of says where a sequence's K/V lives; from_start feeds every token (stage 00, which
    stores nothing). prepare_prefill / prepare_decode are stage 04's verbs: a learner's replace
    them through `components=`.
    """

    def __init__(
        self,
        block_size: int,
        device,
        *,
        table_of=block_table,
        from_start=False,
        prepare_prefill=prepare_prefill,
        prepare_decode=prepare_decode,
    ):
        self.block_size, self.device = block_size, device
        self.table_of, self.from_start = table_of, from_start
        self.prepare_prefill, self.prepare_decode = prepare_prefill, prepare_decode

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs: the batch's new tokens (all of them for stage 00) on one axis."""
        if self.table_of is block_table:  # stage 03 on: the stage-04 verbs, a learner's or ours
            prepare = self.prepare_prefill if batch.is_prefill else self.prepare_decode
            return prepare(batch.seqs, self.block_size, self.device)
        return pack_rows(
            self.rows(batch).rows, self.block_size, self.device, is_prefill=batch.is_prefill
        )

    def rows(self, batch: ScheduledBatch) -> StepMessage:
        """The batch as plain rows: what rank 0 sends each tensor-parallel worker."""
        rows = [step_row(seq, self.table_of(seq), self.from_start) for seq in batch.seqs]
        return StepMessage(batch.is_prefill, rows, len(batch.seqs))

    def prepare_rows(self, message: StepMessage) -> StepInputs:
        """A worker's step: rank 0's rows packed exactly as rank 0 packed them."""
        return pack_rows(message.rows, self.block_size, self.device, is_prefill=message.is_prefill)


def verify_rows(seqs: list[Sequence], guesses: list[list[int]], as_decode: bool) -> StepMessage:
    """Stage 12's verify step: what each sequence computes, its newest token then its guesses
    (which live beside its token_ids until the verdict), from position len(seq) - 1 on.

    As one decode row per token (each at its own position over the sequence's table, so it
    reads exactly its own prefix: the rows before it in the step are stored first; a captured
    graph replays them), or as one prefill-shaped chunk per sequence (causal among its rows,
    each context read once), with logits at every row. Trace, block_size 4, a sequence of 6
    tokens (newest t), table [5, 2], guesses [9, 8]:

        as decode rows                       as one chunk
        row 0: t  @5  slot 9   context 6     rows t@5 9@6 8@7, slots 9 10 11
        row 1: 9  @6  slot 10  context 7     cu_seqlens_q [0, 3], context 8, causal
        row 2: 8  @7  slot 11  context 8
    """
    chunks = [
        (seq.token_ids[-1:] + g, len(seq) - 1, seq.block_table) for seq, g in zip(seqs, guesses)
    ]
    if not as_decode:
        rows = [StepRow(tokens, start, table) for tokens, start, table in chunks]
        return StepMessage(True, rows, len(rows), every_row=True)
    rows = [StepRow([t], start + j, table) for tokens, start, table in chunks
            for j, t in enumerate(tokens)]  # fmt: skip
    return StepMessage(False, rows, len(rows))
