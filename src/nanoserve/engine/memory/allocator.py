"""The block allocator: a pool of `num_blocks` integer block ids, handed out and taken back.

Introduced in stage 02. It knows ids only, not what they hold: no tensors, no tokens, no ref
counts (prefix sharing arrives in stage 07), and no idea which sequence owns which id (that is the
block table's job, stage 03). Stage 07 adds one verb, `take`: hand out one named free id.
"""

from __future__ import annotations


class OutOfBlocks(Exception):
    """Raised when a request asks for more blocks than are free; nothing was allocated."""

    def __init__(self, num_requested: int, num_free: int) -> None:
        self.num_requested = num_requested
        self.num_free = num_free
        super().__init__(f"asked for {num_requested} block(s) but only {num_free} are free")


class BlockAllocator:
    """A LIFO free list of block ids 0..num_blocks-1 with all-or-nothing allocation.

    Contract: `allocate` either returns exactly n distinct free ids or raises `OutOfBlocks` and
    changes nothing; `free` either takes back every id it is given or raises `ValueError` and
    changes nothing. A fresh pool hands out 0, 1, 2, ...; after that, the most recently freed id
    is the first handed out again.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # The free list is a stack whose top is the END of the list. Filling it in reverse makes a
        # fresh pool pop 0, 1, 2, ... in order. Freed ids are pushed on top, so reuse is LIFO:
        # O(1) both ways, and a deterministic order that traces and tests can pin down.
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        # Invariant: _used_ids and set(_free_ids) partition range(num_blocks).
        self._used_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """How many ids `allocate` could hand out right now."""
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        """How many ids are handed out and not yet freed."""
        return len(self._used_ids)

    def can_allocate(self, n: int) -> bool:
        """True when `allocate(n)` would succeed."""
        return 0 <= n <= self.num_free_blocks

    def is_free(self, block_id: int) -> bool:
        """True when `block_id` is in the pool and not handed out; ValueError if out of range."""
        self._check_in_range(block_id)
        return block_id not in self._used_ids

    def allocate(self, n: int) -> list[int]:
        """Hand out n free ids, most recently freed first; OutOfBlocks (and no change) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            # Check before popping anything: a partial grab would strand blocks nobody owns.
            raise OutOfBlocks(n, self.num_free_blocks)
        block_ids = [self._free_ids.pop() for _ in range(n)]
        self._used_ids.update(block_ids)
        return block_ids

    def take(self, block_id: int) -> None:
        """Hand out this exact free id (stage 07 reclaims a freed block that still holds a cached
        prefix); ValueError, and no change, if it is in use or outside the pool."""
        if not self.is_free(block_id):
            raise ValueError(f"block {block_id} is in use; only a free block can be taken")
        self._free_ids.remove(block_id)  # O(num_free); the free list keeps its LIFO order
        self._used_ids.add(block_id)

    def free(self, block_ids: list[int]) -> None:
        """Take ids back in the order given, so the last id here is the next one handed out."""
        self._check_can_free(block_ids)
        for block_id in block_ids:
            self._used_ids.remove(block_id)
            self._free_ids.append(block_id)

    def _check_can_free(self, block_ids: list[int]) -> None:
        # Validate the whole list before touching state, so a bad id frees nothing at all.
        seen: set[int] = set()
        for block_id in block_ids:
            self._check_in_range(block_id)
            if block_id in seen:
                raise ValueError(f"block {block_id} appears twice in one free() call")
            if block_id not in self._used_ids:
                raise ValueError(f"block {block_id} is not allocated (double free?)")
            seen.add(block_id)

    def _check_in_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool 0..{self.num_blocks - 1}")

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free={self.num_free_blocks})"
