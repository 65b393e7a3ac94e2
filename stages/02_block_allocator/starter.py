"""Stage 02 starter: the block allocator, a pool of KV block ids handed out and taken back.

Fill in each body (the lesson, stages/02_block_allocator/README.md, walks through them in task
order) in a copy: `cp stages/02_block_allocator/starter.py my_allocator.py`, then grade it with
`pytest stages/02_block_allocator --impl my_allocator.py`. This file itself must keep failing
(the harness checks it). Ids only: no tensors, no tokens, no idea who owns which block.
"""

from __future__ import annotations


class OutOfBlocks(Exception):
    """Raised when a request asks for more blocks than are free; nothing was allocated.

    Given to you whole: raise it from `allocate`. Add a helpful message if you like.
    """


class BlockAllocator:
    """A pool of block ids 0..num_blocks-1 with a LIFO free list and all-or-nothing allocation.

    Contract (the graded tests check every line):
    - a fresh pool hands out 0, 1, 2, ... in that order;
    - `free(ids)` takes ids back in the order given, so the LAST id freed is the FIRST handed out
      again (a stack: push on free, pop on allocate);
    - `allocate(n)` returns exactly n distinct free ids, or raises OutOfBlocks and changes nothing;
    - `free` of an id that is not currently handed out (a double free, an id never allocated, an
      id outside the pool) raises ValueError and changes nothing.
    """

    def __init__(self, num_blocks: int) -> None:
        """A pool of `num_blocks` ids, all free. Keep `num_blocks` as a public attribute.

        Hint: a Python list used as a stack, filled so that the first pop() gives 0, plus a set
        of the ids handed out, so a bad free is caught in O(1).
        """
        raise NotImplementedError("task 1: BlockAllocator.__init__")

    @property
    def num_free_blocks(self) -> int:
        """How many ids `allocate` could hand out right now."""
        raise NotImplementedError("task 1: BlockAllocator.num_free_blocks")

    def allocate(self, n: int) -> list[int]:
        """Hand out n free ids, most recently freed first; OutOfBlocks (and no change) if short.

        Hint: check that n ids are free *before* popping any: a partial grab strands blocks.
        """
        raise NotImplementedError("tasks 1-2: BlockAllocator.allocate")

    def free(self, block_ids: list[int]) -> None:
        """Take ids back in the order given; ValueError (and no change) for any id not handed out.

        Hint: validate the whole list first (duplicates inside one call count as a double free),
        then push every id.
        """
        raise NotImplementedError("tasks 3-4: BlockAllocator.free")
