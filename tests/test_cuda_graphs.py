"""Stage 08's CUDA graphs: bucket choice and static-buffer logic on the CPU; replay on a GPU is
token-identical to eager decode for every bucket size and the sizes between them."""

import pytest

from nanoserve import SamplingParams
from nanoserve.cache.attention_metadata import prepare_decode
from nanoserve.engine.cuda_graphs import (
    bucket_for,
    fill_static,
    graph_buckets,
    static_decode_inputs,
    table_width,
    view_rows,
)
from nanoserve.types import Sequence


@pytest.mark.parametrize(
    ("max_num_seqs", "buckets"),
    [
        (1, [1]),
        (8, [1, 2, 4, 8]),
        (40, [1, 2, 4, 8, 16, 32, 40]),  # the largest is max_num_seqs even off the 16-grid
        (48, [1, 2, 4, 8, 16, 32, 48]),
        (5, [1, 2, 4, 5]),
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
        1, 4, 8, 16, 16, 32, 40, 40,
    ]  # fmt: skip
    assert bucket_for(41, buckets) is None  # above the largest: eager


def test_the_table_width_covers_a_sequence_at_max_model_len_even_one_past_a_full_block():
    assert table_width(4096, 16) == 256
    assert table_width(4097, 16) == 257  # the last token opens one more block
    block_size, max_model_len = 4, 12
    seq = Sequence(list(range(max_model_len)), SamplingParams())  # exactly fills 3 blocks
    seq.block_table, seq.num_cached_tokens = [5, 1, 7], max_model_len - 1
    step = prepare_decode([seq], block_size, "cpu", batch_size=2,
                          table_width=table_width(max_model_len, block_size))  # fmt: skip
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


# ---- on a GPU: replay == eager ----


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 2, 3, 5, 8, 11, 16, 17, 24])
def test_graph_replay_gives_the_eager_tokens_for_every_batch_size(tiny_checkpoints, num_prompts):
    from nanoserve import LLM
    from nanoserve.engine.cuda_graphs import DecodeGraphs

    folder, _ = tiny_checkpoints["qwen3"]
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + 5 * i)] for i in range(num_prompts)]
    params = [SamplingParams(max_tokens=12 + i % 4, ignore_eos=True) for i in range(num_prompts)]

    def build():
        return LLM(str(folder), stage=6, device="cuda", dtype="float32", block_size=16,
                   max_model_len=128, max_num_seqs=24, num_kv_blocks=256,
                   attention_backend="triton")  # fmt: skip

    eager = [o.token_ids for o in build().generate(prompts, params, use_tqdm=False)]
    llm = build()
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.attention, 24, table_width(128, 16),
                                 runner.device)  # fmt: skip
    runner.graphs.capture()
    replays = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda step: replays.append(step.metadata.num_seqs) or original(step)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == eager
    assert replays, "no decode step was replayed"
