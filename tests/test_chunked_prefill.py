"""Chunked prefill: a prompt longer than the step's token budget is prefilled over several steps,
does not hold back shorter prompts behind it, and gives the tokens of a whole-prompt prefill."""

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager
from nanoserve.testing import ENGINE_MAX_MODEL_LEN

PROMPTS = [list(range(1, 4)), list(range(10, 70)), [5, 6], list(range(100, 117))]


def requests(seeded: bool):
    params = [
        SamplingParams(
            max_tokens=10 + i,
            ignore_eos=True,
            temperature=0.9 if seeded else 0.0,
            seed=7 + i if seeded else None,
        )
        for i in range(len(PROMPTS))
    ]
    return PROMPTS, params


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stage", [1, 4])
def test_chunked_prefill_gives_the_tokens_of_whole_prefills(tiny_checkpoints, stage, seeded):
    folder, _ = tiny_checkpoints["qwen3"]
    whole = LLM(
        str(folder),
        stage=stage,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=ENGINE_MAX_MODEL_LEN,
    )
    expected = [o.token_ids for o in whole.generate(*requests(seeded), use_tqdm=False)]
    chunked = LLM(
        str(folder),
        stage=stage,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=ENGINE_MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
    )
    assert [o.token_ids for o in chunked.generate(*requests(seeded), use_tqdm=False)] == expected


def test_a_long_prompt_is_split_across_steps_and_does_not_block_the_next(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    llm = LLM(
        str(folder),
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=ENGINE_MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    prefills = []
    llm.engine.on_step = lambda r: (
        r.batch.is_prefill and prefills.append(r.inputs.metadata.host.cu_seqlens_q)
    )
    llm.generate(
        [list(range(1, 4)), list(range(10, 70)), [5, 6]],
        SamplingParams(max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )
    assert prefills[0] == [0, 3, 16]  # the short prompt, then 13 of the long one's 60 tokens
    assert prefills[1] == [0, 16] and prefills[2] == [0, 16]  # the long one continues ...
    assert prefills[3] == [0, 15, 16]  # ... finishes; the third starts in the 1 token left


def test_chunked_prefill_with_a_prefix_cache_and_preemption_gives_the_same_tokens(
    tiny_checkpoints,
):
    folder, _ = tiny_checkpoints["llama"]
    system = list(range(40, 64))
    prompts = [[*system, 1], [*system, 2, 3], system, list(range(1, 40))]
    params = [SamplingParams(max_tokens=14, ignore_eos=True)] * len(prompts)
    plain = LLM(
        str(folder),
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=ENGINE_MAX_MODEL_LEN,
    )
    expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        str(folder),
        stage=4,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=ENGINE_MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        max_num_batched_tokens=12,
        num_kv_blocks=30,
        components={"BlockManager": PrefixBlockManager},
    )
    llm.engine.on_step = lambda record: llm.engine.manager.check_invariants()
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.manager.num_hit_tokens > 0
    assert llm.engine.manager.num_free_blocks == 30


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt():
    from nanoserve.config import EngineConfig

    with pytest.raises(ValueError, match="or enable_chunked_prefill"):
        EngineConfig(max_model_len=64, max_num_batched_tokens=16)
    assert EngineConfig(max_model_len=64, max_num_batched_tokens=16, enable_chunked_prefill=True)
