"""GET /metrics's text, without a server: names, histograms, one registry per server."""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.serving.metrics import Metrics
from nanoserve.serving.request_stream import EngineStats

STATS = EngineStats(
    num_running=2,
    num_waiting=1,
    num_blocks_used=7,
    num_blocks_free=9,
    prefix_cache_hit_rate=0.25,
    num_steps=40,
    num_preemptions=3,
)


def sample(text: str, name: str, **labels) -> float | None:
    """The value of one sample in exposition text, parsed by Prometheus's own parser."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_metrics_keep_their_names_and_values():
    metrics = Metrics()
    metrics.requests.labels(finish_reason="length").inc()
    metrics.requests.labels(finish_reason="length").inc()
    metrics.requests.labels(finish_reason="abort").inc()
    metrics.prompt_tokens.inc(11)
    metrics.generation_tokens.inc(5)
    metrics.time_to_first_token.observe(0.003)
    metrics.inter_token_latency.observe(0.2)
    text = metrics.render(STATS)
    want = {
        "nanoserve_requests_running": 2,
        "nanoserve_requests_waiting": 1,
        "nanoserve_kv_blocks_used": 7,
        "nanoserve_kv_blocks_free": 9,
        "nanoserve_prefix_cache_hit_rate": 0.25,
        "nanoserve_engine_steps_total": 40,
        "nanoserve_preemptions_total": 3,
        "nanoserve_prompt_tokens_total": 11,
        "nanoserve_generation_tokens_total": 5,
        "nanoserve_time_to_first_token_seconds_count": 1,
        "nanoserve_inter_token_latency_seconds_sum": 0.2,
    }
    for name, value in want.items():
        assert sample(text, name) == value, name
    assert sample(text, "nanoserve_requests_total", finish_reason="length") == 2
    assert metrics.num_requests("length") == 2 and metrics.num_requests("stop") == 0
    assert "# TYPE nanoserve_time_to_first_token_seconds histogram" in text
    ttft = "nanoserve_time_to_first_token_seconds_bucket"
    assert sample(text, ttft, le="0.0025") == 0 and sample(text, ttft, le="0.005") == 1
    assert sample(text, ttft, le="+Inf") == 1


def test_two_servers_in_one_process_count_apart():
    first, second = Metrics(), Metrics()
    first.generation_tokens.inc(4)
    assert sample(first.render(STATS), "nanoserve_generation_tokens_total") == 4
    assert sample(second.render(STATS), "nanoserve_generation_tokens_total") == 0


def test_metrics_include_the_process_and_python():
    text = Metrics().render(STATS)
    names = {family.name for family in text_string_to_metric_families(text)}
    assert "python_info" in names and "python_gc_collections" in names
    if sys.platform.startswith("linux"):  # ProcessCollector reads /proc
        assert sample(text, "process_resident_memory_bytes") > 0


def test_a_manager_without_blocks_has_no_block_gauges_and_a_missing_one_is_a_comment():
    note = "prefix_cache_hit_rate: the engine's Mine (from mine.py) has no hit_rate property"
    text = Metrics().render(EngineStats(num_running=1, unreported=(note,)))
    assert not re.search(r"^nanoserve_kv_blocks_(used|free) ", text, re.M)
    assert not re.search(r"^nanoserve_prefix_cache_hit_rate ", text, re.M)
    assert "# nanoserve_prefix_cache_hit_rate is not reported: the engine's Mine" in text
    assert sample(text, "nanoserve_requests_running") == 1  # the parser reads past the comment


def test_stage12_guesses_are_counted_and_their_rates_shown():
    from nanoserve.engine.speculation.policy import SpeculationStats

    spec = SpeculationStats(
        num_verify_steps=4, num_verified_seqs=10, num_proposed=30, num_accepted=12
    )
    text = Metrics().render(STATS._replace(speculation=spec))
    assert sample(text, "nanoserve_spec_decode_verify_steps_total") == 4
    assert sample(text, "nanoserve_spec_decode_draft_tokens_total") == 30
    assert sample(text, "nanoserve_spec_decode_accepted_tokens_total") == 12
    assert sample(text, "nanoserve_spec_decode_acceptance_rate") == 0.4
    assert sample(text, "nanoserve_spec_decode_tokens_per_step") == 2.2  # (12 + 10) / 10
    assert sample(Metrics().render(STATS), "nanoserve_spec_decode_draft_tokens_total") is None
