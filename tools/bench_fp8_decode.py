"""One layer's e4m3 kernels beside bfloat16's: paged decode, the K/V store, and prefill.

    PYTHONPATH=src python3 tools/bench_fp8_decode.py            # decode, default tiles
    PYTHONPATH=src python3 tools/bench_fp8_decode.py --sweep    # decode: tiles, warps, stages,
                                                                # partitions
    PYTHONPATH=src python3 tools/bench_fp8_decode.py --store --prefill --no-decode
    PYTHONPATH=/tmp/variants python3 tools/bench_fp8_decode.py --variants --no-decode
                                        # tools/variants/fp8_decode.patch applied to a copy
    PYTHONPATH=/tmp/variants python3 tools/bench_fp8_decode.py --batches 132,256 --no-decode
    PYTHONPATH=src ncu --clock-control none -k 'regex:decode_partition|store_kvcache' \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats python3 tools/bench_fp8_decode.py --once
                                        # why a kernel takes its time, where ncu can read
                                        # the counters (device KINDS.md: Firecracker)

Decode: batch 256, context 1,024, Qwen3-0.6B's heads (16 query, 8 KV, 128 wide), blocks of 16
in a shuffled table; random bfloat16 K/V, and random e4m3 codes (never the NaN codes) with
exponents in -8..0. Prints microseconds and the K/V bytes read per second (the e4m3 pool reads
half of bfloat16's); each sweep row says whether its output is bit for bit the default tiles'.
The sweep times bfloat16 at two sets only: it is the yardstick, not the subject.

Store (`--store`): one decode step's K/V of 256 tokens, each appending to a block of its own,
written by bfloat16's copy and by the e4m3 store kernel. Timed calls repeat the same step, so
after the first no exponent grows and no block is requantized: the common case of a decode
step, not its worst. (Its warps a program were timed at 1 to 8 on 2026-12-05 and made no
difference: docs/benchmarks.md.)

Prefill (`--prefill`): 4 prompts of 4,096 tokens with no cached prefix, in TFLOP/s of causal
attention, bfloat16 beside e4m3 over a few tile sets.

Variants (`--variants`, with the patch applied to a copy of src/ on PYTHONPATH): e4m3 decode as
committed beside V laid out by key (`vt`), the committed layout with at most 128 registers a
thread (`r128`: room for 4 programs an SM by registers, not 3; ncu found shared memory holding
the committed kernel to 3 as well), and `vt` with at most 96 (5), over a few tile sets;
each row says whether its output is bit for bit the committed kernel's at the same tiles.
Then the store of one decode step as committed beside `s16`, the build before one-token runs
got their own (every run loaded and rounded 16 rows), with whether both wrote the same codes
and exponents. `--batches 132,198,256` (with the patch) times bfloat16 and e4m3's decode
(committed, `vt`, `r128`, and the first two at 8 warps) over batch sizes, in K/V TB/s: does the
kernel read faster where its programs fill whole rounds of the SMs?

`triton.testing.do_bench` times each. It asserts nothing: a measuring tool for
docs/benchmarks.md, never a test. Needs a GPU.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import triton

from nanoserve.kernels.paged_decode import paged_attention_decode
from nanoserve.kernels.paged_prefill import paged_attention_prefill
from nanoserve.kernels.store import store_kvcache
from nanoserve.kernels.store_fp8 import store_kvcache_fp8

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 256, 1024, 16, 8, 128, 16
DEVICE = "cuda"


def codes(shape) -> torch.Tensor:
    """Random e4m3 codes, 0x00..0x7E with a random sign: every value but NaN."""
    magnitude = torch.randint(0, 0x7F, shape, device=DEVICE)
    return (magnitude | torch.randint(0, 2, shape, device=DEVICE) << 7).to(torch.uint8)


def exponents(num_blocks: int) -> torch.Tensor:
    return torch.randint(-8, 1, (num_blocks, KV_HEADS), device=DEVICE, dtype=torch.int32)


def paged_pool(seqs: int, length: int):
    """The pool's shape for `seqs` sequences of `length` tokens, their shuffled block tables,
    their lengths, and random exponents for an e4m3 pool of that shape."""
    num_blocks = seqs * length // BLOCK
    tables = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32).view(seqs, -1)
    lens = torch.full((seqs,), length, device=DEVICE, dtype=torch.int32)
    scales = dict(k_scales=exponents(num_blocks), v_scales=exponents(num_blocks))
    return (num_blocks, BLOCK, KV_HEADS, HEAD_DIM), tables, lens, scales


def time_us(fn) -> float:
    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=150)


def decode_sets(sweep: bool) -> list[dict]:
    """The default tiles, then (with sweep) keys x warps x stages, then partitions of 256 and
    512 positions (split-K even where batch x KV heads already fills the GPU)."""
    sets: list[dict] = [{}]
    if sweep:
        for n, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4)):
            sets.append(dict(block_n=n, num_warps=w, num_stages=s))
        for n, s, p in itertools.product((64, 128), (2, 3), (256, 512)):
            sets.append(dict(block_n=n, num_stages=s, partition_size=p))
    return sets


BFLOAT16_SETS = ({}, dict(block_n=64, num_warps=4, num_stages=3))


def bench_decode(sweep: bool) -> None:
    shape, tables, lens, fp8 = paged_pool(BATCH, CONTEXT)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    gigabytes = 2 * k.numel() * k.element_size() / 1e9
    pools = (
        ("bfloat16", k, v, {}, gigabytes),
        ("e4m3", codes(shape), codes(shape), fp8, gigabytes / 2),
    )
    first: dict[str, torch.Tensor] = {}
    for tiles in decode_sets(sweep):
        for name, k_pool, v_pool, scales, size in pools:
            if name == "bfloat16" and tiles not in BFLOAT16_SETS:
                continue

            def decode(k_pool=k_pool, v_pool=v_pool, scales=scales, tiles=tiles):
                return paged_attention_decode(
                    q, k_pool, v_pool, lens, tables, 0.088, **tiles, **scales
                )

            out = decode()
            same = ""
            if name in first:
                same = "same" if torch.equal(out, first[name]) else "DIFFERS"
            first.setdefault(name, out)
            us = time_us(decode)
            label = str(tiles) if tiles else "default tiles"
            print(f"decode {name:9s} {label:62s} {us:8.1f} us  {size / us * 1e3:.2f} TB/s  {same}",
                  flush=True)  # fmt: skip


STORE_BLOCKS = 4096  # the pool a decode step's store writes into


def store_step():
    """One decode step's K and V (256 tokens, each appending to a block of its own), their
    slots, and a fresh e4m3 pool (`fresh_codes`)."""
    key, value = (torch.randn(BATCH, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
                  for _ in range(2))  # fmt: skip
    blocks = torch.randperm(STORE_BLOCKS, device=DEVICE)[:BATCH]
    slots = (blocks * BLOCK + torch.randint(0, BLOCK, (BATCH,), device=DEVICE)).to(torch.int32)
    return key, value, slots, *fresh_codes()


def fresh_codes():
    """An e4m3 pool's K and V codes (zeros) and exponents (-64: nothing stored yet)."""
    shape = (STORE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, device=DEVICE, dtype=torch.uint8) for _ in range(2)]
    exps = {name: torch.full((STORE_BLOCKS, KV_HEADS), -64, device=DEVICE, dtype=torch.int32)
            for name in ("k_scales", "v_scales")}  # fmt: skip
    return caches, exps


def bench_store() -> None:
    key, value, slots, (k_codes, v_codes), fp8 = store_step()
    k_bf16, v_bf16 = (torch.zeros(k_codes.shape, device=DEVICE, dtype=torch.bfloat16)
                      for _ in range(2))  # fmt: skip
    copy_us = time_us(lambda: store_kvcache(key, value, k_bf16, v_bf16, slots))
    print(f"store bfloat16 copy            {copy_us:8.2f} us")
    us = time_us(lambda: store_kvcache_fp8(key, value, k_codes, v_codes, slots, **fp8))
    print(f"store e4m3                     {us:8.2f} us")


def bench_prefill() -> None:
    prompts, length = 4, 4096
    shape, tables, lens, fp8 = paged_pool(prompts, length)
    q = torch.randn(prompts * length, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    cu_seqlens = torch.arange(prompts + 1, device=DEVICE, dtype=torch.int32) * length
    flop = 4 * prompts * length * length / 2 * HEADS * HEAD_DIM  # QK^T and PV, half the pairs
    pools = (("bfloat16", k, v, {}), ("e4m3", codes(shape), codes(shape), fp8))
    for tiles in ({}, dict(num_stages=3), dict(block_m=128, num_warps=8),
                  dict(block_m=128, num_warps=8, num_stages=3), dict(block_n=32)):  # fmt: skip
        for name, k_pool, v_pool, scales in pools:

            def prefill(k_pool=k_pool, v_pool=v_pool, scales=scales, tiles=tiles):
                return paged_attention_prefill(q, k_pool, v_pool, cu_seqlens, lens, tables,
                                               length, 0.088, **tiles, **scales)  # fmt: skip

            us = time_us(prefill)
            label = str(tiles) if tiles else "default tiles"
            print(f"prefill {name:9s} {label:50s} {us:9.1f} us  {flop / us / 1e6:6.1f} TFLOP/s",
                  flush=True)  # fmt: skip


def chosen_variants(option: str) -> set:
    """The patched kernels' set of variants (read at each launch); exits without the patch."""
    from nanoserve.kernels import paged_decode

    chosen = getattr(paged_decode, "_VARIANTS", None)
    if chosen is None:
        raise SystemExit(f"{option} needs tools/variants/fp8_decode.patch applied (its header)")
    return chosen


def e4m3_decode_inputs(batch: int):
    """Queries, an e4m3 pool's K and V codes, V's codes laid out by key (`vt`: block, head, D,
    token), the tables, lengths and exponents, and the codes' gigabytes (K and V)."""
    shape, tables, lens, fp8 = paged_pool(batch, CONTEXT)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k_codes, v_codes = codes(shape), codes(shape)
    by_key = v_codes.permute(0, 2, 3, 1).contiguous().view(shape)
    return q, k_codes, v_codes, by_key, tables, lens, fp8, k_codes.numel() * 2 / 1e9


def bench_variants() -> None:
    from nanoserve.kernels import paged_decode

    chosen = chosen_variants("--variants")
    q, k_codes, v_codes, by_key, tables, lens, fp8, gigabytes = e4m3_decode_inputs(BATCH)
    for tiles in ({}, dict(num_stages=3), dict(num_stages=4), dict(block_n=64, num_stages=3)):
        want = None
        for variant in ("committed", "vt", "r128", "vt,r96"):
            chosen.clear()
            chosen.update(variant.split(","))
            v_pool = by_key if "vt" in chosen else v_codes

            def decode(tiles=tiles, v_pool=v_pool):
                return paged_decode.paged_attention_decode(
                    q, k_codes, v_pool, lens, tables, 0.088, **tiles, **fp8
                )

            out = decode()
            want = out if want is None else want
            same = "same bits" if torch.equal(out, want) else "DIFFERS"
            us = time_us(decode)
            label = str(tiles) if tiles else "default tiles"
            print(f"variant {variant:9s} {label:36s} {us:8.1f} us  "
                  f"{gigabytes / us * 1e3:.2f} TB/s  {same} as committed", flush=True)  # fmt: skip
    key, value, slots, _, _ = store_step()
    written = None
    for variant in ("committed", "s16"):  # s16: one-token runs built for 16 rows, as before
        chosen.clear()
        chosen.add(variant)
        caches, exps = fresh_codes()

        def store(caches=caches, exps=exps):
            store_kvcache_fp8(key, value, *caches, slots, **exps)

        store()
        pool = [*caches, *exps.values()]
        written = pool if written is None else written
        same = all(torch.equal(a, b) for a, b in zip(pool, written))
        agree = "same" if same else "DIFFERENT"
        print(f"store   {variant:9s} a decode step's {BATCH} tokens {time_us(store):8.2f} us  "
              f"{agree} codes and exponents as committed", flush=True)  # fmt: skip
    chosen.clear()  # what runs after (--store, the decode rows) is the committed build


def bench_batches(batches: list[int]) -> None:
    """K/V bytes per second against the batch size (programs: batch x KV heads, so some batches
    fill whole rounds of the SMs and some leave the last round part empty): bfloat16, then e4m3
    as committed, `vt`, `r128`, and the first two at 8 warps a program. Needs the patch."""
    chosen = chosen_variants("--batches")
    for batch in batches:
        print(f"batch {batch:4d} programs {batch * KV_HEADS:5d}  " + batch_row(batch, chosen),
              flush=True)  # fmt: skip
    chosen.clear()  # what runs after (--store, the decode rows) is the committed build


def batch_row(batch: int, chosen: set) -> str:
    """One --batches row: each kernel's K/V TB/s at this batch, context CONTEXT."""
    decode = paged_attention_decode  # the patched kernel's wrapper, with the patch on the path
    q, k_codes, v_codes, by_key, tables, lens, fp8, gigabytes = e4m3_decode_inputs(batch)
    k, v = (torch.randn(k_codes.shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    chosen.clear()
    us = time_us(lambda: decode(q, k, v, lens, tables, 0.088))
    cells = [f"bfloat16 {2 * gigabytes / us * 1e3:.2f}"]
    for variant, warps in (("committed", 4), ("vt", 4), ("r128", 4), ("committed", 8), ("vt", 8)):
        chosen.clear()
        chosen.add(variant)
        v_pool = by_key if variant == "vt" else v_codes
        us = time_us(
            partial(decode, q, k_codes, v_pool, lens, tables, 0.088, num_warps=warps, **fp8)
        )
        cells.append(f"{variant}{'/8w' if warps == 8 else ''} {gigabytes / us * 1e3:.2f}")
    return "  ".join(cells) + "  (TB/s)"


def run_once() -> None:
    """One default-tile decode launch per pool, then one e4m3 store: what a profiler such as
    ncu reads (its counters replay a launch many times; do_bench's hundreds would be many
    minutes)."""
    shape, tables, lens, fp8 = paged_pool(BATCH, CONTEXT)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    paged_attention_decode(q, k, v, lens, tables, 0.088)
    paged_attention_decode(q, codes(shape), codes(shape), lens, tables, 0.088, **fp8)
    key, value, slots, caches, scales = store_step()
    store_kvcache_fp8(key, value, *caches, slots, **scales)
    torch.cuda.synchronize()
    print("ran: decode bfloat16, decode e4m3, store e4m3 (once each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="decode over tile and split sets")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode rows")
    parser.add_argument("--store", action="store_true", help="time the K/V store kernels")
    parser.add_argument("--prefill", action="store_true", help="time the prefill kernels")
    parser.add_argument("--variants", action="store_true", help="tools/variants/fp8_decode.patch")
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")],
                        help="e4m3 decode variants over these batch sizes, e.g. 132,198,256 "
                        "(needs the patch)")  # fmt: skip
    parser.add_argument("--once", action="store_true",
                        help="each pool's decode and the store once, untimed (ncu)")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.once:
        run_once()
        return
    if args.variants:
        bench_variants()
    if args.batches:
        bench_batches(args.batches)
    if args.store:
        bench_store()
    if not args.no_decode:
        bench_decode(args.sweep)
    if args.prefill:
        bench_prefill()


if __name__ == "__main__":
    main()
