"""GPU runs of the engine, checked with the rule the large engines use when arithmetic changes.

bf16 (or float32 with other kernels) on a GPU does not reproduce the CPU's bits, so tokens must be
identical up to the first divergence, and there each side's token must be in the other side's
top-5. Stage 06's Triton kernels meet that rule against stage 04 (tiny checkpoints, Qwen3-0.6B's
shape with random weights, a forced-preemption run), and their logits stay within a tolerance of
the torch reference's. These tests carry the `gpu` marker and skip, with that reason, where no
CUDA GPU exists.
"""

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.torch_paged import TorchPagedAttention
from nanoserve.testing import next_token_logits

from .test_equivalence import step_logits

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


# ---- stage 06: the Triton kernels on CUDA ----


def tiny_prompts(prompts) -> list[list[int]]:
    return [[t % 256 for t in p] for p in prompts]


def test_auto_picks_the_triton_kernels_on_cuda_at_stages_5_and_6(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    for stage in (5, 6):
        llm = LLM(str(folder), stage=stage, device="cuda", num_kv_blocks=8)
        assert llm.engine.attention.name == "triton", stage


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_stage6_triton_on_cuda_matches_stage4_up_to_top5(
    tiny_checkpoints, prompts, dtype, block_size
):
    folder, _ = tiny_checkpoints["qwen3"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    options = dict(device="cuda", dtype=dtype, block_size=block_size, num_kv_blocks=64)
    ref = LLM(str(folder), stage=4, **options)
    got = LLM(str(folder), stage=6, attention_backend="triton", **options)
    prompts = tiny_prompts(prompts)
    for p, r, g in zip(prompts, ref.generate(prompts, params), got.generate(prompts, params)):
        assert_same_up_to_top5_divergence(ref, got, p, r.token_ids, g.token_ids)


def test_stage6_triton_with_forced_preemption_on_cuda_matches_stage4_up_to_top5(
    tiny_checkpoints, prompts
):
    folder, _ = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", block_size=16)
    ref = LLM(str(folder), stage=4, num_kv_blocks=64, **options)
    got = LLM(str(folder), stage=6, attention_backend="triton", num_kv_blocks=12, **options)
    prompts = tiny_prompts(prompts)  # the longest needs ceil((100 + 32) / 16) = 9 blocks
    for p, r, g in zip(prompts, ref.generate(prompts, params), got.generate(prompts, params)):
        assert_same_up_to_top5_divergence(ref, got, p, r.token_ids, g.token_ids)
    assert got.engine.scheduler.num_preemptions > 0, "the pool was meant to run dry"


def test_qwen3_shape_bf16_stage6_triton_matches_stage4_on_cuda_up_to_top5(prompts):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", max_model_len=512, num_kv_blocks=256)
    ref = LLM("qwen3-0.6b", stage=4, **options)
    got = LLM("qwen3-0.6b", stage=6, attention_backend="triton", **options)
    for p, r, g in zip(prompts, ref.generate(prompts, params), got.generate(prompts, params)):
        assert_same_up_to_top5_divergence(ref, got, p, r.token_ids, g.token_ids)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stage6_triton_logits_match_the_torch_reference_on_cuda(tiny_checkpoints, prompts, family):
    """float32: the kernels within 1e-3 of torch. bf16: their error against the float32 torch
    logits at most twice torch's own bf16 error (FlashAttention's rule), plus 1e-3 of the scale."""
    from nanoserve.kernels.triton_backend import TritonPagedAttention

    folder, _ = tiny_checkpoints[family]
    prompts = tiny_prompts(prompts)
    model = {
        d: LLM(str(folder), stage=4, device="cuda", dtype=d, num_kv_blocks=8).model
        for d in ("float32", "bfloat16")
    }
    want = step_logits(model["float32"], TorchPagedAttention, prompts, block_size=16)
    got = step_logits(model["float32"], TritonPagedAttention, prompts, block_size=16)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    torch_bf16 = step_logits(model["bfloat16"], TorchPagedAttention, prompts, block_size=16)
    triton_bf16 = step_logits(model["bfloat16"], TritonPagedAttention, prompts, block_size=16)
    torch_err = (torch_bf16 - want).abs().max().item()
    triton_err = (triton_bf16 - want).abs().max().item()
    assert triton_err <= 2 * torch_err + 1e-3 * want.abs().max().item(), (triton_err, torch_err)


def test_qwen3_shape_bf16_stage8_graphs_match_stage6_eager_on_cuda_up_to_top5(prompts):
    options = dict(dtype="bfloat16", max_num_seqs=16, num_kv_blocks=2048)
    ref = LLM("qwen3-0.6b", stage=6, **options)
    got = LLM("qwen3-0.6b", stage=8, **options)
    assert got.engine.runner.graphs is not None, "stage 8 on CUDA captures decode graphs"
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ids = [[(13 * i + 7 * j) % 10000 for j in range(20 + 9 * i)] for i in range(12)]
    ref_out = ref.generate(ids, params, use_tqdm=False)
    got_out = got.generate(ids, params, use_tqdm=False)
    for prompt, a, b in zip(ids, ref_out, got_out):
        assert_same_up_to_top5_divergence(ref, got, prompt, a.token_ids, b.token_ids)


def test_stage8_with_enforce_eager_captures_nothing(tiny_checkpoints):
    folder, _ = tiny_checkpoints["qwen3"]
    llm = LLM(str(folder), stage=8, device="cuda", num_kv_blocks=64, enforce_eager=True)
    assert llm.engine.runner.graphs is None


@pytest.mark.parametrize("stage", [7, 8])
def test_qwen3_shape_bf16_flash_attn_matches_triton_on_cuda_up_to_top5(prompts, stage):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (it is optional)")
    options = dict(dtype="bfloat16", max_num_seqs=16, max_model_len=1024, block_size=256)
    ref = LLM("qwen3-0.6b", stage=stage, attention_backend="triton", num_kv_blocks=64, **options)
    got = LLM(
        "qwen3-0.6b", stage=stage, attention_backend="flash_attn", num_kv_blocks=64, **options
    )
    assert got.engine.attention.name == "flash_attn"
    assert (got.engine.runner.graphs is not None) == (stage == 8)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ids = [[(13 * i + 7 * j) % 10000 for j in range(20 + 41 * i)] for i in range(12)]  # to 471
    ref_out = ref.generate(ids, params, use_tqdm=False)
    got_out = got.generate(ids, params, use_tqdm=False)
    for prompt, a, b in zip(ids, ref_out, got_out):
        assert_same_up_to_top5_divergence(ref, got, prompt, a.token_ids, b.token_ids)


# ---- stage 11: the overlap loop on the device ----


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_qwen3_shape_bf16_stage11_matches_stage9_on_cuda_up_to_top5(backend):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed (it is optional)")
    options = dict(dtype="bfloat16", max_num_seqs=16, max_model_len=1024, block_size=256)
    options.update(attention_backend=backend, num_kv_blocks=64)
    ref = LLM("qwen3-0.6b", stage=9, **options)
    got = LLM("qwen3-0.6b", stage=11, **options)
    assert got.engine.runner.graphs is not None, "stage 11 on CUDA replays decode graphs"
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [[(13 * i + 7 * j) % 10000 for j in range(20 + 41 * i)] for i in range(20)]
    ref_out = ref.generate(ids, params, use_tqdm=False)
    got_out = got.generate(ids, params, use_tqdm=False)
    for prompt, a, b in zip(ids, ref_out, got_out):
        assert len(b.token_ids) == 40
        assert_same_up_to_top5_divergence(ref, got, prompt, a.token_ids, b.token_ids)


def test_stage11_seeded_tokens_on_cuda_ignore_the_batch_around_them():
    llm = LLM("qwen3-0.6b", stage=11, dtype="float32", max_num_seqs=16, num_kv_blocks=256)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    prompt = [(7 * j) % 10000 for j in range(50)]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].token_ids
    crowd = [[(11 * i + j) % 10000 for j in range(10 + 9 * i)] for i in range(9)]
    batch, params = [*crowd[:4], prompt, *crowd[4:]], [other] * 4 + [seeded] + [other] * 5
    mixed = llm.generate(batch, params, use_tqdm=False)
    assert mixed[4].token_ids == alone


# ---- stage 12: speculative decoding on the device ----


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_qwen3_shape_bf16_stage12_matches_stage11_on_cuda_up_to_top5(method):
    options = dict(dtype="bfloat16", max_num_seqs=16, max_model_len=1024, block_size=256)
    options.update(attention_backend="triton", num_kv_blocks=64, num_speculative_tokens=3)
    ref = LLM("qwen3-0.6b", stage=11, **options)
    got = LLM("qwen3-0.6b", stage=12, speculative_method=method, draft_num_layers=8, **options)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [[(13 * i + 7 * (j % 17)) % 10000 for j in range(20 + 41 * i)] for i in range(20)]
    ref_out = ref.generate(ids, params, use_tqdm=False)
    got_out = got.generate(ids, params, use_tqdm=False)
    assert got.engine.speculation.num_proposed > 0
    for prompt, a, b in zip(ids, ref_out, got_out):
        assert len(b.token_ids) == 40
        assert_same_up_to_top5_divergence(ref, got, prompt, a.token_ids, b.token_ids)


# ---- stage 13: an e4m3 KV cache, its kernels compiled, its decode steps in CUDA graphs ----


def test_qwen3_shape_bf16_stage13_fp8_gives_stage11s_tokens_on_the_dequantized_values():
    """The compiled store kernel and the dequantizing reads, decode steps replayed from CUDA
    graphs, against stage 11 eager over a bf16 pool that holds the dequantized values (a graph
    pads the batch, which may change the decode kernel's split: equal up to a top-5 tie)."""
    from nanoserve.kernels.torch_fp8 import DequantizedStore

    options = dict(dtype="bfloat16", max_num_seqs=16, max_model_len=1024, block_size=256)
    options.update(attention_backend="triton", num_kv_blocks=64)
    ref = LLM("qwen3-0.6b", stage=11, enforce_eager=True, **options)
    ref.engine.runner.attention.store = DequantizedStore()  # a host loop: never in a graph
    got = LLM("qwen3-0.6b", stage=13, kv_cache_dtype="fp8", **options)
    assert got.engine.runner.graphs is not None
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [[(13 * i + 7 * (j % 17)) % 10000 for j in range(20 + 41 * i)] for i in range(12)]
    ref_out = ref.generate(ids, params, use_tqdm=False)
    got_out = got.generate(ids, params, use_tqdm=False)
    for prompt, a, b in zip(ids, ref_out, got_out):  # graphs pad the batch: top-5, as stage 08's
        assert_same_up_to_top5_divergence(ref, got, prompt, a.token_ids, b.token_ids)
