"""Stage 03: the block table translates positions to slots, grows lazily and atomically."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.memory.allocator import BlockAllocator, OutOfBlocks
from nanoserve.engine.memory.block_table import BlockPosition, BlockTable

# --- the seed's traces --------------------------------------------------------------------------


def test_seed_trace_b_reuses_a_blocks_scattered_as_1_0_2():
    allocator = BlockAllocator(8)
    seq_a = BlockTable(allocator, block_size=4)
    seq_a.append(8)
    assert seq_a.block_ids == [0, 1]
    seq_a.free()

    seq_b = BlockTable(allocator, block_size=4)
    seq_b.append(12)
    assert seq_b.block_ids == [1, 0, 2]
    assert seq_b.position(5) == BlockPosition(block_id=0, offset=1)
    assert seq_b.slot(5) == 1
    assert [seq_b.position(p).block_id for p in range(12)] == [1] * 4 + [0] * 4 + [2] * 4


def _table_on_blocks_5_and_2(allocator: BlockAllocator) -> BlockTable:
    """Six one-block sequences take 0..5; freeing 2 then 5 leaves 5 on top, then 2."""
    others = [BlockTable(allocator, block_size=16) for _ in range(6)]
    for seq in others:
        seq.append(16)
    others[2].free()
    others[5].free()
    table = BlockTable(allocator, block_size=16)
    table.append(20)
    return table


def test_seed_figure_position_17_lands_in_block_2_offset_1_slot_33():
    table = _table_on_blocks_5_and_2(BlockAllocator(8))
    assert table.block_ids == [5, 2]
    assert table.position(17) == (2, 1)
    assert table.slot(17) == 33
    assert table.slot(0) == 80  # block 5 starts at slot 5 * 16
    assert table.capacity == 32 and table.num_blocks == 2


# --- lazy growth --------------------------------------------------------------------------------


def test_block_is_pulled_exactly_when_num_tokens_crosses_capacity():
    allocator = BlockAllocator(10)
    table = BlockTable(allocator, block_size=4)
    free_after_each_token = []
    for _ in range(9):
        table.append(1)
        free_after_each_token.append(allocator.num_free_blocks)
    # Tokens 1, 5 and 9 each open a block; the rest land mid-block and touch no allocator.
    assert free_after_each_token == [9, 9, 9, 9, 8, 8, 8, 8, 7]
    assert table.num_tokens == 9 and table.num_blocks == 3 and table.capacity == 12


def test_append_mid_block_does_not_call_the_allocator():
    class CountingAllocator(BlockAllocator):
        num_calls = 0

        def allocate(self, n):
            self.num_calls += 1
            return super().allocate(n)

    allocator = CountingAllocator(4)
    table = BlockTable(allocator, block_size=8)
    table.append(3)
    calls_after_first_block = allocator.num_calls
    table.append(1)
    table.append(4)  # fills the block exactly: still no new block
    assert allocator.num_calls == calls_after_first_block
    assert table.num_blocks == 1


def test_bulk_append_pulls_all_needed_blocks_at_once():
    allocator = BlockAllocator(10)
    table = BlockTable(allocator, block_size=4)
    table.append(2)
    table.append(11)  # 13 tokens need ceil(13 / 4) = 4 blocks
    assert table.block_ids == [0, 1, 2, 3]
    assert allocator.num_free_blocks == 6


def test_append_zero_tokens_changes_nothing():
    allocator = BlockAllocator(2)
    table = BlockTable(allocator, block_size=4)
    table.append(0)
    assert (table.num_tokens, table.block_ids, allocator.num_free_blocks) == (0, [], 2)


# --- atomic growth ------------------------------------------------------------------------------


def test_append_under_exhaustion_raises_and_leaves_table_and_pool_untouched():
    allocator = BlockAllocator(3)
    table = BlockTable(allocator, block_size=4)
    table.append(6)  # blocks [0, 1]; one block left in the pool
    with pytest.raises(OutOfBlocks):
        table.append(7)  # 13 tokens need 4 blocks: two more, only one free
    assert table.num_tokens == 6
    assert table.block_ids == [0, 1]
    assert allocator.num_free_blocks == 1
    table.append(6)  # 12 tokens need exactly the one remaining block
    assert table.block_ids == [0, 1, 2]


def test_negative_append_is_rejected():
    table = BlockTable(BlockAllocator(1), block_size=4)
    with pytest.raises(ValueError, match="negative"):
        table.append(-1)


def test_block_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(BlockAllocator(1), block_size=0)


# --- translation bounds -------------------------------------------------------------------------


@pytest.mark.parametrize("p", [-1, 10, 11, 100])
def test_position_outside_the_sequence_raises_index_error(p):
    table = BlockTable(BlockAllocator(4), block_size=4)
    table.append(10)  # capacity 12, but only positions 0..9 exist
    with pytest.raises(IndexError, match=r"0\.\.9"):
        table.position(p)
    with pytest.raises(IndexError):
        table.slot(p)


def test_empty_table_has_no_positions():
    table = BlockTable(BlockAllocator(4), block_size=4)
    with pytest.raises(IndexError, match="no tokens"):
        table.position(0)


# --- free ---------------------------------------------------------------------------------------


def test_free_returns_every_block_in_table_order_and_resets():
    allocator = BlockAllocator(6)
    table = BlockTable(allocator, block_size=2)
    table.append(5)  # blocks [0, 1, 2]
    table.free()
    assert (table.num_tokens, table.block_ids, table.capacity) == (0, [], 0)
    assert allocator.num_free_blocks == 6
    # Freed in table order 0, 1, 2, so the pool hands them back 2, 1, 0.
    assert allocator.allocate(3) == [2, 1, 0]


def test_freed_table_can_grow_again():
    allocator = BlockAllocator(2)
    table = BlockTable(allocator, block_size=4)
    table.append(8)
    table.free()
    table.append(3)
    assert table.num_tokens == 3 and table.num_blocks == 1


# --- the headline equivalence: decode growth == prefill ----------------------------------------


def test_ten_single_appends_match_one_append_of_ten():
    decode = BlockTable(BlockAllocator(8), block_size=4)
    prefill = BlockTable(BlockAllocator(8), block_size=4)
    for _ in range(10):
        decode.append(1)
    prefill.append(10)
    assert decode.block_ids == prefill.block_ids
    assert [decode.slot(p) for p in range(10)] == [prefill.slot(p) for p in range(10)]


@st.composite
def growth_cases(draw):
    """A block size, a split of N tokens into appends, and a recipe that scatters the free list."""
    block_size = draw(st.integers(1, 32))
    chunks = draw(st.lists(st.integers(0, 40), max_size=12))
    num_needed = -(-sum(chunks) // block_size)
    num_preused = draw(st.integers(0, 12))
    freed_ids = draw(st.permutations(range(num_preused)))
    freed_ids = freed_ids[: draw(st.integers(0, num_preused))]
    num_spare = draw(st.integers(1, 4))  # a pool with room to spare, never an empty one
    return block_size, chunks, num_needed + num_preused + num_spare, num_preused, freed_ids


def _shuffled_allocator(num_blocks: int, num_preused: int, freed_ids: list[int]) -> BlockAllocator:
    allocator = BlockAllocator(num_blocks)
    allocator.allocate(num_preused)
    allocator.free(freed_ids)  # now the free list tops with these ids, in reverse
    return allocator


@settings(max_examples=200, deadline=None)
@given(growth_cases())
def test_any_split_of_appends_lands_on_the_same_blocks_and_slots_as_one_bulk_append(case):
    block_size, chunks, num_blocks, num_preused, freed_ids = case
    num_tokens = sum(chunks)
    decode = BlockTable(_shuffled_allocator(num_blocks, num_preused, freed_ids), block_size)
    prefill = BlockTable(_shuffled_allocator(num_blocks, num_preused, freed_ids), block_size)
    for chunk in chunks:
        decode.append(chunk)
    prefill.append(num_tokens)

    assert decode.num_tokens == prefill.num_tokens == num_tokens
    assert decode.block_ids == prefill.block_ids
    assert [decode.slot(p) for p in range(num_tokens)] == [
        prefill.slot(p) for p in range(num_tokens)
    ]
    assert decode.allocator.num_free_blocks == prefill.allocator.num_free_blocks
    # No block is held ahead of need, and every slot is distinct.
    assert decode.num_blocks == -(-num_tokens // block_size)
    assert len({decode.slot(p) for p in range(num_tokens)}) == num_tokens
