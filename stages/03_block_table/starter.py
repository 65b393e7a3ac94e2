"""Stage 03 starter: the block table, one sequence's map from token position to KV slot.

Fill in each body (the lesson, stages/03_block_table/README.md, walks through them in task
order) in a copy: `cp stages/03_block_table/starter.py my_block_table.py`, then grade it with
`pytest stages/03_block_table --impl my_block_table.py`. This file itself must keep failing (the
harness checks it). The tests hand your table the reference allocator from stage 02.
"""

from __future__ import annotations

from typing import NamedTuple


class BlockPosition(NamedTuple):
    """Where one logical token lives: which physical block, and how far into it. Given whole."""

    block_id: int
    offset: int


class BlockTable:
    """The ordered block ids of one sequence, grown lazily from a shared allocator.

    Logical position p lives in block_ids[p // block_size] at offset p % block_size.
    Invariant: len(block_ids) == ceil(num_tokens / block_size) -- no block is held ahead of need.
    The allocator is any object with `allocate(n) -> list[int]` (all-or-nothing, raising
    OutOfBlocks) and `free(block_ids)`; use nothing else of it.
    """

    def __init__(self, allocator, block_size: int) -> None:
        """An empty table: public attributes `block_size`, `block_ids` ([]) and `num_tokens` (0)."""
        raise NotImplementedError("task 1: BlockTable.__init__")

    def append(self, num_new_tokens: int) -> None:
        """Grow by num_new_tokens (0 or more; 0 changes nothing), pulling new blocks only once
        the held ones are full.

        Atomic: if the allocator cannot supply every block needed, its OutOfBlocks propagates and
        `block_ids` and `num_tokens` are exactly as before.
        Hint: blocks needed = ceil((num_tokens + num_new_tokens) / block_size) - len(block_ids).
        """
        raise NotImplementedError("task 1: BlockTable.append")

    def position(self, p: int) -> BlockPosition:
        """The (block_id, offset) holding logical position p; IndexError outside 0..num_tokens-1."""
        raise NotImplementedError("task 2: BlockTable.position")

    def slot(self, p: int) -> int:
        """The flat slot index of position p: block_id * block_size + offset."""
        raise NotImplementedError("task 2: BlockTable.slot")

    def free(self) -> None:
        """Give every block back to the allocator in table order, then become empty."""
        raise NotImplementedError("task 4: BlockTable.free")
