"""`nanoserve bench --repeat N`: statistics that cannot mislead (issue 31).

Every engine's row is the min, median and max of its counted runs, the ratio column is of the
medians, each round's ratio is listed, and warm-up rounds run but are not counted. The engines
here are scripted stand-ins that report given speeds, so nothing is timed and no figure depends
on the machine; the tiny model still loads, as the command always does.
"""

from __future__ import annotations

import pytest

from nanoserve.bench.rounds import median, round_ratios, run_rounds, runs_note, summarize
from nanoserve.bench.run import run_bench
from nanoserve.bench.workload import BenchResult
from tests.test_bench import TINY_RUN, parse, strict_json

TOKENS = 1_000  # every scripted run makes this many tokens


def result(engine: str, tokens_per_s: float, preemptions: int = 0) -> BenchResult:
    """A run of TOKENS tokens at the given speed."""
    return BenchResult(engine, TOKENS, TOKENS / tokens_per_s, preemptions)


def scripted(engine: str, *tokens_per_s: float):
    """An engine whose runs, in order, go at these speeds; `.calls` counts its runs."""

    def run() -> BenchResult:
        run.calls += 1
        return result(engine, tokens_per_s[run.calls - 1])

    run.calls = 0
    return run


def bench_with(monkeypatch, tmp_path, engines, *argv: str) -> tuple[str, dict]:
    """run_bench's printed output and JSON report, with these engines in place of the real."""
    monkeypatch.setattr("nanoserve.bench.run.engine_runners", lambda *args: engines)
    out_file = tmp_path / "bench.json"
    assert run_bench(parse(*TINY_RUN, *argv, "--json", str(out_file))) == 0
    return out_file.read_text(), strict_json(out_file.read_text())


# stage 11's cold first run (227 tok/s, then 702 warm), and stage 12 at 0.94x of the warm run:
# the slower-middle rule printed stage 12 as 2.92x
COLD_FIRST = (227.0, 702.0)
STAGE_12 = (660.0, 660.0)


# ---- the statistics ----


def test_an_even_counts_median_is_the_mean_of_the_middle_two():
    assert median([4.0, 1.0, 3.0, 100.0]) == 3.5
    assert median([227.0, 702.0]) == 464.5


def test_an_odd_counts_median_is_its_middle_value():
    assert median([50.0, 100.0, 25.0]) == 50.0
    assert median([7.0]) == 7.0


def test_an_engines_summary_is_the_min_median_and_max_of_its_runs():
    summary = summarize([result("a", 50.0), result("a", 100.0, 2), result("a", 25.0)])
    assert (summary.engine, summary.num_runs) == ("a", 3)
    assert (summary.min_tokens_per_s, summary.median_tokens_per_s) == pytest.approx((25, 50))
    assert (summary.max_tokens_per_s, summary.tokens_per_s) == pytest.approx((100, 50))
    assert summary.output_tokens == TOKENS and summary.preemptions == 0  # medians as well


def test_a_cold_first_run_cannot_be_the_reported_figure_for_repeat_2():
    summary = summarize([result("stage 11", s) for s in COLD_FIRST])
    assert summary.tokens_per_s == pytest.approx(464.5)  # not 227, the cold run alone
    assert (summary.min_tokens_per_s, summary.max_tokens_per_s) == pytest.approx(COLD_FIRST)


def test_a_summary_of_one_run_is_that_run():
    run = BenchResult("a", 10, 2.0, None, "a note", 30, 0.5, 1.25)
    summary = summarize([run])
    assert summary.tokens_per_s == summary.min_tokens_per_s == summary.max_tokens_per_s == 5.0
    assert (summary.seconds, summary.preemptions, summary.prefill_tokens) == (2.0, None, 30)
    assert (summary.note, summary.acceptance_rate, summary.tokens_per_step) == ("a note", 0.5, 1.25)


def test_each_rounds_ratio_is_of_the_two_runs_of_that_round():
    runs = [[result("11", s) for s in COLD_FIRST], [result("12", s) for s in STAGE_12]]
    first, second = round_ratios(runs)
    assert first == [1.0, 1.0]
    assert second == pytest.approx([660 / 227, 660 / 702])


def test_the_runs_note_lists_every_run_in_run_order():
    runs = [result("a", 50.0), result("a", 100.0), result("a", 25.0)]
    assert runs_note(runs) == "a: 3 runs, tok/s 50.0 / 100.0 / 25.0 in run order"


def test_no_rounds_run_nothing():
    engine = scripted("a", 1.0)
    assert run_rounds([engine], 0) == [[]] and engine.calls == 0


# ---- the command ----


def test_the_table_and_json_give_each_engines_min_median_and_max(monkeypatch, tmp_path, capsys):
    engines = [scripted("stage 11", 30.0, 10.0, 20.0), scripted("stage 12", 5.0, 40.0, 45.0)]
    _, report = bench_with(monkeypatch, tmp_path, engines, "--repeat", "3")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("engine "))
    assert all(name in header for name in ("min tok/s", "median tok/s", "max tok/s"))
    row = next(line for line in out.splitlines() if line.startswith("stage 12"))
    assert "5.0" in row and "40.0" in row and "45.0" in row
    ours, theirs = report["results"]
    assert [ours["min_tokens_per_s"], ours["median_tokens_per_s"], ours["max_tokens_per_s"]] == (
        pytest.approx([10.0, 20.0, 30.0])
    )
    assert theirs["tokens_per_s"] == pytest.approx(40.0) and theirs["num_runs"] == 3


def test_the_ratio_is_of_the_medians_not_of_one_picked_run(monkeypatch, tmp_path, capsys):
    engines = [scripted("stage 11", *COLD_FIRST), scripted("stage 12", *STAGE_12)]
    _, report = bench_with(monkeypatch, tmp_path, engines, "--repeat", "2")
    out = capsys.readouterr().out
    assert report["results"][1]["ratio"] == pytest.approx(660 / 464.5)  # 1.42x
    row = next(line for line in out.splitlines() if line.startswith("stage 12"))
    assert row.endswith("1.42x")  # the slower-middle rule printed 2.91x here


def test_per_round_ratios_are_printed_and_in_the_json(monkeypatch, tmp_path, capsys):
    engines = [scripted("stage 11", *COLD_FIRST), scripted("stage 12", *STAGE_12)]
    _, report = bench_with(monkeypatch, tmp_path, engines, "--repeat", "2")
    out = capsys.readouterr().out
    assert "note: stage 12 over stage 11, round by round: 2.91x / 0.94x" in out
    assert "the rounds disagree on which is faster" in out  # 2.91x one round, 0.94x the next
    ours, theirs = report["results"]
    assert ours["round_ratios"] == [1.0, 1.0]
    assert theirs["round_ratios"] == pytest.approx([660 / 227, 660 / 702])


def test_rounds_that_agree_are_not_flagged(monkeypatch, tmp_path, capsys):
    engines = [scripted("stage 11", 100.0, 110.0), scripted("stage 12", 90.0, 95.0)]
    bench_with(monkeypatch, tmp_path, engines, "--repeat", "2")
    out = capsys.readouterr().out
    assert "round by round: 0.90x / 0.86x" in out and "disagree" not in out


def test_warm_up_rounds_are_run_but_not_counted(monkeypatch, tmp_path, capsys):
    engines = [scripted("stage 11", 227.0, 702.0, 700.0), scripted("stage 12", 60.0, 660.0, 650.0)]
    _, report = bench_with(
        monkeypatch, tmp_path, engines, "--num-iters-warmup", "1", "--repeat", "2"
    )
    out = capsys.readouterr().out
    assert [e.calls for e in engines] == [3, 3]
    assert out.count("warm-up round 1/1: ") == 2 and out.count("round 2/2: ") == 2
    assert "1 warm-up round ran first and is not counted" in out
    ours, theirs = report["results"]
    assert (ours["tokens_per_s"], ours["min_tokens_per_s"]) == pytest.approx((701, 700))
    assert theirs["round_ratios"] == pytest.approx([660 / 702, 650 / 700])
    assert [len(ours["runs"]), len(ours["warmup_runs"])] == [2, 1]
    assert ours["warmup_runs"][0]["tokens_per_s"] == pytest.approx(227.0)
    assert report["options"]["num_iters_warmup"] == 1


def test_a_warm_up_round_before_a_single_run_is_still_not_counted(monkeypatch, tmp_path, capsys):
    engines = [scripted("stage 11", 1.0, 500.0)]
    _, report = bench_with(monkeypatch, tmp_path, engines, "--num-iters-warmup", "1")
    (only,) = report["results"]
    assert only["tokens_per_s"] == pytest.approx(500.0) and len(only["runs"]) == 1
    assert "warm-up round 1/1: stage 11" in capsys.readouterr().out


def test_no_warm_up_by_default():
    assert parse().num_iters_warmup == 0


@pytest.mark.parametrize("value", ["-1", "one"])
def test_a_warm_up_count_that_is_not_a_count_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit):
        parse("--num-iters-warmup", value)
    assert "argument --num-iters-warmup" in capsys.readouterr().err


def test_a_served_bench_refuses_warm_up_rounds_naming_the_flag():
    with pytest.raises(ValueError, match=r"^argument --num-iters-warmup: "):
        run_bench(parse(*TINY_RUN, "--serve", "--num-iters-warmup", "1"))


def test_the_help_says_warm_up_rounds_run_but_are_not_counted():
    import argparse

    from nanoserve.bench.arguments import add_bench_parser

    parser = argparse.ArgumentParser(prog="nanoserve")
    help_text = " ".join(
        add_bench_parser(parser.add_subparsers(dest="command")).format_help().split()
    )
    assert "not counted" in help_text and "mean of the middle two" in help_text
