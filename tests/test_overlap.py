"""Stage 11 on a CPU: the overlap loop gives stage 09's greedy tokens in every configuration the
engine has (three model families, chunked prefill, prefix caching, preemption, two ranks over
gloo), seeded tokens that ignore batch and chunking, and a persistent batch that mirrors the
managers' tables. Float64 tiny checkpoints: a different batch shape cannot flip a greedy token.
On a GPU: decode steps and stage 12's verify steps captured whole give the tokens of the same
steps launched op by op.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.testing import engine_requests

from .conftest import TINY_FAMILIES
from .test_chunked_prefill import ENGINE_MAX_MODEL_LEN
from .test_equivalence import greedy_tokens, random_prompts
from .test_tensor_parallel import CPU, GREEDY, nothing_left_behind, tiny_sharded_model

__all__ = ["nothing_left_behind"]  # the tensor-parallel test below leaves no process behind
SMALL = dict(device="cpu", dtype="float64", max_model_len=128, max_num_seqs=6, block_size=4)
# chunked prefill, a prefix cache and a pool of 30 blocks small enough to preempt: 4 prompts
# behind one 24-token system prefix and one without it
SYSTEM = list(range(40, 64))
SHARED_PREFIXES = [[*SYSTEM, 1], [*SYSTEM, 2, 3], SYSTEM, list(range(1, 40)), [*SYSTEM, 9]]
PARAMS_14 = SamplingParams(max_tokens=14, ignore_eos=True)
CHUNKED_PREFIX_OPTIONS = dict(
    device="cpu",
    dtype="float64",
    block_size=4,
    max_model_len=ENGINE_MAX_MODEL_LEN,
    enable_chunked_prefill=True,
    max_num_batched_tokens=12,
    num_kv_blocks=30,
    enable_prefix_caching=True,
)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_stage11_reproduces_stage09_on_tiny_models_in_float64(tiny_checkpoints, family):
    folder, _ = tiny_checkpoints[family]
    prompts = random_prompts(256)
    want = greedy_tokens(LLM(str(folder), stage=9, **SMALL), prompts, 40)
    llm = LLM(str(folder), stage=11, **SMALL)
    assert greedy_tokens(llm, prompts, 40) == want
    engine = llm.engine
    assert engine.runner.in_flight is None and not engine.runner.state.rows
    assert engine.num_steps > len(prompts), "several waves of max_num_seqs, each overlapped"


def test_stage11_with_chunks_a_prefix_cache_and_preemption_gives_stage09s_tokens(
    tiny_checkpoints,
):
    folder, _ = tiny_checkpoints["llama"]
    prompts, params, options = SHARED_PREFIXES, PARAMS_14, CHUNKED_PREFIX_OPTIONS
    want = [o.token_ids for o in LLM(str(folder), stage=9, **options).generate(prompts, params)]
    llm = LLM(str(folder), stage=11, **options)
    checks = []

    def check(record):
        llm.engine.manager.check_invariants()
        state = llm.engine.runner.state
        for seq in llm.engine.scheduler.running:  # the device copy of every sent table
            row = state.rows.get(seq.seq_id)
            if row is not None and state.num_sent[row]:
                sent = state.block_tables[row, : state.num_sent[row]].tolist()
                checks.append(sent == seq.block_table[: state.num_sent[row]])

    llm.engine.on_step = check
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    manager = llm.engine.manager
    assert llm.engine.scheduler.num_preemptions > 0 and manager.num_hit_tokens > 0
    assert manager.num_free_blocks == 30 and checks and all(checks)


def test_seeded_tokens_ignore_chunking_and_the_batch(tiny_checkpoints):
    folder, _ = tiny_checkpoints["qwen3"]
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.2, max_tokens=9, ignore_eos=True)
    prompt = list(range(3, 40))
    alone = LLM(str(folder), stage=11, **SMALL).generate([prompt], seeded, use_tqdm=False)
    chunked = LLM(
        str(folder),
        stage=11,
        **{**SMALL, "enable_chunked_prefill": True, "max_num_batched_tokens": 8},
    )
    crowd = [list(range(i, i + 5 + i)) for i in range(1, 6)]
    outs = chunked.generate([*crowd, prompt], [other] * 5 + [seeded], use_tqdm=False)
    assert outs[-1].token_ids == alone[0].token_ids


def test_two_ranks_run_the_overlap_loop_and_give_one_ranks_tokens(tmp_path):
    model = tiny_sharded_model(tmp_path, "qwen3", 300, 4, 2)
    prompts, _ = engine_requests(lengths=(5, 17, 33, 9), vocab_size=300)
    with LLM(model, stage=9, **CPU) as llm:
        want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model, stage=11, tensor_parallel_size=2, **CPU) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.runner.workers is not None
    assert got == want


def test_a_row_of_context_zero_is_padding_that_stores_and_reads_nothing():
    # a captured step (engine/runner/step_graphs.py) pads its rows with the batch's padding row
    import torch

    from nanoserve.engine.runner.device_batch import DeviceBatch
    from nanoserve.types import HostMetadata

    batch = DeviceBatch(capacity=3, table_width=2, block_size=4, device="cpu")
    assert batch.padding_row == 3 and len(batch.seq_lens) == 4, "one row past the capacity"
    batch.block_tables[1] = torch.tensor([5, 2], dtype=torch.int32)
    batch.seq_lens[1] = 7  # row 1 feeds its next token at position 6: block 2, slot 2 * 4 + 2
    rows = torch.tensor([1, batch.padding_row])
    host = HostMetadata([0, 1, 2], [7, 0], [[5, 2], []])
    ctx = batch.seq_lens[rows]
    step = batch.fill_rows(rows, ctx, batch.next_token_ids[rows], host, None)
    assert step.metadata.slot_mapping.tolist() == [10, -1]
    assert step.metadata.context_lens.tolist() == [7, 0]
    assert step.positions.tolist() == [6, 0]
    batch.grow(6)  # growing keeps the rows and moves the padding row past the new capacity
    assert batch.padding_row == 6 and batch.seq_lens[[1, 6]].tolist() == [7, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 3, 5, 16])
def test_decode_steps_captured_whole_give_the_tokens_of_steps_launched_one_by_one(num_prompts):
    # stage 11 on a GPU replays whole decode steps (runner.steps); with it off, every step's
    # inputs, LM head, sampler and record are launched from Python around the forward's graph
    options = dict(dtype="float32", max_num_seqs=16, max_model_len=256, num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    top_k = SamplingParams(temperature=1.1, top_k=30, seed=9, max_tokens=18, ignore_eos=True)
    prompts = [[(13 * i + 7 * j) % 10000 for j in range(5 + 11 * i)] for i in range(num_prompts)]
    params = [(greedy, seeded, top_k)[i % 3] for i in range(num_prompts)]

    def run(captured: bool) -> tuple[list[list[int]], list[tuple[int, bool]]]:
        llm = LLM("qwen3-0.6b", stage=11, **options)
        runner = llm.engine.runner
        assert runner.steps is not None, "stage 11 on one GPU captures its decode steps"
        replays: list[tuple[int, bool]] = []
        if captured:
            original = runner.steps.run
            runner.steps.run = lambda rows, f, host: (
                replays.append((len(rows), f)) or original(rows, f, host)
            )
            runner.state.grow(runner.state.capacity * 2)  # new tensors: every graph recaptured
        else:
            runner.steps = None
        outs = llm.generate(prompts, params, use_tqdm=False)
        padding = runner.state.padding_row
        assert runner.state.seq_lens[padding].item() == 0, "the padding row stays empty"
        return [o.token_ids for o in outs], replays

    eager, _ = run(captured=False)
    tokens, replays = run(captured=True)
    assert tokens == eager
    assert replays, "no decode step was replayed whole"
    assert any(f for _, f in replays) == (num_prompts >= 3), "top-k rows take their own graph"


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_steps_captured_whole_give_the_tokens_of_verify_steps_launched_one_by_one(
    temperature,
):
    # stage 12 guessing ahead on a GPU replays its verify steps (StepGraphs.run_verify): the
    # picking of the guesses, the rows, the forward, the verdict and the record in one graph
    from nanoserve.engine.speculation.ngram_proposer import propose_ngram

    options = dict(dtype="float32", max_num_seqs=16, max_model_len=256, num_kv_blocks=256)
    options.update(speculative_method="ngram", num_speculative_tokens=3)
    # ending at different steps: the last one verifies alone (bucket 1's shape, 3 guesses) with
    # budgets cut below 3 near its max_tokens, so the host must read verdicts at the shape's
    # stride (reading at the budgets' gave wrong tokens on the CPU: test_speculative's [wider])
    params = [
        SamplingParams(temperature=temperature, seed=5, max_tokens=m, ignore_eos=True)
        for m in (40, 29, 17)
    ]
    stretch = [(31 * j) % 10000 for j in range(12)]
    prompts = [stretch * (2 + i) for i in range(3)]

    def lookup(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
        # guesses at every step: sampled text (0.8) soon leaves the repeated prompt, and its
        # newest token may occur nowhere earlier; the H200 then ran no solo verify (2026-12-05)
        return propose_ngram(token_ids, k, max_n, min_n) or token_ids[-1:] * k

    def run(captured: bool) -> tuple[list[list[int]], list, int]:
        llm = LLM("qwen3-0.6b", stage=12, components={"propose_ngram": lookup}, **options)
        runner, engine = llm.engine.runner, llm.engine
        engine.scheduler.speculation.backoff.MAX_WAIT = 1  # guess at every step
        shapes: list = []
        if captured:
            original = runner.steps.run_verify
            runner.steps.run_verify = lambda rows, packed, shape, sampling: (
                shapes.append((len(rows), shape)) or original(rows, packed, shape, sampling)
            )
        else:
            runner.steps.verify_shape = lambda num_seqs, k, width: None  # op by op
        before = engine.speculation.num_verify_steps
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert runner.state.seq_lens[runner.state.padding_row].item() == 0
        return [o.token_ids for o in outs], shapes, engine.speculation.num_verify_steps - before

    eager, _, eager_verifies = run(captured=False)
    tokens, shapes, verifies = run(captured=True)
    assert tokens == eager
    assert eager_verifies > 0 and verifies == eager_verifies
    assert len(shapes) == verifies, "every verify step was one replay"
    assert {1, 3} <= {n for n, _ in shapes}, "three sequences at once, and the last alone"


def step_graphs_of_16_rows(captured: list):
    """StepGraphs over buckets 1..16 on the CPU, its verify captures recorded in `captured`
    instead of run (no GPU): the host half of `StepGraphs.run_verify`."""
    from types import SimpleNamespace

    import torch

    from nanoserve.engine.runner.cuda_graphs import graph_buckets
    from nanoserve.engine.runner.device_batch import DeviceBatch
    from nanoserve.engine.runner.step_graphs import StepGraphs

    state = DeviceBatch(capacity=16, table_width=4, block_size=4, device="cpu")
    decode = SimpleNamespace(buckets=graph_buckets(16), pool=None, static=None)
    steps = StepGraphs(torch.nn.Identity(), decode, state)
    steps._capture_verify = lambda key, rule: captured.append(key)
    return steps


def test_a_verify_step_replays_its_buckets_shape_fixed_from_the_policy():
    # one shape per bucket, planned from the policy's guesses by batch size; which graph a
    # step replays (none: op by op)
    from nanoserve.engine.runner.verify_step import AheadShape

    captured: list = []
    steps = step_graphs_of_16_rows(captured)
    assert steps.decode.buckets == [1, 2, 4, 8, 16]
    policy = {1: 4, 2: 3, 3: 2}  # guesses per sequence by batch size; none past 3
    steps.plan_verify(lambda n: policy.get(n, 0), rule=None)
    assert steps.verify_ks == {1: 4, 2: 3, 4: 2}, "a bucket holds the most its batches take"
    assert steps.verify_width == 10  # a budget of 4 plus a step in flight's 5, plus one
    assert {(shape, greedy) for shape, greedy, _ in captured} == {
        (AheadShape(b, k, 10), g) for b, k in [(1, 4), (2, 3), (4, 2)] for g in (True, False)
    }, "every planned shape captured at start-up, greedy and sampled"
    assert captured[0][0].num_seqs == 4, "the largest first (the memory pool grows once)"
    assert steps.verify_shape(3, 2, 7) == AheadShape(4, 2, 10)
    # a budget cut to 1 near max_tokens, looking up past a step in flight of 2 guesses
    assert steps.verify_shape(3, 1, 5) == AheadShape(4, 2, 10), "rows past a budget: padding"
    assert steps.verify_shape(1, 4, 10) == AheadShape(1, 4, 10)
    assert steps.verify_shape(3, 3, 8) is None, "more guesses than its bucket's shape holds"
    assert steps.verify_shape(1, 1, 11) is None, "a lookup wider than planned"
    assert steps.verify_shape(5, 1, 4) is None, "a bucket that does not guess"
    assert steps.verify_shape(17, 1, 2) is None, "wider than every bucket"
    steps.plan_verify(lambda n: 7, rule=None)  # more than the rows hold: (16 // bucket) - 1
    assert steps.verify_ks == {1: 7, 2: 7, 4: 3, 8: 1}


def test_every_verify_step_the_policy_plans_fits_its_buckets_captured_shape():
    # a batch of n sequences guesses at most what the bucket it replays in holds: (largest
    # bucket - bucket) // bucket each (5 sequences replay bucket 8: 8 x 2 rows of 16), so no
    # verify step the policy plans falls back to launching op by op
    from nanoserve.engine.speculation.policy import Speculation

    policy = Speculation(3, max_model_len=128, graph_rows=16, ahead=True)
    by_size = [policy.guesses_per_sequence(n) for n in range(1, 17)]
    assert by_size == [3, 3, 3, 3, 1, 1, 1, 1] + [0] * 8
    assert Speculation(3, 128, graph_rows=None).guesses_per_sequence(12) == 3, "eager: no cap"
    steps = step_graphs_of_16_rows([])
    steps.plan_verify(policy.guesses_per_sequence, rule=None)
    for n, k in enumerate(by_size, start=1):
        if k:
            assert steps.verify_shape(n, k, 2 * k + 2) is not None, f"{n} sequences, {k} guesses"
