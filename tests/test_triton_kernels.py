"""The Triton kernels of stages 05-06 against plain torch: store_kvcache and paged attention.

On a CPU the kernels run through Triton's interpreter (the root conftest.py sets TRITON_INTERPRET=1
before any kernel module is imported) on tiny shapes in float32/float64, whose tl.dot the
interpreter gets right. The graded files (stages/05_triton_store, stages/06_paged_attention) test
the same kernels on the seed's shapes; this file adds other head shapes and block sizes, argument
checks, the backend's refusals, and, marked `gpu`, Qwen3-0.6B shapes in bf16/fp16/fp32 on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from nanoserve import LLM
from nanoserve.kernels.backend import select_attention_backend

triton = pytest.importorskip("triton", reason="the Triton kernels need triton (pip install triton)")

from nanoserve.kernels.attention import attend  # noqa: E402
from nanoserve.kernels.paged_decode import (  # noqa: E402
    decode_partition_size,
    paged_attention_decode,
)
from nanoserve.kernels.paged_prefill import paged_attention_prefill  # noqa: E402
from nanoserve.kernels.store import store_kvcache  # noqa: E402

CPU = torch.device("cpu")
# The small cases run on the GPU where there is one (compiled), else through the interpreter.
DEVICE = torch.device("cuda") if torch.cuda.is_available() else CPU


class Heads(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int


TINY = Heads(4, 2, 16)  # GQA ratio 2
SMOLLM2 = Heads(9, 3, 64)  # ratio 3; H_kv * D = 192, not a power of two
QWEN3 = Heads(16, 8, 128)  # Qwen3-0.6B
# On a GPU Triton passes the softmax scale as a float32 scalar, so float64 there is only as
# exact as that rounding (~1e-7 relative); the interpreter keeps it in float64.
FLOAT64_TOL = 1e-12 if not torch.cuda.is_available() else 1e-5
TOLERANCE = {  # (atol, rtol) against a float64 torch reference
    torch.float64: (FLOAT64_TOL, FLOAT64_TOL),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (1.5e-2, 1e-2),
}


def torch_store(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The oracle: stage 04's scatter, slot -1 skipped."""
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = value[keep]


def fused_kv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, gen):
    """key, value (T, H_kv, D) as strided views of one fused QKV output, as the model makes them."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen, dtype=torch.float64).to(device, dtype)
    kv = qkv[:, num_heads * head_dim :].view(num_tokens, 2 * num_kv_heads, head_dim)
    return kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # stride(0) = width, not H_kv * D


class PagedBatch:
    """A pool poisoned with NaN, sequences on shuffled blocks, their K/V stored by the oracle."""

    def __init__(
        self, context_lens, heads: Heads, block_size, dtype, device=DEVICE, padding_rows=0
    ):
        self.gen = torch.Generator(device).manual_seed(0)
        num_heads, num_kv_heads, head_dim = heads
        self.num_heads, self.head_dim = num_heads, head_dim
        self.block_size, self.dtype = block_size, dtype
        self.context_lens = list(context_lens) + [0] * padding_rows  # padding rows own nothing
        self.lens = torch.tensor(self.context_lens, dtype=torch.int32, device=device)
        counts = [-(-n // block_size) for n in self.context_lens]
        num_blocks = sum(counts) + 3  # 3 spare blocks stay NaN: nobody may read them
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
        width = max(counts) + 1  # one extra -1 column, as a static buffer would have
        rows = [t + [-1] * (width - len(t)) for t in self.tables]
        self.block_tables = torch.tensor(rows, dtype=torch.int32, device=device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        for b in range(len(self.context_lens)):
            self._store_history(b)

    def _store_history(self, b):
        """Random K/V for all context_lens[b] positions of sequence b, stored by torch_store."""
        n, device = self.context_lens[b], self.k_cache.device
        positions = torch.arange(n, device=device)
        table = torch.tensor(self.tables[b], dtype=torch.long, device=device)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        k, v = (self._randn(n, *self.k_cache.shape[2:]) for _ in range(2))
        torch_store(k, v, self.k_cache, self.v_cache, slots)

    def _randn(self, *shape):
        out = torch.randn(shape, generator=self.gen, device=self.k_cache.device)
        return out.to(self.dtype)

    def queries(self, num_tokens):
        """(num_tokens, H, D) random queries in the pool's dtype."""
        return self._randn(num_tokens, self.num_heads, self.head_dim)

    def reference(self, q, b, num_q):
        """attend() of sequence b's last num_q queries, K/V gathered through its table, float64."""
        n = self.context_lens[b]
        table = torch.tensor(self.tables[b], dtype=torch.long, device=q.device)
        keys, values = (c[table].flatten(0, 1)[:n].double() for c in (self.k_cache, self.v_cache))
        return attend(q.double(), keys, values, self.head_dim**-0.5)


def assert_close(got, want, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# Stage 05: store_kvcache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_matches_torch_scatter_bitwise_with_strided_kv_and_skipped_slots(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    key, value = fused_kv(6, 9, 3, 64, dtype, DEVICE, gen)  # SmolLM2: H_kv * D = 192
    assert key.stride(0) != 3 * 64
    slot_mapping = torch.tensor([5, -1, 0, 13, -1, 7], dtype=slot_dtype, device=DEVICE)
    shape = (4, 4, 3, 64)  # 16 slots, block_size 4
    want_k = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    want_v = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    torch_store(key, value, want_k, want_v, slot_mapping)
    store_kvcache(key, value, got_k, got_v, slot_mapping)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))  # bits, not values
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def test_store_refuses_a_non_contiguous_cache():
    key = value = torch.zeros(2, 2, 16)
    pool = torch.zeros(2, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="contiguous"):
        store_kvcache(key, value, pool[:, 0], pool[:, 1], torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------
# Stage 06: prefill / extend
# ---------------------------------------------------------------------------------------------


def run_prefill(batch: PagedBatch, q_lens, **tiles):
    """Kernel output and float64 reference for the last q_lens[b] positions of each sequence."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = batch.queries(cu[-1])
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=q.device)
    caches = (batch.k_cache, batch.v_cache)
    metadata = (cu_seqlens_q, batch.lens, batch.block_tables, max(q_lens))
    got = paged_attention_prefill(q, *caches, *metadata, batch.head_dim**-0.5, **tiles)
    want = torch.cat([batch.reference(q[cu[b] : cu[b + 1]], b, n) for b, n in enumerate(q_lens)])
    return got, want


@pytest.mark.parametrize(
    ("heads", "block_size", "context_lens", "tile"),
    [
        (Heads(3, 3, 16), 1, [5, 1], 16),  # GQA ratio 1, one position per block
        (SMOLLM2, 4, [8, 12, 3], 16),  # ratio 3, lengths on block boundaries
        (Heads(4, 1, 32), 16, [16, 17], 16),  # ratio 4, one past a full block
        (Heads(4, 1, 128), 256, [260, 40], 64),  # head_dim 128, pages of 256
    ],
)
def test_prefill_of_whole_prompts_matches_causal_attention(heads, block_size, context_lens, tile):
    batch = PagedBatch(context_lens, heads, block_size, torch.float32)
    got, want = run_prefill(batch, context_lens, block_m=tile, block_n=tile)
    assert_close(got, want, torch.float32)


def test_prefill_longer_than_one_query_tile_and_one_key_tile():
    batch = PagedBatch([40, 21], Heads(2, 1, 16), block_size=4, dtype=torch.float32)
    got, want = run_prefill(batch, [35, 21], block_m=16, block_n=16)  # 3 and 2 query tiles
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 16), (16, 32)])
def test_prefill_splits_full_and_diagonal_key_tiles_on_any_prefix(block_m, block_n):
    # The cached prefixes put each query tile's first row at offsets 0, 1, 14 and 15 from a
    # 16-key boundary and 14, 15, 30 and 31 from a 32-key one: the unmasked full tiles end right
    # at the first row, one or two keys before it, or a whole tile before. The query tiles run
    # from the last; the 3-token prompt has fewer of them than the grid and returns early.
    q_lens = [20, 33, 3, 17, 40, 35, 18]
    prefix = [0, 1, 14, 15, 30, 31, 47]
    lens = [q + p for q, p in zip(q_lens, prefix)]
    batch = PagedBatch(lens, Heads(2, 1, 16), block_size=4, dtype=torch.float64)
    got, want = run_prefill(batch, q_lens, block_m=block_m, block_n=block_n)
    assert_close(got, want, torch.float64)


# ---------------------------------------------------------------------------------------------
# Stage 06: decode
# ---------------------------------------------------------------------------------------------


def run_decode(batch: PagedBatch, **launch):
    """Kernel output (B, H, D), its non-padding rows, and their float64 reference."""
    q = batch.queries(len(batch.context_lens))
    metadata = (batch.lens, batch.block_tables)
    got = paged_attention_decode(
        q, batch.k_cache, batch.v_cache, *metadata, batch.head_dim**-0.5, **launch
    )
    live = [b for b, n in enumerate(batch.context_lens) if n > 0]
    want = torch.cat([batch.reference(q[b : b + 1], b, 1) for b in live])
    return got, got[live], want


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_float64_across_block_sizes(block_size):
    batch = PagedBatch([1, 16, 23], TINY, block_size=block_size, dtype=torch.float64)
    _, got, want = run_decode(batch, partition_size=16, block_n=16)
    assert_close(got, want, torch.float64)


def test_decode_head_dim_128_over_pages_of_256_with_split_k():
    batch = PagedBatch([300, 256, 257], Heads(4, 1, 128), block_size=256, dtype=torch.float32)
    _, got, want = run_decode(batch, partition_size=128, block_n=64)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("partition_size", [16, 64])
def test_decode_padding_rows_give_zeros_and_poisoned_pages_stay_unread(partition_size):
    # Unused blocks, positions past each context_len and the whole pool outside the tables hold
    # NaN; rows with context_len 0 (a CUDA graph's padding) have tables of -1 only.
    batch = PagedBatch([5, 18], TINY, block_size=4, dtype=torch.float32, padding_rows=2)
    out, got, want = run_decode(batch, partition_size=partition_size, block_n=16)
    assert torch.isfinite(out).all()
    assert not out[2:].any()
    assert_close(got, want, torch.float32)


def test_decode_refuses_a_partition_that_is_not_whole_key_tiles():
    batch = PagedBatch([5], TINY, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of block_n"):
        run_decode(batch, partition_size=24, block_n=16)


def test_decode_partition_size_depends_only_on_static_shapes():
    small = decode_partition_size(batch=1, num_kv_heads=1, max_context_len=4096, device="cpu")
    large = decode_partition_size(batch=256, num_kv_heads=8, max_context_len=4096, device="cpu")
    assert 256 <= small < large == 4096  # a small batch is split; a large one is not


# ---------------------------------------------------------------------------------------------
# The backend: Triton on a CPU only through the interpreter; learner kernels only on Triton
# ---------------------------------------------------------------------------------------------


def test_the_triton_backend_on_a_cpu_asks_for_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_attention_backend("triton", CPU, ("triton", "torch"))


def test_a_bfloat16_engine_on_the_triton_interpreter_is_refused_naming_dtype(tiny_checkpoints):
    # the interpreter keeps bfloat16 as raw uint16 and tl.dot multiplies the bit patterns
    # (triton#11584): the engine generated one token over and over, with no error
    folder, _ = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match=r"dtype='bfloat16'.*interpreter.*float32"):
        LLM(str(folder), stage=6, device="cpu", dtype="bfloat16", attention_backend="triton")
    llm = LLM(str(folder), stage=6, device="cpu", dtype="float16", attention_backend="triton")
    assert llm.engine.attention.name == "triton", "float16 the interpreter computes right"


def test_auto_keeps_the_torch_path_on_a_cpu_at_the_kernel_stages():
    choice = select_attention_backend("auto", CPU, ("triton", "torch"))
    assert choice.name == "torch" and "cpu" in choice.reason


def test_a_kernel_component_on_the_torch_backend_is_refused(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match=r"run only on stage 5's 'triton' backend"):
        LLM(
            str(folder),
            stage=5,
            device="cpu",
            attention_backend="torch",
            components={"store_kvcache": store_kvcache},
        )


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes in bf16/fp16/fp32 at the tolerances the large engines use
# ---------------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def random_lens(count, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (count,), generator=gen).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_store_is_bitwise_torch_scatter(dtype):
    gen = torch.Generator(CUDA).manual_seed(3)
    key, value = fused_kv(4096, 16, 8, 128, dtype, CUDA, torch.Generator().manual_seed(3))
    slots = torch.randperm(2048 * 16, generator=gen, device=CUDA)[:4096]
    slots[::7] = -1  # padding rows
    want_k = torch.randn(2048, 16, 8, 128, generator=gen, device=CUDA).to(dtype)
    want_v, got_k = torch.randn_like(want_k), want_k.clone()
    got_v = want_v.clone()
    torch_store(key, value, want_k, want_v, slots)
    store_kvcache(key, value, got_k, got_v, slots)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("batch_size", "partition_size"), [(64, None), (256, None), (8, 256)])
def test_gpu_decode_qwen3_shapes_match_reference(dtype, batch_size, partition_size):
    lens = random_lens(batch_size, 1, 2000, seed=batch_size)
    batch = PagedBatch(lens, QWEN3, block_size=16, dtype=dtype, device=CUDA, padding_rows=3)
    out, got, want = run_decode(batch, partition_size=partition_size)
    assert torch.isfinite(out).all() and not out[batch_size:].any()
    assert_close(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("heads", "block_size"), [(QWEN3, 16), (SMOLLM2, 256), (SMOLLM2, 4)])
def test_gpu_prefill_with_cached_prefixes_matches_reference(dtype, heads, block_size):
    q_lens = random_lens(8, 1, 600, seed=4)
    prefix = random_lens(8, 0, 1400, seed=5)
    lens = [q + p for q, p in zip(q_lens, prefix)]
    batch = PagedBatch(lens, heads, block_size=block_size, dtype=dtype, device=CUDA)
    got, want = run_prefill(batch, q_lens)
    assert_close(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [4, 256])
def test_gpu_decode_smollm2_shapes_across_block_sizes(dtype, block_size):
    lens = random_lens(32, 1, 1500, seed=block_size)
    batch = PagedBatch(lens, SMOLLM2, block_size=block_size, dtype=dtype, device=CUDA)
    _, got, want = run_decode(batch)
    assert_close(got, want, dtype)
