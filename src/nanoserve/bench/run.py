"""`nanoserve bench`: nano-vLLM's throughput workload on the engines of one or more stages.

Introduced in stage 04. It times whole runs (prefill included), optionally beside transformers
(`bench/hf.py`), and asserts nothing: tests prove the engine right, this measures its speed.
torch and the engine are imported inside functions so that building the CLI's parser stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from nanoserve.bench import serve
from nanoserve.bench.report import bench_report, write_json
from nanoserve.bench.workload import (
    WARMUP_MAX_TOKENS,
    WARMUP_PROMPT_LEN,
    BenchResult,
    Workload,
    make_workload,
    release_memory,
    timer,
    with_shared_prefix,
)
from nanoserve.config import EngineConfig
from nanoserve.options import (
    CheckedFlags,
    add_engine_source_args,
    check_engine_flags,
    positive_int,
    refusing_as,
)
from nanoserve.stages import latest_stage, require_implemented
from nanoserve.types import ModelSpec


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand and its options to the CLI's subparsers."""
    p = subparsers.add_parser("bench", help="throughput on nano-vLLM's workload")
    p.add_argument("--num-seqs", type=positive_int, default=256, help="(default: %(default)s)")
    p.add_argument(
        "--max-input-len", type=positive_int, default=1024, help="(default: %(default)s)"
    )
    p.add_argument(
        "--max-output-len", type=positive_int, default=1024, help="(default: %(default)s)"
    )
    p.add_argument(
        "--first",
        type=positive_int,
        default=None,
        metavar="N",
        help="time only the first N requests of the --num-seqs workload (default: all)",
    )
    p.add_argument(
        "--shared-prefix",
        type=positive_int,
        default=None,
        metavar="N",
        help="every prompt starts with the same N tokens (prefix caching, stage 07; default: none)",
    )
    p.add_argument("--compare", choices=["hf"], default=None, help="also time transformers")
    p.add_argument(
        "--hf-batch-size", type=positive_int, default=None, help="CPU (default: all requests)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    serve.add_serve_bench_args(p)
    add_engine_source_args(p, many_stages=True)
    return p


def checked_stages(args) -> list[int]:
    """The stage numbers asked for, each implemented; ValueError naming --stage otherwise."""
    numbers = [n for group in args.stage or [[latest_stage().number]] for n in group]
    with refusing_as("--stage"):
        for n in numbers:
            require_implemented(n)
    return list(dict.fromkeys(numbers))  # drop repeats, keep order


def load_bench_model(flags: CheckedFlags):
    """(spec, model): the checked --model on the --device in the --dtype.

    Loaded once and reused by every stage's engine, so each runs on the very same weights.
    """
    from nanoserve.models.loader import load_model

    spec = ModelSpec(flags.source, flags.dtype, flags.device)
    return spec, load_model(spec.source, spec.device, spec.dtype)


def check_fits(config: EngineConfig, workload: Workload) -> None:
    """ValueError naming --max-model-len unless every request of the workload fits it."""
    longest = max(len(p) + m for p, m in zip(*workload))
    if longest > config.max_model_len:
        raise ValueError(
            f"argument --max-model-len: the longest request needs {longest} tokens "
            f"(prompt + max_tokens), more than max_model_len {config.max_model_len}; "
            "lower --max-input-len or --max-output-len"
        )


def drive(engine, prompts: list[list[int]], params: list) -> list:
    """Queue every request and step until all finish (what `LLM.generate` does, minus text)."""
    seqs = [engine.add_request(ids, p) for ids, p in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return seqs


def run_nanoserve(spec, model, stage: int, config: EngineConfig, workload: Workload) -> BenchResult:
    """Build the stage's engine on `model`, warm it up, and time the whole workload."""
    from nanoserve.layers.compiled import unfuse_small_ops
    from nanoserve.llm_arguments import prefix_caching_components
    from nanoserve.parallel.group import start_engine
    from nanoserve.recipes.assemble import build_engine, recipe_for
    from nanoserve.sampling import SamplingParams

    device = spec.device
    shards = recipe_for(stage).shards_model and config.tensor_parallel_size > 1
    parts = prefix_caching_components(stage, config.enable_prefix_caching, None)
    if shards:  # rank 0 and each worker build their own shard; the shared model sits idle
        engine = start_engine(stage, config, spec, model.config.eos_token_ids, parts)
    else:  # a stage before 09 runs on one rank, beside the sharded one in the same table
        config = dataclasses.replace(config, tensor_parallel_size=1)
        engine = build_engine(stage, config, spec, model.config.eos_token_ids, parts, model)
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)
        for m in [WARMUP_MAX_TOKENS, *workload.max_tokens]
    ]
    drive(engine, [workload.prompt_token_ids[0][:WARMUP_PROMPT_LEN]], params[:1])  # warm-up
    preemptions_before = engine.scheduler.num_preemptions
    prefill_before = engine.num_prefill_tokens
    start = timer(device)
    seqs = drive(engine, workload.prompt_token_ids, params[1:])
    seconds = timer(device) - start
    preemptions = engine.scheduler.num_preemptions - preemptions_before
    prefill_tokens = engine.num_prefill_tokens - prefill_before
    output_tokens = sum(seq.num_completion_tokens for seq in seqs)
    ranks = f", tp {config.tensor_parallel_size}" if shards else ""
    name = f"nanoserve stage {stage} ({engine.attention.name}{ranks})"
    engine.shutdown()
    unfuse_small_ops(model)  # stage 08 fused the shared model's small ops: the next stage must not
    del engine, seqs
    release_memory(device)
    return BenchResult(name, output_tokens, seconds, preemptions, prefill_tokens=prefill_tokens)


def describe(args, model, config: EngineConfig, workload: Workload) -> list[str]:
    """The header lines: what ran where, the engine's limits, and the workload."""
    import torch

    device, dtype = next(model.parameters()).device, str(model.dtype).removeprefix("torch.")
    where = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    lens, max_tokens = [len(p) for p in workload.prompt_token_ids], workload.max_tokens
    shared = f", first {args.shared_prefix} tokens shared" if args.shared_prefix else ""
    return [
        f"device {where}, dtype {dtype}, model {args.model}",
        f"engine: max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
        f"{config.max_num_batched_tokens}, max_model_len {config.max_model_len}",
        f"workload: {len(lens)} requests, prompts {min(lens)}..{max(lens)} tokens "
        f"({sum(lens):,} in all), max_tokens {min(max_tokens)}..{max(max_tokens)} "
        f"({sum(max_tokens):,} in all), temperature 0.6, ignore_eos{shared}",
    ]


def format_table(results: list[BenchResult]) -> list[str]:
    """One row per engine; the last column is throughput relative to the first row."""
    lines = [
        f"{'engine':<34} {'output tok':>10} {'seconds':>9} {'tok/s':>9} "
        f"{'preempt':>8} {'prefill tok':>11} {'vs first':>9}"
    ]
    for r in results:
        preempt = "-" if r.preemptions is None else str(r.preemptions)
        prefill = "-" if r.prefill_tokens is None else f"{r.prefill_tokens:,}"
        ratio = r.tokens_per_s / results[0].tokens_per_s if results[0].tokens_per_s else math.nan
        lines.append(
            f"{r.engine:<34} {r.output_tokens:>10,} {r.seconds:>9.2f} "
            f"{r.tokens_per_s:>9.1f} {preempt:>8} {prefill:>11} "
            f"{ratio:>8.2f}x"
        )
    return lines + [f"note: {r.note}" for r in results if r.note]


def bench_workload(args, vocab_size: int | None) -> Workload:
    """The workload the options describe, ids folded into the vocabulary when it is known."""
    workload = make_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    if args.first is not None:  # e.g. the first 64 of 256: docs/benchmarks.md's GPU run
        first = args.first
        workload = Workload(workload.prompt_token_ids[:first], workload.max_tokens[:first])
    if args.shared_prefix is not None:
        workload = with_shared_prefix(workload, args.shared_prefix)
    return workload if vocab_size is None else workload.fold_ids(vocab_size)


def run_bench(args) -> int:
    """Run the benchmark the options describe, print the table (and write JSON); returns 0."""
    stages = checked_stages(args)
    if args.serve or args.url:
        return run_serve_bench(args, stages)
    flags = check_engine_flags(args, stages)
    workload = bench_workload(args, flags.model_config.vocab_size)
    check_fits(flags.config, workload)
    config = flags.config
    spec, model = load_bench_model(flags)
    header = describe(args, model, config, workload)
    print("\n".join(header), flush=True)
    results = [run_nanoserve(spec, model, stage, config, workload) for stage in stages]
    if args.compare == "hf":
        from nanoserve.bench.hf import run_transformers

        results.append(run_transformers(args.model, model, workload, args.hf_batch_size))
    print("\n".join(format_table(results)))
    if args.json:
        write_json(args.json, bench_report(args, header, stages, results, spec.device))
    return 0


def run_serve_bench(args, stages: list[int]) -> int:
    """Offline, then over HTTP, on the same requests (stage 10); --url: over HTTP only."""
    if len(stages) != 1:
        raise ValueError("argument --stage: --serve benchmarks one stage's engine at a time")
    results, header, device = [], [], None
    if args.url:
        workload = bench_workload(args, None)  # the server rejects ids outside its vocabulary
        url = args.url.rstrip("/")
        timings, seconds = serve.drive(url, workload, args)
    else:
        flags = check_engine_flags(args, stages)
        workload = bench_workload(args, flags.model_config.vocab_size)
        check_fits(flags.config, workload)
        config = flags.config
        spec, model = load_bench_model(flags)
        header = describe(args, model, config, workload)
        print("\n".join(header), flush=True)
        results.append(run_nanoserve(spec, model, stages[0], config, workload))
        dtype = str(model.dtype).removeprefix("torch.")
        del model  # the server loads its own; free this copy's memory first
        release_memory(spec.device)
        device = spec.device
        port = serve.free_port()
        command = serve.serve_command(args, stages[0], spec.device.type, dtype, port)
        with serve.ServerProcess(command, port) as url:
            timings, seconds = serve.drive(url, workload, args)
    results.append(serve.served_result(timings, seconds, args))
    lines = format_table(results) + serve.latency_lines(timings)
    if len(results) == 2:
        offline, served = results
        lines.append(serve.overhead_line(offline, served, args.request_rate))
    print("\n".join(lines))
    if args.json:
        header += lines[len(results) + 1 :]
        write_json(args.json, bench_report(args, header, stages, results, device, timings))
    return 0
