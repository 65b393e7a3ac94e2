"""Stage 03 mutants: the block table (engine/block_table.py), one realistic learner bug each."""

from __future__ import annotations

from tests.mutants import Mutant

TABLE = "nanoserve.engine.block_table"
GROWTH = (
    "        if num_missing > 0:\n"
    "            # allocate() is all-or-nothing, and nothing here changes before it returns, "
    "so an\n"
    "            # OutOfBlocks leaves num_tokens and block_ids exactly as they were.\n"
    "            self.block_ids.extend(self.allocator.allocate(num_missing))\n"
    "        self.num_tokens += num_new_tokens\n"
)


def mutant(name: str, bug: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(3, name, bug, TABLE, edits)


MUTANTS = (
    mutant(
        "floor_instead_of_ceil", "blocks needed = num_tokens // block_size (a partial block is "
        "forgotten)",
        ("return -(-num_tokens // self.block_size)", "return num_tokens // self.block_size"),
    ),
    mutant(
        "ceil_as_floor_plus_one", "ceil written as num_tokens // block_size + 1: one block too "
        "many at every exact multiple",
        ("return -(-num_tokens // self.block_size)", "return num_tokens // self.block_size + 1"),
    ),
    mutant(
        "one_block_per_append", "append pulls at most one block, whatever the growth needs",
        ("self.block_ids.extend(self.allocator.allocate(num_missing))",
         "self.block_ids.extend(self.allocator.allocate(1))"),
    ),
    mutant(
        "counts_tokens_before_allocating", "num_tokens grows before the allocator is asked: a "
        "refused append still counts its tokens",
        (GROWTH,
         "        self.num_tokens += num_new_tokens\n"
         "        if num_missing > 0:\n"
         "            self.block_ids.extend(self.allocator.allocate(num_missing))\n"),
    ),
    mutant(
        "one_allocate_per_block", "append asks for its blocks one at a time: a refusal keeps "
        "the first ones",
        ("self.block_ids.extend(self.allocator.allocate(num_missing))",
         "for _ in range(num_missing):\n"
         "                self.block_ids.extend(self.allocator.allocate(1))"),
    ),
    mutant(
        "position_allows_the_empty_tail", "position accepts any p below the capacity, so the "
        "empty tail of the last block translates",
        ("if not 0 <= p < self.num_tokens:", "if not 0 <= p < self.capacity:"),
    ),
    mutant(
        "negative_positions_wrap", "position forgets the lower bound: -1 reads the last block",
        ("if not 0 <= p < self.num_tokens:", "if p >= self.num_tokens:"),
    ),
    mutant(
        "slot_uses_the_table_index", "slot multiplies the table index, not the block id",
        ("        block_id, offset = self.position(p)\n        return block_id * self.block_size",
         "        block_id, offset = self.position(p)\n"
         "        return p // self.block_size * self.block_size"),
    ),
    mutant(
        "offset_and_block_swapped", "position returns p // block_size as the offset too",
        ("BlockPosition(self.block_ids[p // self.block_size], p % self.block_size)",
         "BlockPosition(self.block_ids[p // self.block_size], p // self.block_size)"),
    ),
    mutant(
        "free_in_reverse", "free hands the blocks back last to first",
        ("self.allocator.free(self.release())", "self.allocator.free(self.release()[::-1])"),
    ),
    mutant(
        "free_sorted", "free hands the blocks back sorted by id, not in table order",
        ("self.allocator.free(self.release())", "self.allocator.free(sorted(self.release()))"),
    ),
    mutant(
        "free_keeps_num_tokens", "free empties block_ids but leaves num_tokens",
        ("block_ids, self.block_ids, self.num_tokens = self.block_ids, [], 0",
         "block_ids, self.block_ids = self.block_ids, []"),
    ),
)  # fmt: skip
