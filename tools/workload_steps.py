"""Where the benchmark's time goes: every step of one timed run, by kind and batch size.

    PYTHONPATH=src python3 tools/workload_steps.py --stage 11
    PYTHONPATH=src python3 tools/workload_steps.py --stage 13 --kv-cache-dtype fp8 --out steps.jsonl
    PYTHONPATH=src python3 tools/workload_steps.py --device cpu --num-seqs 4 --max-output-len 8

Options it does not know go to `nanoserve bench`'s parser (the workload's size, the device).

Builds the stage's engine on the Qwen3-0.6B preset (random bfloat16 weights) as `nanoserve
bench` does, warms it up, and runs nano-vLLM's workload (256 requests, 100-1,024 prompt and
output tokens) once, stamping `time.perf_counter()` at every step's `on_step`. With one step in
flight (stage 11+), `execute` launches step k and waits for step k-1's tokens, so the gap
between the stamps of steps k and k+1 is step k's time on a device that is never idle (stage
11's exposed host time is zero, docs/benchmarks.md). The gaps add up to the run's time.

It prints the run's time split into prefill steps and decode steps by batch size, each beside
its roofline: a decode step must read the weights once and every sequence's K/V once at
--bandwidth bytes per second; a prefill step must do 2 x parameters x tokens of matmul work
plus its attention at --flops. It asserts nothing: a measuring tool for docs/benchmarks.md
("Where the workload's time goes"), never a test. Needs a GPU for numbers worth printing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import NamedTuple

from nanoserve.bench.arguments import bench_workload
from nanoserve.bench.nanoserve_engine import drive, load_bench_model
from nanoserve.bench.workload import WARMUP_MAX_TOKENS, WARMUP_PROMPT_LEN, timer
from nanoserve.cli_parser import build_parser
from nanoserve.llm_arguments import prefix_caching_components
from nanoserve.options import check_engine_flags
from nanoserve.recipes.assemble import build_engine
from nanoserve.sampling import SamplingParams

BUCKETS = ((256, 512), (128, 256), (64, 128), (16, 64), (4, 16), (1, 4))  # decode batch sizes


class Step(NamedTuple):
    """One step of the timed run, as its plan saw it."""

    stamp: float  # perf_counter at on_step
    prefill: bool
    seqs: int
    tokens: int  # tokens computed: a prefill's chunk lengths, a decode step's batch size
    context: int  # tokens of K/V the step's attention reads (every sequence's length)
    query_context: int  # prefill: sum over sequences of tokens x context, for attention FLOPs


def record(engine, steps: list[Step]):
    """Append a Step to steps at every step the engine runs (its `on_step`, before `update`)."""

    def on_step(rec) -> None:
        seqs = rec.batch.seqs
        tokens = [seq.num_scheduled_tokens if rec.batch.is_prefill else 1 for seq in seqs]
        lengths = [len(seq) for seq in seqs]
        steps.append(
            Step(time.perf_counter(), rec.batch.is_prefill, len(seqs), sum(tokens),
                 sum(lengths), sum(t * n for t, n in zip(tokens, lengths)))
        )  # fmt: skip

    engine.on_step = on_step


def step_times(steps: list[Step], end: float) -> list[float]:
    """Step k's seconds: from its stamp to the next one's (the last: to the run's end)."""
    stamps = [s.stamp for s in steps] + [end]
    return [b - a for a, b in itertools.pairwise(stamps)]


def report(steps: list[Step], seconds: list[float], model_config, weight_bytes: int, args) -> None:
    """Print the run's time by group of steps (prefill, decode by batch size) beside each
    group's roofline, and their ratio."""
    c = model_config
    kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    kv_bytes_per_token *= args.kv_bytes
    matmul_params = args.params - c.vocab_size * c.hidden_size * (not c.tie_word_embeddings)
    total = sum(seconds)
    print(f"run {total:.3f} s, {len(steps)} steps; roofline at {args.bandwidth / 1e12:.1f} TB/s "
          f"and {args.flops / 1e12:.0f} TFLOP/s")  # fmt: skip
    header = f"{'steps':<18}{'n':>6}{'tokens':>9}{'s':>8}{'share':>7}{'ms/step':>9}"
    print(header + f"{'batch':>7}{'context':>9}{'roofline ms':>13}{'x roof':>9}")
    groups = [("prefill", lambda s: s.prefill)] + [
        (f"decode {lo}-{hi - 1}", lambda s, lo=lo, hi=hi: not s.prefill and lo <= s.seqs < hi)
        for lo, hi in BUCKETS
    ]
    roof_total = 0.0
    for name, member in groups:
        picked = [(s, t) for s, t in zip(steps, seconds) if member(s)]
        if not picked:
            continue
        n = len(picked)
        secs = sum(t for _, t in picked)
        tokens = sum(s.tokens for s, _ in picked)
        if name == "prefill":
            # QK^T and PV, 2 FLOPs a product, half the pairs under the causal mask
            pairs = sum(s.query_context for s, _ in picked) / 2
            attention = 4 * pairs * c.num_attention_heads * c.head_dim * c.num_hidden_layers
            roof = (2 * matmul_params * tokens + attention) / args.flops
        else:
            read = sum(weight_bytes + s.context * kv_bytes_per_token for s, _ in picked)
            roof = read / args.bandwidth
        roof_total += roof
        batch = sum(s.seqs for s, _ in picked) / n
        context = sum(s.context for s, _ in picked) / max(1, sum(s.seqs for s, _ in picked))
        print(f"{name:<18}{n:>6}{tokens:>9}{secs:>8.3f}{100 * secs / total:>6.1f}% "
              f"{1000 * secs / n:>8.3f} {batch:>6.1f} {context:>8.0f} {1000 * roof / n:>12.3f}"
              f" {secs / roof:>8.2f}")  # fmt: skip
    print(f"{'all':<18}{len(steps):>6}{'':>9}{total:>8.3f}{'':>7}{'':>9}{'':>7}{'':>9}"
          f"{'':>13} {total / roof_total:>8.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=11)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes per second")
    parser.add_argument("--flops", type=float, default=700e12, help="bf16 matmul FLOP/s")
    parser.add_argument("--out", help="append one JSON line per step here")
    args, more = parser.parse_known_args()  # the rest goes to bench: --num-seqs 8 --device cpu
    args.kv_bytes = 1 if args.kv_cache_dtype == "fp8" else 2
    bench = ["bench", "--model", "qwen3-0.6b", "--kv-cache-dtype", args.kv_cache_dtype, *more]
    bench_args = build_parser().parse_args(bench)
    flags = check_engine_flags(bench_args, [args.stage])
    spec, model = load_bench_model(flags)
    workload = bench_workload(bench_args, model.config.vocab_size, flags.source)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    args.params = sum(p.numel() for p in model.parameters())
    components = prefix_caching_components(args.stage, None, None)
    engine = build_engine(
        args.stage, flags.config, spec, model.config.eos_token_ids, components, model
    )
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)
              for m in [WARMUP_MAX_TOKENS, *workload.max_tokens]]  # fmt: skip
    drive(engine, [workload.prompt_token_ids[0][:WARMUP_PROMPT_LEN]], params[:1])
    steps: list[Step] = []
    record(engine, steps)
    start = timer(spec.device)
    seqs = drive(engine, workload.prompt_token_ids, params[1:])
    end = timer(spec.device)
    output = sum(seq.num_completion_tokens for seq in seqs)
    print(f"stage {args.stage}: {output} tokens in {end - start:.3f} s, "
          f"{output / (end - start):,.1f} tok/s; weights {weight_bytes / 1e9:.3f} GB")  # fmt: skip
    seconds = step_times(steps, end)
    seconds[0] += steps[0].stamp - start  # the first launch's host time
    report(steps, seconds, model.config, weight_bytes, args)
    if args.out:
        with open(args.out, "a") as f:
            for s, t in zip(steps, seconds):
                f.write(json.dumps({"stage": args.stage, **s._asdict(), "seconds": t}) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
