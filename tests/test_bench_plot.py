"""`bench --plot PATH`: the run's report drawn as an image, and --plot refused before any loading
when it cannot be written (no matplotlib, no such folder); the GPU workload on a CPU warned
about before it starts."""

from __future__ import annotations

import importlib.util

import pytest

from nanoserve.bench import plot
from nanoserve.bench.plot import check_plot, plot_report
from nanoserve.bench.run import run_bench

from .test_bench import TINY_RUN, parse

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_tiny_bench_draws_its_throughput_with_every_run(tmp_path, capsys):
    image = tmp_path / "bench.png"
    assert run_bench(parse(*TINY_RUN, "--stage", "4", "--repeat", "2", "--plot", str(image))) == 0
    assert image.read_bytes().startswith(PNG)
    assert "nanoserve stage 4" in capsys.readouterr().out


def test_a_served_report_draws_the_latency_distributions(tmp_path):
    requests = [
        {"sent_ms": 0.0, "output_tokens": 5, "ttft_ms": 40.0 + i, "tpot_ms": 9.0, "e2e_ms": 80.0}
        for i in range(8)
    ] + [{"sent_ms": 1.0, "output_tokens": 1, "ttft_ms": 30.0, "tpot_ms": None, "e2e_ms": 30.0}]
    report = {
        "header": ["device cpu"],
        "results": [{"engine": "served", "tokens_per_s": 12.5}],
        "requests": requests,
    }
    image = tmp_path / "served.png"
    plot_report(report, str(image))
    assert image.read_bytes().startswith(PNG)


def test_plot_into_a_missing_folder_is_refused_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match=r"argument --plot: folder .* does not exist"):
        check_plot(str(tmp_path / "no-such-folder" / "bench.png"))
    check_plot(None)  # no --plot: nothing to check


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        plot.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with pytest.raises(ValueError, match="argument --plot: matplotlib is not installed"):
        run_bench(parse(*TINY_RUN, "--plot", str(tmp_path / "bench.png")))


def test_the_gpu_workload_on_a_cpu_is_warned_about_and_a_small_one_is_not(capsys):
    import torch

    from nanoserve.bench.arguments import warn_if_large_on_cpu
    from nanoserve.bench.workload import make_workload

    warn_if_large_on_cpu(torch.device("cpu"), make_workload(256, 1024, 1024))
    err = capsys.readouterr().err
    assert "is the GPU workload; on a CPU it takes hours" in err and "--num-seqs 16" in err
    warn_if_large_on_cpu(torch.device("cpu"), make_workload(16, 256, 64))
    warn_if_large_on_cpu(torch.device("cuda"), make_workload(256, 1024, 1024))
    assert capsys.readouterr().err == ""


def test_bench_shows_progress_only_on_a_terminal_and_not_when_quiet(monkeypatch):
    from nanoserve.bench import arguments

    monkeypatch.setattr(arguments.sys.stderr, "isatty", lambda: True)
    assert arguments.progress(parse(*TINY_RUN)) is True
    assert arguments.progress(parse(*TINY_RUN, "--quiet")) is False
    monkeypatch.setattr(arguments.sys.stderr, "isatty", lambda: False)
    assert arguments.progress(parse(*TINY_RUN)) is False


def test_a_bar_of_finished_requests_goes_to_stderr(capsys):
    from nanoserve import LLM, SamplingParams
    from nanoserve.bench.nanoserve_engine import drive

    llm = LLM("tiny-llama", device="cpu", dtype="float32", max_model_len=64)
    params = [SamplingParams(max_tokens=3, ignore_eos=True)] * 2
    seqs = drive(llm.engine, [[1, 2, 3], [4, 5]], params, progress="stage 11")
    assert all(s.is_finished for s in seqs)
    assert "stage 11" in capsys.readouterr().err
