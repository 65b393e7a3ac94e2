"""Stage 02's graded contract: the block allocator's order, atomicity and guarded free.

Run against any implementation with `pytest stages/02_block_allocator --impl ref|starter|yours.py`.
The tests use only the public API (`num_blocks`, `num_free_blocks`, `allocate`, `free`); task 5
proves the allocator equal to a plain model of the contract over random operation sequences, and
task 6 runs stage 03's engine on your allocator and demands the slab engine's tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve import LLM
from nanoserve.testing import (
    ENGINE_MAX_MODEL_LEN,
    ENGINE_PROMPT_LENGTHS,
    assert_num_free,
    engine_requests,
    raises,
)

# derandomized: a learner sees the same examples on every run, so a grade never flickers
GRADED = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def assert_allocates(allocator, num_blocks: int, want: list[int], after: str) -> list[int]:
    """allocate(num_blocks) must return the block ids `want`, in that order."""
    got = allocator.allocate(num_blocks)
    assert got == want, f"{after}: allocate({num_blocks}) returned blocks {got}, expected {want}"
    return got


# ---- task 1: a fresh pool ----


def test_task_1_a_fresh_pool_hands_out_ids_in_ascending_order(impl):
    allocator = impl.BlockAllocator(6)
    assert_allocates(allocator, 3, [0, 1, 2], "a fresh pool of 6")
    assert_allocates(allocator, 1, [3], "after blocks 0-2 were handed out")
    assert_allocates(allocator, 2, [4, 5], "after blocks 0-3 were handed out")


def test_task_1_num_free_blocks_counts_what_is_left(impl):
    allocator = impl.BlockAllocator(8)
    assert allocator.num_blocks == 8, f"BlockAllocator(8).num_blocks is {allocator.num_blocks}"
    assert_num_free(allocator, 8, "a fresh pool of 8")
    allocator.allocate(5)
    assert_num_free(allocator, 3, "8 blocks, 5 handed out")
    assert_allocates(allocator, 0, [], "8 blocks, 5 handed out")
    assert_num_free(allocator, 3, "8 blocks, 5 handed out, then allocate(0)")


# ---- task 2: all or nothing ----


def test_task_2_asking_for_more_than_is_free_raises_out_of_blocks(impl):
    allocator = impl.BlockAllocator(4)
    allocator.allocate(3)
    with raises(impl.OutOfBlocks, "allocate(2) with 1 of 4 blocks free"):
        allocator.allocate(2)


def test_task_2_a_refused_allocation_changes_nothing(impl):
    allocator = impl.BlockAllocator(4)
    allocator.allocate(1)
    with raises(impl.OutOfBlocks, "allocate(4) with 3 of 4 blocks free"):
        allocator.allocate(4)
    assert_num_free(allocator, 3, "4 blocks, 1 handed out, then a refused allocate(4)")
    assert_allocates(
        allocator, 3, [1, 2, 3], "after a refused allocate(4), which must not have taken any id"
    )


def test_task_2_the_whole_pool_can_be_taken_and_then_nothing_more(impl):
    allocator = impl.BlockAllocator(3)
    got = sorted(allocator.allocate(3))
    assert got == [0, 1, 2], f"allocate(3) on a pool of 3 returned blocks {got} (sorted)"
    assert_num_free(allocator, 0, "the whole pool of 3 handed out")
    with raises(impl.OutOfBlocks, "allocate(1) with the whole pool of 3 handed out"):
        allocator.allocate(1)


# ---- task 3: LIFO reuse ----


def test_task_3_the_last_id_freed_is_the_first_handed_out(impl):
    allocator = impl.BlockAllocator(8)
    allocator.allocate(5)  # [0, 1, 2, 3, 4]
    allocator.free([3, 1])
    assert_allocates(allocator, 1, [1], "blocks 0-4 handed out, then free([3, 1])")
    assert_allocates(allocator, 1, [3], "after free([3, 1]) and block 1 handed out again")


def test_task_3_reuse_after_a_free_scatters_the_next_request(impl):
    # the seed's trace: A holds [0, 1] and frees them; B's three blocks come out as [1, 0, 2]
    allocator = impl.BlockAllocator(8)
    a_blocks = assert_allocates(allocator, 2, [0, 1], "request A, on a fresh pool of 8")
    allocator.free(a_blocks)
    assert_num_free(allocator, 8, "request A freed its blocks [0, 1]")
    assert_allocates(allocator, 3, [1, 0, 2], "request B, after A freed [0, 1]")


# ---- task 4: a guarded free ----


def test_task_4_freeing_a_block_twice_raises_value_error(impl):
    allocator = impl.BlockAllocator(4)
    allocator.free(allocator.allocate(2))
    with raises(ValueError, "free([0]) of a block already freed"):
        allocator.free([0])


@pytest.mark.parametrize(
    "bad_ids",
    [[3], [9], [-1], [0, 0]],
    ids=["never-handed-out", "outside-the-pool", "negative", "twice-in-one-call"],
)
def test_task_4_a_rejected_free_raises_value_error_and_frees_nothing(impl, bad_ids):
    allocator = impl.BlockAllocator(4)
    held = allocator.allocate(2)  # [0, 1]
    with raises(ValueError, f"free({[1, *bad_ids]}) with blocks [0, 1] held"):
        allocator.free([1, *bad_ids])
    assert_num_free(allocator, 2, f"blocks [0, 1] held, then a rejected free({[1, *bad_ids]})")
    allocator.free(held)  # both still count as handed out, so this is legal
    assert_num_free(allocator, 4, "after the rejected free, free([0, 1])")


# ---- task 5: equal to a plain model of the contract ----


class PoolModel:
    """The contract written as plainly as possible: a stack of free ids, a set of held ones."""

    def __init__(self, num_blocks):
        self.free_stack = list(range(num_blocks - 1, -1, -1))  # the top (end) is 0
        self.held = set()

    def allocate(self, n):
        block_ids = [self.free_stack.pop() for _ in range(n)]
        self.held.update(block_ids)
        return block_ids

    def free(self, block_ids):
        self.held.difference_update(block_ids)
        self.free_stack.extend(block_ids)


@GRADED
@given(num_blocks=st.integers(1, 10), data=st.data())
def test_task_5_any_sequence_of_operations_matches_the_stack_model(impl, num_blocks, data):
    allocator, model = impl.BlockAllocator(num_blocks), PoolModel(num_blocks)
    ops = [f"BlockAllocator({num_blocks})"]  # what ran so far, for the failure message
    for _ in range(data.draw(st.integers(1, 30), label="num_ops")):
        if not model.held or data.draw(st.booleans(), label="allocate?"):
            n = data.draw(st.integers(0, num_blocks + 1), label="n")
            if n > len(model.free_stack):
                with raises(impl.OutOfBlocks, f"after {', '.join(ops)}: allocate({n})"):
                    allocator.allocate(n)
                ops.append(f"allocate({n}) -> OutOfBlocks")
            else:
                got, want = allocator.allocate(n), model.allocate(n)
                assert got == want, (
                    f"after {', '.join(ops)}: allocate({n}) returned blocks {got}, the contract "
                    f"hands out {want}"
                )
                ops.append(f"allocate({n}) -> {got}")
        else:
            shuffled = data.draw(st.permutations(sorted(model.held)), label="held, shuffled")
            block_ids = shuffled[: data.draw(st.integers(1, len(shuffled)), label="num_freed")]
            allocator.free(block_ids)
            model.free(block_ids)
            ops.append(f"free({block_ids})")
        got = allocator.num_free_blocks
        assert got == len(model.free_stack), (
            f"after {', '.join(ops)}: num_free_blocks is {got}, expected {len(model.free_stack)}"
        )


# ---- task 6: your allocator in the engine ----

# eight requests around block boundaries, 32 to 46 greedy tokens each; the oracle is the
# `slab_engine_tokens` fixture (conftest.py): stage 01's engine, no blocks anywhere
MAX_MODEL_LEN, BLOCK_SIZE, NUM_KV_BLOCKS = ENGINE_MAX_MODEL_LEN, 4, 32
PROMPT_LENGTHS = ENGINE_PROMPT_LENGTHS
requests = engine_requests


def block_table_engine(folder, impl):
    """Stage 03's engine (block tables, K/V at flat slots) drawing its blocks from your pool.

    32 blocks of 4 tokens: admission reserves each request's worst case (prompt + max_tokens),
    up to 24 blocks for the 60-token prompt, so at most a few requests run and the rest wait.
    """
    return LLM(
        folder,
        stage=3,
        device="cpu",
        dtype="float64",
        components={"BlockAllocator": impl.BlockAllocator},
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
    )


def test_task_6_the_block_table_engine_on_your_allocator_reproduces_the_slab_engine(
    impl, tiny_llama_folder, slab_engine_tokens
):
    llm = block_table_engine(tiny_llama_folder, impl)
    outputs = llm.generate(*requests(), use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outputs, slab_engine_tokens)):
        assert out.token_ids == expected, f"request {i} ({PROMPT_LENGTHS[i]}-token prompt)"


def test_task_6_under_engine_traffic_your_pool_counts_right_and_gets_every_block_back(
    impl, tiny_llama_folder
):
    llm = block_table_engine(tiny_llama_folder, impl)
    engine = llm.engine
    allocator = engine.manager.allocator  # your BlockAllocator, the one the engine built
    for prompt, params in zip(*requests()):
        engine.add_request(prompt, params)
    num_steps_with_a_queue = 0
    while engine.has_unfinished():  # what LLM.generate does, one step at a time
        engine.step()
        held = [b for table in engine.manager.tables.values() for b in table.block_ids]
        assert len(set(held)) == len(held), f"one block handed to two sequences: {sorted(held)}"
        got = allocator.num_free_blocks
        assert got == NUM_KV_BLOCKS - len(held), (
            f"num_free_blocks is {got} while the running sequences hold {len(held)} of "
            f"{NUM_KV_BLOCKS} blocks"
        )
        num_steps_with_a_queue += bool(engine.scheduler.waiting)
    got = allocator.num_free_blocks
    assert got == NUM_KV_BLOCKS, (
        f"after every request finished, {got} of {NUM_KV_BLOCKS} blocks are free: every "
        "finished request frees its blocks"
    )
    assert num_steps_with_a_queue > 0, "with 32 blocks, some requests must have waited"
