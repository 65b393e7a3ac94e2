"""Micro-benchmark of stage 06's kernels against torch and flash-attn, on one GPU, for one layer.

Introduced in stage 06. Times paged decode attention (Triton split-K kernel; torch's gather path
as stage 04 runs it; torch's paged FlexAttention; flash-attn 2's paged decode when installed; SDPA
over a contiguous copy made beforehand) in K/V bytes read per second, and causal prefill (Triton
paged; flash-attn 2's varlen kernel, contiguous and paged; SDPA) in TFLOP/s. A measurement tool
only: no test runs it, and it needs CUDA.

    PYTHONPATH=src python3 tools/bench_kernels.py                 # batch 256 x context 1024
    PYTHONPATH=src python3 tools/bench_kernels.py --sweep         # also try decode tile sets
    PYTHONPATH=src python3 tools/bench_kernels.py --no-decode --sweep-prefill   # prefill tiles
    PYTHONPATH=src python3 tools/bench_kernels.py --ragged --batch 64 --context 2000
    PYTHONPATH=/tmp/fa:src python3 tools/bench_kernels.py         # with flash-attn's rows
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math

import torch
import torch.nn.functional as F

from nanoserve.kernels.paged_decode import paged_attention_decode
from nanoserve.kernels.paged_prefill import paged_attention_prefill


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024, help="context length (max if ragged)")
    parser.add_argument("--ragged", action="store_true", help="lengths uniform in 1..context")
    parser.add_argument("--heads", type=int, default=16)  # Qwen3-0.6B
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="try decode tile/warp/stage sets")
    parser.add_argument(
        "--sweep-prefill",
        action="store_true",
        help="try prefill block_m x block_n x warps x stages",
    )
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode rows")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    return parser.parse_args()


FLASH_PAGE_SIZE = 256  # flash-attn's paged KV wants a block size that is a multiple of 256


def load_flash_attn():
    """The flash_attn module, or None after one line saying why its rows are skipped."""
    try:
        import flash_attn
    except ImportError as exc:
        print(f"flash-attn rows skipped: flash_attn is not importable ({exc})")
        return None
    print(f"flash-attn {flash_attn.__version__} from {flash_attn.__file__}")
    return flash_attn


def to_pages(keys: torch.Tensor, values: torch.Tensor, page_size: int):
    """The same per-sequence K/V (B, L, H_kv, D) laid out as a paged pool on shuffled pages.

    Returns (k_pages, v_pages, block_tables): pools (B * W, page_size, H_kv, D), W = ceil(L /
    page_size), and int32 tables (B, W); positions past L (the last page's tail) are zeros.
    """
    batch, length, num_kv_heads, head_dim = keys.shape
    width = math.ceil(length / page_size)
    order = torch.randperm(batch * width, device=keys.device).to(torch.int32)
    block_tables = order.view(batch, width)
    pools = []
    for x in (keys, values):
        pool = x.new_zeros(batch * width, page_size, num_kv_heads, head_dim)
        padded = x.new_zeros(batch, width * page_size, num_kv_heads, head_dim)
        padded[:, :length] = x
        pool[block_tables.long()] = padded.view(batch, width, page_size, num_kv_heads, head_dim)
        pools.append(pool)
    return pools[0], pools[1], block_tables


def time_us(fn, iters: int) -> float:
    """Mean microseconds per call, CUDA events around `iters` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()  # compiles (Triton JIT, torch.compile) and warms caches
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


class DecodeCase:
    """One layer's paged pool in shuffled block order, plus the same K/V laid out contiguously."""

    def __init__(self, args: argparse.Namespace):
        gen = torch.Generator(device="cuda").manual_seed(0)
        dtype, bs = getattr(torch, args.dtype), args.block_size
        b, hkv, d = args.batch, args.kv_heads, args.head_dim
        if args.ragged:
            lens = torch.randint(1, args.context + 1, (b,), device="cuda", generator=gen)
        else:
            lens = torch.full((b,), args.context, device="cuda")
        self.context_lens = lens.to(torch.int32)
        width = math.ceil(args.context / bs)  # every table as wide as the longest allows
        num_blocks = b * width
        order = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
        self.block_tables = order.view(b, width)
        used = torch.arange(width, device="cuda")[None, :] * bs < lens[:, None]
        self.block_tables = torch.where(used, self.block_tables, -1)  # -1 past each length
        shape = (num_blocks, bs, hkv, d)
        self.k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
        self.v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
        self.q = torch.randn(b, args.heads, d, device="cuda", dtype=dtype, generator=gen)
        self.scale = d**-0.5
        tables = self.block_tables.clamp(min=0).long()
        # (B, H_kv, L, D) contiguous copies, made once and never timed: SDPA's best case.
        self.k_dense = self.k_cache[tables].flatten(1, 2).transpose(1, 2).contiguous()
        self.v_dense = self.v_cache[tables].flatten(1, 2).transpose(1, 2).contiguous()
        positions = torch.arange(self.k_dense.shape[2], device="cuda")
        self.pad_mask = (positions[None, :] < lens[:, None])[:, None, None, :]  # True = attend
        self.kv_bytes = int(lens.sum()) * hkv * d * 2 * self.k_cache.element_size()
        self.reference = self.sdpa(self.q.float(), self.k_dense.float(), self.v_dense.float())

    def rate(self, us: float) -> float:
        """TB/s of K/V read by a call of `us` microseconds."""
        return self.kv_bytes / us / 1e6

    def sdpa(self, q, k_dense, v_dense) -> torch.Tensor:
        """SDPA (enable_gqa) of one query per row over the contiguous copy; (B, H, D)."""
        out = F.scaled_dot_product_attention(
            q[:, :, None],
            k_dense,
            v_dense,
            attn_mask=self.pad_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[:, :, 0]


def gather_decode(case: DecodeCase) -> torch.Tensor:
    """Stage 04's path: gather every block of every table, then attend with padding masked."""
    tables = case.block_tables.clamp(min=0)
    keys = case.k_cache[tables].flatten(1, 2)  # (B, W * block_size, H_kv, D), a fresh copy
    values = case.v_cache[tables].flatten(1, 2)
    return case.sdpa(case.q, keys.transpose(1, 2), values.transpose(1, 2))


def flex_decode_fn(case: DecodeCase):
    """torch's paged FlexAttention: the pool as one batch-1 sequence, pages as KV blocks."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    num_blocks, bs, hkv, d = case.k_cache.shape
    batch, width = case.block_tables.shape
    tables = case.block_tables
    # physical_to_logical[b, page] = the page's index in b's table, -1 where b does not own it.
    physical_to_logical = torch.full((batch, num_blocks), -1, dtype=torch.int32, device="cuda")
    rows = torch.arange(batch, device="cuda")[:, None].expand(batch, width)
    cols = torch.arange(width, device="cuda", dtype=torch.int32)[None, :].expand(batch, width)
    owned = tables >= 0
    physical_to_logical[rows[owned], tables[owned].long()] = cols[owned]
    lens = case.context_lens

    def mask_mod(b, h, q_idx, kv_idx):
        logical_block = physical_to_logical[b, kv_idx // bs]
        return (logical_block >= 0) & (logical_block * bs + kv_idx % bs < lens[b])

    kv_num_blocks = ((lens + bs - 1) // bs).view(batch, 1, 1)
    kv_indices = tables.clamp(min=0).view(batch, 1, 1, width)
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(16, bs),
        mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * bs),
        compute_q_blocks=False,
    )
    k_flat = case.k_cache.view(1, num_blocks * bs, hkv, d).transpose(1, 2)  # (1, H_kv, S, D)
    v_flat = case.v_cache.view(1, num_blocks * bs, hkv, d).transpose(1, 2)
    flex = torch.compile(flex_attention, dynamic=False)
    q = case.q[:, :, None]  # (B, H, 1, D)
    return lambda: flex(
        q, k_flat, v_flat, block_mask=block_mask, scale=case.scale, enable_gqa=True
    )[:, :, 0]


def flash_decode_fn(case: DecodeCase, flash):
    """flash-attn 2's paged decode over the same K/V, moved onto shuffled pages of 256."""
    keys, values = case.k_dense.transpose(1, 2), case.v_dense.transpose(1, 2)  # (B, L, H_kv, D)
    k_pages, v_pages, block_tables = to_pages(keys, values, FLASH_PAGE_SIZE)
    q = case.q[:, None]  # (B, 1, H, D): one new token per sequence
    return lambda: flash.flash_attn_with_kvcache(
        q,
        k_pages,
        v_pages,
        cache_seqlens=case.context_lens,
        block_table=block_tables,
        softmax_scale=case.scale,
        causal=True,
    )[:, 0]


def packed(out: torch.Tensor) -> torch.Tensor:
    """SDPA's prefill output (B, H, L, D) as the kernels' packed (T, H, D); others pass through."""
    return out.transpose(1, 2).flatten(0, 1) if out.dim() == 4 else out


def report(name: str, fn, case, iters: int) -> float | None:
    """One table row: time, case.rate (TB/s or TFLOP/s), max abs error against case.reference."""
    try:
        err = (packed(fn()).float() - case.reference).abs().max().item()
        us = time_us(fn, iters)
    except Exception as exc:  # a comparison that cannot run here is reported, not fatal
        print(f"{name:<52} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
        return None
    print(f"{name:<52} {us:>9.1f} {case.rate(us):>8.2f} {err:>10.2e}")
    return us


def triton_configs(sweep: bool):
    """(label, kwargs) pairs for paged_attention_decode; the defaults first."""
    yield "triton split-K decode (defaults)", {}
    yield "triton split-K decode (partition_size 512)", {"partition_size": 512}
    if not sweep:
        return
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
        for part in (None, 512):
            kw = dict(block_n=block_n, num_warps=warps, num_stages=stages, partition_size=part)
            yield f"triton n={block_n} w={warps} s={stages} part={part or 'auto'}", kw


def bench_decode(args: argparse.Namespace, flash) -> None:
    case = DecodeCase(args)
    lens = case.context_lens
    print(
        f"decode: batch {args.batch}, context {'<= ' if args.ragged else ''}{args.context} "
        f"(mean {lens.float().mean():.0f}), H {args.heads}, H_kv {args.kv_heads}, "
        f"D {args.head_dim}, block_size {args.block_size}, {args.dtype}; "
        f"K/V read {case.kv_bytes / 1e9:.3f} GB per call"
    )
    print(f"{'kernel':<52} {'us':>9} {'TB/s':>8} {'max err':>10}")
    args_ = (case.q, case.k_cache, case.v_cache, case.context_lens, case.block_tables, case.scale)
    for label, kw in triton_configs(args.sweep):
        report(label, lambda kw=kw: paged_attention_decode(*args_, **kw), case, args.iters)
    report(
        "torch gather (stage 04: k_cache[tables]) + SDPA",
        lambda: gather_decode(case),
        case,
        args.iters,
    )
    if not args.no_flex:
        try:
            report("torch FlexAttention paged (compiled)", flex_decode_fn(case), case, args.iters)
        except Exception as exc:
            print(f"torch FlexAttention paged: setup failed: {type(exc).__name__}: {exc}")
    if flash is not None:
        name = f"flash-attn 2 with_kvcache, paged (block {FLASH_PAGE_SIZE})"
        report(name, flash_decode_fn(case, flash), case, args.iters)
    report(
        "SDPA over a contiguous copy (copy not timed)",
        lambda: case.sdpa(case.q, case.k_dense, case.v_dense),
        case,
        args.iters,
    )


class PrefillCase:
    """Whole prompts of `context` tokens, `batch // 16` of them, on shuffled pages of the pool,
    plus the same K/V contiguous (B, H_kv, L, D) for SDPA and packed (T, H_kv, D) for flash-attn.
    """

    def __init__(self, args: argparse.Namespace):
        num_seqs, length = max(args.batch // 16, 1), args.context
        dtype, bs = getattr(torch, args.dtype), args.block_size
        hkv, d = args.kv_heads, args.head_dim
        self.num_seqs, self.length, self.scale = num_seqs, length, d**-0.5
        width = math.ceil(length / bs)
        self.block_tables = torch.randperm(num_seqs * width, device="cuda").to(torch.int32)
        self.block_tables = self.block_tables.view(num_seqs, width)
        self.k_cache = torch.randn(num_seqs * width, bs, hkv, d, device="cuda", dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        self.q = torch.randn(num_seqs * length, args.heads, d, device="cuda", dtype=dtype)
        self.cu_seqlens = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * length
        self.context_lens = torch.full((num_seqs,), length, device="cuda", dtype=torch.int32)
        tables = self.block_tables.long()
        keys = self.k_cache[tables].flatten(1, 2)[:, :length]  # (B, L, H_kv, D)
        values = self.v_cache[tables].flatten(1, 2)[:, :length]
        self.k_packed, self.v_packed = keys.flatten(0, 1), values.flatten(0, 1)  # (T, H_kv, D)
        self.k_dense = keys.transpose(1, 2).contiguous()  # (B, H_kv, L, D)
        self.v_dense = values.transpose(1, 2).contiguous()
        self.q_dense = self.q.view(num_seqs, length, args.heads, d).transpose(1, 2)
        self.flops = 4 * num_seqs * args.heads * d * length * length / 2  # causal: half the scores
        q32, k32, v32 = (x.float() for x in (self.q_dense, self.k_dense, self.v_dense))
        self.reference = packed(self.sdpa(q32, k32, v32))

    def rate(self, us: float) -> float:
        """TFLOP/s of a call of `us` microseconds."""
        return self.flops / us / 1e6

    def sdpa(self, q=None, k=None, v=None) -> torch.Tensor:
        """SDPA's causal kernel (enable_gqa) over contiguous K/V; (B, H, L, D)."""
        q, k, v = (self.q_dense, self.k_dense, self.v_dense) if q is None else (q, k, v)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
        )

    def paged(self, **tiles) -> torch.Tensor:
        """The Triton paged prefill kernel; (T, H, D)."""
        metadata = (self.cu_seqlens, self.context_lens, self.block_tables, self.length)
        return paged_attention_prefill(
            self.q, self.k_cache, self.v_cache, *metadata, self.scale, **tiles
        )


def flash_prefill_fns(case: PrefillCase, flash):
    """(label, fn) of flash-attn 2's varlen prefill: contiguous K/V (nano-vLLM's prefill without
    a prefix hit) and the same K/V on shuffled pages of 256 (nanoserve's flash_attn backend)."""
    cu, length, num_seqs = case.cu_seqlens, case.length, case.num_seqs
    keys = case.k_packed.view(num_seqs, length, *case.k_packed.shape[1:])  # (B, L, H_kv, D)
    values = case.v_packed.view(num_seqs, length, *case.v_packed.shape[1:])
    k_pages, v_pages, block_tables = to_pages(keys, values, FLASH_PAGE_SIZE)
    varlen = functools.partial(
        flash.flash_attn_varlen_func,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=length,
        max_seqlen_k=length,
        softmax_scale=case.scale,
        causal=True,
    )
    return [
        (
            "flash-attn 2 varlen, contiguous K/V",
            lambda: varlen(case.q, case.k_packed, case.v_packed),
        ),
        (
            f"flash-attn 2 varlen, paged (block {FLASH_PAGE_SIZE})",
            lambda: varlen(case.q, k_pages, v_pages, block_table=block_tables),
        ),
    ]


def prefill_configs(sweep: bool):
    """(label, kwargs) pairs for paged_attention_prefill; the defaults first."""
    yield "triton paged prefill (defaults)", {}
    if not sweep:
        return
    for block_m, block_n, warps, stages in itertools.product(
        (64, 128), (32, 64, 128), (4, 8), (2, 3, 4, 5)
    ):
        kw = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        yield f"triton prefill m={block_m} n={block_n} w={warps} s={stages}", kw


def bench_prefill(args: argparse.Namespace, flash) -> None:
    """Triton paged prefill (and its tile sweep) against flash-attn 2 and SDPA, causal."""
    case = PrefillCase(args)
    print(
        f"\nprefill: {case.num_seqs} prompts x {case.length} tokens, causal, H {args.heads}, "
        f"H_kv {args.kv_heads}, D {args.head_dim}, block_size {args.block_size}, {args.dtype}"
    )
    print(f"{'kernel':<52} {'us':>9} {'TFLOP/s':>8} {'max err':>10}")
    timed = []
    for label, kw in prefill_configs(args.sweep_prefill):
        us = report(label, lambda kw=kw: case.paged(**kw), case, args.iters)
        timed += [(us, label)] if us is not None else []
    if flash is not None:
        for label, fn in flash_prefill_fns(case, flash):
            report(label, fn, case, args.iters)
    report("SDPA causal, contiguous", case.sdpa, case, args.iters)
    if args.sweep_prefill and timed:
        us, label = min(timed)
        print(f"fastest Triton prefill: {label}, {us:.1f} us = {case.rate(us):.1f} TFLOP/s")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    flash = load_flash_attn()
    if not args.no_decode:
        bench_decode(args, flash)
    if not args.no_prefill:
        bench_prefill(args, flash)


if __name__ == "__main__":
    main()
