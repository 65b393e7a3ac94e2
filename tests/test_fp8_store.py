"""Stage 13's Triton store against the torch store: the same e4m3 codes and exponents, bit for bit.

On a CPU the kernel runs through Triton's interpreter (the root conftest.py sets TRITON_INTERPRET=1
before any kernel module is imported), on tiny pools; with a GPU the same tests run compiled, and a
`gpu` test adds Qwen3-0.6B shapes. Every comparison checks the codes and the exponents of K and V:
a store whose codes match at a wrong exponent decodes to wrong values.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from nanoserve.cache.fp8_pool import E4M3_MAX, SMALLEST_EXPONENT
from nanoserve.kernels.torch_fp8 import store_kvcache_fp8 as torch_store_fp8

triton = pytest.importorskip("triton", reason="the Triton kernels need triton (pip install triton)")

import triton.language as tl  # noqa: E402

from nanoserve.kernels.e4m3 import bfloat16_of_float32, e4m3_to_float, e4m3_value  # noqa: E402
from nanoserve.kernels.store_fp8 import store_kvcache_fp8  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class Fp8Caches(NamedTuple):
    k_cache: torch.Tensor  # (num_blocks, block_size, H_kv, D) uint8 codes
    v_cache: torch.Tensor
    k_scales: torch.Tensor  # (num_blocks, H_kv) int32 exponents
    v_scales: torch.Tensor

    def store_with(self, store, key, value, slot_mapping) -> None:
        """Call a store_kvcache_fp8 (the kernel or torch's) on these caches."""
        k_cache, v_cache, k_scales, v_scales = self
        store(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)


def poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, seed=0) -> Fp8Caches:
    """Random finite codes (never 0x7F/0xFF, e4m3's NaNs: a store writes none) and exponents, as
    a pool holds after earlier requests: what a sequence finds in a partly filled block."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    codes = [torch.randint(0, 0x7F, shape, generator=gen) for _ in range(2)]
    codes = [c | (torch.randint(0, 2, shape, generator=gen) << 7) for c in codes]  # the sign
    exps = [torch.randint(-70, 10, (num_blocks, num_kv_heads), generator=gen) for _ in range(2)]
    exps = [e.clamp(min=SMALLEST_EXPONENT) for e in exps]
    tensors = [c.to(torch.uint8) for c in codes] + [e.to(torch.int32) for e in exps]
    return Fp8Caches(*(t.to(DEVICE) for t in tensors))


def store_both(key, value, caches: Fp8Caches, slot_mapping) -> Fp8Caches:
    """Store with the kernel into caches (in place) and with torch into a copy; assert that the
    codes and exponents are bitwise equal. Returns the caches as torch left them."""
    slot_mapping = slot_mapping.to(DEVICE)  # with a GPU: beside the caches, as the engine's are
    want = Fp8Caches(*(c.clone() for c in caches))
    want.store_with(torch_store_fp8, key, value, slot_mapping)
    caches.store_with(store_kvcache_fp8, key, value, slot_mapping)
    for name, got, wanted in zip(Fp8Caches._fields, caches, want):
        where = (got != wanted).nonzero()[:4].tolist()
        assert torch.equal(got, wanted), f"{name} differs from torch's at {where}"
    return want


def strided_kv(values: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value (T, H_kv, D) holding values (2, T, H_kv, D), as strided views: key a slice of a
    fused QKV output (rows wider than H_kv * D), value with its head and dim strides swapped."""
    _, num_tokens, num_kv_heads, head_dim = values.shape
    fused = torch.zeros(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    fused[:, num_kv_heads : 2 * num_kv_heads] = values[0].to(DEVICE, dtype)
    value = values[1].transpose(1, 2).contiguous().transpose(1, 2).to(DEVICE, dtype)
    return fused[:, num_kv_heads : 2 * num_kv_heads], value


class Sequences:
    """Sequences on shuffled blocks of one pool, each already holding `held` tokens (codes the
    pool's poison gives them); a step appends tokens to some and returns the slot_mapping."""

    def __init__(self, held, block_size, blocks_each, gen):
        order = torch.randperm(len(held) * blocks_each, generator=gen).tolist()
        self.tables = [order[i * blocks_each : (i + 1) * blocks_each] for i in range(len(held))]
        self.lens, self.block_size = list(held), block_size

    def step(self, num_new) -> torch.Tensor:
        """Slots of num_new[i] new tokens of sequence i, in order; -1 rows after every odd
        sequence and two at the end (a CUDA graph's padding)."""
        slots = []
        for i, n in enumerate(num_new):
            positions = range(self.lens[i], self.lens[i] + n)
            bs = self.block_size
            slots += [self.tables[i][p // bs] * bs + p % bs for p in positions]
            slots += [-1] * (i % 2)
            self.lens[i] += n
        return torch.tensor([*slots, -1, -1], device=DEVICE)


def steps(block_size):
    """(new tokens of each sequence, log2 of the values' size) for four steps of four sequences
    that hold 0, bs/2 + 1, 2 bs - 1 and 1.5 bs tokens first."""
    bs = block_size
    return [
        ((bs + 3, bs // 2 + 2, 1, 0), 0),  # prompts: fresh blocks, a partly filled one; a decode
        ((1, 1, 1, 1), -3),  # decodes
        ((bs - 1, 0, 1, 2), 6),  # chunked prefill and decodes 64x larger: exponents grow
        ((1, 1, 0, 1), 0),
    ]


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype", "slot_dtype"),
    [
        (4, 3, 48, torch.float32, torch.int64),  # D not a power of two: masked lanes
        (16, 1, 64, torch.bfloat16, torch.int32),
        (64, 1, 8, torch.bfloat16, torch.int64),  # runs and older rows longer than CHUNK (16)
        (4, 1, 64, torch.float16, torch.int32),
        (16, 1, 8, torch.float64, torch.int64),
    ],
)
def test_store_matches_torch_bitwise_over_prefill_decode_and_chunked_steps(
    block_size, num_kv_heads, head_dim, dtype, slot_dtype
):
    gen = torch.Generator().manual_seed(block_size * num_kv_heads + head_dim)
    bs = block_size
    sequences = Sequences((0, bs // 2 + 1, 2 * bs - 1, bs + bs // 2), bs, blocks_each=4, gen=gen)
    caches = poisoned_caches(4 * 4, bs, num_kv_heads, head_dim, seed=block_size)
    for num_new, log2_size in steps(bs):
        slot_mapping = sequences.step(num_new).to(slot_dtype)
        num_tokens = len(slot_mapping)
        sizes = 2.0 ** torch.randint(-2, 3, (2, 1, num_kv_heads, 1), generator=gen)  # per head
        values = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=gen) * sizes
        caches = store_both(*strided_kv(values * 2.0**log2_size, dtype), caches, slot_mapping)


def test_a_run_that_grows_the_exponent_requantizes_the_older_codes():
    caches = poisoned_caches(2, 16, 2, 8)
    gen = torch.Generator().manual_seed(5)
    first = torch.rand(2, 10, 2, 8, generator=gen)  # amax < 1: exponent -8
    caches = store_both(*strided_kv(first, torch.float32), caches, torch.arange(16, 26))
    before = caches.k_cache[1, :10].clone()
    grown = torch.full((2, 1, 2, 8), 100.0)  # exponent -2: the older codes shrink 64x
    caches = store_both(*strided_kv(grown, torch.float32), caches, torch.tensor([26]))
    assert (caches.k_scales[1] == -2).all()
    assert not torch.equal(caches.k_cache[1, :10], before)


def test_a_run_ends_at_the_last_token_though_the_memory_after_it_goes_on():
    values = torch.randn(2, 8, 1, 8, generator=torch.Generator().manual_seed(6))
    key, value = strided_kv(values, torch.float32)
    slots = torch.arange(8, device=DEVICE)  # the batch is the first 5: slots 5.. are not its
    store_both(key[:5], value[:5], poisoned_caches(2, 8, 1, 8), slots[:5])


def test_one_token_runs_in_long_blocks_grow_the_exponent_as_a_decode_step_does():
    """A decode step's runs are one token each (the kernel builds them with one row): past
    the first CHUNK rows of 64-token blocks, growing the exponent and so requantizing 40 older
    rows; beside a run of 3, and with the batch's last token one of them."""
    gen = torch.Generator().manual_seed(7)
    caches = poisoned_caches(3, 64, 2, 8)
    first = torch.rand(2, 40, 2, 8, generator=gen)  # a prompt of 40 in block 1: exponent -8
    caches = store_both(*strided_kv(first, torch.float32), caches, torch.arange(64, 104))
    step = torch.randn(2, 5, 2, 8, generator=gen) * 100.0  # larger: the exponents grow
    slots = torch.tensor([17, 18, 19, 104, 130])  # a run of 3, then one token, then one token
    caches = store_both(*strided_kv(step, torch.float32), caches, slots)
    assert (caches.k_scales[1] > -8).all()


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 magnitude (0 .. 448), as float32."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def rounding_cases() -> torch.Tensor:
    """448 first (it pins the block's exponent at e), then each e4m3 magnitude, each midpoint of
    two neighbours (ties: subnormal and normal) and the float32 values next to it, both signs, and
    -0.0; (1024,) values a block of 16 tokens of 1 head of 64 dims holds."""
    codes = e4m3_values()
    midpoints = (codes[1:] + codes[:-1]) / 2
    beside = [torch.nextafter(midpoints, midpoints + s) for s in (-1.0, 1.0)]
    tiny = torch.tensor([2.0**-10, 2.0**-11, 1e-30, 0.0])  # 2**-10: the tie below 2**-9, to 0
    magnitudes = torch.cat([codes, midpoints, *beside, tiny])
    values = torch.cat([torch.tensor([E4M3_MAX]), magnitudes, -magnitudes])
    padding = torch.full((1024 - len(values),), -0.0)
    return torch.cat([values, padding])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_code_midpoint_and_neighbour_rounds_as_torch_at_several_exponents(dtype):
    exponents = [SMALLEST_EXPONENT, -20, 0, 7]
    blocks = [rounding_cases() * 2.0**e for e in exponents]  # one block of 16 x 64 each
    values = torch.stack(blocks).view(1, 4 * 16, 1, 64).expand(2, -1, -1, -1)
    caches = poisoned_caches(4, 16, 1, 64)
    caches = store_both(*strided_kv(values, dtype), caches, torch.arange(64, device=DEVICE))
    assert caches.k_scales.flatten().tolist() == exponents


def test_requantizing_every_code_down_by_one_to_four_powers_of_two_rounds_as_torch():
    codes = torch.cat([e4m3_values(), -e4m3_values()])  # 254 codes, in 4 rows of 64
    values = torch.zeros(2, 20, 1, 64)
    values[:, :16, 0] = torch.cat([codes, torch.zeros(2)]).view(4, 64).repeat(4, 1)
    for shift in range(1, 5):  # block `shift - 1`: rows 0..3 are the codes at exponent 0
        values[:, 16 + shift - 1, 0, 0] = E4M3_MAX * 2.0**shift  # its one new token
    # Two calls, as two engine steps: in one call two runs must not share a block (a GPU runs
    # their programs at once; the interpreter, one after the other, would hide the race).
    older = torch.tensor([*range(4), *range(8, 12), *range(16, 20), *range(24, 28)])
    caches = store_both(*strided_kv(values[:, :16], torch.float32), poisoned_caches(4, 8, 1, 64),
                        older)  # fmt: skip
    assert caches.k_scales.flatten().tolist() == [0, 0, 0, 0]
    new = torch.tensor([4, 12, 20, 28])
    caches = store_both(*strided_kv(values[:, 16:], torch.float32), caches, new)
    assert caches.k_scales.flatten().tolist() == [1, 2, 3, 4]


def test_zero_and_tiny_blocks_take_the_smallest_exponent_and_keep_the_sign_of_zero():
    values = torch.zeros(2, 8, 1, 8)
    values[:, :4, 0, ::2] = -0.0
    values[:, 4:, 0, 1] = 1e-30  # below 448 * 2**-64: still exponent -64
    slots = torch.arange(8, device=DEVICE)
    caches = store_both(*strided_kv(values, torch.float32), poisoned_caches(2, 4, 1, 8), slots)
    assert (caches.k_scales == SMALLEST_EXPONENT).all()
    zeros = caches.k_cache[0, :, 0]
    assert (zeros[:, ::2] == 0x80).all() and (zeros[:, 1::2] == 0).all()


def test_store_refuses_caches_that_are_not_uint8_codes():
    key = value = torch.zeros(2, 1, 8, device=DEVICE)
    caches = poisoned_caches(2, 4, 1, 8)
    floats = caches._replace(k_cache=caches.k_cache.float(), v_cache=caches.v_cache.float())
    with pytest.raises(ValueError, match="uint8"):
        floats.store_with(store_kvcache_fp8, key, value, torch.tensor([0, 1], device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_store_matches_torch_bitwise_on_qwen3_shapes(dtype):
    gen = torch.Generator().manual_seed(7)
    sequences = Sequences(torch.randint(0, 200, (64,), generator=gen).tolist(), 16, 32, gen)
    caches = poisoned_caches(64 * 32, 16, 8, 128)
    for num_new in ([100] * 16 + [1] * 48, [1] * 64, [7] * 64):
        slot_mapping = sequences.step(num_new)
        sizes = 2.0 ** torch.randint(-4, 5, (2, len(slot_mapping), 8, 1), generator=gen)
        values = torch.randn(2, len(slot_mapping), 8, 128, generator=gen) * sizes
        caches = store_both(*strided_kv(values.to(DEVICE), dtype), caches, slot_mapping)


@triton.jit
def _decode_to_bfloat16(codes_ptr, out_ptr, N: tl.constexpr, HARDWARE: tl.constexpr):
    offs = tl.arange(0, N)
    codes = tl.load(codes_ptr + offs)
    if HARDWARE:  # what the attention kernels run on a GPU with fp8 instructions
        values = e4m3_to_float(codes, tl.bfloat16, True)
    else:  # the same float32 -> bfloat16 step, the float32 decoded from the bits
        values = bfloat16_of_float32(e4m3_value(codes))
    tl.store(out_ptr + offs, values)


def decode_every_code_to_bfloat16(device, hardware: bool) -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.cat([codes, codes[:2]]).to(device)  # 256 entries, a power of two; no NaN
    out = torch.empty(256, dtype=torch.bfloat16, device=device)
    _decode_to_bfloat16[(1,)](codes, out, N=256, HARDWARE=hardware)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))  # 0x80 is -0.0: bits


def test_a_float32_holding_an_e4m3_value_gives_its_bfloat16_by_a_shift():
    """`bfloat16_of_float32` (the top 16 bits) on every finite e4m3 value: torch's bfloat16."""
    decode_every_code_to_bfloat16(DEVICE, hardware=False)


@pytest.mark.gpu
def test_gpu_converts_every_e4m3_code_to_torchs_bfloat16():
    """The hardware path the attention kernels take for a bfloat16 model, code by code."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from nanoserve.kernels.e4m3 import converts_fp8

    if not converts_fp8(torch.empty(0, device="cuda")):
        pytest.skip("this GPU has no fp8 conversion (compute capability below 8.9)")
    decode_every_code_to_bfloat16("cuda", hardware=True)
