"""`nanoserve bench --repeat N`: every engine of the table N times, round by round, and statistics.

Introduced with the peer comparison (after stage 10). The GPU hosts differ by up to 30 % between
leases and drift within one, so the runs interleave (stage a, stage b, peer, stage a, stage b,
peer, ...) rather than repeating one engine N times in a row: a slow minute then costs every
engine alike. Each engine's row is the min, median and max of its runs, its ratio is of the
medians, and each round's own ratio is listed beside it (issue 31). It times nothing itself.

    warm-up:  a ─ b ─ peer        run, printed, not counted (--num-iters-warmup)
    round 1:  a ─ b ─ peer        runs[0] = [a1, a2, a3]  -> summarize -> a's row
    round 2:  a ─ b ─ peer        runs[1] = [b1, b2, b3]  -> summarize -> b's row, b/a of medians
    round 3:  a ─ b ─ peer        round_ratios: [b1/a1, b2/a2, b3/a3], [p1/a1, p2/a2, p3/a3]

With --alternate, odd rounds run the table backwards (peer ─ b ─ a) and even rounds forwards,
so that no engine always runs first, on the least warmed-up machine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import NamedTuple

from nanoserve.bench.workload import BenchResult


def run_rounds(
    runners: Sequence[Callable[[], BenchResult]],
    repeat: int,
    on_run: Callable[[int, BenchResult], None] | None = None,
    alternate: bool = False,
) -> list[list[BenchResult]]:
    """Call every runner once per round, `repeat` rounds; each runner's results in run order.
    `on_run(round, result)` hears of each run as it ends (round counts from 1); alternate: odd
    rounds call the runners last to first."""
    runs: list[list[BenchResult]] = [[] for _ in runners]
    for round_number in range(1, repeat + 1):
        order = list(zip(runs, runners))
        for engine_runs, runner in order[::-1] if alternate and round_number % 2 else order:
            result = runner()
            engine_runs.append(result)
            if on_run is not None:
                on_run(round_number, result)
    return runs


def median(values: Sequence[float]) -> float:
    """The middle value; of an even count, the mean of the middle two (never one of them alone:
    with two runs, "the slower middle one" was a cold first run)."""
    return statistics.median(values)


def median_count(values: Sequence[int]) -> float:
    """The median of counts, an int where it is whole (two middle runs of 1,000 tokens: 1000)."""
    middle = median(values)
    return int(middle) if float(middle).is_integer() else middle


class EngineSummary(NamedTuple):
    """One engine's row: its counted runs' tokens/s as min, median and max, and the median of
    each other number (None where the engine does not report it)."""

    engine: str
    num_runs: int
    output_tokens: float
    seconds: float
    preemptions: float | None
    note: str | None
    prefill_tokens: float | None
    acceptance_rate: float | None
    tokens_per_step: float | None
    min_tokens_per_s: float
    median_tokens_per_s: float  # of each run's tokens/s, not output_tokens / median seconds
    max_tokens_per_s: float

    @property
    def tokens_per_s(self) -> float:
        """The row's figure: the median."""
        return self.median_tokens_per_s


def summarize(runs: Sequence[BenchResult]) -> EngineSummary:
    """One engine's row from its counted runs (one run: that run's numbers)."""

    def median_of(name: str, middle: Callable[[list], float] = median) -> float | None:
        values = [getattr(r, name) for r in runs]
        return None if any(v is None for v in values) else middle(values)

    speeds = [r.tokens_per_s for r in runs]
    return EngineSummary(
        engine=runs[0].engine,
        num_runs=len(runs),
        output_tokens=median_count([r.output_tokens for r in runs]),
        seconds=median([r.seconds for r in runs]),
        preemptions=median_of("preemptions", median_count),
        note="; ".join(dict.fromkeys(r.note for r in runs if r.note)) or None,
        prefill_tokens=median_of("prefill_tokens", median_count),
        acceptance_rate=median_of("acceptance_rate"),
        tokens_per_step=median_of("tokens_per_step"),
        min_tokens_per_s=min(speeds),
        median_tokens_per_s=median(speeds),
        max_tokens_per_s=max(speeds),
    )


def ratio(tokens_per_s: float, first: float) -> float | None:
    """tokens_per_s relative to the first engine's (None where the first's is 0 or unbounded)."""
    return tokens_per_s / first if 0 < first < math.inf else None


def round_ratios(runs: Sequence[Sequence[BenchResult]]) -> list[list[float | None]]:
    """Each engine's tokens/s over the first engine's in the same round, round by round."""
    return [[ratio(r.tokens_per_s, f.tokens_per_s) for r, f in zip(rs, runs[0])] for rs in runs]


def runs_note(runs: Sequence[BenchResult]) -> str:
    """Every run's tokens/s in run order, for the table's notes."""
    each = " / ".join(f"{r.tokens_per_s:,.1f}" for r in runs)
    return f"{runs[0].engine}: {len(runs)} runs, tok/s {each} in run order"


def ratios_note(engine: str, first: str, ratios: Sequence[float | None]) -> str:
    """One engine's ratio round by round, and whether the rounds disagree on which is faster."""
    each = " / ".join("-" if r is None else f"{r:.2f}x" for r in ratios)
    known = [r for r in ratios if r is not None]
    disagree = any(r > 1 for r in known) and any(r < 1 for r in known)
    warning = "; the rounds disagree on which is faster" if disagree else ""
    return f"{engine} over {first}, round by round: {each}{warning}"


def repeat_notes(runs: Sequence[Sequence[BenchResult]], num_warmups: int) -> list[str]:
    """The notes under a table of repeated runs: every run, each round's ratio, the warm-up."""
    if len(runs[0]) < 2 and not num_warmups:
        return []
    first = runs[0][0].engine
    notes = [runs_note(rs) for rs in runs if len(rs) > 1]
    if len(runs[0]) > 1:
        ratios = round_ratios(runs)[1:]  # the first engine's are all 1
        notes += [ratios_note(rs[0].engine, first, r) for rs, r in zip(runs[1:], ratios)]
        notes.append(
            "median: of an even count of runs, the mean of the middle two; vs first: the ratio "
            "of the medians; counts: medians too"
        )
    if num_warmups:
        rounds = "round ran first and is" if num_warmups == 1 else "rounds ran first and are"
        notes.append(f"{num_warmups} warm-up {rounds} not counted")
    return [f"note: {n}" for n in notes]


def compile_notes(runs: Sequence[Sequence[BenchResult]]) -> list[str]:
    """Per engine that counted them: Triton's compile seconds at start-up, run by run, and the
    kernels built inside the timed runs (whose seconds the engine's time then includes). Silent
    where nothing compiled (the interpreter, a peer)."""
    notes = []
    for engine_runs in runs:
        counted = [r for r in engine_runs if r.startup_compile_s is not None]
        timed = sum(r.timed_compiles or 0 for r in counted)
        if not counted or (timed == 0 and not any(r.startup_compile_s for r in counted)):
            continue
        startup = " / ".join(f"{r.startup_compile_s:.1f}" for r in counted)
        notes.append(
            f"note: {engine_runs[0].engine}: Triton compile at start-up {startup} s; "
            f"{timed} kernel{'s' * (timed != 1)} compiled inside the timed run"
            f"{'s' * (len(counted) != 1)}"
        )
    return notes


def run_line(round_number: int, repeat: int, result: BenchResult, kind: str = "round") -> str:
    """One finished run as a progress line: which round (or warm-up round), which engine, how
    fast."""
    return (
        f"{kind} {round_number}/{repeat}: {result.engine}: {result.output_tokens:,} tokens in "
        f"{result.seconds:.2f} s, {result.tokens_per_s:,.1f} tok/s"
    )
