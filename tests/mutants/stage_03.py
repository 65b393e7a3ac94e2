"""Stage 03 mutants: the block table (BlockTable), one realistic learner bug each."""

from __future__ import annotations

from tests.mutants import maker

GROW = "self.block_ids.extend(self.allocator.allocate(num_missing))"


mutant = maker(3, "BlockTable")


MUTANTS = (
    mutant(
        "floor_instead_of_ceil",
        "blocks needed = num_tokens // block_size (a partial block is forgotten)",
        "_num_blocks_for",
        ("-(-num_tokens // self.block_size)", "num_tokens // self.block_size"),
    ),
    mutant(
        "ceil_as_floor_plus_one",
        "ceil written as num_tokens // block_size + 1: one block too many at every exact multiple",
        "_num_blocks_for",
        ("-(-num_tokens // self.block_size)", "num_tokens // self.block_size + 1"),
    ),
    mutant(
        "one_block_per_append",
        "append pulls at most one block, whatever the growth needs",
        "append",
        ("self.allocator.allocate(num_missing)", "self.allocator.allocate(1)"),
    ),
    mutant(
        "counts_tokens_before_allocating",
        "num_tokens grows before the allocator is asked: a refused append still counts its tokens",
        "append",
        (
            f"if num_missing > 0:\n    {GROW}\nself.num_tokens += num_new_tokens",
            f"self.num_tokens += num_new_tokens\nif num_missing > 0:\n    {GROW}",
        ),
    ),
    mutant(
        "one_allocate_per_block",
        "append asks for its blocks one at a time: a refusal keeps the first ones",
        "append",
        (
            GROW,
            "for _ in range(num_missing):\n    self.block_ids.extend(self.allocator.allocate(1))",
        ),
    ),
    mutant(
        "position_allows_the_empty_tail",
        "position accepts any p below the capacity, so the empty tail of the last block translates",
        "position",
        ("0 <= p < self.num_tokens", "0 <= p < self.capacity"),
    ),
    mutant(
        "negative_positions_wrap",
        "position forgets the lower bound: -1 reads the last block",
        "position",
        ("not 0 <= p < self.num_tokens", "p >= self.num_tokens"),
    ),
    mutant(
        "slot_uses_the_table_index",
        "slot multiplies the table index, not the block id",
        "slot",
        ("block_id * self.block_size", "p // self.block_size * self.block_size"),
    ),
    mutant(
        "offset_and_block_swapped",
        "position returns p // block_size as the offset too",
        "position",
        ("p % self.block_size", "p // self.block_size"),
    ),
    mutant(
        "free_in_reverse",
        "free hands the blocks back last to first",
        "free",
        ("self.release()", "self.release()[::-1]"),
    ),
    mutant(
        "free_sorted",
        "free hands the blocks back sorted by id, not in table order",
        "free",
        ("self.release()", "sorted(self.release())"),
    ),
    mutant(
        "free_keeps_num_tokens",
        "free empties block_ids but leaves num_tokens",
        "release",
        (
            "block_ids, self.block_ids, self.num_tokens = self.block_ids, [], 0",
            "block_ids, self.block_ids = self.block_ids, []",
        ),
    ),
)
