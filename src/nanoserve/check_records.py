"""What a graded pytest run writes and `nanoserve check` reads: one record per test outcome.

Introduced in stage 00. This module is the pytest plugin (`-p nanoserve.check_records`) that
`nanoserve check` loads into the pytest subprocess it starts: its hooks append a JSON line per
outcome to the file REPORT_ENV_VAR names, and a line per finished test to the progress file, for
the bar. `read_report` folds those lines back into one TestResult per test. It imports nothing
of nanoserve, so the subprocess loads it before any learner code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

REPORT_ENV_VAR = "NANOSERVE_CHECK_REPORT"  # where the hooks below write outcomes
PROGRESS_ENV_VAR = "NANOSERVE_CHECK_PROGRESS"  # and "collected N", then a line per finished test


class Outcome(Enum):
    """What happened to one graded test."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    SKIPPED_NEEDS_GPU = "skipped, needs a GPU"


@dataclass(frozen=True)
class TestResult:
    """One graded test: its pytest id, outcome and a one-line message (failure or skip reason)."""

    __test__ = False  # not a pytest test class, despite the name

    nodeid: str
    outcome: Outcome
    message: str = ""

    @property
    def behaviour(self) -> str:
        """The test name as a sentence: test_task_2_foo_bar[x] -> 'task 2: foo bar [x]'."""
        name = self.nodeid.rsplit("::", 1)[-1].removeprefix("test_")
        name, bracket, params = name.partition("[")
        words = name.split("_")
        if len(words) > 2 and words[0] == "task" and words[1].isdigit():
            words = [f"task {words[1]}:", *words[2:]]
        return " ".join(words) + (f" [{params}" if bracket else "")


def read_report(path: Path) -> tuple[TestResult, ...]:
    """The results the hooks below wrote to `path` (the file REPORT_ENV_VAR names)."""
    return _results(_read_records(path))


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _results(records: list[dict]) -> tuple[TestResult, ...]:
    """Fold setup/call/teardown records into one result per test: a failure beats a skip beats
    a pass, and the first failure's message is the one kept."""
    rank = {Outcome.PASSED: 0, Outcome.SKIPPED: 1, Outcome.SKIPPED_NEEDS_GPU: 1, Outcome.FAILED: 2}
    by_test: dict[str, TestResult] = {}
    for record in records:
        result = TestResult(record["nodeid"], Outcome(record["outcome"]), record["message"])
        previous = by_test.get(result.nodeid)
        if previous is None or rank[result.outcome] > rank[previous.outcome]:
            by_test[result.nodeid] = result
    return tuple(by_test.values())


# ---- the hooks: loaded into the pytest subprocess with `-p nanoserve.check_records` ----


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or not report.passed:
        _write_record(report.nodeid, _outcome_of(report), _message_of(report))


def pytest_collection_finish(session) -> None:
    _write_progress(f"collected {len(session.items)}")


def pytest_runtest_logfinish(nodeid, location) -> None:
    _write_progress("finished")


def _write_progress(line: str) -> None:
    path = os.environ.get(PROGRESS_ENV_VAR)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def pytest_collectreport(report) -> None:
    if report.failed:  # an import or syntax error in the graded file: nothing could run
        _write_record(report.nodeid or "collection", Outcome.FAILED, _message_of(report))


def _outcome_of(report) -> Outcome:
    if report.failed:
        return Outcome.FAILED
    if report.skipped:
        return Outcome.SKIPPED_NEEDS_GPU if "gpu" in report.keywords else Outcome.SKIPPED
    return Outcome.PASSED


def _message_of(report) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


def _write_record(nodeid: str, outcome: Outcome, message: str) -> None:
    path = os.environ.get(REPORT_ENV_VAR)
    if path:
        record = {"nodeid": nodeid, "outcome": outcome.value, "message": message}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
