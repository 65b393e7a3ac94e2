"""Stage 02: the block allocator hands out ids in order, all or nothing, and reuses them LIFO."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoserve.engine.memory.allocator import BlockAllocator, OutOfBlocks

# --- order and counts ---------------------------------------------------------------------------


def test_fresh_allocator_hands_out_ids_in_ascending_order():
    allocator = BlockAllocator(6)
    assert allocator.allocate(2) == [0, 1]
    assert allocator.allocate(3) == [2, 3, 4]
    assert allocator.allocate(1) == [5]


def test_free_count_falls_on_allocate_and_rises_on_free():
    allocator = BlockAllocator(5)
    assert allocator.num_blocks == 5
    assert allocator.num_free_blocks == 5
    ids = allocator.allocate(3)
    assert allocator.num_free_blocks == 2
    allocator.free(ids)
    assert allocator.num_free_blocks == 5


def test_allocating_zero_blocks_returns_empty_list_and_changes_nothing():
    allocator = BlockAllocator(2)
    assert allocator.allocate(0) == []
    assert allocator.num_free_blocks == 2


def test_can_allocate_and_is_free_agree_with_allocate():
    allocator = BlockAllocator(3)
    assert allocator.can_allocate(3)
    assert not allocator.can_allocate(4)
    (block_id,) = allocator.allocate(1)
    assert not allocator.is_free(block_id)
    assert allocator.is_free(2)
    assert not allocator.can_allocate(3)


# --- LIFO reuse ---------------------------------------------------------------------------------


def test_last_freed_id_is_first_handed_out():
    allocator = BlockAllocator(8)
    allocator.allocate(5)  # 0..4
    allocator.free([3, 1])
    assert allocator.allocate(1) == [1]
    assert allocator.allocate(1) == [3]
    assert allocator.allocate(1) == [5]  # freed ids exhausted: back to never-used ids


def test_seed_trace_freeing_a_then_allocating_b_gives_1_0_2():
    allocator = BlockAllocator(8)
    seq_a = allocator.allocate(2)  # 8 tokens at block_size 4
    assert seq_a == [0, 1]
    allocator.free(seq_a)  # table order: 0 pushed first, so 1 is on top
    assert allocator.allocate(3) == [1, 0, 2]


# --- all-or-nothing and errors ------------------------------------------------------------------


def test_failed_allocation_raises_out_of_blocks_and_takes_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(OutOfBlocks, match=r"2 block.*only 1"):
        allocator.allocate(2)
    assert allocator.num_free_blocks == 1
    assert allocator.allocate(1) == [3]


def test_out_of_blocks_carries_requested_and_free_counts():
    allocator = BlockAllocator(2)
    with pytest.raises(OutOfBlocks) as excinfo:
        allocator.allocate(5)
    assert (excinfo.value.num_requested, excinfo.value.num_free) == (5, 2)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_pool_of_fewer_than_one_block_is_rejected(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(num_blocks)


def test_negative_allocation_is_rejected():
    with pytest.raises(ValueError, match="negative"):
        BlockAllocator(2).allocate(-1)


@pytest.mark.parametrize(
    "bad_free",
    [
        pytest.param([0, 2], id="id-never-handed-out"),
        pytest.param([1, 1], id="id-repeated-in-one-call"),
        pytest.param([0, 9], id="id-out-of-range"),
        pytest.param([1, -1], id="negative-id"),
    ],
)
def test_invalid_free_raises_and_frees_nothing(bad_free):
    allocator = BlockAllocator(4)
    allocator.allocate(2)  # 0 and 1 are used; 2 and 3 are free
    with pytest.raises(ValueError):
        allocator.free(bad_free)
    assert allocator.num_free_blocks == 2
    assert not allocator.is_free(0) and not allocator.is_free(1)
    assert allocator.allocate(2) == [2, 3]  # the free stack is untouched


def test_freeing_an_id_twice_raises():
    allocator = BlockAllocator(3)
    ids = allocator.allocate(2)
    allocator.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([ids[0]])


# --- model-based state machine ------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Drives a BlockAllocator and a plain model side by side.

    The model keeps a set of used ids, a stack of freed ids (top = end) and the next never-used id.
    Expected order of `allocate(n)`: freed ids from the top of the stack, then never-used ids
    ascending. A failed call must leave both unchanged, which later steps would expose.
    """

    @initialize(num_blocks=st.integers(1, 12))
    def start(self, num_blocks):
        self.allocator = BlockAllocator(num_blocks)
        self.num_blocks = num_blocks
        self.used: set[int] = set()
        self.freed_stack: list[int] = []
        self.next_fresh = 0

    def expected_allocation(self, n: int) -> list[int]:
        from_freed = self.freed_stack[::-1][:n]
        return from_freed + list(range(self.next_fresh, self.next_fresh + n - len(from_freed)))

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        num_free = self.num_blocks - len(self.used)
        if n > num_free:
            with pytest.raises(OutOfBlocks):
                self.allocator.allocate(n)
            return
        expected = self.expected_allocation(n)
        got = self.allocator.allocate(n)
        assert got == expected
        assert not self.used & set(got), "an id was handed out twice"
        self.used |= set(got)
        num_from_freed = min(n, len(self.freed_stack))
        del self.freed_stack[len(self.freed_stack) - num_from_freed :]
        self.next_fresh += n - num_from_freed

    @rule(data=st.data())
    def free_some(self, data):
        ids = data.draw(st.permutations(sorted(self.used)))
        ids = ids[: data.draw(st.integers(0, len(ids)))]
        self.allocator.free(ids)
        self.used -= set(ids)
        self.freed_stack.extend(ids)

    @rule(data=st.data())
    def free_invalid(self, data):
        # A valid prefix followed by one bad id: the valid ids must not be freed either.
        prefix = data.draw(st.permutations(sorted(self.used)))
        prefix = prefix[: data.draw(st.integers(0, len(prefix)))]
        free_ids = sorted(set(range(self.num_blocks)) - self.used)
        bad_choices = [st.sampled_from([-1, self.num_blocks, self.num_blocks + 5])]
        if free_ids:
            bad_choices.append(st.sampled_from(free_ids))  # never handed out, or double free
        if prefix:
            bad_choices.append(st.sampled_from(prefix))  # repeated within one call
        ids = [*prefix, data.draw(st.one_of(bad_choices))]
        before = self.allocator.num_free_blocks
        with pytest.raises(ValueError):
            self.allocator.free(ids)
        assert self.allocator.num_free_blocks == before

    @invariant()
    def free_plus_used_is_total(self):
        assert self.allocator.num_free_blocks + len(self.used) == self.num_blocks

    @invariant()
    def is_free_matches_model(self):
        for block_id in range(self.num_blocks):
            assert self.allocator.is_free(block_id) == (block_id not in self.used)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
test_allocator_matches_set_model = AllocatorMachine.TestCase
