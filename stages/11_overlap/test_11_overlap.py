"""Stage 11's graded contract: your persistent batch and overlap loop, alone and inside the engine.

Run against any implementation with `pytest stages/11_overlap --impl ref|starter|yours.py`.
Tasks 1 and 2 call your `PersistentBatch` on a CPU "device" and read its tensors back. Task 3
drives your `OverlapScheduler` with hand-made launched steps (no model): what each sequence owes,
holds and frees after `commit` and `resolve`. Task 4 runs the engine (`LLM(stage=11,
components=...)`) with your loop and your batch on a tiny float64 Llama and demands stage 09's
greedy tokens, with and without preemption, stop tokens, aborts and max_model_len, and a seeded
request's tokens whatever its batch; a step with nothing to do raises. Task 5 does the same on a
GPU with CUDA graphs (it skips without one).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager
from nanoserve.testing import recorded_releases
from nanoserve.types import ScheduledBatch, Sequence, SequenceStatus

API = ("PersistentBatch", "OverlapScheduler", "OverlapEngine")
BLOCK_SIZE = 4
WIDTH = 8  # table columns of the test batches


def seq_of(n: int, **params) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(**{"max_tokens": 8, **params}))


def device_table(batch, row: int) -> list[int]:
    """The row's block table on the device, up to its first -1."""
    values = batch.block_tables[row].tolist()
    return values[: values.index(-1)] if -1 in values else values


class Uploads:
    """Every `upload` the batch makes: how many table entries each step carried."""

    def __init__(self, batch):
        self.entries: list[int] = []
        inner = batch.upload

        def counted(rows, changed_rows, columns, blocks):
            self.entries.append(len(changed_rows))
            return inner(rows, changed_rows, columns, blocks)

        batch.upload = counted


# ---- task 1: a row per running request ----


def test_task_1_each_request_keeps_one_row_and_no_two_share_one(impl):
    batch = impl.PersistentBatch(4, WIDTH, BLOCK_SIZE, "cpu")
    seqs = [seq_of(3) for _ in range(4)]
    rows = [batch.row_of(s) for s in seqs]
    assert len(set(rows)) == 4, f"four running requests got rows {rows}: two share one"
    assert all(0 <= r < 4 for r in rows), f"rows {rows} outside a capacity of 4"
    assert [batch.row_of(s) for s in seqs] == rows, "a request's row changed between steps"


def test_task_1_a_released_row_goes_to_the_next_request_without_growing(impl):
    batch = impl.PersistentBatch(2, WIDTH, BLOCK_SIZE, "cpu")
    a, b, c = seq_of(3), seq_of(4), seq_of(5)
    row_a, row_b = batch.row_of(a), batch.row_of(b)
    batch.release(a)
    batch.release(seq_of(1))  # holds no row: nothing happens
    row_c = batch.row_of(c)
    assert row_c == row_a, f"c took row {row_c}; the only free row was {row_a}, a's"
    assert batch.block_tables.shape[0] == 2, "the batch grew although a row was free"
    assert batch.row_of(b) == row_b
    batch.release(c)
    for _ in range(5):  # a request that comes and goes, again and again: no row leaks
        d = seq_of(2)
        assert batch.row_of(d) == row_a
        batch.release(d)


def test_task_1_more_requests_than_rows_grow_the_batch(impl):
    batch = impl.PersistentBatch(2, WIDTH, BLOCK_SIZE, "cpu")
    seqs = [seq_of(3) for _ in range(5)]
    rows = [batch.row_of(s) for s in seqs]
    assert len(set(rows)) == 5, f"five running requests got rows {rows}"
    assert max(rows) < batch.block_tables.shape[0], "a row past the end of the tensors"


def test_task_1_a_new_row_holds_its_requests_sampling_parameters(impl):
    batch = impl.PersistentBatch(4, WIDTH, BLOCK_SIZE, "cpu")
    batch.row_of(seq_of(3))
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)
    seq = Sequence([1, 2], params)
    row = batch.row_of(seq)
    got = (batch.temperature[row].item(), batch.top_k[row].item(), batch.seeds[row].item())
    assert got == (pytest.approx(0.7), 5, 11), "row_of must write_params(row, seq.params)"
    assert batch.top_p[row].item() == pytest.approx(0.9)


# ---- task 2: the device copy of every table, sent by difference ----


def test_task_2_send_returns_the_rows_in_batch_order_and_the_device_holds_each_table(impl):
    batch = impl.PersistentBatch(4, WIDTH, BLOCK_SIZE, "cpu")
    seqs = [seq_of(6), seq_of(9), seq_of(2)]
    for seq, table in zip(seqs, ([5, 2], [7, 1, 3], [0])):
        seq.block_table = table
    batch.row_of(seqs[2])  # not the first row for the first sequence
    rows = batch.send(seqs)
    assert rows.tolist() == [batch.row_of(s) for s in seqs], "rows not in the order of seqs"
    for seq in seqs:
        assert device_table(batch, batch.row_of(seq)) == seq.block_table


def test_task_2_a_step_sends_only_the_entries_the_device_lacks(impl):
    batch = impl.PersistentBatch(4, WIDTH, BLOCK_SIZE, "cpu")
    uploads = Uploads(batch)
    a, b = seq_of(6), seq_of(3)
    a.block_table, b.block_table = [5, 2], [4]
    batch.send([a, b])
    batch.send([a, b])  # nothing changed
    a.block_table = [5, 2, 9]  # a block boundary
    batch.send([a, b])
    b.block_table = [4, 6]
    a.block_table = [5, 2, 9, 8]
    batch.send([b, a])
    assert uploads.entries == [3, 0, 1, 2], (
        f"entries sent per step: {uploads.entries}; the first step sends every table (3 "
        "entries), then a step sends only what a boundary added"
    )
    assert device_table(batch, batch.row_of(a)) == [5, 2, 9, 8]
    assert device_table(batch, batch.row_of(b)) == [4, 6]


def test_task_2_a_row_handed_on_is_sent_its_new_owners_whole_table(impl):
    batch = impl.PersistentBatch(1, WIDTH, BLOCK_SIZE, "cpu")
    a = seq_of(9)
    a.block_table = [3, 1, 4]
    batch.send([a])
    batch.release(a)
    b = seq_of(5)
    b.block_table = [6, 0]
    batch.send([b])
    assert batch.row_of(b) == 0
    assert device_table(batch, 0)[:2] == [6, 0], "the new owner's table was not sent whole"
    preempted = a  # preempted, then admitted again: a new table, sent whole
    batch.release(b)
    preempted.block_table = [2, 7, 5]
    batch.send([preempted])
    assert device_table(batch, batch.row_of(preempted)) == [2, 7, 5]


# ---- task 3: commit and resolve ----


class Step(NamedTuple):
    """A launched step as the scheduler sees it: its batch and who samples."""

    batch: ScheduledBatch
    inputs: None
    sampled: list[int]


def scheduler_with(impl, seqs, num_blocks=16, manager_cls=BlockManager):
    config = EngineConfig(max_model_len=64, max_num_seqs=4, block_size=BLOCK_SIZE)
    manager = manager_cls(num_blocks, BLOCK_SIZE)
    scheduler = impl.OverlapScheduler(config, manager)
    released = recorded_releases(scheduler)  # whose rows it let go of (told in the next plan)
    for seq in seqs:
        scheduler.add(seq)
    return scheduler, manager, released


def test_task_3_commit_stores_the_step_and_counts_one_owed_token_per_sampled_sequence(impl):
    whole, chunk = seq_of(6), seq_of(10)
    scheduler, _, _ = scheduler_with(impl, [whole, chunk])
    scheduler.config = scheduler.config.__class__(
        max_model_len=64,
        max_num_seqs=4,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
    )
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.seqs == [whole, chunk]
    chunk.num_scheduled_tokens = 4  # as if the budget had cut it to a chunk of 4
    scheduler.commit(Step(batch, None, [0]))
    assert (whole.num_cached_tokens, whole.num_scheduled_tokens, whole.num_pending) == (6, 0, 1)
    assert (chunk.num_cached_tokens, chunk.num_scheduled_tokens, chunk.num_pending) == (4, 0, 0)
    assert len(whole) == 7 and whole.token_ids == list(range(1, 7)), (
        "an owed token counts in len(seq) but is not in token_ids until it arrives"
    )


def test_task_3_commit_makes_the_blocks_its_step_filled_shareable_at_once(impl):
    seq = seq_of(10, max_tokens=8, ignore_eos=True)  # tokens 1..10: blocks of 4, 4 and 2
    scheduler, manager, _ = scheduler_with(impl, [seq], manager_cls=PrefixBlockManager)

    def shareable(when: str, num_blocks: int) -> None:
        """A new request with seq's tokens 1..12 finds its first num_blocks blocks cached."""
        found = manager.cached_prefix(Sequence([*range(1, 13), 99], SamplingParams()))
        assert found == seq.block_table[:num_blocks], (
            f"{when}: {seq.num_cached_tokens} tokens of request {seq.seq_id} are stored, so its "
            f"{num_blocks} full blocks {seq.block_table[:num_blocks]} must be in the prefix cache "
            f"(commit hashes them: self.prefix_manager.hash_blocks(seq)); a new request finds "
            f"{found}"
        )

    prefill = Step(scheduler.schedule(), None, [0])
    scheduler.commit(prefill)
    shareable("after the prefill's commit", 2)
    second = Step(scheduler.schedule(), None, [0])  # launched before the prefill resolves
    scheduler.resolve(prefill, [11], eos_ids=set())
    scheduler.commit(second)
    shareable("after the commit of the step that stores token 11", 2)  # block 2 holds 3
    third = Step(scheduler.schedule(), None, [0])
    scheduler.resolve(second, [12], eos_ids=set())
    scheduler.commit(third)
    shareable("after the commit of the step that stores token 12, before it resolves", 3)
    manager.check_invariants()


def test_task_3_resolve_appends_the_owed_tokens_and_frees_a_finished_sequence(impl):
    a, b = seq_of(5, max_tokens=3), seq_of(3, max_tokens=3)
    scheduler, manager, released = scheduler_with(impl, [a, b])
    free_before = manager.num_free_blocks
    prefill = scheduler.schedule()
    step = Step(prefill, None, [0, 1])
    scheduler.commit(step)
    finished = scheduler.resolve(step, [42, 2], eos_ids={2})
    assert a.token_ids[-1] == 42 and a.num_pending == 0 and len(a) == 6
    assert finished == [b] and b.finish_reason == "stop" and b.is_finished
    assert b not in scheduler.running and released == [b], "a finished sequence frees its row"
    assert manager.num_free_blocks == free_before - len(a.block_table), "b's blocks not freed"


def test_task_3_the_step_after_a_sequences_end_is_discarded(impl):
    a, b = seq_of(5, max_tokens=6), seq_of(3, max_tokens=6)
    scheduler, _, _ = scheduler_with(impl, [a, b])
    first = Step(scheduler.schedule(), None, [0, 1])
    scheduler.commit(first)
    second = Step(scheduler.schedule(), None, [0, 1])  # launched before `first` resolves
    assert second.batch.seqs == [a, b]
    scheduler.resolve(first, [7, 2], eos_ids={2})  # b hit EOS: its place in `second` is waste
    scheduler.commit(second)
    assert (b.num_pending, len(b)) == (0, 4), "a finished sequence owes nothing"
    scheduler.resolve(second, [8, 99], eos_ids={2})
    assert b.token_ids == [1, 2, 3, 2], "the token sampled after EOS was appended"
    assert a.token_ids == [1, 2, 3, 4, 5, 7, 8] and a.num_pending == 0


def test_task_3_max_tokens_ends_a_sequence_exactly(impl):
    a = seq_of(4, max_tokens=2, ignore_eos=True)
    scheduler, _, _ = scheduler_with(impl, [a])
    step = Step(scheduler.schedule(), None, [0])
    scheduler.commit(step)
    assert scheduler.resolve(step, [9], eos_ids=set()) == []
    step = Step(scheduler.schedule(), None, [0])
    scheduler.commit(step)
    assert scheduler.resolve(step, [10], eos_ids=set()) == [a]
    assert a.finish_reason == "length" and a.completion_token_ids == [9, 10]


def test_task_3_a_sequence_preempted_while_its_token_was_in_flight(impl):
    a, b = seq_of(4, max_tokens=5), seq_of(4, max_tokens=5)
    scheduler, manager, released = scheduler_with(impl, [a, b])
    free_before = manager.num_free_blocks
    step = Step(scheduler.schedule(), None, [0, 1])
    scheduler.commit(step)
    scheduler.running.remove(b)  # as the scheduler does when memory runs out
    scheduler.preempt(b)
    assert b.status is SequenceStatus.WAITING and b in scheduler.waiting
    finished = scheduler.resolve(step, [5, 2], eos_ids={2})
    assert finished == [b] and b not in scheduler.waiting, "a finished sequence still waits"
    assert b.token_ids == [1, 2, 3, 4, 2] and b.num_pending == 0
    assert released == [b], "a preempted sequence frees its row"
    assert manager.num_free_blocks == free_before - len(a.block_table)
    plan = scheduler.schedule()
    assert plan.seqs == [a] and plan.freed == (b,), "the next plan tells the runner b's row"


# ---- task 4: the loop, inside the engine ----

ENGINE = dict(dtype="float64", block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=4)


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 9, 4, 12, 5))]


def engine(folder, impl, stage=11, **options) -> LLM:
    parts = {"PersistentBatch": impl.PersistentBatch, "OverlapEngine": impl.OverlapEngine}
    components = parts if stage == 11 else None
    return LLM(folder, stage=stage, device="cpu", components=components, **{**ENGINE, **options})


def tokens(llm: LLM, params) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def stage_09(tiny_llama_folder):
    """Stage 09's greedy tokens: 12 each, and with a pool so small that requests get preempted."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(device="cpu", **ENGINE)
    return {
        "plenty": tokens(LLM(tiny_llama_folder, stage=9, num_kv_blocks=64, **options), params),
        "scarce": tokens(LLM(tiny_llama_folder, stage=9, num_kv_blocks=9, **options), params),
    }


def test_task_4_the_loop_gives_stage_09s_greedy_tokens(impl, tiny_llama_folder, stage_09):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    got = tokens(llm, SamplingParams(max_tokens=12, ignore_eos=True))
    assert got == stage_09["plenty"]
    engine_ = llm.engine
    assert not engine_.has_unfinished() and engine_.in_flight is None
    assert engine_.manager.num_free_blocks == 64, "blocks still held after every request ended"
    assert not engine_.runner.state.rows, "rows still held after every request ended"


def test_task_4_with_preemption_the_tokens_stay_stage_09s(impl, tiny_llama_folder, stage_09):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=9)
    got = tokens(llm, SamplingParams(max_tokens=12, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    assert got == stage_09["plenty"] == stage_09["scarce"]


def test_task_4_a_request_that_reaches_max_model_len_ends_there_as_in_stage_09(
    impl, tiny_llama_folder
):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    short = dict(device="cpu", num_kv_blocks=64, **{**ENGINE, "max_model_len": 16})
    want = LLM(tiny_llama_folder, stage=9, **short).generate(prompts(), params, use_tqdm=False)
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64, max_model_len=16)
    got = llm.generate(prompts(), params, use_tqdm=False)
    for prompt, mine, theirs in zip(prompts(), got, want):
        assert (len(mine.token_ids), mine.finish_reason) == (
            len(theirs.token_ids),
            theirs.finish_reason,
        ), (
            f"max_model_len 16, max_tokens 12, a prompt of {len(prompt)} tokens: stage 09 ends it "
            f"after {len(theirs.token_ids)} tokens ({theirs.finish_reason!r}), yours after "
            f"{len(mine.token_ids)} ({mine.finish_reason!r})"
        )
        assert mine.token_ids == theirs.token_ids
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts(), got)] == [15, 16, 16, 16, 16]
    assert llm.engine.manager.num_free_blocks == 64 and not llm.engine.runner.state.rows


def test_task_4_a_step_with_nothing_to_launch_and_nothing_in_flight_raises(impl, tiny_llama_folder):
    engine_ = engine(tiny_llama_folder, impl, num_kv_blocks=64).engine
    with pytest.raises(RuntimeError):
        engine_.step()
        pytest.fail("step() on an engine without requests returned: it must raise RuntimeError")
    seq = engine_.add_request(prompts()[0], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine_.has_unfinished():
        engine_.step()
    assert seq.is_finished and engine_.in_flight is None
    with pytest.raises(RuntimeError):
        engine_.step()
        pytest.fail(
            "step() after every request finished, with no step in flight, returned: nothing can "
            "be launched and nothing resolved, and it must raise RuntimeError"
        )


def test_task_4_the_loop_launches_a_step_before_it_waits_for_the_last(impl, tiny_llama_folder):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    engine_, calls = llm.engine, []
    launch, resolve = engine_.runner.launch, engine_.scheduler.resolve
    engine_.runner.launch = lambda batch: calls.append("launch") or launch(batch)
    engine_.scheduler.resolve = lambda *a: calls.append("resolve") or resolve(*a)
    engine_.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine_.step()
    engine_.step()
    assert calls == ["launch", "launch", "resolve"], (
        f"calls {calls}: the second step must launch before it waits for the first one's tokens"
    )


def test_task_4_a_stop_token_runs_one_discarded_step_and_frees_the_blocks_then(
    impl, tiny_llama_folder, stage_09
):
    stop = stage_09["plenty"][1][4]  # the fifth token of the second prompt
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop])
    want = tokens(LLM(tiny_llama_folder, stage=9, device="cpu", num_kv_blocks=64, **ENGINE), params)
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    assert tokens(llm, params) == want
    manager, engine_ = llm.engine.manager, llm.engine
    seq = engine_.add_request(prompts()[1], params)
    steps = 0
    while not seq.is_finished:
        engine_.step()
        steps += 1
    assert seq.completion_token_ids == want[1] and len(seq) == len(seq.token_ids)
    assert steps == len(want[1]) + 1, (
        f"{steps} steps for {len(want[1])} tokens: its stop token is seen one step late, after "
        "the next step was launched"
    )
    assert manager.num_free_blocks == 64, "the finished request's blocks were not freed"
    assert not engine_.has_unfinished() and engine_.in_flight is None, (
        "the last request ended: the discarded step is resolved before step() returns"
    )
    assert seq.completion_token_ids == want[1]


def test_task_4_an_abort_mid_overlap_leaves_nothing_behind(impl, tiny_llama_folder, stage_09):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    engine_ = llm.engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    keep, drop = (engine_.add_request(p, params) for p in prompts()[:2])
    for _ in range(3):
        engine_.step()  # a step is in flight now
    engine_.abort([drop])
    held = len(drop.token_ids)
    while engine_.has_unfinished():
        engine_.step()
    assert drop.finish_reason == "abort" and len(drop.token_ids) == held == len(drop)
    assert keep.completion_token_ids == stage_09["plenty"][0]
    assert engine_.manager.num_free_blocks == 64 and not engine_.runner.state.rows


def test_task_4_a_seeded_request_draws_the_same_tokens_in_any_batch(impl, tiny_llama_folder):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)
    alone = engine(tiny_llama_folder, impl, num_kv_blocks=64, max_num_seqs=1)
    want = alone.generate([prompts()[3]], seeded, use_tqdm=False)[0].token_ids
    crowd = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    outs = crowd.generate(prompts(), [other, other, other, seeded, other], use_tqdm=False)
    assert outs[3].token_ids == want, "a seeded request's tokens depend on its batch"
    assert len(set(map(tuple, [o.token_ids for o in outs]))) > 1


# ---- task 5: on a GPU, with the decode steps replayed as CUDA graphs ----


@pytest.mark.gpu
def test_task_5_on_a_gpu_the_loop_gives_stage_09s_tokens(impl, tiny_llama_folder):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(device="cuda", num_kv_blocks=64, attention_backend="triton", **ENGINE)
    want = tokens(LLM(tiny_llama_folder, stage=9, enforce_eager=True, **options), params)
    parts = {"PersistentBatch": impl.PersistentBatch, "OverlapEngine": impl.OverlapEngine}
    llm = LLM(tiny_llama_folder, stage=11, components=parts, **options)
    assert llm.engine.runner.graphs is not None, "stage 11 on CUDA replays decode graphs"
    assert tokens(llm, params) == want
    assert torch.cuda.is_available()
