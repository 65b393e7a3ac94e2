"""`nanoserve bench`: nano-vLLM's throughput workload on the engines of one or more stages.

Introduced in stage 04. It times whole runs (prefill included), optionally beside transformers
(`bench/hf.py`) or nano-vLLM (`bench/peer.py`, after stage 10), each engine `--repeat` times in
interleaved rounds (`bench/rounds.py`), and asserts nothing: tests prove the engine right, this
measures its speed. torch and the engine are imported inside functions so that building the
CLI's parser stays quick.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from collections.abc import Callable

from nanoserve.bench import serve
from nanoserve.bench.nanoserve_engine import load_bench_model, run_nanoserve
from nanoserve.bench.peer import PEER, check_peer, check_peer_path
from nanoserve.bench.plot import check_plot, plot_report
from nanoserve.bench.report import bench_report, write_json
from nanoserve.bench.rounds import median_run, run_line, run_rounds, runs_note
from nanoserve.bench.workload import (
    BenchResult,
    Workload,
    make_workload,
    release_memory,
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

Runner = Callable[[], BenchResult]  # one engine's timed run of the whole workload


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
    p.add_argument(
        "--compare",
        choices=["hf", PEER],
        default=None,
        help=f"also time transformers (hf) or nano-vLLM ({PEER}: CUDA, flash_attn, a Qwen3 model)",
    )
    p.add_argument(
        "--peer-path",
        default=None,
        metavar="DIR",
        help=f"a nano-vLLM source checkout, for --compare {PEER} where nanovllm is not "
        "importable (default: none)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="N",
        help="run every engine N times, in interleaved rounds, and report each one's median run "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--hf-batch-size", type=positive_int, default=None, help="CPU (default: all requests)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars (they are shown only on a terminal anyway)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also draw throughput (and served latencies) into this image, e.g. bench.png "
        "(needs matplotlib)",
    )
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


def check_fits(config: EngineConfig, workload: Workload) -> None:
    """ValueError naming --max-model-len unless every request of the workload fits it."""
    longest = max(len(p) + m for p, m in zip(*workload))
    if longest > config.max_model_len:
        raise ValueError(
            f"argument --max-model-len: the longest request needs {longest} tokens "
            f"(prompt + max_tokens), more than max_model_len {config.max_model_len}; "
            "lower --max-input-len or --max-output-len"
        )


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


def progress(args) -> bool:
    """Bars on stderr while engines run: on a terminal, unless --quiet."""
    return not args.quiet and sys.stderr.isatty()


CPU_OUTPUT_TOKENS = 5_000  # more than this on a CPU is a long wait (the small run makes 601)


def warn_if_large_on_cpu(device, workload: Workload) -> None:
    """A warning on stderr (no question: the run goes on) when a CPU is given a GPU-sized run."""
    output_tokens = sum(workload.max_tokens)
    if device.type != "cpu" or output_tokens <= CPU_OUTPUT_TOKENS:
        return
    print(
        f"warning: {len(workload.max_tokens)} requests and up to {output_tokens:,} output tokens "
        "is the GPU workload; on a CPU it takes hours. Ctrl-C stops it; a CPU-sized run is "
        "nanoserve bench --num-seqs 16 --max-input-len 256 --max-output-len 64",
        file=sys.stderr,
        flush=True,
    )


def check_bench_flags(args) -> None:
    """The flags that say what to compare and how often, checked before anything loads."""
    check_peer_path(args.peer_path, args.compare)
    if args.serve or args.url:
        served = "--serve" if args.serve else "--url"
        if args.compare:
            raise ValueError(f"argument --compare: {served} times nanoserve only")
        if args.repeat > 1:
            raise ValueError(f"argument --repeat: {served} runs once")


def engine_runners(args, flags: CheckedFlags, spec, model, stages, workload, stack) -> list[Runner]:
    """One runner per row of the table: each stage, then the peer or transformers. The peer's
    folder (a temporary one, when it must be written) lives as long as `stack`."""
    config, parts = flags.config, flags.parts
    if parts is not None:  # --impl: its pieces run in the engine of their one stage
        stages = [parts.engine_stage]
    runners: list[Runner] = [
        functools.partial(run_nanoserve, spec, model, n, config, workload, parts, progress(args))
        for n in stages
    ]
    if args.compare == PEER:
        from nanoserve.bench.peer import run_peer
        from nanoserve.bench.peer_folder import peer_folder
        from nanoserve.models.presets import PRESETS, preset_config

        hf_config = preset_config(flags.source) if flags.source in PRESETS else None
        folder = stack.enter_context(peer_folder(flags.source, model, hf_config))
        runners.append(functools.partial(run_peer, folder, config, workload, args.peer_path))
    elif args.compare == "hf":
        from nanoserve.bench.hf import run_transformers

        hf = functools.partial(run_transformers, args.model, model, workload, args.hf_batch_size)
        runners.append(hf)
    return runners


def run_bench(args) -> int:
    """Run the benchmark the options describe, print the table (and write JSON); returns 0."""
    stages = checked_stages(args)
    check_bench_flags(args)
    check_plot(args.plot)
    if args.serve or args.url:
        return run_serve_bench(args, stages)
    flags = check_engine_flags(args, stages)
    if flags.parts is not None:
        from nanoserve.learner_parts import require_engine_parts

        require_engine_parts(flags.parts, "bench")
    if args.compare == PEER:
        check_peer(flags, args.peer_path)
    workload = bench_workload(args, flags.model_config.vocab_size)
    check_fits(flags.config, workload)
    warn_if_large_on_cpu(flags.device, workload)
    spec, model = load_bench_model(flags)
    header = describe(args, model, flags.config, workload)
    print("\n".join(header), flush=True)

    def progress(round_number: int, result: BenchResult) -> None:
        print(run_line(round_number, args.repeat, result), flush=True)

    with contextlib.ExitStack() as stack:
        runners = engine_runners(args, flags, spec, model, stages, workload, stack)
        runs = run_rounds(runners, args.repeat, progress if args.repeat > 1 else None)
    results = [median_run(engine_runs) for engine_runs in runs]
    notes = [f"note: {runs_note(engine_runs)}" for engine_runs in runs if len(engine_runs) > 1]
    print("\n".join(format_table(results) + notes))
    write_outputs(args, bench_report(args, header, stages, results, spec.device, runs=runs))
    return 0


def write_outputs(args, report: dict) -> None:
    """The report as --json and as --plot, where asked for."""
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot_report(report, args.plot)


def run_serve_bench(args, stages: list[int]) -> int:
    """Offline, then over HTTP, on the same requests (stage 10); --url: over HTTP only."""
    if len(stages) != 1:
        raise ValueError("argument --stage: --serve benchmarks one stage's engine at a time")
    results, header, device = [], [], None
    if args.url:
        if args.impl is not None:
            raise ValueError(
                "argument --impl: --url times a server already running; start it with "
                "nanoserve serve --impl FILE, or let --serve start one"
            )
        workload = bench_workload(args, None)  # the server rejects ids outside its vocabulary
        url = args.url.rstrip("/")
        timings, seconds = serve.drive(url, workload, args)
    else:
        flags = check_engine_flags(args, stages)
        workload = bench_workload(args, flags.model_config.vocab_size)
        check_fits(flags.config, workload)
        config, parts = flags.config, flags.parts
        spec, model = load_bench_model(flags)
        header = describe(args, model, config, workload)
        print("\n".join(header), flush=True)
        # offline runs the learner's engine parts; stage 10's loop runs only in the server
        yours = parts if parts is not None and parts.components else None
        stage = stages[0] if parts is None else parts.engine_stage
        results.append(run_nanoserve(spec, model, stage, config, workload, yours, progress(args)))
        dtype = str(model.dtype).removeprefix("torch.")
        del model  # the server loads its own; free this copy's memory first
        release_memory(spec.device)
        device = spec.device
        port = serve.free_port()
        # the file's own stage: the server sorts --impl's pieces itself
        command = serve.serve_command(args, stages[0], spec.device.type, dtype, port)
        with serve.ServerProcess(command, port) as url:
            timings, seconds = serve.drive(url, workload, args)
    results.append(serve.served_result(timings, seconds, args))
    lines = format_table(results) + serve.latency_lines(timings)
    if len(results) == 2:
        offline, served = results
        lines.append(serve.overhead_line(offline, served, args.request_rate, args.max_concurrency))
    print("\n".join(lines))
    header += lines[len(results) + 1 :]
    write_outputs(args, bench_report(args, header, stages, results, device, timings))
    return 0
