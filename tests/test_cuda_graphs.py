"""Stage 08's CUDA graphs: bucket choice and static-buffer logic on the CPU, and the engine's
replay path on the CPU with a stand-in for each graph (it runs the model again on the static
buffers, all a graph can read); on a GPU, replay is token-identical to eager decode for every
bucket size and the sizes between them, and a step too wide for the captured tables runs eagerly.
"""

import itertools
import logging

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.runner.cuda_graphs import (
    DecodeGraphs,
    bucket_for,
    fill_static,
    graph_buckets,
    static_decode_inputs,
    table_width,
    view_rows,
)
from nanoserve.engine.runner.input_packer import prepare_decode, prepare_prefill
from nanoserve.testing import RerunGraph
from nanoserve.types import Sequence


@pytest.mark.parametrize(
    ("max_num_seqs", "buckets"),
    [
        (1, [1]),
        (8, [1, 2, 4, 8]),
        (40, [1, 2, 4, 8, 16, 32, 40]),  # the largest is max_num_seqs even off the 16-grid
        (48, [1, 2, 4, 8, 16, 32, 48]),
        (5, [1, 2, 4, 5]),
        (17, [1, 2, 4, 8, 16, 17]),
        (20, [1, 2, 4, 8, 16, 20]),
        (33, [1, 2, 4, 8, 16, 32, 33]),
        (256, [1, 2, 4, 8, *range(16, 257, 16)]),
    ],
)
def test_buckets_are_powers_of_two_to_8_then_steps_of_16_ending_at_max_num_seqs(
    max_num_seqs, buckets
):
    assert graph_buckets(max_num_seqs) == buckets


def test_a_batch_replays_the_smallest_bucket_that_holds_it():
    buckets = graph_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 16, 17, 33, 40)] == [
        1,
        4,
        8,
        16,
        16,
        32,
        40,
        40,
    ]
    assert bucket_for(41, buckets) is None  # above the largest: eager


def test_the_table_width_covers_a_sequence_at_max_model_len_even_one_past_a_full_block():
    assert table_width(4096, 16) == 256
    assert table_width(4097, 16) == 257  # the last token opens one more block
    block_size, max_model_len = 4, 12
    seq = Sequence(list(range(max_model_len)), SamplingParams())  # exactly fills 3 blocks
    seq.block_table, seq.num_cached_tokens = [5, 1, 7], max_model_len - 1
    step = prepare_decode(
        [seq], block_size, "cpu", batch_size=2, table_width=table_width(max_model_len, block_size)
    )
    assert step.metadata.block_tables.tolist() == [[5, 1, 7], [-1, -1, -1]]


def test_static_buffers_start_as_padding_and_take_a_padded_step_in_their_first_rows():
    static = static_decode_inputs(8, 6, "cpu")
    md = static.metadata
    assert md.slot_mapping.tolist() == [-1] * 8 and md.context_lens.tolist() == [0] * 8
    seqs = [Sequence(list(range(n)), SamplingParams()) for n in (5, 9)]
    for seq, table in zip(seqs, ([3, 1], [0, 2, 4])):
        seq.block_table, seq.num_cached_tokens = table, len(seq) - 1
    rows = view_rows(static, 4)
    fill_static(static, prepare_decode(seqs, 4, "cpu", batch_size=4, table_width=6))
    assert rows.input_ids.tolist() == [4, 8, 0, 0]
    assert rows.metadata.slot_mapping.tolist() == [4, 16, -1, -1]
    assert rows.metadata.context_lens.tolist() == [5, 9, 0, 0]
    assert rows.metadata.block_tables[1].tolist() == [0, 2, 4, -1, -1, -1]
    assert md.slot_mapping[4:].tolist() == [-1] * 4  # rows past the bucket untouched


def test_every_max_num_seqs_gets_buckets_that_hold_every_batch_up_to_it_and_none_above():
    for max_num_seqs in range(1, 301):
        buckets = graph_buckets(max_num_seqs)
        assert buckets[0] == 1 and buckets[-1] == max_num_seqs, buckets
        assert buckets == sorted(set(buckets)), f"not ascending and distinct: {buckets}"
        assert all(b - a <= 16 for a, b in itertools.pairwise(buckets)), buckets  # <= 15 pads
        assert all(bucket_for(n, buckets) >= n for n in range(1, max_num_seqs + 1))
        assert bucket_for(max_num_seqs + 1, buckets) is None


def tensors(step):
    md = step.metadata
    return [
        step.input_ids,
        step.positions,
        md.cu_seqlens_q,
        md.cu_seqlens_k,
        md.slot_mapping,
        md.context_lens,
        md.block_tables,
    ]


def test_static_buffers_have_the_shapes_and_dtypes_of_a_padded_step():
    # copy_ would silently cast a wrong dtype; the kernels read int32 tables and lengths
    seq = Sequence(list(range(6)), SamplingParams())
    seq.block_table, seq.num_cached_tokens = [2, 0], 5
    step = prepare_decode([seq], 4, "cpu", batch_size=8, table_width=5)
    static = static_decode_inputs(8, 5, "cpu")
    for got, want in zip(tensors(static), tensors(step)):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)


def decode_of(lengths, block_size=4):
    """An unpadded decode step of fresh sequences of these lengths on consecutive blocks."""
    seqs, next_block = [], 0
    for n in lengths:
        seq = Sequence(list(range(n)), SamplingParams())
        count = -(-n // block_size)
        seq.block_table = list(range(next_block, next_block + count))
        seq.num_cached_tokens, next_block = n - 1, next_block + count
        seqs.append(seq)
    return seqs, prepare_decode(seqs, block_size, "cpu")


def test_a_step_replays_only_if_it_is_a_decode_that_fits_a_bucket_and_the_table_width():
    # no model needed to ask; max_model_len 13 at block_size 4 gives a width of 4 blocks
    graphs = DecodeGraphs(None, None, 6, table_width(13, 4), "cpu")
    seqs, step = decode_of([13, 5])  # 13 tokens: the 13th opens the 4th block, the edge
    assert step.metadata.block_tables.shape[1] == 4 and graphs.can_replay(step)
    assert not graphs.can_replay(prepare_prefill(seqs, 4, "cpu")), "prefill stays eager"
    assert not graphs.can_replay(decode_of([3] * 7)[1]), "7 sequences: above the largest bucket"
    assert not graphs.can_replay(decode_of([17, 2])[1]), "a 5th block: wider than the graphs"


# ---- the engine's replay path: real graphs on a GPU, stand-ins for them on a CPU ----


MAX_MODEL_LEN, MAX_NUM_SEQS = 40, 20  # 20: the largest bucket is off the 16-grid
ENGINE = dict(
    dtype="float64",
    block_size=4,
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=MAX_NUM_SEQS,
    num_kv_blocks=256,
)
POOL_TOLERANCE = {"cpu": 1e-12, "cuda": 1e-9}  # K/V summed in another order than eager's


@torch.inference_mode()
def capture_reruns(graphs: DecodeGraphs) -> None:
    for bucket in graphs.buckets:
        graphs.graphs[bucket] = RerunGraph(graphs, bucket)


def run_to_max_model_len(folder, lengths, width=None, device="cpu"):
    """(tokens, pool, steps) of stage 08: each prompt generates up to max_model_len tokens.

    With width, decode replays graphs whose tables are that wide (real ones on a GPU, stand-ins
    on a CPU); steps lists (batch size, table width, replayed?) of every decode step offered.
    enforce_eager keeps stage 08 from capturing its own graphs (and from fusing small ops)."""
    backend = "triton" if device == "cuda" else "torch"
    llm = LLM(
        str(folder), stage=8, device=device, attention_backend=backend, enforce_eager=True, **ENGINE
    )
    runner, steps = llm.engine.runner, []
    if width is not None:
        graphs = DecodeGraphs(runner.model, runner.attention, MAX_NUM_SEQS, width, device)
        if device == "cuda":
            graphs.capture()
        else:
            capture_reruns(graphs)
        can_replay = graphs.can_replay

        def recorded(step):
            md, fits = step.metadata, can_replay(step)
            if not md.is_prefill:
                steps.append((md.num_seqs, md.block_tables.shape[1], fits))
            return fits

        graphs.can_replay, runner.graphs = recorded, graphs
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(256, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=MAX_MODEL_LEN - n, ignore_eos=True) for n in lengths]
    tokens = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, runner.cache.kv.cpu(), steps


# 20 prompts around block edges of 4; 12, 16, 20, 24, 28 and 32 exactly fill their blocks
FULL_BATCH = (1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20, 23, 24, 25, 28, 31, 32)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_replaying_every_batch_size_up_to_a_bucket_off_the_16_grid_gives_the_eager_tokens(
    tiny_checkpoints, device
):
    folder, _ = tiny_checkpoints["qwen3"]
    width = table_width(MAX_MODEL_LEN, 4)
    eager, eager_pool, _ = run_to_max_model_len(folder, FULL_BATCH, device=device)
    tokens, pool, steps = run_to_max_model_len(folder, FULL_BATCH, width, device)
    assert tokens == eager
    assert all(fits for _, _, fits in steps), "every decode step fits: none may run eagerly"
    assert sorted({n for n, _, _ in steps}) == list(range(1, 21)), "20..1, the bucket of 20 too"
    assert max(w for _, w, _ in steps) == width, "the widest table is exactly the static width"
    # padding rows wrote nothing: every slot holds eager's K/V (summed in another order: ~1e-15)
    tolerance = POOL_TOLERANCE[device]
    torch.testing.assert_close(pool, eager_pool, atol=tolerance, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_sequence_grown_past_the_captured_table_width_runs_eagerly_and_corrupts_nothing(
    tiny_checkpoints, device
):
    # graphs captured for tables of 4 blocks (16 tokens); the prompts grow to 40 tokens
    folder, _ = tiny_checkpoints["qwen3"]
    lengths = (2, 3, 5, 6, 9, 10)
    eager, eager_pool, _ = run_to_max_model_len(folder, lengths, device=device)
    tokens, pool, steps = run_to_max_model_len(folder, lengths, 4, device)
    assert tokens == eager
    replayed = [w for _, w, fits in steps if fits]
    eager_widths = [w for _, w, fits in steps if not fits]
    assert replayed and max(replayed) == 4, "steps that fit the captured width replay"
    assert eager_widths and min(eager_widths) == 5, "wider steps fall back to eager decode"
    tolerance = POOL_TOLERANCE[device]
    torch.testing.assert_close(pool, eager_pool, atol=tolerance, rtol=0)


def test_stage_08_on_a_cpu_captures_nothing_and_says_it_runs_as_07(tiny_checkpoints, caplog):
    folder, _ = tiny_checkpoints["llama"]
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        llm = LLM(str(folder), stage=8, device="cpu", dtype="float64", num_kv_blocks=32)
    assert llm.engine.runner.graphs is None
    assert any("stage 08 runs as 07" in r.message for r in caplog.records), caplog.text


# ---- on a GPU: replay == eager ----


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 2, 3, 5, 8, 11, 16, 17, 24])
def test_graph_replay_gives_the_eager_tokens_for_every_batch_size(tiny_checkpoints, num_prompts):
    folder, _ = tiny_checkpoints["qwen3"]
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + 5 * i)] for i in range(num_prompts)]
    params = [SamplingParams(max_tokens=12 + i % 4, ignore_eos=True) for i in range(num_prompts)]

    def build():
        return LLM(
            str(folder),
            stage=6,
            device="cuda",
            dtype="float32",
            block_size=16,
            max_model_len=128,
            max_num_seqs=24,
            num_kv_blocks=256,
            attention_backend="triton",
        )

    eager = [o.token_ids for o in build().generate(prompts, params, use_tqdm=False)]
    llm = build()
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.attention, 24, table_width(128, 16), runner.device
    )
    runner.graphs.capture()
    replays = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda step: replays.append(step.metadata.num_seqs) or original(step)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == eager
    assert replays, "no decode step was replayed"


def test_fused_small_ops_can_be_undone_so_a_shared_model_runs_plain_again(tiny_checkpoints):
    from nanoserve.layers.activation import silu_mul
    from nanoserve.layers.compiled import fuse_small_ops, unfuse_small_ops

    folder, _ = tiny_checkpoints["qwen3"]
    model = LLM(str(folder), stage=0, device="cpu", dtype="float64").model
    assert fuse_small_ops(model) > 0  # compiles lazily: nothing runs here
    unfuse_small_ops(model)
    for module in model.modules():
        for name in ("forward", "add_then_norm", "norm_and_rotate"):
            assert name not in module.__dict__, (type(module).__name__, name)
        assert getattr(module, "act", silu_mul) is silu_mul
