"""`--trace` shows each step's batch, block tables, slots and free blocks, from the live engine."""

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.loop.trace import format_step


def traced(llm: LLM, prompts, max_tokens: int) -> list[str]:
    """Generate greedily and return the --trace block of every step."""
    lines = []
    llm.engine.on_step = lambda record: lines.append(format_step(record, llm.engine.manager))
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return lines


@pytest.mark.parametrize("stage", [4, 11])  # stage 11 traces each step as it is launched
def test_trace_shows_prefill_then_decode_with_the_slots_written(tiny_checkpoints, stage):
    folder, _ = tiny_checkpoints["llama"]
    llm = LLM(
        str(folder),
        stage=stage,
        device="cpu",
        dtype="float64",
        block_size=4,
        num_kv_blocks=8,
        max_model_len=32,
    )
    prompt = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33]  # the seed's prompt A
    prefill, decode_12, decode_13 = traced(llm, [prompt], max_tokens=3)
    assert prefill.startswith("step 1 prefill  seqs 1  free blocks 5/8  preempted 0")
    assert "len 11  blocks [0, 1, 2]  slots [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]" in prefill
    assert "len 12  blocks [0, 1, 2]  slots [11]" in decode_12  # last offset of block 2
    assert "free blocks 4/8" in decode_13  # length 13 needs a fourth block ...
    assert "len 13  blocks [0, 1, 2, 3]  slots [12]" in decode_13  # ... whose first slot is 12


def test_trace_of_the_slab_engine_names_the_slab(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    llm = LLM(str(folder), stage=1, device="cpu", dtype="float64", num_slabs=2, max_model_len=32)
    lines = traced(llm, [[1, 2], [3]], max_tokens=2)
    assert "free slabs 0/2" in lines[0]
    assert "slab 0" in lines[0] and "slab 1" in lines[0]


def test_trace_of_the_block_table_engine_shows_tables_and_free_blocks(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    llm = LLM(
        str(folder),
        stage=3,
        device="cpu",
        dtype="float64",
        block_size=4,
        num_kv_blocks=8,
        max_model_len=32,
    )
    lines = traced(llm, [list(range(1, 12))], max_tokens=2)
    assert "free blocks 5/8" in lines[0] and "blocks [0, 1, 2]" in lines[0]
    assert "slots [11]" in lines[1]


def test_trace_marks_a_block_shared_by_two_sequences_with_its_holders(tiny_checkpoints):
    from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager

    folder, _ = tiny_checkpoints["llama"]
    llm = LLM(
        str(folder),
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=32,
        max_num_seqs=1,
        components={"BlockManager": PrefixBlockManager},
    )
    a = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33]  # the seed's prompts A and B
    b = [11, 12, 13, 14, 51, 52, 53, 54, 61, 62, 63, 64, 71]
    lines = traced(llm, [a, b], max_tokens=20)
    assert any("blocks [0(x2), 3, 4, 5]" in line for line in lines)


def test_the_trace_of_stage_12_shows_every_verdict_even_one_landing_with_no_step(tiny_checkpoints):
    # a verdict lands with the step after it, or with an empty plan that only lands the step
    # in flight (the engine's flush at the end, or a plan that must wait): shown there too
    import re

    folder, _ = tiny_checkpoints["llama"]
    options = dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=64)
    llm = LLM(str(folder), stage=12, speculative_method="ngram", num_speculative_tokens=3,
              max_model_len=128, **options)  # fmt: skip
    llm.engine.scheduler.speculation.backoff.MAX_WAIT = 1  # guess whenever a lookup finds one
    stretch = [3, 5, 7, 9, 11, 13]
    before = llm.engine.speculation
    blocks = traced(llm, [stretch * 4, stretch * 3], max_tokens=24)
    stats = llm.engine.speculation
    verdicts = [re.findall(r"verdict: seq \d+ guessed (\d+) kept (\d+)", b) for b in blocks]
    kept = sum(int(k) for found in verdicts for _, k in found)
    assert stats.num_accepted - before.num_accepted > 0, "the repeats keep some guesses"
    assert kept == stats.num_accepted - before.num_accepted, "every kept guess is traced"
    flushes = [b for b in blocks if b.startswith("after step")]
    assert any("verdict:" in b for b in flushes), "a verdict that lands with no step launched"
