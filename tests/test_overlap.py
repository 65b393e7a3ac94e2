"""Stage 11 on a CPU: the overlap loop gives stage 09's greedy tokens in every configuration the
engine has (three model families, chunked prefill, prefix caching, preemption, two ranks over
gloo), seeded tokens that ignore batch and chunking, and a persistent batch that mirrors the
managers' tables. Float64 tiny checkpoints: a different batch shape cannot flip a greedy token.
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
