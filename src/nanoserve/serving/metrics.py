"""GET /metrics: the server's counters, latency histograms and the engine's state (stage 10).

Introduced in stage 10. prometheus_client writes the text format; each server has a registry of
its own (not the library's global one), so tests and several servers in one process never share a
count. Counters and histograms are updated on the event loop thread by the request handlers, which
see what a client sees (time to first token, time between tokens); the engine's numbers come from
`EngineStats`, the snapshot the loop thread publishes after every step, read at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from nanoserve.serving.request_stream import EngineStats

# what GET /metrics answers with: Prometheus's text format, version 0.0.4
CONTENT_TYPE = CONTENT_TYPE_LATEST

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


class EngineCollector:
    """The engine's gauges and counters, read from the last `EngineStats` at each scrape."""

    def __init__(self) -> None:
        self.stats = EngineStats()

    def collect(self) -> Iterator[Metric]:
        """What Prometheus calls at each scrape: one metric family per engine number."""
        stats = self.stats
        gauges = [
            ("requests_running", "Requests in the engine's running queue.", stats.num_running),
            ("requests_waiting", "Requests in the engine's waiting queue.", stats.num_waiting),
            ("kv_blocks_used", "KV cache blocks held by sequences.", stats.num_blocks_used),
            ("kv_blocks_free", "KV cache blocks free.", stats.num_blocks_free),
            (
                "prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens admitted.",
                stats.prefix_cache_hit_rate,
            ),
        ]
        for name, help, value in gauges:
            if value is not None:  # a manager without blocks (stage 00) has no block gauges
                yield GaugeMetricFamily(f"nanoserve_{name}", help, value=value)
        yield CounterMetricFamily("nanoserve_engine_steps", "Engine steps run.", stats.num_steps)
        yield CounterMetricFamily(
            "nanoserve_preemptions", "Sequences preempted for memory.", stats.num_preemptions
        )
        yield from speculation_metrics(stats.speculation)


def speculation_metrics(spec) -> Iterator[Metric]:
    """Stage 12's guesses (nothing for an engine that does not guess): counters, and the two
    ratios a person reads first (the counters give them over any window: rate over rate)."""
    if spec is None:
        return
    counters = [
        ("verify_steps", "Steps that verified guesses.", spec.num_verify_steps),
        ("draft_tokens", "Guesses judged by a verify step.", spec.num_proposed),
        ("accepted_tokens", "Guesses kept.", spec.num_accepted),
    ]
    for name, help, value in counters:
        yield CounterMetricFamily(f"nanoserve_spec_decode_{name}", help, value)
    yield GaugeMetricFamily(
        "nanoserve_spec_decode_acceptance_rate",
        "Guesses kept / guesses judged, since the engine started.",
        value=spec.acceptance_rate,
    )
    yield GaugeMetricFamily(
        "nanoserve_spec_decode_tokens_per_step",
        "Tokens a verified sequence gained per verify step (kept guesses + 1), since the start.",
        value=spec.tokens_per_step,
    )


class Metrics:
    """One server's registry: what the handlers count, the engine's snapshot and the process's
    own metrics (CPU, memory, open files, Python's version and garbage collector)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineCollector()
        self.registry.register(self.engine)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # (name, help): prometheus_client adds _total to a counter's samples
        self.requests = Counter(
            "nanoserve_requests",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "nanoserve_prompt_tokens",
            "Prompt tokens of accepted requests.",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "nanoserve_generation_tokens", "Tokens generated and sent.", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "nanoserve_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "nanoserve_inter_token_latency_seconds",
            "Between two tokens of one request.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def num_requests(self, finish_reason: str) -> int:
        """Finished requests with this finish reason so far (0 before the first)."""
        value = self.registry.get_sample_value(
            "nanoserve_requests_total", {"finish_reason": finish_reason}
        )
        return int(value or 0)

    def render(self, stats: EngineStats) -> str:
        """Prometheus text exposition format, version 0.0.4, with `stats` as the engine's state.

        A metric the engine should report and cannot (a learner's prefix cache without a
        hit_rate) is a comment at the end: Prometheus reads past it, a person does not."""
        self.engine.stats = stats
        notes = []
        for note in stats.unreported:
            name, why = note.split(": ", 1)
            notes.append(f"# nanoserve_{name} is not reported: {why}\n")
        return generate_latest(self.registry).decode() + "".join(notes)
