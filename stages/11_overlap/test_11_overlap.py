"""Stage 11's graded contract: your persistent batch and your scheduler's commit and land, alone
and inside the engine.

Run against any implementation with `pytest stages/11_overlap --impl ref|starter|yours.py`.
Tasks 1 and 2 call your `PersistentBatch` on a CPU "device" and read its tensors back. Task 3
drives your `OverlapScheduler.commit` with plans from its own `schedule` (no model), task 4 its
`land` the same way: what each sequence owes, holds and frees. (Each lands or commits with the
reference's other half, so a task is graded alone.) Task 4 then runs the engine (`LLM(stage=11,
components=...)`, the one loop: schedule, execute, update) with your three pieces on a tiny
float64 Llama and demands stage 09's greedy tokens, with and without preemption, stop tokens,
aborts and max_model_len, and a seeded request's tokens whatever its batch; a step with nothing
to do raises. Task 5 does the same on a GPU with CUDA graphs (it skips without one).
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.loop.scheduler import Scheduler
from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager
from nanoserve.testing import recorded_releases
from nanoserve.types import Landed, Sequence, SequenceStatus

API = ("PersistentBatch", "OverlapScheduler")
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
    assert batch.capacity == 2, "the batch grew although a row was free"
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
    assert max(rows) < batch.capacity, "a row past the capacity (rows 0 to capacity - 1)"


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


# ---- task 3: commit, when a step is launched ----


def scheduler_with(impl, seqs, num_blocks=16, manager_cls=BlockManager, eos_ids=(), **config):
    """Your scheduler on a real block manager (no model), the seqs queued; and whose rows it
    released (told to the runner in the next plan)."""
    config = EngineConfig(max_model_len=64, max_num_seqs=4, block_size=BLOCK_SIZE, **config)
    manager = manager_cls(num_blocks, BLOCK_SIZE)
    scheduler = impl.OverlapScheduler(config, manager, eos_ids)
    released = recorded_releases(scheduler)
    for seq in seqs:
        scheduler.add(seq)
    return scheduler, manager, released


def reference_land(scheduler, plan, tokens) -> list[Sequence]:
    """The reference's land on your scheduler: task 3 is graded without your task 4."""
    return Scheduler.land(scheduler, Landed(plan, tokens))


def reference_commit(scheduler, plan, sampled) -> None:
    """The reference's commit on your scheduler: task 4 is graded without your task 3."""
    Scheduler.commit(scheduler, plan, sampled)


def test_task_3_commit_stores_the_step_and_counts_one_owed_token_per_sampled_sequence(impl):
    whole, chunk = seq_of(6), seq_of(10)  # a budget of 10 tokens: 6 for one, a chunk of 4
    scheduler, _, _ = scheduler_with(
        impl, [whole, chunk], max_num_batched_tokens=10, enable_chunked_prefill=True
    )
    plan = scheduler.schedule()
    assert plan.is_prefill and plan.seqs == [whole, chunk] and chunk.num_scheduled_tokens == 4
    scheduler.commit(plan, (0,))  # the chunk does not end its prompt: it samples nothing
    assert (whole.num_cached_tokens, whole.num_scheduled_tokens, whole.num_pending) == (6, 0, 1)
    assert (chunk.num_cached_tokens, chunk.num_scheduled_tokens, chunk.num_pending) == (4, 0, 0), (
        "the chunk (4 of its 10 tokens): (num_cached_tokens, num_scheduled_tokens, num_pending) "
        "should be (4, 0, 0): its K/V is stored, but a chunk that does not end its prompt samples "
        "nothing, so it owes no token (its index is not in `sampled`)"
    )
    assert len(whole) == 7 and whole.token_ids == list(range(1, 7)), (
        "an owed token counts in len(seq) but is not in token_ids until it lands"
    )
    rest = scheduler.schedule()  # the chunk's remaining 6 tokens: a prefill step again
    assert rest.seqs == [chunk] and chunk.num_scheduled_tokens == 6
    scheduler.commit(rest, (0,))
    assert (chunk.num_cached_tokens, chunk.num_pending, len(chunk)) == (10, 1, 11)


def test_task_3_commit_skips_a_sequence_that_finished_meanwhile(impl):
    a, b = seq_of(5, max_tokens=6), seq_of(3, max_tokens=6)
    scheduler, _, _ = scheduler_with(impl, [a, b], eos_ids=(2,))
    first = scheduler.schedule()
    scheduler.commit(first, (0, 1))
    second = scheduler.schedule()  # launched before `first` lands, a and b in it
    assert second.seqs == [a, b]
    reference_land(scheduler, first, [[7], [2]])  # b sampled EOS in `first`: it is finished
    scheduler.commit(second, (0, 1))
    got = (b.num_pending, b.num_scheduled_tokens, b.num_cached_tokens, len(b))
    assert got == (0, 0, 3, 4), (
        f"b finished before `second` was committed: it owes nothing and stores nothing more "
        f"(num_pending, num_scheduled_tokens, num_cached_tokens, len) = {got}, want (0, 0, 3, 4)"
    )
    assert (a.num_pending, a.num_scheduled_tokens, a.num_cached_tokens, len(a)) == (1, 0, 6, 7)


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

    prefill = scheduler.schedule()
    scheduler.commit(prefill, (0,))
    shareable("after the prefill's commit", 2)
    second = scheduler.schedule()  # launched before the prefill lands
    reference_land(scheduler, prefill, [[11]])
    scheduler.commit(second, (0,))
    shareable("after the commit of the step that stores token 11", 2)  # block 2 holds 3
    third = scheduler.schedule()
    reference_land(scheduler, second, [[12]])
    scheduler.commit(third, (0,))
    shareable("after the commit of the step that stores token 12, before it lands", 3)
    manager.check_invariants()


# ---- task 4: land, when a step's tokens arrive; then the engine ----


def test_task_4_land_appends_the_owed_tokens_and_frees_a_finished_sequence(impl):
    a, b = seq_of(5, max_tokens=3), seq_of(3, max_tokens=3)
    scheduler, manager, released = scheduler_with(impl, [a, b], eos_ids=(2,))
    free_before = manager.num_free_blocks
    plan = scheduler.schedule()
    reference_commit(scheduler, plan, (0, 1))
    finished = scheduler.land(Landed(plan, [[42], [2]]))
    assert a.token_ids[-1] == 42 and a.num_pending == 0 and len(a) == 6
    assert finished == [b] and b.finish_reason == "stop" and b.is_finished
    assert b.token_ids == [1, 2, 3, 2] and b.num_pending == 0
    assert b not in scheduler.running and released == [b], "a finished sequence frees its row"
    assert manager.num_free_blocks == free_before - len(a.block_table), "b's blocks not freed"
    assert scheduler.running == type(scheduler.running)([a])


def test_task_4_the_sequences_that_finish_come_back_in_the_plans_order(impl):
    seqs = [seq_of(3 + i, max_tokens=m, ignore_eos=True) for i, m in enumerate((1, 2, 1, 1))]
    scheduler, _, _ = scheduler_with(impl, seqs)
    plan = scheduler.schedule()
    reference_commit(scheduler, plan, (0, 1, 2, 3))
    finished = scheduler.land(Landed(plan, [[7], [8], [9], [10]]))
    order = {id(seq): i for i, seq in enumerate(plan.seqs)}
    want = [seq for seq in plan.seqs if seq.params.max_tokens == 1]
    assert finished == want, (
        f"four sequences land, three finish (max_tokens 1): land returns them in the order of "
        f"plan.seqs, {[order[id(s)] for s in want]}; got {[order.get(id(s)) for s in finished]}"
    )


def test_task_4_a_prefill_chunk_gains_nothing_when_its_step_lands(impl):
    whole, chunk = seq_of(6), seq_of(10)
    scheduler, _, _ = scheduler_with(
        impl, [whole, chunk], max_num_batched_tokens=10, enable_chunked_prefill=True
    )
    plan = scheduler.schedule()
    reference_commit(scheduler, plan, (0,))
    assert scheduler.land(Landed(plan, [[42], []])) == []
    assert whole.token_ids == [1, 2, 3, 4, 5, 6, 42] and whole.num_pending == 0
    got = (chunk.token_ids, chunk.num_pending, chunk.num_cached_tokens, chunk.status)
    assert got == (list(range(1, 11)), 0, 4, SequenceStatus.RUNNING), (
        f"a chunk's [] is no token: (token_ids, num_pending, num_cached_tokens, status) = {got}"
    )


def test_task_4_the_step_after_a_sequences_end_is_discarded(impl):
    a, b = seq_of(5, max_tokens=6), seq_of(3, max_tokens=6)
    scheduler, _, _ = scheduler_with(impl, [a, b], eos_ids=(2,))
    first = scheduler.schedule()
    reference_commit(scheduler, first, (0, 1))
    second = scheduler.schedule()  # launched before `first` lands
    assert scheduler.land(Landed(first, [[7], [2]])) == [b]  # b's place in `second` is waste
    reference_commit(scheduler, second, (0, 1))
    assert scheduler.land(Landed(second, [[8], [99]])) == []
    assert b.token_ids == [1, 2, 3, 2], "the token sampled after EOS was appended"
    assert (b.num_pending, len(b)) == (0, 4)
    assert a.token_ids == [1, 2, 3, 4, 5, 7, 8] and a.num_pending == 0


def test_task_4_max_tokens_ends_a_sequence_exactly(impl):
    a = seq_of(4, max_tokens=2, ignore_eos=True)
    scheduler, _, _ = scheduler_with(impl, [a])
    plan = scheduler.schedule()
    reference_commit(scheduler, plan, (0,))
    assert scheduler.land(Landed(plan, [[9]])) == []
    plan = scheduler.schedule()
    reference_commit(scheduler, plan, (0,))
    assert scheduler.land(Landed(plan, [[10]])) == [a]
    assert a.finish_reason == "length" and a.completion_token_ids == [9, 10]


def test_task_4_a_sequence_preempted_while_its_token_was_in_flight(impl):
    a, b = seq_of(4, max_tokens=5), seq_of(4, max_tokens=5)
    scheduler, manager, released = scheduler_with(impl, [a, b], eos_ids=(2,))
    free_before = manager.num_free_blocks
    plan = scheduler.schedule()
    reference_commit(scheduler, plan, (0, 1))
    scheduler.running.remove(b)  # as the scheduler does when memory runs out
    scheduler.preempt(b)
    assert b.status is SequenceStatus.WAITING and b in scheduler.waiting and released == [b]
    finished = scheduler.land(Landed(plan, [[5], [2]]))
    assert finished == [b] and b not in scheduler.waiting, "a finished sequence still waits"
    assert b.token_ids == [1, 2, 3, 4, 2] and b.num_pending == 0 and b.finish_reason == "stop"
    assert released == [b], "b's row was released once, when it was preempted"
    assert manager.num_free_blocks == free_before - len(a.block_table)
    manager.check_invariants()
    plan = scheduler.schedule()
    assert plan.seqs == [a] and plan.freed == (b,), "the next plan tells the runner b's row"


def test_task_4_several_tokens_land_in_order_up_to_the_one_that_finishes(impl):
    """Stage 12's verify step lands the guesses the model kept, then the token it drew."""
    stops = seq_of(6, max_tokens=8, stop_token_ids=[50])
    keeps = Sequence(list(range(31, 37)), SamplingParams(max_tokens=8))
    scheduler, manager, _ = scheduler_with(
        impl, [stops, keeps], manager_cls=PrefixBlockManager, eos_ids=(2,)
    )
    plan = scheduler.schedule()
    reference_commit(scheduler, plan, (0, 1))
    finished = scheduler.land(Landed(plan, [[20, 50, 21], [20, 21, 22]]))
    assert finished == [stops] and stops.finish_reason == "stop"
    assert stops.completion_token_ids == [20, 50], "a token past the stop token was appended"
    assert keeps.completion_token_ids == [20, 21, 22] and keeps.num_pending == 0
    assert (keeps.num_cached_tokens, len(keeps)) == (8, 9), (
        "three tokens landed: the two before the drawn one were fed to the step, so their K/V "
        f"is stored (num_cached_tokens 6 + 2 = 8); got {keeps.num_cached_tokens}"
    )
    found = manager.cached_prefix(Sequence([*range(31, 37), 20, 21, 99], SamplingParams()))
    assert found == keeps.block_table[:2], (
        "8 tokens stored: both full blocks must be in the prefix cache after the landing"
    )


ENGINE = dict(dtype="float64", block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=4)


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 9, 4, 12, 5))]


def engine(folder, impl, stage=11, **options) -> LLM:
    parts = {"PersistentBatch": impl.PersistentBatch, "OverlapScheduler": impl.OverlapScheduler}
    components = parts if stage == 11 else None
    return LLM(folder, stage=stage, device="cpu", components=components, **{**ENGINE, **options})


def tokens(llm: LLM, params) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts(), params, use_tqdm=False)]


def assert_all_released(llm: LLM, num_kv_blocks: int) -> None:
    """Nothing in flight, every block free, and every row of the device batch free: as many new
    requests as it has rows each get one without the batch growing."""
    engine_, state = llm.engine, llm.engine.runner.state
    assert not engine_.has_unfinished() and engine_.runner.in_flight is None
    assert engine_.manager.num_free_blocks == num_kv_blocks, "blocks held after every request"
    capacity = state.capacity
    with torch.inference_mode():  # the runner's tensors are inference tensors
        rows = {state.row_of(seq_of(2)) for _ in range(capacity)}
    assert len(rows) == capacity and state.capacity == capacity, (
        "a row is still held after every request ended: a finished or preempted request's row "
        "was never released"
    )


@pytest.fixture(scope="module")
def stage_09(tiny_llama_folder):
    """Stage 09's greedy tokens: 12 each, and with a pool so small that requests get preempted."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(device="cpu", **ENGINE)
    return {
        "plenty": tokens(LLM(tiny_llama_folder, stage=9, num_kv_blocks=64, **options), params),
        "scarce": tokens(LLM(tiny_llama_folder, stage=9, num_kv_blocks=9, **options), params),
    }


def test_task_4_the_engine_gives_stage_09s_greedy_tokens(impl, tiny_llama_folder, stage_09):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    got = tokens(llm, SamplingParams(max_tokens=12, ignore_eos=True))
    assert got == stage_09["plenty"]
    assert_all_released(llm, 64)


def test_task_4_with_preemption_the_tokens_stay_stage_09s(impl, tiny_llama_folder, stage_09):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=9)
    got = tokens(llm, SamplingParams(max_tokens=12, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    assert got == stage_09["plenty"] == stage_09["scarce"]
    assert_all_released(llm, 9)


def test_task_4_between_steps_one_step_is_in_flight_and_its_token_is_owed(impl, tiny_llama_folder):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    engine_, calls = llm.engine, []
    launch, land = engine_.runner.launch, engine_.scheduler.land
    engine_.runner.launch = lambda plan: calls.append("launch") or launch(plan)
    engine_.scheduler.land = lambda landed: calls.append("land") or land(landed)
    seq = engine_.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine_.step()  # launches the prefill; nothing lands
    assert (seq.completion_token_ids, seq.num_pending, len(seq)) == ([], 1, 4)
    engine_.step()  # launches the first decode, then the prefill's token lands
    assert calls == ["launch", "launch", "land"], calls
    assert engine_.runner.in_flight is not None
    assert (len(seq.completion_token_ids), seq.num_pending, len(seq)) == (1, 1, 5), (
        "after two steps the prefill's token has landed and the decode's is owed"
    )
    assert seq.num_cached_tokens == 4


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
    assert_all_released(llm, 64)


def test_task_4_a_step_with_nothing_to_run_and_nothing_in_flight_raises(impl, tiny_llama_folder):
    engine_ = engine(tiny_llama_folder, impl, num_kv_blocks=64).engine
    empty = "scheduler produced an empty batch with requests pending"
    with pytest.raises(RuntimeError, match=empty):
        engine_.step()
        pytest.fail("step() on an engine without requests returned: it must raise RuntimeError")
    seq = engine_.add_request(prompts()[0], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine_.has_unfinished():
        engine_.step()
    assert seq.is_finished and engine_.runner.in_flight is None
    with pytest.raises(RuntimeError, match=empty):
        engine_.step()
        pytest.fail(
            "step() after every request finished, with no step in flight, returned: nothing can "
            "be launched and nothing lands, and it must raise RuntimeError"
        )


def test_task_4_a_stop_token_runs_one_discarded_step_and_frees_the_blocks_then(
    impl, tiny_llama_folder, stage_09
):
    stop = stage_09["plenty"][1][4]  # the fifth token of the second prompt
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop])
    want = tokens(LLM(tiny_llama_folder, stage=9, device="cpu", num_kv_blocks=64, **ENGINE), params)
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    assert tokens(llm, params) == want
    engine_ = llm.engine
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
    assert_all_released(llm, 64)  # the discarded step landed before step() returned


def test_task_4_an_abort_mid_overlap_leaves_nothing_behind(impl, tiny_llama_folder, stage_09):
    llm = engine(tiny_llama_folder, impl, num_kv_blocks=64)
    engine_ = llm.engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    keep, drop = (engine_.add_request(p, params) for p in prompts()[:2])
    for _ in range(3):
        engine_.step()  # a step is in flight now
    assert engine_.runner.in_flight is not None
    engine_.abort([drop])
    held = len(drop.token_ids)
    while engine_.has_unfinished():
        engine_.step()
    assert drop.finish_reason == "abort" and len(drop.token_ids) == held == len(drop)
    assert keep.completion_token_ids == stage_09["plenty"][0]
    assert_all_released(llm, 64)


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
def test_task_5_on_a_gpu_the_engine_gives_stage_09s_tokens(impl, tiny_llama_folder):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(device="cuda", num_kv_blocks=64, attention_backend="triton", **ENGINE)
    want = tokens(LLM(tiny_llama_folder, stage=9, enforce_eager=True, **options), params)
    parts = {"PersistentBatch": impl.PersistentBatch, "OverlapScheduler": impl.OverlapScheduler}
    llm = LLM(tiny_llama_folder, stage=11, components=parts, **options)
    assert llm.engine.runner.graphs is not None, "stage 11 on CUDA replays decode graphs"
    assert tokens(llm, params) == want
    assert torch.cuda.is_available()
