"""Stage 05's graded contract: your Triton store_kvcache writes exactly the bytes stage 04's torch
scatter writes, on its own and inside the engine.

Run against any implementation with `pytest stages/05_triton_store --impl ref|starter|yours.py`.
Without a GPU the kernel runs through Triton's interpreter (the repository's conftest.py sets
TRITON_INTERPRET=1). Tasks 1 to 4 fill a two-layer pool with random values, write layer 1 with
your store and with stage 04's scatter on identical copies and compare every byte of both pools,
so a write to the wrong slot, a lane past the row or a padding row's write shows up; under the
interpreter every load and store lane must also fall inside a tensor the kernel was given. Task 5
plugs your function into the reference engine
(`LLM(stage=5, attention_backend="triton", components=...)`).
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernel_memory import strays_message, watch_memory
from nanoserve.kernels.torch_paged import (
    store_kvcache as torch_store,  # stage 04's scatter: the oracle
)

pytest.importorskip("triton", reason="stage 05 needs triton (pip install triton)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU: the interpreter


def random_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """A [2, L=2, N, block_size, H_kv, D] pool full of random values, so any stray write shows."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equality of two pools (a NaN or a -0.0 must match too), naming what differs."""
    for kv, layer in ((0, 0), (0, 1), (1, 0), (1, 1)):
        got_bytes = got[kv, layer].flatten(0, 1).view(torch.uint8).flatten(1)
        want_bytes = want[kv, layer].flatten(0, 1).view(torch.uint8).flatten(1)
        differs = (got_bytes != want_bytes).any(1).nonzero().flatten().tolist()
        hint = ""
        if layer == 0 and differs and differs[-1] == got.shape[2] * got.shape[3] - 1:
            hint = " (layer 0's last slot, just before layer 1's: a slot of -1 used as an address?)"
        assert not differs, (
            f"{'kv'[kv]}_cache of layer {layer}: slots {differs[:8]} differ from stage 04's "
            f"scatter{hint}"
        )


def check_store(impl, key, value, slot_mapping, num_blocks=6, block_size=4):
    """Your store and the torch scatter write layer 1 of identical random pools; every byte of
    both pools (layer 0 included: a write before layer 1's first slot lands there) must agree."""
    want = random_pool(num_blocks, block_size, key.shape[1], key.shape[2], key.dtype)
    got = want.to(DEVICE, copy=True)  # a copy on a CPU too
    torch_store(key.cpu(), value.cpu(), want[0, 1], want[1, 1], slot_mapping)
    k_cache, v_cache, slots = got[0, 1], got[1, 1], slot_mapping.to(DEVICE)
    with watch_memory() as strays:  # under the interpreter: every lane inside some argument
        result = impl.store_kvcache(key, value, k_cache, v_cache, slots)
    if strays:
        tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache}
        advice = (
            "A padding row (slot -1) must store nothing (return early, or mask its stores), "
            "and every load and store of a row needs the mask offs < H_kv * D"
        )
        raise AssertionError(strays_message(strays, {**tensors, "slot_mapping": slots}, advice))
    assert result is None, "store_kvcache writes into the caches it is given and returns nothing"
    assert_same_bytes(got.cpu(), want)


def new_kv(num_tokens, num_kv_heads, head_dim, dtype=torch.float32, seed=1):
    """key, value (T, H_kv, D), contiguous, on the device."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_kv_heads, head_dim)
    return tuple(
        torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype) for _ in "kv"
    )


def fused_kv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=2):
    """key, value (T, H_kv, D) as views of one fused QKV output (T, (H + 2 H_kv) * D): each
    token's row is (H + 2 H_kv) * D values apart, not H_kv * D."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    kv = qkv[:, num_heads * head_dim :].view(num_tokens, 2 * num_kv_heads, head_dim)
    return kv[:, :num_kv_heads], kv[:, num_kv_heads:]


# ---- task 1: one program per token ----


def test_task_1_each_token_lands_in_the_block_and_offset_of_its_slot(impl):
    key, value = new_kv(5, 2, 16)  # rows of 2 x 16 = 32 values: a power of two
    check_store(impl, key, value, torch.tensor([0, 6, 7, 23, 13]))  # 23: the last slot


def test_task_1_a_prefill_of_consecutive_slots_across_a_block_boundary(impl):
    key, value = new_kv(7, 2, 16, seed=3)
    check_store(impl, key, value, torch.arange(2, 9))  # slots 2..8: blocks 0, 1 and 2


# ---- task 2: padding rows own no slot ----


def test_task_2_slot_minus_one_writes_nothing(impl):
    key, value = new_kv(4, 2, 16, seed=4)
    check_store(impl, key, value, torch.tensor([-1, 9, -1, 3]))  # -1 must not hit layer 0


def test_task_2_a_batch_of_only_padding_rows_leaves_the_pool_untouched(impl):
    key, value = new_kv(3, 2, 16, seed=5)
    check_store(impl, key, value, torch.full((3,), -1))


# ---- task 3: rows that are not a power of two ----


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim"),
    [(3, 64), (1, 24), (5, 8)],  # 192 (SmolLM2), 24, 40 values a token
    ids=["smollm2-3x64", "1x24", "5x8"],
)
def test_task_3_masked_lanes_touch_no_neighbouring_slot(impl, num_kv_heads, head_dim):
    key, value = new_kv(4, num_kv_heads, head_dim, seed=6)
    check_store(impl, key, value, torch.tensor([6, 5, 12, 0]))  # 5 and 6: neighbours


# ---- task 4: strided inputs, any float dtype, int32 or int64 slots ----


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=dtype_id)
def test_task_4_strided_views_of_a_fused_qkv_output_are_copied_bit_for_bit(impl, dtype, slot_dtype):
    key, value = fused_kv(6, 9, 3, 64, dtype)  # SmolLM2's heads: 9 query, 3 KV, D 64
    assert not key.is_contiguous() and key.stride(0) == 15 * 64, "the test's view is not strided"
    check_store(impl, key, value, torch.tensor([5, -1, 0, 13, -1, 7], dtype=slot_dtype))


def test_task_4_key_and_value_are_each_read_by_their_own_strides(impl):
    key, _ = fused_kv(5, 9, 3, 64, torch.float32)  # rows 960 values apart, heads 64 apart
    gen = torch.Generator().manual_seed(7)
    padded = torch.randn(5, 3, 72, generator=gen, dtype=torch.float64).to(DEVICE, torch.float32)
    value = padded[..., :64]  # heads 72 values apart, rows 216: another layout than key's
    assert (key.stride(), value.stride()) == ((960, 64, 1), (216, 72, 1))
    check_store(impl, key, value, torch.tensor([3, 8, -1, 0, 17]))


# ---- task 5: the engine writes its pool with your kernel ----

PROMPT_LENS = (3, 5, 9)  # below, at and past block boundaries of block_size 4
ENGINE = dict(device=DEVICE.type, dtype="float64", block_size=4, max_model_len=64, num_kv_blocks=32)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def run(llm: LLM, prompts) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens, and the pool tensor as the run left it."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, llm.engine.runner.cache.kv.cpu()


@pytest.fixture(scope="module")
def stage_04_run(tiny_llama_folder, prompts):
    return run(LLM(tiny_llama_folder, stage=4, **ENGINE), prompts)


def test_task_5_the_engine_on_your_store_gives_stage_04_tokens_and_pool_bytes(
    impl, tiny_llama_folder, prompts, stage_04_run
):
    llm = LLM(
        tiny_llama_folder,
        stage=5,
        attention_backend="triton",
        components={"store_kvcache": impl.store_kvcache},
        **ENGINE,
    )
    tokens, pool = run(llm, prompts)
    want_tokens, want_pool = stage_04_run
    for i, (mine, want) in enumerate(zip(tokens, want_tokens)):
        assert mine == want, f"request {i} generated {mine} on your store; stage 04 gave {want}"
    assert tokens == want_tokens, f"{len(tokens)} outputs for {len(want_tokens)} requests"
    assert pool.shape == want_pool.shape, f"pool {tuple(pool.shape)}, stage 04's {want_pool.shape}"
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8)), "pool bytes differ"
