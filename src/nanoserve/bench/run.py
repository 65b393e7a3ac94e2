"""`nanoserve bench`: nano-vLLM's throughput workload on the engines of one or more stages.

Introduced in stage 04. It times whole runs (prefill included), optionally beside transformers
(`bench/hf.py`) or nano-vLLM (`bench/peer.py`, after stage 10), each engine `--repeat` times in
interleaved rounds (`bench/rounds.py`), and asserts nothing: tests prove the engine right, this
measures its speed. torch and the engine are imported inside functions so that building the
CLI's parser stays quick.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

from nanoserve.bench import serve
from nanoserve.bench.arguments import (
    bench_workload,
    check_bench_flags,
    check_fits,
    checked_stages,
    progress,
    warn_if_large_on_cpu,
)
from nanoserve.bench.nanoserve_engine import load_bench_model, run_nanoserve
from nanoserve.bench.peer import PEER, check_peer
from nanoserve.bench.plot import check_plot, plot_report
from nanoserve.bench.report import bench_report, write_json
from nanoserve.bench.rounds import (
    EngineSummary,
    compile_notes,
    ratio,
    repeat_notes,
    run_line,
    run_rounds,
    summarize,
)
from nanoserve.bench.workload import (
    BenchResult,
    Workload,
    release_memory,
)
from nanoserve.config import EngineConfig
from nanoserve.options import (
    CheckedFlags,
    check_engine_flags,
)

Runner = Callable[[], BenchResult]  # one engine's timed run of the whole workload
Runs = list[list[BenchResult]]  # each engine's runs, in run order


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
        f"({sum(max_tokens):,} in all), temperature {args.temperature}, ignore_eos{shared}",
    ]


def format_table(rows: list[EngineSummary]) -> list[str]:
    """One row per engine; the last column is throughput relative to the first row. With
    repeated runs the row is min, median and max tok/s (each run's seconds are on its line)."""
    repeated = any(r.num_runs > 1 for r in rows)
    speed = f"{'seconds':>9} {'tok/s':>9}"
    if repeated:
        speed = f"{'min tok/s':>10} {'median tok/s':>12} {'max tok/s':>10}"
    lines = [
        f"{'engine':<34} {'output tok':>10} {speed} {'preempt':>8} {'prefill tok':>11} "
        f"{'vs first':>9}"
    ]
    for r in rows:
        speeds = f"{r.seconds:>9.2f} {r.tokens_per_s:>9.1f}"
        if repeated:
            speeds = (
                f"{r.min_tokens_per_s:>10.1f} {r.tokens_per_s:>12.1f} {r.max_tokens_per_s:>10.1f}"
            )
        vs = ratio(r.tokens_per_s, rows[0].tokens_per_s)
        lines.append(
            f"{r.engine:<34} {count(r.output_tokens):>10} {speeds} {count(r.preemptions):>8} "
            f"{count(r.prefill_tokens):>11} {'-' if vs is None else f'{vs:.2f}x':>9}"
        )
    notes = [f"note: {r.note}" for r in rows if r.note]
    return (
        lines
        + notes
        + [
            f"note: {r.engine}: {r.acceptance_rate:.0%} of guesses kept, "
            f"{r.tokens_per_step:.2f} tokens per verified sequence and step"
            for r in rows
            if r.acceptance_rate is not None and r.tokens_per_step is not None
        ]
    )


def count(value: float | None) -> str:
    """A count for the table: - for none; a median of an even number of runs may end in .5."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if value == int(value) else f"{value:,.1f}"


def engine_runners(args, flags: CheckedFlags, spec, model, stages, workload, stack) -> list[Runner]:
    """One runner per row of the table: each stage, then the peer or transformers. The peer's
    folder (a temporary one, when it must be written) lives as long as `stack`."""
    config, parts = flags.config, flags.parts
    if parts is not None:  # --impl: its pieces run in the engine of their one stage
        stages = [parts.engine_stage]
    runners: list[Runner] = [
        functools.partial(
            run_nanoserve, spec, model, n, config, workload, parts, progress(args), args.temperature
        )
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
    workload = bench_workload(args, flags.model_config.vocab_size, flags.source)
    check_fits(flags.config, workload)
    warn_if_large_on_cpu(flags.device, workload)
    spec, model = load_bench_model(flags, progress(args))
    header = describe(args, model, flags.config, workload)
    print("\n".join(header), flush=True)

    with contextlib.ExitStack() as stack:
        runners = engine_runners(args, flags, spec, model, stages, workload, stack)
        warmup_runs, runs = timed_rounds(args, runners)
    rows = [summarize(engine_runs) for engine_runs in runs]
    notes = repeat_notes(runs, args.num_iters_warmup) + compile_notes(runs)
    print("\n".join(format_table(rows) + notes))
    report = bench_report(args, header, stages, rows, spec.device, runs=runs, warmup=warmup_runs)
    write_outputs(args, report)
    return 0


def timed_rounds(args, runners: list[Runner]) -> tuple[Runs, Runs]:
    """(warm-up runs, counted runs), each engine's in run order: --num-iters-warmup rounds that
    are not counted, then --repeat rounds; a line per run when there is more than one."""

    def report(kind: str, num_rounds: int) -> Callable[[int, BenchResult], None]:
        return lambda n, result: print(run_line(n, num_rounds, result, kind), flush=True)

    num_warmups = args.num_iters_warmup
    warmup_runs = run_rounds(
        runners, num_warmups, report("warm-up round", num_warmups), args.alternate
    )
    shown = args.repeat > 1 or num_warmups > 0
    on_run = report("round", args.repeat) if shown else None
    runs = run_rounds(runners, args.repeat, on_run, args.alternate)
    return warmup_runs, runs


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
        spec, model = load_bench_model(flags, progress(args))
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
    rows = [summarize([r]) for r in results]
    lines = format_table(rows) + serve.latency_lines(timings)
    if len(results) == 2:
        offline, served = results
        lines.append(serve.overhead_line(offline, served, args.request_rate, args.max_concurrency))
    print("\n".join(lines))
    header += lines[len(results) + 1 :]
    write_outputs(args, bench_report(args, header, stages, rows, device, timings))
    return 0
