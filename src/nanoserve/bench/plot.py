"""`nanoserve bench --plot PATH`: the run's report (what --json writes) drawn with matplotlib.

Introduced with the bench's JSON report. Left panel: output tokens per second of each engine, a
bar for its median (of an even count of runs, the mean of the middle two) and a dot for every
run (`--repeat`). Right panel, for a served run: the distribution of each request's time to
first token, time per output token and end-to-end latency (empirical CDFs, milliseconds, log
scale). It draws what the report holds and measures nothing.
matplotlib is an optional dependency (the `notebooks` and `docs` extras): `check_plot` refuses
--plot before the model loads when it is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

LATENCIES = (
    ("ttft_ms", "time to first token"),
    ("tpot_ms", "time per output token"),
    ("e2e_ms", "end-to-end"),
)


def check_plot(path: str | None) -> None:
    """ValueError naming --plot when it cannot be written: no matplotlib, or no such folder."""
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "argument --plot: matplotlib is not installed; pip install matplotlib (or the "
            "nanoserve[notebooks] extra)"
        )
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"argument --plot: folder {str(folder)!r} does not exist")


def plot_report(report: dict, path: str) -> None:
    """Draw the report's throughput (and latencies, when served) into an image file at path."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    served = bool(report.get("requests"))
    fig, axes = plt.subplots(1, 2 if served else 1, figsize=(12 if served else 7, 4.5))
    throughput_panel(axes[0] if served else axes, report["results"])
    if served:
        latency_panel(axes[1], report["requests"])
    title = (report.get("header") or [""])[0]
    fig.suptitle(f"nanoserve bench: {title}" if title else "nanoserve bench", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def throughput_panel(ax, results: list[dict]) -> None:
    """One bar per engine (the median of its runs), one dot per run."""
    names = [r["engine"] for r in results]
    ax.barh(names, [r["tokens_per_s"] or 0 for r in results], color="#4C72B0", alpha=0.7)
    for y, record in enumerate(results):
        runs = [run["tokens_per_s"] for run in record.get("runs", []) if run["tokens_per_s"]]
        ax.plot(runs, [y] * len(runs), "o", color="black", markersize=4)
    ax.invert_yaxis()  # the first engine on top, as in the table
    ax.set_xlabel("output tokens / s")
    ax.set_title("throughput (bar: median; dots: every run)", fontsize=9)


def latency_panel(ax, requests: list[dict]) -> None:
    """Empirical CDFs of the served requests' latencies, in milliseconds."""
    for key, label in LATENCIES:
        values = sorted(r[key] for r in requests if r.get(key) is not None)
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", label=f"{label} ({len(values)})")
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("fraction of requests")
    ax.set_title("served latencies (empirical CDF)", fontsize=9)
    ax.legend(fontsize=8)
