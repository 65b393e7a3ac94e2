"""Progress on stderr: `nanoserve check` and model loading show a bar on a terminal, nothing but
plain lines elsewhere, and `check --quiet` prints only its report."""

from __future__ import annotations

import io
import sys
import time

import pytest
import torch
from tqdm import tqdm

from nanoserve import check
from nanoserve.models.loader import load_model

KEYWORD = "task_1"  # stage 02's first task: a few fast tests


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, and keeps what was written to it."""

    def isatty(self) -> bool:
        return True


def test_check_off_a_terminal_prints_one_plain_line_and_no_bar(capsys):
    assert check.run_check(2, "ref", KEYWORD) == 0
    out, err = capsys.readouterr()
    assert "OK: every graded test passed" in out
    assert err.splitlines() == [
        "nanoserve check: running stages/02_block_allocator/test_02_block_allocator.py "
        "against --impl ref"
    ]
    assert "\r" not in err and "\r" not in out


def test_check_quiet_prints_only_the_report(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())  # quiet even on a terminal
    assert check.run_check(2, "ref", KEYWORD, quiet=True) == 0
    assert sys.stderr.getvalue() == ""
    assert "OK: every graded test passed" in capsys.readouterr().out


def test_check_on_a_terminal_draws_a_bar_over_the_tests(capsys, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert check.run_check(2, "ref", KEYWORD) == 0
    assert "\r" in terminal.getvalue() and "stage 02_block_allocator" in terminal.getvalue()


def test_the_bar_counts_every_test_that_ran():
    with tqdm(file=io.StringIO(), disable=False) as bar:
        results, returncode, _ = check.run_test_file(
            check.grading.repo_root() / check.get_stage(2).test_file, "ref", KEYWORD, bar=bar
        )
    assert returncode == 0 and len(results) >= 2
    assert bar.n == bar.total == len(results)


@pytest.mark.slow  # waits out a 30 s deadline
def test_a_run_past_its_deadline_is_killed_and_says_what_it_printed(tmp_path):
    """A graded run that hangs (a learner's endless loop, a mutant's) ends at its deadline.
    30 s leaves pytest time to start and print even on a loaded machine."""
    stuck = tmp_path / "test_stuck.py"
    stuck.write_text("import time\n\ndef test_stuck():\n    print('started', flush=True)\n"
                     "    time.sleep(600)\n")  # fmt: skip
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"test_stuck\.py ran past 30 s and was killed") as e:
        check.run_test_file(stuck, "ref", cwd=tmp_path, extra_args=("-s",), deadline_s=30)
    assert time.monotonic() - start < 120
    assert "started" in str(e.value)  # what it printed before it was killed


@pytest.fixture(scope="module")
def folder(tiny_checkpoints):
    return tiny_checkpoints["llama"][0]


def test_loading_off_a_terminal_prints_nothing(folder, capsys):
    load_model(folder, torch.device("cpu"), torch.float32)
    assert capsys.readouterr().err == ""


def test_loading_on_a_terminal_draws_a_bar_over_the_tensors(folder, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_model(folder, torch.device("cpu"), torch.float32)
    assert "loading weights" in terminal.getvalue() and "\r" in terminal.getvalue()
    terminal.seek(0)
    terminal.truncate()
    load_model(folder, torch.device("cpu"), torch.float32, progress=False)
    assert terminal.getvalue() == ""
