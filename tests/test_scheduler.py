"""Scheduler + block manager: invariants under random traffic, preemption, leaks, rejection.

The stateful test needs no model: sampled tokens are random ids, so thousands of steps run in
seconds while the bookkeeping is exercised exactly as the engine does it.
"""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.types import Sequence, SequenceStatus, StepOutput

STOP = 7  # a fake "EOS": some requests finish early when this id is sampled


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, lengths and finishes against a small pool."""

    def __init__(self):
        super().__init__()
        self.config = EngineConfig(
            max_model_len=64, max_num_seqs=4, max_num_batched_tokens=96, block_size=4
        )
        self.manager = BlockManager(num_blocks=24, block_size=4)
        self.scheduler = Scheduler(self.config, self.manager)
        self.rng = random.Random(0)
        self.finished: list[Sequence] = []
        self.all: list[Sequence] = []

    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 24), stops=st.booleans())
    def arrive(self, prompt_len, max_tokens, stops):
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,) if stops else ())
        longest = min(prompt_len + max_tokens, self.config.max_model_len)
        self.manager.check_fits(prompt_len, longest)  # always fits: 24 blocks hold 96 tokens
        seq = Sequence([self.rng.randrange(100) for _ in range(prompt_len)], params)
        self.scheduler.add(seq)
        self.all.append(seq)

    @precondition(lambda self: not self.scheduler.is_finished())
    @rule()
    def step(self):
        batch = self.scheduler.schedule()
        assert batch.seqs, "work is pending but nothing was scheduled"
        for seq in batch.seqs:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) * 4 >= len(seq)  # room for every token it will store
        token_ids = [self.rng.randrange(10) for _ in batch.seqs]
        self.finished += self.scheduler.update(batch, StepOutput.of(token_ids))

    @invariant()
    def bookkeeping_is_consistent(self):
        self.manager.check_invariants()
        running = set(s.seq_id for s in self.scheduler.running)
        assert len(running) == len(self.scheduler.running)
        assert sum(len(s.block_table) for s in self.scheduler.running) == (
            self.manager.num_blocks - self.manager.num_free_blocks
        )
        for seq in self.scheduler.waiting:
            assert seq.block_table == [] and seq.num_cached_tokens == 0

    def teardown(self):
        while not self.scheduler.is_finished():  # drain: everything finishes, nothing leaks
            self.step()
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert all(seq.is_finished for seq in self.all)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_decode_preempts_the_newest_sequence_when_the_pool_runs_dry():
    config = EngineConfig(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=32, block_size=4)
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(config, manager)
    older, newer = (Sequence([1, 2, 3, 4], SamplingParams(max_tokens=8)) for _ in range(2))
    scheduler.add(older)
    scheduler.add(newer)
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.seqs == [older, newer]
    scheduler.update(batch, StepOutput.of([5, 5]))  # both now need a second block
    manager.allocate(Sequence([0] * 8, SamplingParams()))  # an outsider takes the last 2 blocks
    batch = scheduler.schedule()
    assert not batch.is_prefill and batch.seqs == [older]  # older got newer's freed block
    assert scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [newer] and newer.block_table == []
    assert newer.token_ids == [1, 2, 3, 4, 5]  # no output lost: recomputed at its next prefill
    manager.check_invariants()


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoints):
    return str(tiny_checkpoints["llama"][0])


def test_forced_preemption_gives_the_same_tokens_as_a_large_pool(tiny_llama):
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    big = LLM(
        tiny_llama,
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        num_kv_blocks=1000,
        max_model_len=96,
    )
    small = LLM(
        tiny_llama,
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        num_kv_blocks=24,
        max_model_len=96,
    )
    expected = [o.token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert big.engine.scheduler.num_preemptions == 0
    assert small.engine.scheduler.num_preemptions >= 5
    assert got == expected
    assert small.engine.manager.num_free_blocks == 24  # no leaks


def test_a_request_that_can_never_fit_is_rejected_and_the_rest_complete(tiny_llama):
    llm = LLM(
        tiny_llama,
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        num_kv_blocks=8,
        max_model_len=96,
    )
    engine = llm.engine
    ok = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=5)) for _ in range(3)]
    with pytest.raises(ValueError, match=r"needs 10 blocks of 4 but the pool has only 8"):
        engine.add_request(list(range(40)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt \\+ max_tokens"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=60))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.manager.check_invariants()
        steps += 1
        assert steps < 100
    assert all(seq.is_finished and seq.num_completion_tokens == 5 for seq in ok)
    assert engine.manager.num_free_blocks == 8
