"""`--trace`: one readable block per engine step, so a learner can watch memory move.

Introduced in stage 04 (it works for every stage). It formats what the engine already decided:
the batch, each sequence's block table (or slab; from stage 07 a shared block shows its holder
count, `0(x2)`), the slots written, free memory, preemptions. It changes nothing and is off
unless asked for.

    step 7 decode  seqs 2  free blocks 5/12  preempted 0      (block_size 4)
      seq 4  len 13  blocks [0, 1, 2, 6]  slots [24]          position 12: block 6, offset 0
      seq 5  len 10  blocks [3, 4, 5]  slots [21]             position 9: block 5, offset 1

Stage 12's verify steps say how many guesses each sequence may take (`may guess 3`; their len
leaves the guesses out: they live beside token_ids, and their blocks hold the room reserved for
them). A verify step's verdict comes back with a later step, which says what each sequence of it
guessed and kept (`verdict: seq 4 guessed 3 kept 1`), before the room goes back.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from nanoserve.engine.memory.kv_manager import CountsBlocks, CountsRefs, CountsSlabs
from nanoserve.types import Landed, ScheduledBatch, StepInputs


class StepRecord(NamedTuple):
    """What one step did."""

    step: int
    batch: ScheduledBatch
    inputs: StepInputs
    num_preempted: int  # sequences preempted while scheduling this step
    verdicts: tuple[Landed, ...] = ()  # stage 12: verify steps whose tokens arrived in it


def free_memory(manager) -> str:
    """Free blocks or slabs out of the total, in the manager's own unit."""
    if isinstance(manager, CountsBlocks):
        return f"free blocks {manager.num_free_blocks}/{manager.num_blocks}"
    if isinstance(manager, CountsSlabs):
        return f"free slabs {manager.num_free_slabs}/{manager.num_slabs}"
    return "no KV cache"


def slots_per_seq(record: StepRecord) -> list[list[int]]:
    """The slots each sequence's new tokens were written to (-1: not stored, stage 00)."""
    md = record.inputs.metadata
    slots, bounds = md.slot_mapping.tolist(), md.host.cu_seqlens_q
    rows = [1 + b for b in record.batch.guesses]  # stage 12: a decode row per token judged
    if md.num_seqs != len(record.batch.seqs) and sum(rows) == md.num_seqs:
        bounds = list(itertools.accumulate(rows, initial=0))
    spans = [slots[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    if rows:  # guessing ahead gives each sequence k + 1 rows: past 1 + its budget, padding
        spans = [span[:n] for span, n in zip(spans, rows)]
    return spans


def short(values: list, limit: int = 12) -> str:
    """[a, b, ..., z] with the middle elided for long lists."""
    if len(values) <= limit:
        return f"[{', '.join(map(str, values))}]"
    head, tail = values[: limit // 2], values[-2:]
    return f"[{', '.join(map(str, head))}, ... {', '.join(map(str, tail))}] ({len(values)})"


def blocks_with_refs(block_ids: list[int], manager) -> str:
    """A block table; a block another sequence also holds shows its holders: 0(x2)."""
    if not isinstance(manager, CountsRefs):
        return short(block_ids)
    return short(
        [f"{b}(x{manager.ref_counts[b]})" if manager.ref_counts[b] > 1 else b for b in block_ids]
    )


def format_step(record: StepRecord, manager) -> str:
    """A header line for the step, then one line per sequence in the batch; after the last
    step, when it lands with nothing launched (stage 12), the verdicts it brought."""
    if record.inputs is None:
        lines = [f"after step {record.step}: the step in flight landed"]
        return "\n".join(lines + verdict_lines(record))
    kind = "prefill" if record.batch.is_prefill else "decode"
    if any(record.batch.guesses):
        kind = "verify"
    lines = [
        f"step {record.step} {kind}  seqs {len(record.batch.seqs)}  {free_memory(manager)}  "
        f"preempted {record.num_preempted}"
    ]
    for seq, slots in zip(record.batch.seqs, slots_per_seq(record)):
        where = f"blocks {blocks_with_refs(seq.block_table, manager)}" if seq.block_table else ""
        if seq.slab_id is not None:
            where = f"slab {seq.slab_id}"
        written = f"  slots {short(slots)}" if any(s >= 0 for s in slots) else ""
        lines.append(f"  seq {seq.seq_id}  len {len(seq)}  {where}{written}")
    for i, budget in enumerate(record.batch.guesses, start=1):
        if budget:
            lines[i] = f"{lines[i]}  may guess {budget}"
    return "\n".join(lines + verdict_lines(record))


def verdict_lines(record: StepRecord) -> list[str]:
    """Stage 12: a line per sequence that guessed in the verify steps whose verdicts arrived
    with this step (printed before the rollback)."""
    lines = []
    for verdict in record.verdicts:
        for seq, guessed, gained in zip(verdict.plan.seqs, verdict.guesses or [], verdict.tokens):
            if guessed or len(gained) > 1:
                lines.append(f"  verdict: seq {seq.seq_id} guessed {len(guessed)} "
                             f"kept {len(gained) - 1}")  # fmt: skip
    return lines
