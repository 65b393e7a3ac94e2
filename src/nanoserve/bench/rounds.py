"""`nanoserve bench --repeat N`: every engine of the table N times, round by round, and medians.

Introduced with the peer comparison (after stage 10). The GPU hosts differ by up to 30 % between
leases and drift within one, so the runs interleave (stage a, stage b, peer, stage a, stage b,
peer, ...) rather than repeating one engine N times in a row: a slow minute then costs every
engine alike. Each engine's row is its median run. It times nothing itself.

    round 1:  a ─ b ─ peer        runs[0] = [a1, a2, a3]  -> median_run -> a's row
    round 2:  a ─ b ─ peer        runs[1] = [b1, b2, b3]  -> median_run -> b's row
    round 3:  a ─ b ─ peer        runs[2] = [p1, p2, p3]  -> median_run -> the peer's row
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nanoserve.bench.workload import BenchResult


def run_rounds(
    runners: Sequence[Callable[[], BenchResult]],
    repeat: int,
    on_run: Callable[[int, BenchResult], None] | None = None,
) -> list[list[BenchResult]]:
    """Call every runner once per round, `repeat` rounds; each runner's results in run order.
    `on_run(round, result)` hears of each run as it ends (round counts from 1)."""
    runs: list[list[BenchResult]] = [[] for _ in runners]
    for round_number in range(1, repeat + 1):
        for engine_runs, runner in zip(runs, runners):
            result = runner()
            engine_runs.append(result)
            if on_run is not None:
                on_run(round_number, result)
    return runs


def median_run(runs: Sequence[BenchResult]) -> BenchResult:
    """The run of median tokens/s; of an even number, the slower of the middle two.

    A real run, not an average, so its seconds, preemptions and prefill tokens belong together.
    """
    ordered = sorted(runs, key=lambda r: r.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def runs_note(runs: Sequence[BenchResult]) -> str:
    """Every run's tokens/s in run order, for the table's notes."""
    each = " / ".join(f"{r.tokens_per_s:,.1f}" for r in runs)
    return f"{runs[0].engine}: {len(runs)} runs, tok/s {each} in run order; the row is the median"


def run_line(round_number: int, repeat: int, result: BenchResult) -> str:
    """One finished run as a progress line: which round, which engine, how fast."""
    return (
        f"round {round_number}/{repeat}: {result.engine}: {result.output_tokens:,} tokens in "
        f"{result.seconds:.2f} s, {result.tokens_per_s:,.1f} tok/s"
    )
