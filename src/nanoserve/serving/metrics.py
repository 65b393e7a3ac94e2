"""GET /metrics: the server's counters, latency histograms and the engine's state (stage 10).

Introduced in stage 10. Prometheus's text format, written by hand (a dozen lines do it; no
client library). Counters and histograms are updated on the event loop thread by the request
handlers, which see what a client sees (time to first token, time between tokens); the engine's
gauges come from `EngineStats`, the snapshot the loop thread publishes after every step.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

from nanoserve.serving.request_stream import EngineStats

# seconds; log-spaced from a fast GPU step to a slow CPU prefill
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class Histogram:
    """Counts per upper bound (cumulative when written), their sum and their count."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """Count a value (`times` times over)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        """The histogram's sample lines: name_bucket{le=...} (cumulative), name_sum, name_count."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            total += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class Metrics:
    """What the handlers count; `render` adds the engine's snapshot and writes it all."""

    def __init__(self):
        self.requests = Counter()  # finish_reason -> finished requests (abort, rejected, ...)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()

    def render(self, stats: EngineStats) -> str:
        """Prometheus text exposition format, version 0.0.4."""
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[str]) -> None:
            out.extend([f"# HELP nanoserve_{name} {help}", f"# TYPE nanoserve_{name} {kind}"])
            out.extend(f"nanoserve_{s}" for s in samples)

        def gauge(name: str, help: str, value) -> None:
            if value is not None:
                metric(name, "gauge", help, [f"{name} {value}"])

        gauge("requests_running", "Requests in the engine's running queue.", stats.num_running)
        gauge("requests_waiting", "Requests in the engine's waiting queue.", stats.num_waiting)
        gauge("kv_blocks_used", "KV cache blocks held by sequences.", stats.num_blocks_used)
        gauge("kv_blocks_free", "KV cache blocks free.", stats.num_blocks_free)
        gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens admitted.",
            stats.prefix_cache_hit_rate,
        )
        for note in stats.unreported:  # a comment: Prometheus reads past it, a person does not
            name, why = note.split(": ", 1)
            out.append(f"# nanoserve_{name} is not reported: {why}")
        metric(
            "engine_steps_total",
            "counter",
            "Engine steps run.",
            [f"engine_steps_total {stats.num_steps}"],
        )
        metric(
            "preemptions_total",
            "counter",
            "Sequences preempted for memory.",
            [f"preemptions_total {stats.num_preemptions}"],
        )
        metric(
            "requests_total",
            "counter",
            "Finished requests by finish reason.",
            [
                f'requests_total{{finish_reason="{r}"}} {n}'
                for r, n in sorted(self.requests.items())
            ],
        )
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of accepted requests.",
            [f"prompt_tokens_total {self.num_prompt_tokens}"],
        )
        metric(
            "generation_tokens_total",
            "counter",
            "Tokens generated and sent.",
            [f"generation_tokens_total {self.num_generation_tokens}"],
        )
        metric(
            "time_to_first_token_seconds",
            "histogram",
            "From a request's arrival to its first token.",
            self.time_to_first_token.lines("time_to_first_token_seconds"),
        )
        metric(
            "inter_token_latency_seconds",
            "histogram",
            "Between two tokens of one request.",
            self.inter_token_latency.lines("inter_token_latency_seconds"),
        )
        return "\n".join(out) + "\n"
