"""Stage 08's graded contract: your buckets, padding and static-buffer copy, alone and driving the
engine's decode graphs.

Run against any implementation with `pytest stages/08_cuda_graphs --impl ref|starter|yours.py`.
Tasks 1 to 3 call your functions on small decode steps that the reference `prepare_decode`
packs (block_size 4, block tables set by hand); task 3 pads with the reference `pad_decode`, so
each task is graded on its own. Task 4 runs the engine's graph runner, `DecodeGraphs`
(nanoserve/engine/runner/cuda_graphs.py), on your four functions, on a CPU: each captured graph is
replaced by a stand-in that runs the model again on the bucket's rows of the static buffers,
which is all a real graph can read, so a value you did not copy in is a value the model never
sees. Task 5 captures real CUDA graphs and skips without a GPU (a skip is not a pass). The
oracle of tasks 4 and 5 is the same engine run eagerly, in float64: the tokens must be equal.
In tasks 2 and 3 every torch.empty (yours too) comes back full of poison (0x5A5A5A5A in an
integer tensor), so a padding row you never write fails on every run, not only when fresh
memory happens to hold something other than zeros.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.runner import cuda_graphs
from nanoserve.engine.runner.cuda_graphs import (
    DecodeGraphs,
    static_decode_inputs,
    table_width,
    view_rows,
)
from nanoserve.engine.runner.input_packer import pad_decode as reference_pad_decode
from nanoserve.engine.runner.input_packer import prepare_decode
from nanoserve.kernel_memory import empty_is_poison
from nanoserve.testing import RerunGraph
from nanoserve.types import Sequence, StepInputs

API = ("graph_buckets", "bucket_for", "pad_decode", "fill_static")
BLOCK_SIZE = 4
# three sequences of 5, 9 and 12 tokens; the third exactly fills its three blocks
LENGTHS, TABLES = (5, 9, 12), ([3, 1], [0, 2, 4], [7, 5, 6])


def decode_step(lengths=LENGTHS, tables=TABLES) -> StepInputs:
    """The unpadded decode step of sequences of these lengths on these block tables. Sequence b's
    token at position p is 100 * (b + 1) + p, so each row shows whose it is."""
    seqs = []
    for b, (n, table) in enumerate(zip(lengths, tables)):
        seq = Sequence([100 * (b + 1) + p for p in range(n)], SamplingParams())
        seq.block_table, seq.num_cached_tokens = list(table), n - 1
        seqs.append(seq)
    return prepare_decode(seqs, BLOCK_SIZE, "cpu")


def tensors(step: StepInputs) -> dict[str, torch.Tensor]:
    """Every tensor a decode graph reads, by name."""
    md = step.metadata
    names = ("cu_seqlens_q", "cu_seqlens_k", "slot_mapping", "context_lens", "block_tables")
    return {
        "input_ids": step.input_ids,
        "positions": step.positions,
        **{name: getattr(md, name) for name in names},
    }


def as_lists(step: StepInputs) -> dict[str, list]:
    return {name: t.tolist() for name, t in tensors(step).items()}


# ---- task 1: the buckets, and the one a batch replays ----


@pytest.mark.parametrize(
    ("max_num_seqs", "buckets"),
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 3]),
        (5, [1, 2, 4, 5]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 9]),
        (16, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 20]),  # off the 16-grid: the largest is still max_num_seqs
        (40, [1, 2, 4, 8, 16, 32, 40]),
        (48, [1, 2, 4, 8, 16, 32, 48]),
        (100, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]),
        (256, [1, 2, 4, 8, *range(16, 257, 16)]),
    ],
)
def test_task_1_buckets_are_1_2_4_8_then_steps_of_16_up_to_max_num_seqs(
    impl, max_num_seqs, buckets
):
    got = impl.graph_buckets(max_num_seqs)
    assert got == buckets, f"max_num_seqs {max_num_seqs}: buckets {got}, want {buckets}"


def test_task_1_a_batch_replays_the_smallest_bucket_that_holds_it(impl):
    buckets = [1, 2, 4, 8, 16, 20]
    for batch_size in range(1, 21):
        want = min(b for b in buckets if b >= batch_size)
        got = impl.bucket_for(batch_size, buckets)
        assert got == want, f"a batch of {batch_size} with buckets {buckets}: {got}, want {want}"


def test_task_1_a_batch_above_the_largest_bucket_has_none_and_runs_eagerly(impl):
    for batch_size in (21, 22, 300):
        got = impl.bucket_for(batch_size, [1, 2, 4, 8, 16, 20])
        assert got is None, f"a batch of {batch_size} fits no bucket, got {got}"


def test_task_1_bucket_for_picks_from_the_buckets_it_is_given(impl):
    got = [impl.bucket_for(n, [3, 10]) for n in (1, 3, 4, 10, 11)]
    assert got == [3, 3, 10, 10, None], (
        f"with buckets [3, 10], batches 1, 3, 4, 10, 11 got {got}: the smallest bucket that "
        "holds the batch, None above the largest"
    )


@pytest.fixture(autouse=True)
def unwritten_memory_is_poison(request):
    """Tasks 2 and 3: torch.empty returns poison, so what no one writes is wrong on every run."""
    if not request.node.name.startswith(("test_task_2_", "test_task_3_")):
        yield
        return
    with empty_is_poison():
        yield


# ---- task 2: padding a decode step to a bucket and the static table width ----


def test_task_2_real_rows_come_first_unchanged(impl):
    step = decode_step()
    padded = as_lists(impl.pad_decode(step, 4, 6))
    for name, want in as_lists(step).items():
        if name in ("cu_seqlens_q", "cu_seqlens_k"):
            got = padded[name][: len(want)]
        elif name == "block_tables":
            got = [row[:3] for row in padded[name][:3]]
        else:
            got = padded[name][:3]
        assert got == want, f"{name}: the real rows changed: {got}, want {want}"


def test_task_2_padding_rows_feed_token_0_at_position_0(impl):
    padded = impl.pad_decode(decode_step(), 4, 6)
    assert padded.input_ids.tolist() == [104, 208, 311, 0], (
        f"input_ids {padded.input_ids.tolist()}: the padding row feeds token 0"
    )
    assert padded.positions.tolist() == [4, 8, 11, 0], (
        f"positions {padded.positions.tolist()}: the padding row sits at position 0"
    )


def test_task_2_padding_rows_write_to_slot_minus_1_and_read_context_0(impl):
    md = impl.pad_decode(decode_step(), 5, 6).metadata
    # slots: 1 * 4 + 0, 4 * 4 + 0, 6 * 4 + 3; a padding row must not write over a real slot
    assert md.slot_mapping.tolist() == [4, 16, 27, -1, -1], "padding rows write to slot -1"
    assert md.context_lens.tolist() == [5, 9, 12, 0, 0], "padding rows read context length 0"


def test_task_2_every_table_is_widened_with_minus_1_to_the_static_width(impl):
    md = impl.pad_decode(decode_step(), 4, 6).metadata
    want = [
        [3, 1, -1, -1, -1, -1],
        [0, 2, 4, -1, -1, -1],
        [7, 5, 6, -1, -1, -1],
        [-1, -1, -1, -1, -1, -1],
    ]
    got = md.block_tables.tolist()
    assert got == want, f"block_tables {got}: each row widened to 6 with -1, a padding row all -1"


def test_task_2_cu_seqlens_give_every_row_one_query_and_padding_no_context(impl):
    md = impl.pad_decode(decode_step(), 5, 6).metadata
    assert md.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4, 5], "every row is one query token"
    assert md.cu_seqlens_k.tolist() == [0, 5, 14, 26, 26, 26], "padding rows add no context"


def test_task_2_the_real_sequences_are_still_the_ones_counted(impl):
    # the runner samples metadata.num_seqs rows: the host copies hold only the real sequences
    step = decode_step()
    md = impl.pad_decode(step, 8, 6).metadata
    assert md.num_seqs == 3, f"num_seqs {md.num_seqs}: the padding rows are not sequences"
    assert md.host == step.metadata.host, "the host copies must stay the real sequences' lists"
    assert md.is_prefill is False, f"is_prefill is {md.is_prefill!r}: a padded step is a decode"


def test_task_2_every_tensor_keeps_its_dtype(impl):
    step = decode_step()
    padded = tensors(impl.pad_decode(step, 4, 6))
    for name, want in tensors(step).items():
        got = padded[name].dtype
        assert got == want.dtype, f"{name}: {got}, not {want.dtype}"


def test_task_2_a_step_already_at_its_bucket_and_width_is_unchanged(impl):
    step = decode_step()
    got = as_lists(impl.pad_decode(step, 3, 3))
    changed = [name for name, want in as_lists(step).items() if got.get(name) != want]
    assert got == as_lists(step), f"padding to its own size and width changed {changed}"


def test_task_2_at_the_table_width_edge_the_last_tokens_block_fills_the_row(impl):
    # max_model_len 13 at block_size 4: the 13th token opens a 4th block, so the width is 4
    width = table_width(13, BLOCK_SIZE)
    step = decode_step((12, 13), ([7, 5, 6], [0, 2, 4, 1]))
    md = impl.pad_decode(step, 4, width).metadata
    got = md.block_tables.tolist()
    assert got == [[7, 5, 6, -1], [0, 2, 4, 1], [-1] * 4, [-1] * 4], (
        f"block_tables {got} at width {width}: the 13-token sequence's 4 blocks fill its row"
    )
    slots = md.slot_mapping.tolist()
    assert slots == [27, 4, -1, -1], f"slot_mapping {slots}: 6 * 4 + 3, then 1 * 4 + 0"


@pytest.mark.parametrize(("batch_size", "width"), [(2, 6), (4, 2)], ids=["rows", "columns"])
def test_task_2_a_step_too_large_for_the_bucket_or_the_width_is_refused(impl, batch_size, width):
    # cutting it would drop a sequence, or blocks of its history, without a word
    with pytest.raises(ValueError):
        impl.pad_decode(decode_step(), batch_size, width)


# ---- task 3: copying a padded step into the static buffers, in place ----


def test_task_3_the_step_lands_in_the_views_a_graph_captured_before_it(impl):
    static = static_decode_inputs(8, 6, "cpu")
    captured = view_rows(static, 4)  # what the graph of bucket 4 reads: views, taken at capture
    addresses = {name: t.data_ptr() for name, t in tensors(static).items()}
    step = reference_pad_decode(decode_step(), 4, 6)
    impl.fill_static(static, step)
    for name, want in as_lists(step).items():
        got = tensors(captured)[name].tolist()
        assert got == want, f"{name}: the static buffer holds {got}, the step {want}"
    moved = [n for n, t in tensors(static).items() if t.data_ptr() != addresses[n]]
    assert not moved, f"{moved} now point at other memory: copy into the buffers, never rebind"


def test_task_3_rows_past_the_bucket_stay_padding(impl):
    static = static_decode_inputs(8, 6, "cpu")
    impl.fill_static(static, reference_pad_decode(decode_step(), 4, 6))
    md = static.metadata
    assert md.slot_mapping[4:].tolist() == [-1] * 4, "rows 4..7 must not write anywhere"
    assert md.context_lens[4:].tolist() == [0] * 4, "rows 4..7 must read nothing"
    assert md.block_tables[4:].tolist() == [[-1] * 6] * 4, "rows 4..7's tables must stay -1"


def test_task_3_a_smaller_batch_replaces_the_last_steps_rows_with_padding(impl):
    # a finished sequence's row must not stay in the buffers: it would write its K/V again
    static = static_decode_inputs(4, 6, "cpu")
    four = decode_step((5, 9, 12, 7), (*TABLES, [8, 9]))
    impl.fill_static(static, reference_pad_decode(four, 4, 6))
    three = decode_step((6, 10, 13), ([3, 1], [0, 2, 4], [7, 5, 6, 10]))
    impl.fill_static(static, reference_pad_decode(three, 4, 6))
    md = static.metadata
    assert static.input_ids.tolist() == [105, 209, 312, 0], (
        f"input_ids {static.input_ids.tolist()}: row 3 is padding now, token 0"
    )
    assert md.slot_mapping.tolist() == [5, 17, 40, -1], "row 3 is padding now: slot -1"
    assert md.context_lens.tolist() == [6, 10, 13, 0], "row 3 is padding now: context 0"
    got = md.block_tables.tolist()[2:]
    assert got == [[7, 5, 6, 10, -1, -1], [-1] * 6], f"rows 2, 3 of block_tables: {got}"


def test_task_3_the_buffers_hold_copies_not_the_steps_tensors(impl):
    static = static_decode_inputs(4, 6, "cpu")
    step = reference_pad_decode(decode_step(), 4, 6)
    impl.fill_static(static, step)
    step.metadata.slot_mapping.fill_(99)  # the next step's tensors are new; this one may change
    step.input_ids.fill_(99)
    slots, ids = static.metadata.slot_mapping.tolist(), static.input_ids.tolist()
    assert slots == [4, 16, 27, -1] and ids == [104, 208, 311, 0], (
        f"the buffers changed with the step's tensors (slots {slots}, input_ids {ids}): "
        "fill_static must copy values in, not keep the step's tensors"
    )


# ---- tasks 4-5: the engine replays decode steps through your pieces ----

MAX_MODEL_LEN, MAX_NUM_SEQS = 32, 12  # buckets 1, 2, 4, 8, 12; tables of 8 blocks of 4
PROMPT_LENGTHS = (1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24)  # around block edges of 4
ENGINE = dict(
    dtype="float64",
    block_size=BLOCK_SIZE,
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=MAX_NUM_SEQS,
    num_kv_blocks=128,
)


def requests():
    """Twelve prompts that each run to exactly max_model_len tokens, so every table reaches the
    full width, and finish at twelve different steps: batch sizes 12, 11, ..., 1."""
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    params = [SamplingParams(max_tokens=MAX_MODEL_LEN - n, ignore_eos=True) for n in PROMPT_LENGTHS]
    return prompts, params


def greedy(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(*requests(), use_tqdm=False)]


@pytest.fixture
def your_pieces(impl, monkeypatch):
    """DecodeGraphs, the engine's graph runner, calls your four functions from here on."""
    for name in API:
        monkeypatch.setattr(cuda_graphs, name, getattr(impl, name))


def replaying_engine(folder, device: str, capture) -> tuple[LLM, list[int]]:
    """A stage 08 engine whose decode steps replay graphs that capture(graphs) records, and the
    list of batch sizes it replays. enforce_eager keeps stage 08 from capturing its own."""
    options = dict(attention_backend="triton") if device == "cuda" else {}
    llm = LLM(folder, stage=8, device=device, enforce_eager=True, **ENGINE, **options)
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model,
        runner.attention,
        MAX_NUM_SEQS,
        table_width(MAX_MODEL_LEN, BLOCK_SIZE),
        runner.device,
    )
    capture(graphs)
    replayed, replay = [], graphs.replay
    graphs.replay = lambda step: replayed.append(step.metadata.num_seqs) or replay(step)
    runner.graphs = graphs
    return llm, replayed


@torch.inference_mode()
def capture_reruns(graphs: DecodeGraphs) -> None:
    for bucket in graphs.buckets:
        graphs.graphs[bucket] = RerunGraph(graphs, bucket)


def replay_message(got: list[list[int]], eager: list[list[int]]) -> str:
    """Which requests' replayed tokens differ from the eager engine's, and where."""
    for i, (mine, want) in enumerate(zip(got, eager)):
        if mine != want:
            at = next((j for j, (a, b) in enumerate(zip(mine, want)) if a != b), None)
            where = f"from token {at}" if at is not None else "in length"
            return f"request {i} differs {where}: replayed {mine}, eager {want}"
    return f"{len(got)} outputs for {len(eager)} requests"


def test_task_4_the_engine_replays_through_your_pieces_and_gives_the_eager_tokens(
    impl, your_pieces, tiny_llama_folder
):
    eager = greedy(LLM(tiny_llama_folder, stage=8, device="cpu", **ENGINE))
    llm, replayed = replaying_engine(tiny_llama_folder, "cpu", capture_reruns)
    got = greedy(llm)
    assert got == eager, replay_message(got, eager)
    assert sorted(set(replayed)) == list(range(1, MAX_NUM_SEQS + 1)), "every decode step replays"


@pytest.mark.gpu
def test_task_5_on_a_gpu_captured_graphs_replay_the_eager_tokens(
    impl, your_pieces, tiny_llama_folder
):
    eager = greedy(
        LLM(
            tiny_llama_folder,
            stage=8,
            device="cuda",
            enforce_eager=True,
            attention_backend="triton",
            **ENGINE,
        )
    )
    llm, replayed = replaying_engine(tiny_llama_folder, "cuda", DecodeGraphs.capture)
    got = greedy(llm)
    assert got == eager, replay_message(got, eager)
    assert sorted(set(replayed)) == list(range(1, MAX_NUM_SEQS + 1)), "every decode step replays"
