"""Stage 03's cache manager: a block table per sequence, with its worst case reserved up front.

Introduced in stage 03. Each running sequence owns a `BlockTable` over one shared
`BlockAllocator`. Admission still reserves the worst case (prompt + max_tokens, in blocks rather
than stage 01's max_model_len slabs), so decode never runs out; blocks are pulled lazily, but
the promise is made at admission. Lazy reservation with preemption arrives in stage 04.
"""

from __future__ import annotations

from nanoserve.engine.memory.allocator import BlockAllocator
from nanoserve.engine.memory.block_table import BlockTable
from nanoserve.engine.memory.kv_manager import blocks_for, check_blocks_fit, grow_table
from nanoserve.types import Sequence


class TableManager:
    """One BlockTable per running sequence, plus the blocks promised to it but not yet pulled."""

    def __init__(self, allocator, block_size: int, max_model_len: int, table_cls=BlockTable):
        self.allocator = allocator
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.table_cls = table_cls
        self.tables: dict[int, BlockTable] = {}  # seq_id -> table
        self.num_promised: dict[int, int] = {}  # seq_id -> blocks reserved, not yet pulled

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds (some of them may be promised)."""
        return self.allocator.num_free_blocks

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks for the longest seq can get: prompt + max_tokens, capped at max_model_len."""
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        return blocks_for(longest, self.block_size)

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Raise ValueError for a request whose worst case exceeds the whole pool."""
        check_blocks_fit(max_num_tokens, "prompt + max_tokens", self.block_size, self.num_blocks)

    def can_allocate(self, seq: Sequence) -> bool:
        """True when the unpromised free blocks cover seq's worst case."""
        unpromised = self.allocator.num_free_blocks - sum(self.num_promised.values())
        return unpromised >= self.blocks_needed(seq)

    def allocate(self, seq: Sequence) -> int:
        """Pull blocks for the prompt now; promise the rest of the worst case. 0 tokens cached."""
        pulled = self._grow(seq, self.table_cls(self.allocator, self.block_size))
        self.num_promised[seq.seq_id] = self.blocks_needed(seq) - len(pulled)
        return 0

    def can_append(self, seq: Sequence) -> bool:
        """Always: the blocks for decode were promised at admission."""
        return True

    def may_append(self, seq: Sequence) -> None:
        """Grow seq's table by the token this decode step writes (a block only at a boundary)."""
        self.num_promised[seq.seq_id] -= len(self._grow(seq, self.tables[seq.seq_id]))

    def deallocate(self, seq: Sequence) -> None:
        """Hand every block and promise back."""
        self.tables.pop(seq.seq_id).free()
        del self.num_promised[seq.seq_id]
        seq.block_table = []

    def _grow(self, seq: Sequence, table) -> list[int]:
        """Grow table to len(seq) tokens and record it as seq's; returns the ids it pulled.

        This and deallocate are the only writers of seq.block_table: the manager owns the table,
        the sequence shows it (re-shown each time: a table may replace its list when it grows).
        An OutOfBlocks leaves everything as it was.
        """
        pulled = grow_table(table, len(seq))
        self.tables[seq.seq_id] = table
        seq.block_table = table.block_ids
        return pulled

    def check_invariants(self) -> None:
        """Held blocks are distinct, promises non-negative, and the free blocks cover them."""
        held = [b for table in self.tables.values() for b in table.block_ids]
        assert len(held) == len(set(held)), "a block is held by two tables"
        assert len(held) + self.num_free_blocks == self.num_blocks, "free + held != total"
        assert all(n >= 0 for n in self.num_promised.values()), "a negative promise"
        assert sum(self.num_promised.values()) <= self.num_free_blocks, "promised > free"


def build_table_manager(
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    allocator_cls=BlockAllocator,
    table_cls=BlockTable,
) -> TableManager:
    """The stage-03 manager over a (possibly learner-provided) allocator and block table."""
    return TableManager(allocator_cls(num_blocks), block_size, max_model_len, table_cls)
