"""Stage 07's prefix cache: the seed's traces exactly, confirmed hits under a weak hash, stale
entries never served, ref counts, and token equality with the unshared engine."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager, chain_hash
from nanoserve.engine.runner.input_packer import chunk_end, prepare_prefill
from nanoserve.testing import ENGINE_MAX_MODEL_LEN
from nanoserve.types import Sequence, StepOutput

from .test_scheduler import SchedulerMachine

A = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33]
B = [11, 12, 13, 14, 51, 52, 53, 54, 61, 62, 63, 64, 71]


def seq_of(token_ids) -> Sequence:
    return Sequence(token_ids, SamplingParams(max_tokens=8))


def computed(manager, seq, num_tokens=None) -> None:
    """What the scheduler's update does once a forward pass stored seq's K/V."""
    seq.num_cached_tokens = len(seq) if num_tokens is None else num_tokens
    manager.hash_blocks(seq)


def admitted(manager, token_ids) -> Sequence:
    seq = seq_of(token_ids)
    assert manager.can_allocate(seq)
    seq.num_cached_tokens = manager.allocate(seq)  # as the scheduler admits it
    manager.check_invariants()
    return seq


@pytest.fixture
def seed():
    """The seed's pool: block_size 4, 8 free blocks, A prefilled and hashed."""
    manager = PrefixBlockManager(8, 4)
    a = admitted(manager, A)
    computed(manager, a)
    return manager, a


def test_seed_prompt_a_gets_blocks_0_1_2_and_hashes_only_its_full_pages(seed):
    manager, a = seed
    assert a.block_table == [0, 1, 2]
    assert sorted(manager.cached) == [0, 1]  # partial block 2 is not hashed


def test_seed_prompt_b_shares_a_first_page_and_computes_only_its_suffix(seed):
    manager, _ = seed
    b = seq_of(B)
    admission = manager.can_allocate(b)
    assert admission.fits and admission.num_cached_blocks == 1
    b.num_cached_tokens = manager.allocate(b)
    assert b.block_table == [0, 3, 4, 5]
    assert manager.ref_counts[0] == 2 and b.num_cached_tokens == 4
    step = prepare_prefill([b], 4, "cpu")
    md = step.metadata
    assert step.input_ids.tolist() == [51, 52, 53, 54, 61, 62, 63, 64, 71]
    assert step.positions.tolist() == list(range(4, 13))
    assert md.cu_seqlens_q.tolist() == [0, 9] and md.cu_seqlens_k.tolist() == [0, 13]
    assert md.slot_mapping.tolist() == list(range(12, 21))
    computed(manager, b)
    assert {3, 4} <= set(manager.cached) and 5 not in manager.cached  # pages 1, 2; not 3


def test_seed_decode_crosses_a_page_and_release_keeps_the_shared_block(seed):
    manager, a = seed
    b = admitted(manager, B)
    computed(manager, b)
    a.append_token(99)  # length 12: written into page 2 at offset 3, slot 11
    assert manager.can_append(a)
    manager.may_append(a)
    assert a.block_table == [0, 1, 2]
    computed(manager, a)
    assert 2 in manager.cached  # [31, 32, 33, 99] is full now
    a.append_token(100)  # length 13: the first token of a new page
    manager.may_append(a)
    assert a.block_table == [0, 1, 2, 6]
    free_before = list(manager.allocator._free_ids)
    manager.deallocate(a)
    assert manager.allocator._free_ids == [*free_before, 6, 2, 1]  # walked in reverse
    assert manager.ref_counts[0] == 1  # B still holds it
    manager.check_invariants()


def test_a_finished_prefix_is_reclaimed_from_the_free_list(seed):
    manager, a = seed
    manager.deallocate(a)
    again = admitted(manager, [*A[:8], 7, 7])
    assert again.block_table[:2] == [0, 1] and again.num_cached_tokens == 8
    assert manager.ref_counts[:2] == [1, 1]


def test_a_fully_cached_prompt_still_computes_its_last_token():
    manager = PrefixBlockManager(8, 4)
    first = admitted(manager, A[:8])
    computed(manager, first)
    second = admitted(manager, A[:8])
    assert second.num_cached_tokens == 4 and second.block_table[0] == first.block_table[0]


def test_a_block_handed_out_for_new_content_drops_its_stale_entry():
    manager = PrefixBlockManager(3, 4)
    a = admitted(manager, A[:9])  # blocks 0, 1, 2
    computed(manager, a)
    manager.deallocate(a)  # freed, still hashed: 0 and 1 findable
    other = admitted(manager, [90, 91, 92, 93, 94, 95, 96, 97, 98])  # needs every block
    computed(manager, other)
    manager.deallocate(other)
    again = admitted(manager, A[:9])
    assert again.num_cached_tokens == 0  # A's pages were overwritten: nothing may be served
    manager.check_invariants()


def test_a_colliding_hash_never_serves_the_wrong_blocks():
    manager = PrefixBlockManager(16, 4, hash_fn=lambda parent, tokens: b"same")
    a = admitted(manager, A)
    computed(manager, a)
    b = admitted(manager, [99, 98, 97, 96, 21, 22, 23, 24, 5])  # a different first page
    assert b.num_cached_tokens == 0
    c = admitted(manager, [*A[:8], 1])  # the true prefix still hits block 0 (the index's entry)
    assert c.block_table[0] == 0 and c.num_cached_tokens >= 4


def test_a_page_whose_prefix_was_repurposed_is_not_served():
    manager = PrefixBlockManager(4, 4)
    a = admitted(manager, A[:9])  # blocks 0, 1, 2
    computed(manager, a)
    manager.deallocate(a)  # free list top: 0 (walked in reverse: 2, 1, 0)
    x = admitted(manager, [5, 6, 7])  # takes block 0: its entry is dropped
    assert x.block_table == [0]
    y = admitted(manager, A[:9])  # page 0 has no entry; page 1 may not hit behind it
    assert y.num_cached_tokens == 0
    manager.check_invariants()


# ---- the engine, with the prefix manager plugged in ----


def prefix_llm(folder, **options) -> LLM:
    return LLM(
        str(folder),
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=ENGINE_MAX_MODEL_LEN,
        **options,
        components={"BlockManager": PrefixBlockManager},
    )


def shared_prefix_requests():
    system = list(range(30, 50))  # 20 tokens: five full blocks of 4
    prompts = [[*system, 7], [*system, 8, 9], system, system + [1] * 4, [3] * 8, [3] * 8]
    params = [SamplingParams(max_tokens=12 + i, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("num_kv_blocks", [200, 26], ids=["roomy", "preempting"])
def test_sharing_prefixes_gives_the_unshared_tokens(tiny_checkpoints, num_kv_blocks):
    folder, _ = tiny_checkpoints["llama"]
    requests = shared_prefix_requests()
    plain = LLM(
        str(folder),
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=ENGINE_MAX_MODEL_LEN,
    )
    expected = [o.token_ids for o in plain.generate(*requests, use_tqdm=False)]
    llm = prefix_llm(folder, num_kv_blocks=num_kv_blocks, max_num_seqs=3)
    shared_writes = []

    def check_step(record):
        manager = llm.engine.manager
        manager.check_invariants()
        for slot in record.inputs.metadata.slot_mapping.tolist():
            if slot >= 0 and manager.ref_counts[slot // 4] > 1:
                shared_writes.append(slot)

    llm.engine.on_step = check_step
    got = [o.token_ids for o in llm.generate(*requests, use_tqdm=False)]
    assert got == expected
    assert shared_writes == [], "a block shared by two sequences was written"
    manager = llm.engine.manager
    assert manager.num_hit_tokens > 0 and manager.num_free_blocks == num_kv_blocks


# ---- random traffic with shared prefixes, against a shadow of the KV pool ----


class PrefixMachine(SchedulerMachine):
    """Stage 04's state machine on a prefix-caching manager, with chunked prefill, plus a shadow
    pool: each step "writes" its tokens into the slots the metadata names, and every token a
    sequence counts as cached must sit in its slot, whether computed or found by hash."""

    def __init__(self):
        super().__init__()
        self.config = EngineConfig(
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            block_size=4,
            enable_chunked_prefill=True,
        )
        self.manager = PrefixBlockManager(num_blocks=24, block_size=4)
        self.scheduler = Scheduler(self.config, self.manager)
        self.shadow: dict[int, int] = {}  # slot -> the token whose K/V it holds
        self.prefixes = [[self.rng.randrange(100) for _ in range(12)] for _ in range(3)]

    @rule(prefix=st.integers(0, 3), suffix_len=st.integers(0, 20), max_tokens=st.integers(1, 16))
    def arrive_sharing(self, prefix, suffix_len, max_tokens):
        head = self.prefixes[prefix][: self.rng.randrange(4, 13)] if prefix < 3 else []
        tokens = head + [self.rng.randrange(100) for _ in range(suffix_len)] or [1]
        seq = Sequence(tokens, SamplingParams(max_tokens=max_tokens))
        self.scheduler.add(seq)
        self.all.append(seq)

    def write_shadow(self, batch) -> None:
        for seq in batch.seqs:
            for p in range(seq.num_cached_tokens, chunk_end(seq)):
                block_id = seq.block_table[p // 4]
                assert self.manager.ref_counts[block_id] == 1, "a shared block was written"
                self.shadow[block_id * 4 + p % 4] = seq.token_ids[p]

    @precondition(lambda self: not self.scheduler.is_finished())
    @rule()
    def step(self):
        batch = self.scheduler.schedule()
        assert batch.seqs, "work is pending but nothing was scheduled"
        self.write_shadow(batch)
        token_ids = [self.rng.randrange(10) for _ in batch.seqs]
        for i, seq in enumerate(batch.seqs):  # a prefill chunk short of the end samples nothing
            if seq.num_cached_tokens + seq.num_scheduled_tokens < len(seq):
                token_ids[i] = None
        self.finished += self.scheduler.update(batch, StepOutput.of(token_ids))

    @invariant()
    def every_cached_token_sits_in_its_slot(self):
        for seq in self.scheduler.running:
            for p in range(seq.num_cached_tokens):
                slot = seq.block_table[p // 4] * 4 + p % 4
                assert self.shadow.get(slot) == seq.token_ids[p], (seq.seq_id, p)

    @invariant()
    def bookkeeping_is_consistent(self):
        self.manager.check_invariants()  # ref counts == table references, index entries valid


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)


def test_admission_hashes_the_prompt_once_across_can_allocate_and_allocate():
    calls = []

    def counting_hash(parent, token_ids):
        calls.append(token_ids)
        return chain_hash(parent, token_ids)

    manager = PrefixBlockManager(16, 4, hash_fn=counting_hash)
    a = admitted(manager, A)
    computed(manager, a)
    calls.clear()
    b = admitted(manager, B)  # can_allocate, then allocate: B's leading block is looked up once
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert calls == [(11, 12, 13, 14), (51, 52, 53, 54)], "each prompt block is hashed once"


def test_a_remembered_admission_is_not_reused_once_its_blocks_hold_other_content():
    manager = PrefixBlockManager(4, 4)
    a = admitted(manager, A)
    computed(manager, a)
    manager.deallocate(a)  # a's blocks are free but still findable
    again = seq_of(A)
    assert manager.can_allocate(again).num_cached_blocks == 2
    other = admitted(manager, [90 + i for i in range(16)])  # takes every free block: cache gone
    manager.deallocate(other)
    cached = manager.allocate(again)  # the hits can_allocate saw are gone: found anew, none
    assert cached == 0
    manager.check_invariants()
