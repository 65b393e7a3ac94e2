"""One layer's paged decode kernel over a bfloat16 pool and over e4m3 codes, side by side.

    PYTHONPATH=src python3 tools/bench_fp8_decode.py            # default tiles
    PYTHONPATH=src python3 tools/bench_fp8_decode.py --sweep    # 12 tile / warp / stage sets

Batch 256, context 1,024, Qwen3-0.6B's heads (16 query, 8 KV, 128 wide), blocks of 16 in a
shuffled table; random bfloat16 K/V, and random e4m3 codes (never the NaN codes) with exponents
in -8..0. Times `paged_attention_decode` with `triton.testing.do_bench` and prints microseconds
and the K/V bytes read per second (the e4m3 pool reads half of bfloat16's). It asserts
nothing: a measuring tool for docs/benchmarks.md ("Where a decode step's time goes"), never a
test. Needs a GPU.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from nanoserve.kernels.paged_decode import paged_attention_decode

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 256, 1024, 16, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also 12 tile / warp / stage sets")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, num_blocks = "cuda", BATCH * CONTEXT // BLOCK
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2))

    def codes() -> torch.Tensor:  # 0x00..0x7E with a random sign: every e4m3 value but NaN
        magnitude = torch.randint(0, 0x7F, shape, device=device)
        return (magnitude | torch.randint(0, 2, shape, device=device) << 7).to(torch.uint8)

    def exponents() -> torch.Tensor:
        return torch.randint(-8, 1, (num_blocks, KV_HEADS), device=device, dtype=torch.int32)

    fp8 = dict(k_scales=exponents(), v_scales=exponents())
    k_codes, v_codes = codes(), codes()
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(BATCH, -1)
    lens = torch.full((BATCH,), CONTEXT, device=device, dtype=torch.int32)
    gigabytes = 2 * k.numel() * k.element_size() / 1e9
    sets = [{}]
    if args.sweep:
        grid = itertools.product((32, 64, 128), (4, 8), (2, 3))
        sets += [dict(block_n=n, num_warps=w, num_stages=s) for n, w, s in grid]
    pools = (("bfloat16", k, v, {}, gigabytes), ("e4m3", k_codes, v_codes, fp8, gigabytes / 2))
    for tiles in sets:
        for name, k_pool, v_pool, scales, size in pools:

            def decode(k_pool=k_pool, v_pool=v_pool, scales=scales, tiles=tiles):
                return paged_attention_decode(
                    q, k_pool, v_pool, lens, tables, 0.088, **tiles, **scales
                )

            ms = triton.testing.do_bench(decode, warmup=25, rep=200)
            label = str(tiles) if tiles else "default tiles"
            print(f"{name:9s} {label:55s} {1000 * ms:8.1f} us  {size / ms:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
