"""Stage 04's graded contract: the block manager, the pool's write and read, the step tensors,
and the whole engine built from your pieces.

Run against any implementation with `pytest stages/04_paged_pool --impl ref|starter|yours.py`.
The numbers are the seed's hand traces at block_size 4 (prompt A = 11 tokens on blocks [0, 1, 2],
its decode at lengths 12 and 13, B's cached prefix, the packed batch C + D). Tasks 2 to 5 build
their sequences' block tables by hand, so each task is graded on its own. Task 6 plugs your five
names into the reference engine (`LLM(stage=4, components=...)`) and demands stage 01's tokens
from a tiny random Llama in float64, with and without preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.types import Sequence

API = ("BlockManager", "store_kvcache", "gather_kv", "prepare_prefill", "prepare_decode")

# the seed's prompts: pages of 4 written apart so the block boundaries show
A = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33]
B = [11, 12, 13, 14, 51, 52, 53, 54, 61, 62, 63, 64, 71]


def seq_of(token_ids, block_table=(), num_cached_tokens=0) -> Sequence:
    """A sequence whose block table is set by hand, as if a block manager had placed it."""
    seq = Sequence(token_ids, SamplingParams())
    seq.block_table = list(block_table)
    seq.num_cached_tokens = num_cached_tokens
    return seq


def admitted(manager, token_ids) -> Sequence:
    """A new sequence admitted the way the scheduler admits one."""
    seq = Sequence(token_ids, SamplingParams())
    assert manager.can_allocate(seq), f"a fresh {len(token_ids)}-token sequence should fit"
    seq.num_cached_tokens = manager.allocate(seq)
    return seq


def decode_one(manager, seq, token_id=99) -> None:
    """What one engine step does to seq: its K/V is now stored, one token is sampled, and the
    next decode makes room for that token."""
    seq.num_cached_tokens = len(seq)
    seq.append_token(token_id)
    assert manager.can_append(seq), (
        f"can_append refused token {len(seq)} of a sequence on {seq.block_table} with "
        f"{manager.num_free_blocks} blocks free"
    )
    manager.may_append(seq)


def slots_message(name: str, got: torch.Tensor, want: torch.Tensor, block_size: int) -> str:
    """The slots of a (num_blocks, block_size, H_kv, D) cache that differ, by block and offset."""
    wrong = (got != want).flatten(2).any(-1).nonzero().tolist()
    places = [f"slot {b * block_size + o} (block {b}, offset {o})" for b, o in wrong[:5]]
    return f"{name}: {len(wrong)} slot(s) hold the wrong values: {', '.join(places)}"


def positions_message(got: torch.Tensor, want: torch.Tensor) -> str:
    """Which gathered rows differ; every row of `want` holds its position + 1, so a row's values
    say which position was read into it (-7 is a slot the sequence does not own)."""
    if got.shape != want.shape:
        return f"gather_kv returned {tuple(got.shape)}, expected {tuple(want.shape)}"
    rows = (got != want).flatten(1).any(-1).nonzero().flatten().tolist()
    read = [f"row {p} holds {got[p].flatten()[0].item():g}" for p in rows[:5]]
    return (
        f"rows {rows} are wrong ({'; '.join(read)}): row p must hold position p's values, "
        "p + 1 here, and -7 marks a slot read that the sequence does not own"
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_books(manager, live, num_blocks, block_size, num_tokens_of=len) -> None:
    """What must hold after every call, seen from outside: ids in range, no block held by two
    sequences, every token covered with no block held ahead of need, free + held == total.
    num_tokens_of(seq) is how many tokens seq's blocks must cover at this moment."""
    held = [b for seq in live for b in seq.block_table]
    assert all(0 <= b < num_blocks for b in held), f"block id out of range in {held}"
    assert len(held) == len(set(held)), f"a block is held by two sequences: {sorted(held)}"
    for seq in live:
        need = ceil_div(num_tokens_of(seq), block_size)
        assert len(seq.block_table) == need, (
            f"{num_tokens_of(seq)} tokens need {need} blocks of {block_size}, got {seq.block_table}"
        )
    assert manager.num_free_blocks + len(held) == num_blocks, (
        f"num_free_blocks {manager.num_free_blocks} + {len(held)} held != {num_blocks} blocks"
    )
    manager.check_invariants()


def values(step) -> dict:
    """Every field of a StepInputs as plain lists."""
    md = step.metadata
    return {
        "is_prefill": md.is_prefill,
        "input_ids": step.input_ids.tolist(),
        "positions": step.positions.tolist(),
        "slot_mapping": md.slot_mapping.tolist(),
        "cu_seqlens_q": md.cu_seqlens_q.tolist(),
        "cu_seqlens_k": md.cu_seqlens_k.tolist(),
        "context_lens": md.context_lens.tolist(),
        "block_tables": md.block_tables.tolist(),
        "max_seqlen_q": md.max_seqlen_q,
        "max_seqlen_k": md.max_seqlen_k,
        "host.cu_seqlens_q": list(md.host.cu_seqlens_q),
        "host.context_lens": list(md.host.context_lens),
        "host.block_tables": [list(t) for t in md.host.block_tables],
    }


# the dtypes AttentionMetadata and StepInputs document (nanoserve/types.py)
DTYPES = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "cu_seqlens_q": torch.int32,
    "cu_seqlens_k": torch.int32,
    "context_lens": torch.int32,
    "block_tables": torch.int32,
}


def assert_dtypes(step) -> None:
    tensors = {"input_ids": step.input_ids, "positions": step.positions}
    tensors.update({f: getattr(step.metadata, f) for f in DTYPES if f not in tensors})
    for field, dtype in DTYPES.items():
        assert tensors[field].dtype == dtype, f"{field} is {tensors[field].dtype}, expected {dtype}"


def assert_step(step, expected: dict) -> None:
    """Each expected field of the step, compared on its own: a failure names the field and the
    first position that differs."""
    got = values(step)
    for field, want in expected.items():
        assert got[field] == want, f"{field}{first_difference(got[field], want)}"


def first_difference(got, want) -> str:
    if not isinstance(got, list) or not isinstance(want, list):
        return f" is {got!r}, expected {want!r}"
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"[{i}] is {a!r}, expected {b!r} (whole: {got}, expected {want})"
    return f" has {len(got)} entries, expected {len(want)} (got {got}, expected {want})"


# ---- task 1: the block manager ----


def test_task_1_prompt_a_on_a_fresh_pool_gets_blocks_0_1_2(impl):
    manager = impl.BlockManager(8, 4)
    books = (manager.num_blocks, manager.block_size, manager.num_free_blocks)
    assert books == (8, 4, 8), f"BlockManager(8, 4): (num_blocks, block_size, free) is {books}"
    a = admitted(manager, A)
    assert a.block_table == [0, 1, 2], (  # ceil(11 / 4) = 3 blocks, a fresh pool's first ids
        f"11 tokens on a fresh pool of blocks of 4 got {a.block_table}, not [0, 1, 2]"
    )
    assert manager.num_free_blocks == 5, f"{manager.num_free_blocks} free of 8 after 3 taken"
    check_books(manager, [a], 8, 4)


def test_task_1_allocate_answers_that_fresh_blocks_hold_none_of_the_sequence(impl):
    manager = impl.BlockManager(8, 4)
    for tokens in (A, A[:8], [5]):  # 11 tokens, two full blocks exactly, one token
        seq = Sequence(tokens, SamplingParams())
        got = manager.allocate(seq)
        assert got == 0, (
            f"allocate of {len(tokens)} tokens returned {got!r}, expected 0: it answers how many "
            "of seq's tokens already have K/V in its blocks (the scheduler makes that "
            "seq.num_cached_tokens), and fresh blocks hold none"
        )
        assert seq.num_cached_tokens == 0, "allocate writes seq.block_table only, not the count"


def test_task_1_can_allocate_counts_every_token_and_changes_nothing(impl):
    manager = impl.BlockManager(4, 4)
    small = admitted(manager, [1, 2])  # 3 blocks left
    preempted = Sequence(A, SamplingParams())  # as if preempted after generating two tokens:
    preempted.append_token(99)  # its 13 tokens are all recomputed, so it needs 4 blocks,
    preempted.append_token(100)  # not the 3 its 11-token prompt alone would need
    assert not manager.can_allocate(preempted), (
        "can_allocate said yes to a 13-token sequence (4 blocks) with 3 free: count every "
        "token, not only the prompt's 11, and round up to whole blocks (ceil(13 / 4) = 4)"
    )
    assert manager.num_free_blocks == 3 and preempted.block_table == [], (
        f"a refused can_allocate changed something: {manager.num_free_blocks} free (3), table "
        f"{preempted.block_table} ([])"
    )
    manager.deallocate(small)
    assert manager.can_allocate(preempted), "13 tokens on 4 free blocks of 4 must fit"
    manager.allocate(preempted)
    assert len(preempted.block_table) == 4 and manager.num_free_blocks == 0, (
        f"13 tokens got {preempted.block_table} with {manager.num_free_blocks} free; "
        "expected 4 blocks and 0 free"
    )
    check_books(manager, [preempted], 4, 4)


def test_task_1_check_fits_refuses_a_request_that_needs_more_blocks_than_exist(impl):
    manager = impl.BlockManager(8, 4)
    manager.check_fits(32, 32)  # exactly 8 blocks: fits
    manager.check_fits(3, 32)
    for prompt, longest, why in ((33, 34, "the prompt alone"), (3, 60, "prompt + max_tokens")):
        with pytest.raises(ValueError):
            manager.check_fits(prompt, longest)
            pytest.fail(
                f"check_fits({prompt}, {longest}) on 8 blocks of 4 raised nothing: {why} needs "
                f"{ceil_div(max(prompt, longest), 4)} blocks; refuse it with a ValueError"
            )
    assert manager.num_free_blocks == 8, "check_fits must take no block"


def test_task_1_decode_at_length_12_needs_no_block_and_at_13_takes_one(impl):
    manager = impl.BlockManager(8, 4)
    a = admitted(manager, A)
    other = admitted(manager, list(range(12)))  # takes 3, 4, 5
    assert other.block_table == [3, 4, 5], f"the second sequence got {other.block_table}"
    decode_one(manager, a, 99)  # length 12: token 99 sits at position 11, offset 3 of block 2
    assert a.block_table == [0, 1, 2] and manager.num_free_blocks == 2, (
        f"at length 12, A is on {a.block_table} with {manager.num_free_blocks} free: position 11 "
        "is offset 3 of block 2, so no block may be taken"
    )
    decode_one(manager, a, 100)  # length 13: token 100 is the first of a new page
    assert a.block_table == [0, 1, 2, 6] and manager.num_free_blocks == 1, (
        f"at length 13, A is on {a.block_table} with {manager.num_free_blocks} free; expected "
        "[0, 1, 2, 6] and 1: position 12 opens a new page"
    )
    check_books(manager, [a, other], 8, 4)


def test_task_1_can_append_is_false_only_when_a_boundary_meets_an_empty_pool(impl):
    manager = impl.BlockManager(3, 4)
    a = admitted(manager, A)  # all three blocks
    decode_one(manager, a, 99)  # position 11 still fits block 2
    a.num_cached_tokens = len(a)
    a.append_token(100)  # position 12 needs a fourth block; there is none
    assert not manager.can_append(a), "position 12 needs a fourth block and the pool is empty"
    assert a.block_table == [0, 1, 2] and manager.num_free_blocks == 0, (
        f"can_append changed something: A on {a.block_table}, {manager.num_free_blocks} free"
    )


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_task_1_with_the_pool_exhausted_can_append_is_true_exactly_while_the_last_block_has_room(
    impl, block_size
):
    num_blocks = ceil_div(5, block_size)  # a 5-token prompt takes the whole pool
    manager = impl.BlockManager(num_blocks, block_size)
    seq = admitted(manager, [7, 8, 9, 10, 11])
    capacity = num_blocks * block_size
    for length in range(6, capacity + 2):  # each decode adds one token; the last one overflows
        seq.num_cached_tokens = len(seq)
        seq.append_token(length)
        fits = length <= capacity
        table_before = list(seq.block_table)
        assert manager.can_append(seq) is fits, (
            f"block_size {block_size}, {num_blocks} blocks all held, len(seq) {length}: "
            f"position {length - 1} {'fits the last block' if fits else 'needs a new block'}"
        )
        assert seq.block_table == table_before and manager.num_free_blocks == 0, (
            "can_append must change nothing"
        )
        if fits:
            manager.may_append(seq)
    assert seq.block_table == list(range(num_blocks)), f"the table ended as {seq.block_table}"


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_task_1_growth_is_lazy_and_never_moves_a_block(impl, block_size):
    manager = impl.BlockManager(64, block_size)
    seq = admitted(manager, [7, 8, 9])
    for step in range(37):  # 3 -> 40 tokens, one decode at a time
        before = list(seq.block_table)
        decode_one(manager, seq, step)
        assert seq.block_table[: len(before)] == before, "a block holding K/V moved"
        check_books(manager, [seq], 64, block_size)


def test_task_1_deallocate_frees_everything_and_writes_only_the_table(impl):
    manager = impl.BlockManager(8, 4)
    a = admitted(manager, A)
    decode_one(manager, a)
    decode_one(manager, a)  # 13 tokens on 4 blocks, 12 of them cached
    manager.deallocate(a)
    after = (a.block_table, a.num_cached_tokens, manager.num_free_blocks)
    assert after == ([], 12, 8), (
        f"after deallocate: (block_table, num_cached_tokens, free) is {after}; expected "
        "([], 12, 8): the scheduler keeps num_cached_tokens (it zeroes it itself)"
    )
    a.num_cached_tokens = 0  # as the scheduler does
    check_books(manager, [], 8, 4)
    assert manager.can_allocate(a), "a preempted 13-token sequence must fit an empty pool of 8"
    manager.allocate(a)
    assert len(a.block_table) == 4, f"13 tokens readmitted got {a.block_table}: 4 blocks of 4"
    check_books(manager, [a], 8, 4)


def test_task_1_blocks_freed_by_a_finished_sequence_are_reused_last_freed_first(impl):
    manager = impl.BlockManager(3, 4)
    a = admitted(manager, A)
    assert not manager.can_allocate(Sequence([5], SamplingParams())), "the pool is full"
    manager.deallocate(a)  # frees [0, 1, 2] in table order: 2 is on top of the free stack
    b = admitted(manager, list(range(12)))
    assert b.block_table == [2, 1, 0], (
        f"b got {b.block_table}: deallocate frees a's blocks in table order, so the last one "
        "freed (a's last block, 2) is the first handed out again"
    )
    check_books(manager, [b], 3, 4)


def test_task_1_a_scattered_table_is_freed_in_table_order_not_sorted_or_reversed(impl):
    manager = impl.BlockManager(8, 4)
    x, y, z = (admitted(manager, [1, 2, 3, 4]) for _ in range(3))  # blocks 0, 1, 2
    manager.deallocate(x)
    manager.deallocate(z)  # the free stack's top is now 2, then 0, then 3 4 5 6 7
    a = admitted(manager, A)
    assert a.block_table == [2, 0, 3], "a fresh pool hands out 0, 1, 2, ..., last freed first"
    manager.deallocate(a)  # table order: 2, 0, 3 go back, so 3 is on top, then 0, then 2
    d = admitted(manager, list(range(12)))
    assert d.block_table == [3, 0, 2], (
        f"d got {d.block_table}: a's scattered table [2, 0, 3] must be freed in that order"
    )
    check_books(manager, [y, d], 8, 4)


def test_task_1_check_invariants_catches_a_sequence_admitted_twice(impl):
    # A scheduler bug: a running sequence is allocated again without being deallocated. Its
    # first blocks are now neither free nor held by any live sequence (in any bookkeeping that
    # knows which sequence holds what), so allocate must refuse it or the books must disagree.
    manager = impl.BlockManager(8, 4)
    a = admitted(manager, A)
    manager.check_invariants()  # consistent so far
    try:
        manager.allocate(a)
    except Exception:
        return  # refusing the second admission is fine too
    try:
        manager.check_invariants()
    except AssertionError:
        return
    pytest.fail(
        "after allocate(a) twice, a's first 3 blocks are neither free nor held by a live "
        "sequence, yet check_invariants() raised nothing (free + held == num_blocks fails)"
    )


def test_task_1_random_traffic_keeps_the_books_consistent(impl):
    rng, num_blocks, block_size = random.Random(0), 24, 4
    manager = impl.BlockManager(num_blocks, block_size)
    live: list[Sequence] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.25:  # a new arrival, when it fits
            seq = Sequence([1] * rng.randrange(1, 30), SamplingParams())
            if manager.can_allocate(seq):
                manager.allocate(seq)
                live.append(seq)
        elif action < 0.4 and live:  # a finish or a preemption
            manager.deallocate(live.pop(rng.randrange(len(live))))
        elif live:  # a decode step, when there is room
            seq = rng.choice(live)
            seq.num_cached_tokens = len(seq)
            seq.append_token(3)
            if manager.can_append(seq):
                manager.may_append(seq)
            else:
                manager.deallocate(seq)  # no room: preempt it
                live.remove(seq)
        check_books(manager, live, num_blocks, block_size)
    for seq in live:
        manager.deallocate(seq)
    assert manager.num_free_blocks == num_blocks, (
        f"every sequence released, yet {num_blocks - manager.num_free_blocks} blocks are held"
    )


# ---- task 2: write K/V into the pool by slot ----


def empty_caches(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3):
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float64)
    return k_cache, torch.zeros_like(k_cache)


def test_task_2_store_writes_each_token_at_the_block_and_offset_of_its_slot(impl):
    k_cache, v_cache = empty_caches()
    k = torch.randn(5, 2, 3, dtype=torch.float64)
    v = torch.randn(5, 2, 3, dtype=torch.float64)
    slots = [0, 6, 7, 20, 13]
    impl.store_kvcache(k, v, k_cache, v_cache, torch.tensor(slots))
    expected_k, expected_v = empty_caches()
    for j, slot in enumerate(slots):
        expected_k[slot // 4, slot % 4] = k[j]
        expected_v[slot // 4, slot % 4] = v[j]
    for name, got, want in (("k_cache", k_cache, expected_k), ("v_cache", v_cache, expected_v)):
        assert torch.equal(got, want), slots_message(name, got, want, 4)


def test_task_2_store_skips_padding_slots_marked_minus_one(impl):
    k_cache, v_cache = empty_caches()
    k = torch.ones(4, 2, 3, dtype=torch.float64)
    impl.store_kvcache(k, 2 * k, k_cache, v_cache, torch.tensor([-1, 9, -1, -1]))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        written = cache.flatten(0, 1).abs().sum((1, 2)).nonzero().flatten().tolist()
        assert written, (
            f"{name}: nothing was written; write into the cache you are given, in place "
            "(index_copy_ or an indexed assignment), not into a copy"
        )
        assert written == [9], (
            f"{name}: slots {written} changed; only slot 9 may (-1 must not wrap to the last slot)"
        )
    assert torch.equal(k_cache[2, 1], k[1]) and torch.equal(v_cache[2, 1], 2 * k[1]), (
        "slot 9 (block 2, offset 1) must hold token 1's k and v"
    )


def test_task_2_store_writes_into_the_pool_through_its_layer_views(impl):
    pool = torch.zeros(2, 3, 6, 4, 2, 3, dtype=torch.float64)  # [2, L, N, block_size, H_kv, D]
    k = torch.randn(3, 2, 3, dtype=torch.float64)
    impl.store_kvcache(k, -k, pool[0, 1], pool[1, 1], torch.tensor([8, 9, 23]))
    assert torch.equal(pool[0, 1, 2, :2], k[:2]) and torch.equal(pool[0, 1, 5, 3], k[2]), (
        "layer 1's keys: slots 8, 9 (block 2, offsets 0, 1) and 23 (block 5, offset 3) must hold "
        "tokens 0, 1, 2, written through the view pool[0, 1]"
    )
    assert torch.equal(pool[1, 1, 2, :2], -k[:2]) and torch.equal(pool[1, 1, 5, 3], -k[2]), (
        "layer 1's values: slots 8, 9 and 23 must hold tokens 0, 1, 2, through pool[1, 1]"
    )
    assert pool[:, 0].abs().sum() == 0 and pool[:, 2].abs().sum() == 0, "other layers changed"


# ---- task 3: read one sequence's history through its block table ----


def filled_cache(table, context_len, block_size=4, num_blocks=6, num_kv_heads=2, head_dim=3):
    """A cache holding position p's row (every value p + 1) at block table[p // bs], p % bs,
    plus junk (-7) in every slot that is not the sequence's."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, -7.0, dtype=torch.float64)
    for p in range(context_len):
        cache[table[p // block_size], p % block_size] = p + 1
    expected = torch.arange(1, context_len + 1, dtype=torch.float64)[:, None, None]
    return cache, expected.expand(-1, num_kv_heads, head_dim)


def test_task_3_gather_returns_logical_order_from_scattered_blocks(impl):
    cache, expected = filled_cache([5, 2, 0], 10)
    got = impl.gather_kv(cache, torch.tensor([5, 2, 0], dtype=torch.int32), 10)
    assert got.shape == (10, 2, 3), f"gather_kv returned {tuple(got.shape)}, not (10, 2, 3)"
    assert torch.equal(got, expected), positions_message(got, expected)


def test_task_3_gather_stops_at_context_len_and_never_reads_padding(impl):
    cache, expected = filled_cache([3, 1], 5)
    table = torch.tensor([3, 1, -1, -1], dtype=torch.int32)  # a padded row of block_tables
    got = impl.gather_kv(cache, table, 5)
    assert got.shape == (5, 2, 3), "return exactly context_len rows"
    assert torch.equal(got, expected), positions_message(got, expected)


@pytest.mark.parametrize("context_len", [1, 4, 8])
def test_task_3_gather_at_block_edges(impl, context_len):
    cache, expected = filled_cache([4, 0], context_len)
    got = impl.gather_kv(cache, torch.tensor([4, 0, -1], dtype=torch.int32), context_len)
    assert got.shape == expected.shape and torch.equal(got, expected), positions_message(
        got, expected
    )


def test_task_3_gather_reads_blocks_of_block_size_rows_whatever_the_other_dimensions(impl):
    # block_size 2, 5 KV heads, head_dim 7: a dimension mixed up with another shows here
    table = [6, 1, 3, 0]
    cache, expected = filled_cache(table, 7, block_size=2, num_blocks=8, num_kv_heads=5, head_dim=7)
    got = impl.gather_kv(cache, torch.tensor([*table, -1], dtype=torch.int32), 7)
    assert got.shape == (7, 5, 7), f"shape {tuple(got.shape)}, expected (7, 5, 7)"
    for p in range(7):
        assert torch.equal(got[p], expected[p]), f"position {p} (block {table[p // 2]})"


# ---- task 4: the prefill step's tensors ----


def test_task_4_prefill_of_prompt_a_writes_slots_0_to_10(impl):
    step = impl.prepare_prefill([seq_of(A, [0, 1, 2])], 4, "cpu")
    assert_step(
        step,
        {
            "is_prefill": True,
            "input_ids": A,
            "positions": list(range(11)),
            "slot_mapping": list(range(11)),
            "cu_seqlens_q": [0, 11],
            "cu_seqlens_k": [0, 11],
            "context_lens": [11],
            "block_tables": [[0, 1, 2]],
            "max_seqlen_q": 11,
            "max_seqlen_k": 11,
            "host.cu_seqlens_q": [0, 11],
            "host.context_lens": [11],
            "host.block_tables": [[0, 1, 2]],
        },
    )
    assert_dtypes(step)


def test_task_4_slots_follow_a_fragmented_block_table(impl):
    seq = seq_of(list(range(10)), [0, 4, 7])
    # position 6: page 1 -> block 4, offset 2 -> slot 4 * 4 + 2 = 18
    step = impl.prepare_prefill([seq], 4, "cpu")
    assert_step(step, {"slot_mapping": [0, 1, 2, 3, 16, 17, 18, 19, 28, 29]})


def test_task_4_a_cached_prefix_is_skipped_in_q_but_counted_in_k(impl):
    b = seq_of(B, [0, 3, 4, 5], num_cached_tokens=4)  # the seed's B after a 4-token prefix hit
    assert_step(
        impl.prepare_prefill([b], 4, "cpu"),
        {
            "input_ids": B[4:],
            "positions": list(range(4, 13)),
            "cu_seqlens_q": [0, 9],
            "cu_seqlens_k": [0, 13],
            "slot_mapping": list(range(12, 21)),  # 12..15, 16..19 and 20
            "block_tables": [[0, 3, 4, 5]],
            "context_lens": [13],
            "max_seqlen_q": 9,
            "max_seqlen_k": 13,
        },
    )


def test_task_4_a_packed_batch_keeps_two_cumulative_length_arrays(impl):
    c = seq_of([40, 41, 42, 43, 44, 45, 46], [8, 9], num_cached_tokens=4)  # 4 cached + 3 new
    d = seq_of([50, 51], [10])  # 0 cached + 2 new
    assert_step(
        impl.prepare_prefill([c, d], 4, "cpu"),
        {
            "input_ids": [44, 45, 46, 50, 51],
            "positions": [4, 5, 6, 0, 1],
            "cu_seqlens_q": [0, 3, 5],
            "cu_seqlens_k": [0, 7, 9],
            "host.cu_seqlens_q": [0, 3, 5],
            "slot_mapping": [36, 37, 38, 40, 41],
            "block_tables": [[8, 9], [10, -1]],  # padded with -1
            "host.block_tables": [[8, 9], [10]],  # the host copy is not padded
            "context_lens": [7, 2],
            "host.context_lens": [7, 2],
        },
    )


def test_task_4_b_sharing_nothing_packs_after_a_with_its_own_blocks(impl):
    # without stage 07's prefix cache, B's first page is not shared: it lands on blocks 3..6
    a, b = seq_of(A, [0, 1, 2]), seq_of(B, [3, 4, 5, 6])
    assert_step(
        impl.prepare_prefill([a, b], 4, "cpu"),
        {
            "cu_seqlens_q": [0, 11, 24],
            "cu_seqlens_k": [0, 11, 24],
            "slot_mapping": [*range(0, 11), *range(12, 25)],
            "positions": [*range(11), *range(13)],
            "block_tables": [[0, 1, 2, -1], [3, 4, 5, 6]],
        },
    )


def test_task_4_prefill_reads_the_tables_and_changes_nothing(impl):
    a = seq_of(A, [0, 1, 2])
    step = impl.prepare_prefill([a], 4, "cpu")
    after = (a.block_table, a.num_cached_tokens, len(a))
    assert after == ([0, 1, 2], 0, 11), f"prepare_prefill changed the sequence: {after}"
    assert step.input_ids.device.type == "cpu", f"input_ids on {step.input_ids.device}, not cpu"


# ---- task 5: the decode step's tensors ----


def test_task_5_decode_at_length_12_writes_slot_11_and_reads_three_blocks(impl):
    a = seq_of([*A, 99], [0, 1, 2], num_cached_tokens=11)
    step = impl.prepare_decode([a], 4, "cpu")
    assert_step(
        step,
        {
            "is_prefill": False,
            "input_ids": [99],
            "positions": [11],
            "slot_mapping": [2 * 4 + 3],
            "cu_seqlens_q": [0, 1],
            "cu_seqlens_k": [0, 12],
            "context_lens": [12],
            "block_tables": [[0, 1, 2]],
            "max_seqlen_q": 1,
            "max_seqlen_k": 12,
            "host.cu_seqlens_q": [0, 1],
            "host.context_lens": [12],
            "host.block_tables": [[0, 1, 2]],
        },
    )
    assert_dtypes(step)


def test_task_5_decode_at_length_13_writes_the_first_slot_of_the_new_block(impl):
    a = seq_of([*A, 99, 100], [0, 1, 2, 6], num_cached_tokens=12)
    assert_step(
        impl.prepare_decode([a], 4, "cpu"),
        {
            "input_ids": [100],
            "positions": [12],
            "slot_mapping": [24],
            "context_lens": [13],
            "block_tables": [[0, 1, 2, 6]],
        },
    )


def test_task_5_a_decode_batch_pads_short_block_tables_with_minus_one(impl):
    a = seq_of([*A, 99, 100], [0, 1, 2, 6], num_cached_tokens=12)  # the seed's A and B
    b = seq_of([*B, 77], [0, 3, 4, 5], num_cached_tokens=13)
    e = seq_of([5, 6], [7], num_cached_tokens=1)
    assert_step(
        impl.prepare_decode([a, b, e], 4, "cpu"),
        {
            "input_ids": [100, 77, 6],
            "positions": [12, 13, 1],
            "slot_mapping": [6 * 4 + 0, 5 * 4 + 1, 7 * 4 + 1],
            "block_tables": [[0, 1, 2, 6], [0, 3, 4, 5], [7, -1, -1, -1]],
            "context_lens": [13, 14, 2],
            "host.context_lens": [13, 14, 2],
            "cu_seqlens_q": [0, 1, 2, 3],
            "host.cu_seqlens_q": [0, 1, 2, 3],
            "cu_seqlens_k": [0, 13, 27, 29],
            "max_seqlen_q": 1,
            "max_seqlen_k": 14,
        },
    )


# ---- task 6: the engine, built from your pieces, reproduces stage 01 ----

MAX_TOKENS = 32
MAX_MODEL_LEN = 96
# around the block boundaries of block_size 4, so prefill and decode both cross them
PROMPT_LENS = (1, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 30)
SMALL_POOL = 18  # the longest request needs ceil((30 + 32) / 4) = 16 of them


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(4)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def stage_01_tokens(tiny_llama_folder, prompts):
    """The reference of the chain: stage 01's contiguous slabs, greedy, to MAX_TOKENS each."""
    llm = LLM(
        tiny_llama_folder, stage=1, device="cpu", dtype="float64", max_model_len=MAX_MODEL_LEN
    )
    return [o.token_ids for o in llm.generate(prompts, params(), use_tqdm=False)]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def paged_llm(folder, components, num_kv_blocks) -> LLM:
    return LLM(
        folder,
        stage=4,
        device="cpu",
        dtype="float64",
        components=components,
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_model_len=MAX_MODEL_LEN,
    )


def assert_tokens(got: list[list[int]], expected: list[list[int]]) -> None:
    """Request by request: which request differs, and at which generated token."""
    assert len(got) == len(expected), f"{len(got)} outputs for {len(expected)} requests"
    for i, (have, want) in enumerate(zip(got, expected)):
        k = next(
            (k for k, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want))
        )
        assert have == want, (
            f"request {i} ({PROMPT_LENS[i]}-token prompt) differs from stage 01 at generated "
            f"token {k}: {have[k : k + 3]} != {want[k : k + 3]}"
        )


def run_checked(llm, prompts, num_kv_blocks) -> list[list[int]]:
    """Step the engine by hand, checking the books after every step; the completion tokens."""
    engine = llm.engine
    seqs = [engine.add_request(p, params()) for p in prompts]
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        engine.step()
        # between steps a running sequence holds blocks for the tokens whose K/V is stored; the
        # token sampled last gets its block (if it needs one) when its decode is scheduled
        running = list(engine.scheduler.running)
        check_books(engine.manager, running, num_kv_blocks, 4, lambda s: s.num_cached_tokens)
        assert all(s.block_table == [] for s in engine.scheduler.waiting), "a waiting seq holds"
    assert not engine.has_unfinished(), "the engine did not finish in 10,000 steps"
    return [seq.completion_token_ids for seq in seqs]


@pytest.mark.parametrize("piece", API)
def test_task_6_each_piece_alone_in_the_reference_engine_gives_stage_01_tokens(
    impl, tiny_llama_folder, prompts, stage_01_tokens, piece
):
    llm = paged_llm(tiny_llama_folder, {piece: getattr(impl, piece)}, num_kv_blocks=1000)
    outputs = llm.generate(prompts, params(), use_tqdm=False)
    assert_tokens([out.token_ids for out in outputs], stage_01_tokens)


def test_task_6_all_pieces_with_a_large_pool_give_stage_01_tokens_and_free_every_block(
    impl, tiny_llama_folder, prompts, stage_01_tokens
):
    llm = paged_llm(
        tiny_llama_folder, {name: getattr(impl, name) for name in API}, num_kv_blocks=1000
    )
    assert_tokens(run_checked(llm, prompts, 1000), stage_01_tokens)
    num_preemptions = llm.engine.scheduler.num_preemptions
    assert num_preemptions == 0, f"{num_preemptions} preemptions on a pool of 1000 blocks"
    num_held = 1000 - llm.engine.manager.num_free_blocks
    assert num_held == 0, f"{num_held} blocks still held after every request finished"


def test_task_6_a_pool_so_small_it_preempts_still_gives_stage_01_tokens(
    impl, tiny_llama_folder, prompts, stage_01_tokens
):
    llm = paged_llm(tiny_llama_folder, {name: getattr(impl, name) for name in API}, SMALL_POOL)
    assert_tokens(run_checked(llm, prompts, SMALL_POOL), stage_01_tokens)
    assert llm.engine.scheduler.num_preemptions >= 5, "the pool was meant to run dry"
    assert llm.engine.manager.num_free_blocks == SMALL_POOL, "blocks leaked"
