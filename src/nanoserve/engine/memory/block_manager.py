"""The block manager: which physical KV blocks each running sequence holds, and who else does.

Introduced in stage 04, built on stage 02's `BlockAllocator` and stage 03's `BlockTable`. It is
pure bookkeeping (no tensors): `seq.block_table` is the list `prepare_prefill` /
`prepare_decode` turn into the `block_tables` tensor. Blocks grow lazily, one decode token at a
time. Ref counts live here (always 1 per holder until stage 07 shares blocks), and a block goes
back to the allocator only when its count reaches 0 (docs/architecture.md, "Block ownership").
"""

from __future__ import annotations

from nanoserve.engine.memory.allocator import BlockAllocator
from nanoserve.engine.memory.block_table import BlockTable
from nanoserve.engine.memory.kv_manager import blocks_for, check_blocks_fit, grow_table
from nanoserve.types import Sequence


class BlockManager:
    """can_allocate / allocate / can_append / may_append / deallocate over a block pool."""

    def __init__(
        self, num_blocks: int, block_size: int, allocator_cls=BlockAllocator, table_cls=BlockTable
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allocator = allocator_cls(num_blocks)
        self.table_cls = table_cls
        self.ref_counts = [0] * num_blocks  # holders of each block; 0 means free
        self.tables: dict[int, BlockTable] = {}  # seq_id -> its table

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds."""
        return self.allocator.num_free_blocks

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Raise ValueError for a request that could not finish even alone in the pool.

        max_num_tokens is the longest the sequence can get (prompt + max_tokens, capped at
        max_model_len). Without this check such a request would preempt itself forever.
        """
        check_blocks_fit(num_prompt_tokens, "prompt", self.block_size, self.num_blocks)
        check_blocks_fit(max_num_tokens, "prompt + max_tokens", self.block_size, self.num_blocks)

    def can_allocate(self, seq: Sequence) -> bool:
        """True when the free blocks cover every token seq has now (prompt, or more after
        preemption)."""
        return self.num_free_blocks >= blocks_for(len(seq), self.block_size)

    def allocate(self, seq: Sequence) -> int:
        """Give seq blocks for all its current tokens (all-or-nothing); returns how many of its
        tokens already have K/V stored: none (stage 07's manager finds a cached prefix)."""
        self._grow(seq, self.table_cls(self.allocator, self.block_size))
        return 0

    def can_append(self, seq: Sequence) -> bool:
        """True when seq's next decode token fits: in its last block, or in one free block."""
        table = self.tables[seq.seq_id]  # (stage 12: it may hold room reserved past len(seq))
        needs_block = len(seq) > len(table.block_ids) * self.block_size
        return self.num_free_blocks >= int(needs_block)

    def may_append(self, seq: Sequence) -> None:
        """Make room for the token this decode step writes (a new block only at a boundary)."""
        self._grow(seq, self.tables[seq.seq_id])

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks (finish or preemption); free those nobody else holds.

        Blocks go back in table order, so the last one freed is the first handed out again.
        """
        block_ids = self._release(seq)
        self.allocator.free([b for b in block_ids if self.ref_counts[b] == 0])

    def reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Stage 12: grow seq's table toward num_tokens tokens with free blocks only (nobody is
        preempted for it); returns how many tokens the table has room for now."""
        table = self.tables[seq.seq_id]
        room = (len(table.block_ids) + self.num_free_blocks) * self.block_size
        num_tokens = max(table.num_tokens, min(num_tokens, room))
        self._grow(seq, table, num_tokens)
        return num_tokens

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Stage 12's rollback: seq's table keeps its first num_tokens tokens; blocks past them
        are dropped (and freed, last first, when nobody else holds them)."""
        self.allocator.free([b for b in self._shrink(seq, num_tokens) if self.ref_counts[b] == 0])

    def _grow(self, seq: Sequence, table: BlockTable, num_tokens: int | None = None) -> list[int]:
        """Grow table to len(seq) tokens (or num_tokens), hold what it pulled, record it as
        seq's; returns the new ids. An OutOfBlocks leaves everything as it was.

        This, `_release` and `_shrink` (stage 12) are the only writers of seq.block_table: the
        manager owns the table, the sequence shows it (re-shown each time: a table may replace
        its list when it grows).
        """
        fresh = grow_table(table, len(seq) if num_tokens is None else num_tokens)
        self._hold(fresh)
        self.tables[seq.seq_id] = table
        seq.block_table = table.block_ids
        return fresh

    def _shrink(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Cut seq's table to num_tokens tokens and drop its hold on the blocks past them;
        returns their ids, last first. Shrinking pulls nothing, so it cannot run out of blocks."""
        table = self.tables[seq.seq_id]
        dropped = table.truncate(num_tokens)
        for block_id in dropped:
            self.ref_counts[block_id] -= 1
        seq.block_table = table.block_ids
        return dropped

    def _release(self, seq: Sequence) -> list[int]:
        """Drop seq's table and its hold on every block; returns the ids in table order."""
        block_ids = self.tables.pop(seq.seq_id).release()
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
        seq.block_table = []
        return block_ids

    def _hold(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.ref_counts[block_id] += 1

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent; tests call it after every step."""
        held = [0] * self.num_blocks
        for table in self.tables.values():
            for block_id in table.block_ids:
                held[block_id] += 1
        assert held == self.ref_counts, "ref counts differ from block-table references"
        used = sum(1 for count in self.ref_counts if count > 0)  # each held block exactly once
        assert self.num_free_blocks + used == self.num_blocks, "free + used != total"
        for seq_id, table in self.tables.items():
            assert len(table.block_ids) * self.block_size >= table.num_tokens, seq_id
