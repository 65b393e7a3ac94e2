"""`--trace`: one readable block per engine step, so a learner can watch memory move.

Introduced in stage 04 (it works for every stage). It formats what the engine already decided:
the batch, each sequence's block table (or slab; from stage 07 a shared block shows its holder
count, `0(x2)`), the slots written, free memory, preemptions. It changes nothing and is off
unless asked for.

    step 7 decode  seqs 2  free blocks 5/12  preempted 0      (block_size 4)
      seq 4  len 13  blocks [0, 1, 2, 6]  slots [24]          position 12: block 6, offset 0
      seq 5  len 10  blocks [3, 4, 5]  slots [21]             position 9: block 5, offset 1

Stage 12's verify steps say how many guesses each sequence made and kept (`guessed 3 kept 1`);
their len leaves the guesses out (they live beside token_ids), and their blocks still hold the
room reserved for them (the line is printed before the room goes back).
"""

from __future__ import annotations

from typing import NamedTuple

from nanoserve.engine.memory.kv_manager import CountsBlocks, CountsRefs, CountsSlabs
from nanoserve.types import ScheduledBatch, StepInputs


class StepRecord(NamedTuple):
    """What one step did."""

    step: int
    batch: ScheduledBatch
    inputs: StepInputs
    num_preempted: int  # sequences preempted while scheduling this step
    gained: list[list[int]] | None = None  # stage 12's verify step: kept guesses + drawn token
    guesses: list[list[int]] | None = None  # stage 12: what each sequence guessed


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
    return [slots[bounds[i] : bounds[i + 1]] for i in range(md.num_seqs)]


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
    """A header line for the step, then one line per sequence in the batch."""
    kind = "prefill" if record.batch.is_prefill else "decode"
    if record.gained is not None:
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
    if record.gained is not None:  # printed before the rollback: blocks hold the guesses' room
        guesses = record.guesses or [[] for _ in record.gained]
        for i, (guessed, gained) in enumerate(zip(guesses, record.gained), start=1):
            lines[i] = f"{lines[i]}  guessed {len(guessed)} kept {len(gained) - 1}"
    return "\n".join(lines)
