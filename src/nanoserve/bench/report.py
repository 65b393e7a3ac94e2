"""`nanoserve bench --json`: one run as strict JSON that any parser loads, for plots and tables.

Introduced in stage 04 (records per engine); stage 10 added the served run's latencies, as
numbers in milliseconds (TTFT, TPOT, ITL and end-to-end: mean, p50, p90, p99), and a record per
request; `--repeat` adds each engine's runs, each round's ratio and the uncounted warm-up runs,
and makes a record's numbers medians beside min and max tokens/s (issue 31). Every number is
finite: an unbounded option (`--request-rate inf`) is written as null, so `JSON.parse` and
`json.loads(..., parse_constant=...)` that refuse NaN and Infinity both read it. It measures
nothing itself.
"""

from __future__ import annotations

import datetime
import json
import math
import subprocess
from pathlib import Path

from nanoserve.bench.clients import Timing
from nanoserve.bench.rounds import EngineSummary, ratio, round_ratios
from nanoserve.bench.workload import BenchResult

PERCENTILES = (50, 90, 99)
# a run's numbers in --json (acceptance_rate and tokens_per_step: stage 12's, None for others)
RUN_FIELDS = (
    "output_tokens",
    "seconds",
    "preemptions",
    "prefill_tokens",
    "acceptance_rate",
    "tokens_per_step",
    "startup_compile_s",
    "timed_compiles",
)


def finite(value):
    """The value with every non-finite float (inf, nan) in it replaced by None, at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def summary_ms(seconds: list[float]) -> dict[str, float] | None:
    """mean, p50, p90 and p99 of durations in seconds, in milliseconds (None for no values)."""
    import numpy as np

    if not seconds:
        return None
    ms = np.asarray(seconds) * 1000
    points = np.percentile(ms, PERCENTILES)
    return {"mean": float(ms.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}}


def request_record(timing: Timing, start: float) -> dict:
    """One served request: when it was sent, its tokens, TTFT, TPOT and end-to-end, in ms.

    TPOT is vLLM's: (end-to-end - TTFT) / (tokens - 1), None for a request of one token.
    """
    ttft = timing.token_times[0] - timing.sent if timing.token_times else None
    e2e = timing.done - timing.sent
    tpot = None
    if ttft is not None and timing.num_tokens > 1:
        tpot = (e2e - ttft) / (timing.num_tokens - 1)
    return {
        "sent_ms": (timing.sent - start) * 1000,
        "output_tokens": timing.num_tokens,
        "ttft_ms": None if ttft is None else ttft * 1000,
        "tpot_ms": None if tpot is None else tpot * 1000,
        "e2e_ms": e2e * 1000,
    }


def latency_report(timings: list[Timing]) -> dict:
    """The served run's latencies: summaries (ms) and one record per request."""
    start = min(t.sent for t in timings)
    records = [request_record(t, start) for t in timings]

    def values(key: str) -> list[float]:
        return [r[key] / 1000 for r in records if r[key] is not None]

    itl = [gap for t in timings for gap in t.inter_token_gaps()]
    return {
        "latency_ms": {
            "ttft": summary_ms(values("ttft_ms")),
            "tpot": summary_ms(values("tpot_ms")),
            "itl": summary_ms(itl),
            "e2e": summary_ms(values("e2e_ms")),
        },
        "requests": records,
    }


def result_record(row: EngineSummary, first: EngineSummary) -> dict:
    """One engine's row: medians of its runs' counts and seconds, min, median and max tokens/s
    (tokens_per_s is the median) and the ratio of its median to the first row's."""
    return dict(
        row._asdict(),
        tokens_per_s=row.tokens_per_s,
        ratio=ratio(row.tokens_per_s, first.tokens_per_s),
    )


def run_record(result: BenchResult) -> dict:
    """One timed run of an engine (of several, with --repeat): its counts, seconds, tokens/s."""
    return {**{n: getattr(result, n) for n in RUN_FIELDS}, "tokens_per_s": result.tokens_per_s}


def git_commit() -> str | None:
    """The commit of the source tree nanoserve runs from, if it is a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def device_record(device) -> dict | None:
    """What the engine ran on: cuda and the card's name, or cpu with its CPUs and threads."""
    import os

    import torch

    if device is None:  # --url: the server's machine is not ours to see
        return None
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device)}
    return {"type": "cpu", "num_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def write_json(path: str, report: dict) -> None:
    """The report as strict JSON (allow_nan=False: a stray inf fails here, not in a reader)."""
    with open(path, "w") as f:
        json.dump(finite(report), f, indent=2, allow_nan=False)


def bench_report(args, header, stages, rows, device, timings=None, runs=None, warmup=None) -> dict:
    """The whole run: provenance, the header lines, the options, one record per engine (with
    `runs`, one list per engine: its runs in run order and each round's ratio; with `warmup`,
    the runs of the rounds not counted) and, for a served run, the latencies and the requests."""
    from nanoserve import __version__

    options = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    options["stage"] = stages
    report = {
        "version": __version__,
        "commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_record(device),
        "header": header,
        "options": options,
        "results": [result_record(r, rows[0]) for r in rows],
    }
    for record, engine_runs, ratios in zip(report["results"], runs or [], round_ratios(runs or [])):
        record["runs"] = [run_record(r) for r in engine_runs]
        record["round_ratios"] = ratios
    for record, engine_runs in zip(report["results"], warmup or []):
        record["warmup_runs"] = [run_record(r) for r in engine_runs]
    if timings:
        report.update(latency_report(timings))
    return report
