"""A kernel variant beside the committed kernels, end to end: interleaved `nanoserve bench` runs.

    rm -rf /tmp/variants && cp -r src /tmp/variants
    patch -s -d /tmp/variants -p1 < tools/variants/fp8_decode.patch
    python3 tools/variant_rounds.py --variant vt --rounds 3 -- \
        --model qwen3-0.6b --stage 13 --kv-cache-dtype fp8

`nanoserve bench --repeat --alternate` interleaves stages inside one process; a variant of
tools/variants/ is chosen when the kernels' module is imported (NANOSERVE_FP8_VARIANTS), so it
needs a process of its own. This runs one process per engine and round, both from the patched
tree (--tree), the committed kernels with the variable empty and the variant with it set; the
committed one first in odd rounds, second in even ones. It prints each run as it ends (a round
cut short by a time limit still shows), then each engine's median and the ratio of the medians,
with every round's ratio: a speed claim's numbers (docs/benchmarks.md, "How to run it").
Everything after `--` goes to `nanoserve bench` (`--quiet --json` are added).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_bench(tree: str, variant: str, bench_args: list[str]) -> list[tuple[str, float]]:
    """One `nanoserve bench` process: (engine, tok/s) of each stage it ran."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "bench.json"
        env = {**os.environ, "PYTHONPATH": tree, "NANOSERVE_FP8_VARIANTS": variant}
        command = [sys.executable, "-m", "nanoserve", "bench", *bench_args, "--quiet",
                   "--json", str(report)]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"nanoserve bench failed (NANOSERVE_FP8_VARIANTS={variant!r}):\n"
                             f"{done.stderr[-3000:]}")  # fmt: skip
        results = json.loads(report.read_text())["results"]
    return [(r["engine"], r["tokens_per_s"]) for r in results]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", required=True, help="NANOSERVE_FP8_VARIANTS, e.g. vt")
    parser.add_argument("--rounds", type=int, default=3, help="an odd number (default: 3)")
    parser.add_argument("--tree", default="/tmp/variants", help="the patched copy of src/")
    args = parser.parse_args(argv[:split])
    if args.rounds < 1 or args.rounds % 2 == 0:
        parser.error(f"--rounds must be odd and at least 1 (a median of runs), got {args.rounds}")
    bench_args = argv[split + 1 :]
    names = {"": "committed", args.variant: args.variant}
    speeds: dict[tuple[str, str], list[float]] = {}  # (engine, kernels) -> tok/s, round by round
    for round_ in range(1, args.rounds + 1):
        order = ("", args.variant) if round_ % 2 else (args.variant, "")
        for variant in order:
            for engine, tok_s in run_bench(args.tree, variant, bench_args):
                speeds.setdefault((engine, names[variant]), []).append(tok_s)
                print(f"round {round_}: {engine}, {names[variant]}: {tok_s:,.1f} tok/s", flush=True)
    for engine in dict.fromkeys(engine for engine, _ in speeds):
        base, other = speeds[(engine, "committed")], speeds[(engine, args.variant)]
        ratios = " / ".join(f"{o / b:.3f}" for b, o in zip(base, other))
        median_base, median_other = statistics.median(base), statistics.median(other)
        print(f"{engine}: committed {median_base:,.1f} tok/s, {args.variant} {median_other:,.1f} "
              f"(medians of {len(base)}): {median_other / median_base:.3f}x; "
              f"rounds {ratios}")  # fmt: skip


if __name__ == "__main__":
    main()
