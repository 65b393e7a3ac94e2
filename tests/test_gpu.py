"""GPU runs of the engine, checked with the rule the large engines use when arithmetic changes.

bf16 (or float32 with other kernels) on a GPU does not reproduce the CPU's bits, so tokens must be
identical up to the first divergence, and there each side's token must be in the other side's
top-5. These tests carry the `gpu` marker and skip, with that reason, where no CUDA GPU exists.
"""

import random

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.testing import next_token_logits

pytestmark = pytest.mark.gpu


def assert_same_up_to_top5_divergence(ref_llm, got_llm, prompt, ref_tokens, got_tokens):
    """Identical until they differ; at the first difference each token is in the other's top-5."""
    for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)):
        if a == b:
            continue
        prefix = prompt + ref_tokens[:i]
        ref_top5 = next_token_logits(ref_llm.model, prefix).topk(5).indices.tolist()
        got_top5 = next_token_logits(got_llm.model, prefix).topk(5).indices.tolist()
        assert b in ref_top5 and a in got_top5, (i, a, b, ref_top5, got_top5)
        return
    assert len(ref_tokens) == len(got_tokens)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(500) for _ in range(n)] for n in (3, 15, 16, 17, 40, 100)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stage4_on_cuda_matches_cpu_float64_up_to_top5(tiny_checkpoints, prompts, dtype):
    folder, _ = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = LLM(str(folder), stage=4, device="cpu", dtype="float64", block_size=16)
    got = LLM(str(folder), stage=4, device="cuda", dtype=dtype, block_size=16, num_kv_blocks=64)
    prompts = [[t % 256 for t in p] for p in prompts]
    for p, r, g in zip(prompts, ref.generate(prompts, params), got.generate(prompts, params)):
        assert_same_up_to_top5_divergence(ref, got, p, r.token_ids, g.token_ids)


def test_qwen3_shape_bf16_stage4_matches_stage1_on_cuda_up_to_top5(prompts):
    pytest.importorskip("nanoserve.models.presets")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", max_model_len=512, num_kv_blocks=256)
    ref = LLM("qwen3-0.6b", stage=1, num_slabs=8, **options)
    got = LLM("qwen3-0.6b", stage=4, **options)
    for p, r, g in zip(prompts, ref.generate(prompts, params), got.generate(prompts, params)):
        assert_same_up_to_top5_divergence(ref, got, p, r.token_ids, g.token_ids)
