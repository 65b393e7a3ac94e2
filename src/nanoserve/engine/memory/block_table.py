"""The block table: one sequence's map from logical token position to a physical KV slot.

Introduced in stage 03, on top of stage 02's allocator. It only computes addresses: it stores no
K/V (the pool tensor arrives in stage 04) and decides no sharing. Stage 07 adds two verbs:
`adopt` (start from blocks someone else pulled: a cached prefix) and `release` (hand the ids to
the block manager, which frees only those no other sequence holds); stage 12 adds `truncate`
(forget rejected proposals: the blocks past the kept tokens go back to the manager).

    logical positions          block table           physical pool, block_size 16
    (one 20-token sequence)    (block_ids)           (flat slot = block_id * 16 + offset)

    p  0..15  ------------->   index 0 -> 5 ---.     block 0 | other seq     |  slots  0..15
    p 16..19  ------------->   index 1 -> 2 -. |     block 1 | free          |  slots 16..31
                                             '-+---> block 2 | 16 17 18 19 . |  slots 32..47
                                               |     block 3 | free          |  slots 48..63
                                               |     block 4 | other seq     |  slots 64..79
                                               '---> block 5 |  0  1 ... 15  |  slots 80..95

    position 17:  17 // 16 = 1  ->  block_ids[1] = 2      17 % 16 = 1  ->  offset 1
                  slot = 2 * 16 + 1 = 33

The sequence looks contiguous from the left and is scattered on the right; translation does not
care whether a sequence's blocks are neighbours, and that gap between the two views is paging.
"""

from __future__ import annotations

from typing import NamedTuple

from nanoserve.engine.memory.allocator import BlockAllocator


class BlockPosition(NamedTuple):
    """Where one logical token lives: which physical block, and how far into it."""

    block_id: int
    offset: int


class BlockTable:
    """The ordered block ids of one sequence, grown lazily from a shared `BlockAllocator`.

    Invariant: `num_blocks == ceil(num_tokens / block_size)`, so the last block may be partly
    empty and no block is ever held ahead of need. The table uses only the allocator's
    `allocate(n)` and `free(ids)`, so any object with those two methods can stand in for it.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.block_ids: list[int] = []  # block_ids[i] holds positions i*bs .. (i+1)*bs - 1
        self.num_tokens = 0

    @property
    def num_blocks(self) -> int:
        """How many physical blocks this sequence holds."""
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """How many tokens fit before the next block must be pulled."""
        return self.num_blocks * self.block_size

    def append(self, num_new_tokens: int) -> None:
        """Grow by num_new_tokens, pulling blocks only past capacity; atomic on OutOfBlocks."""
        if num_new_tokens < 0:
            raise ValueError(f"cannot append a negative number of tokens ({num_new_tokens})")
        num_missing = self._num_blocks_for(self.num_tokens + num_new_tokens) - self.num_blocks
        if num_missing > 0:
            # allocate() is all-or-nothing, and nothing here changes before it returns, so an
            # OutOfBlocks leaves num_tokens and block_ids exactly as they were.
            self.block_ids.extend(self.allocator.allocate(num_missing))
        self.num_tokens += num_new_tokens

    def position(self, p: int) -> BlockPosition:
        """The (block_id, offset) holding logical position p; IndexError outside 0..num_tokens-1."""
        if not 0 <= p < self.num_tokens:
            raise IndexError(self._out_of_range_message(p))
        return BlockPosition(self.block_ids[p // self.block_size], p % self.block_size)

    def slot(self, p: int) -> int:
        """The flat slot index block_id * block_size + offset of logical position p."""
        block_id, offset = self.position(p)
        return block_id * self.block_size + offset

    def free(self) -> None:
        """Hand every block back to the allocator in table order and become empty."""
        self.allocator.free(self.release())

    def adopt(self, block_ids: list[int]) -> None:
        """Append full blocks that were pulled elsewhere (a shared prefix); nothing is allocated.

        Only whole blocks can be adopted, onto a table whose own blocks are full.
        """
        if self.num_tokens != self.capacity:
            raise ValueError(
                f"cannot adopt blocks after a partly filled block ({self.num_tokens} tokens in "
                f"{self.num_blocks} blocks of {self.block_size})"
            )
        self.block_ids.extend(block_ids)
        self.num_tokens += len(block_ids) * self.block_size

    def truncate(self, num_tokens: int) -> list[int]:
        """Become num_tokens long (stage 12's rollback); return the ids of the blocks past them,
        last first, without freeing any (the block manager decides who else holds them)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        keep = self._num_blocks_for(num_tokens)
        dropped, self.block_ids = self.block_ids[keep:], self.block_ids[:keep]
        self.num_tokens = num_tokens
        return dropped[::-1]

    def release(self) -> list[int]:
        """Become empty and return the ids held, in table order, without freeing any of them."""
        block_ids, self.block_ids, self.num_tokens = self.block_ids, [], 0
        return block_ids

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil division without floats

    def _out_of_range_message(self, p: int) -> str:
        if self.num_tokens == 0:
            return f"position {p} is out of range: the sequence holds no tokens yet"
        return (
            f"position {p} is out of range: the sequence holds positions 0..{self.num_tokens - 1}"
        )

    def __repr__(self) -> str:
        return (
            f"BlockTable(block_size={self.block_size}, num_tokens={self.num_tokens}, "
            f"block_ids={self.block_ids})"
        )
