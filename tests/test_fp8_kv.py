"""Stage 13's proof: an engine on an e4m3 KV pool gives stage 11's tokens when stage 11 stores
the very values the pool holds (`DequantizedStore`: quantize, then dequantize into a pool of the
model's dtype). The loss is thus confined to `quantize`; its size is bounded in
tests/test_fp8_loss.py. Also: the pool holds about twice the tokens, and the option's errors.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.cache.fp8_pool import Fp8KVPool
from nanoserve.cache.paged import PagedKVPool
from nanoserve.kernels.torch_fp8 import DequantizedStore

from .conftest import TINY_FAMILIES
from .test_equivalence import greedy_tokens, random_prompts
from .test_overlap import CHUNKED_PREFIX_OPTIONS, SHARED_PREFIXES

SMALL = dict(
    device="cpu", dtype="float64", max_model_len=128, max_num_seqs=6, block_size=4, num_kv_blocks=96
)


# Triton's kernels on CPU tensors run only through the interpreter, which conftest.py turns on
# where no GPU is visible; on a GPU machine the `gpu` tests below run the same checks compiled.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors through Triton's interpreter (off with a GPU: the gpu tests run compiled)",
)


def on_dequantized_values(llm: LLM) -> LLM:
    """Stage 11's engine, storing what an e4m3 pool would hold (its attention unchanged)."""
    attention = llm.engine.runner.attention
    attention.store = DequantizedStore()
    return llm


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_stage13_fp8_gives_stage11s_tokens_on_the_dequantized_values(tiny_checkpoints, family):
    folder, _ = tiny_checkpoints[family]
    prompts = random_prompts(256)[:6]
    oracle = on_dequantized_values(LLM(str(folder), stage=11, **SMALL))
    fp8 = LLM(str(folder), stage=13, kv_cache_dtype="fp8", **SMALL)
    assert isinstance(fp8.engine.runner.cache, Fp8KVPool)
    assert greedy_tokens(fp8, prompts, 24) == greedy_tokens(oracle, prompts, 24)
    assert fp8.engine.manager.num_free_blocks == fp8.engine.manager.num_blocks


def test_stage13_fp8_with_chunked_prefill_prefix_caching_and_guesses(tiny_checkpoints):
    """Blocks filled over several steps (a chunk, then decode; guesses rolled back) grow their
    exponents and requantize older codes: the oracle must follow every one of those writes."""
    folder, _ = tiny_checkpoints["llama"]
    options = dict(CHUNKED_PREFIX_OPTIONS, num_speculative_tokens=3)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    oracle = on_dequantized_values(LLM(str(folder), stage=11, **CHUNKED_PREFIX_OPTIONS))
    want = [o.token_ids for o in oracle.generate(SHARED_PREFIXES, params, use_tqdm=False)]
    fp8 = LLM(str(folder), stage=13, kv_cache_dtype="fp8", **options)
    got = [o.token_ids for o in fp8.generate(SHARED_PREFIXES, params, use_tqdm=False)]
    assert got == want
    assert fp8.engine.manager.num_hit_tokens > 0 and fp8.engine.speculation.num_proposed > 0


def test_stage13_fp8_sampling_with_a_seed_is_the_oracles(tiny_checkpoints):
    folder, _ = tiny_checkpoints["qwen3"]
    prompts = random_prompts(256)[4:8]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    oracle = on_dequantized_values(LLM(str(folder), stage=11, **SMALL))
    fp8 = LLM(str(folder), stage=13, kv_cache_dtype="fp8", **SMALL)
    want = [o.token_ids for o in oracle.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in fp8.generate(prompts, params, use_tqdm=False)] == want


@interpreted
@pytest.mark.slow  # the interpreter, or two processes: make test runs it, make check not
def test_stage13_fp8_triton_kernels_give_the_oracles_tokens(tiny_checkpoints):
    """The store kernel quantizes and the attention kernels dequantize in registers (here
    through Triton's interpreter): the same tokens as stage 11's kernels on the oracle's pool."""
    pytest.importorskip("triton")
    folder, _ = tiny_checkpoints["qwen3"]
    small = dict(SMALL, max_model_len=64, num_kv_blocks=64, attention_backend="triton")
    prompts = random_prompts(256)[2:5]
    oracle = on_dequantized_values(LLM(str(folder), stage=11, **small))
    fp8 = LLM(str(folder), stage=13, kv_cache_dtype="fp8", **small)
    assert greedy_tokens(fp8, prompts, 8) == greedy_tokens(oracle, prompts, 8)


def test_stage13_auto_is_stage12(tiny_checkpoints):
    """kv_cache_dtype="auto" (the default, as vLLM's) keeps the model's dtype: stage 12 exactly."""
    folder, _ = tiny_checkpoints["qwen2"]
    prompts = random_prompts(256)[:4]
    auto = LLM(str(folder), stage=13, **SMALL)
    assert type(auto.engine.runner.cache) is PagedKVPool
    assert greedy_tokens(auto, prompts, 12) == greedy_tokens(
        LLM(str(folder), stage=12, **SMALL), prompts, 12
    )


def test_the_fp8_pool_holds_about_twice_the_tokens_of_bfloat16(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    budget = dict(device="cpu", dtype="bfloat16", block_size=16, kv_cache_bytes=1 << 22)
    auto = LLM(str(folder), stage=13, **budget).engine.manager.num_blocks
    fp8 = LLM(str(folder), stage=13, kv_cache_dtype="fp8", **budget).engine.manager.num_blocks
    assert 1.9 <= fp8 / auto <= 2.0, (auto, fp8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": 13, "kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
        ({"stage": 12, "kv_cache_dtype": "fp8"}, "needs stage 13"),
    ],
)
def test_a_bad_kv_cache_dtype_names_the_argument(tiny_checkpoints, options, message):
    folder, _ = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **{**SMALL, **options})


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernels_read_an_e4m3_pool_as_the_dequantized_pool_bit_for_bit(dtype):
    """Prefill and split-K decode over e4m3 codes (decoded from their bits, times 2**e, in
    registers) give exactly what the same kernels give over the values `DequantizedStore` wrote:
    the two compute on the same numbers. Two sequences, tables out of order, a partial block."""
    pytest.importorskip("triton")
    read_e4m3_as_dequantized(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernels_convert_e4m3_in_hardware_as_the_bits_decode(dtype):
    """On a GPU with fp8 instructions the tile loader converts the codes in hardware
    (`e4m3_to_float`); the kernels still give, bit for bit, what they give over the dequantized
    values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from nanoserve.kernels.e4m3 import converts_fp8

    device = torch.device("cuda")
    if not converts_fp8(torch.empty(0, device=device)):
        pytest.skip("this GPU has no fp8 conversion (compute capability below 8.9)")
    read_e4m3_as_dequantized(dtype, device)


def read_e4m3_as_dequantized(dtype: torch.dtype, device) -> None:
    from nanoserve.kernels.paged_decode import FP8_DECODE_TILE, paged_attention_decode
    from nanoserve.kernels.paged_prefill import paged_attention_prefill
    from nanoserve.kernels.torch_fp8 import store_kvcache_fp8

    torch.manual_seed(0)
    pool = Fp8KVPool(16, 4, 1, 2, 16, dtype, device)
    (k_codes, v_codes), scales = pool.layer_caches(0), pool.layer_scales(0)
    k_values = torch.zeros(16, 4, 2, 16, dtype=dtype, device=device)
    v_values = torch.zeros_like(k_values)
    tables = torch.tensor([[3, 7, 1, -1], [5, 2, -1, -1]], dtype=torch.int32, device=device)
    lens = [10, 6]
    slots = torch.tensor(
        [int(tables[b, p // 4]) * 4 + p % 4 for b, n in enumerate(lens) for p in range(n)],
        device=device,
    )
    k = (torch.randn(sum(lens), 2, 16) * 3).to(device, dtype)
    v = torch.randn(sum(lens), 2, 16).to(device, dtype)
    store_kvcache_fp8(k, v, k_codes, v_codes, slots, **scales)
    DequantizedStore()(k, v, k_values, v_values, slots)
    q = torch.randn(sum(lens), 4, 16).to(device, dtype)
    cu = torch.tensor([0, 10, 16], dtype=torch.int32, device=device)
    context = torch.tensor(lens, dtype=torch.int32, device=device)
    got = paged_attention_prefill(q, k_codes, v_codes, cu, context, tables, 10, 0.25, **scales)
    want = paged_attention_prefill(q, k_values, v_values, cu, context, tables, 10, 0.25)
    assert torch.equal(got, want)
    q = q[[9, 15]]
    want = paged_attention_decode(q, k_values, v_values, context, tables, 0.25)
    assert torch.equal(
        paged_attention_decode(q, k_codes, v_codes, context, tables, 0.25, **scales), want
    )
    # a GPU decodes e4m3 codes in tiles of FP8_DECODE_TILE keys: one tile past every context
    tile = dict(block_n=FP8_DECODE_TILE, partition_size=FP8_DECODE_TILE)
    got = paged_attention_decode(q, k_codes, v_codes, context, tables, 0.25, **tile, **scales)
    assert torch.equal(got, want)


@pytest.mark.slow  # the interpreter, or two processes: make test runs it, make check not
def test_two_ranks_on_e4m3_pools_give_one_ranks_tokens(tmp_path):
    """Tensor parallelism splits the KV heads; a scale is per head, so each rank's pool holds
    the codes and exponents one rank's pool holds for those heads: the same tokens."""
    from nanoserve.testing import engine_requests

    from .test_tensor_parallel import CPU, GREEDY, tiny_sharded_model

    model = tiny_sharded_model(tmp_path, "qwen3", 300, 4, 2)
    prompts, _ = engine_requests(lengths=(5, 17, 33, 9), vocab_size=300)
    with LLM(model, stage=13, kv_cache_dtype="fp8", **CPU) as llm:
        want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model, stage=13, kv_cache_dtype="fp8", tensor_parallel_size=2, **CPU) as llm:
        assert isinstance(llm.engine.runner.cache, Fp8KVPool)
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
