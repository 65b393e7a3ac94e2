"""`nanoserve check NN --impl X`: run a stage's graded tests; report passed, failed, skipped.

Introduced in stage 00. The tests run in a pytest subprocess (a fresh import of the learner's
code each time) with `check_records` loaded as a plugin that records every test's outcome, and a
line per finished test for the progress bar (on a terminal, unless --quiet). A skip is never a
pass: only a test that needs a GPU and skipped for lack of one is excused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from nanoserve import grading
from nanoserve.check_records import (
    PROGRESS_ENV_VAR,
    REPORT_ENV_VAR,
    Outcome,
    TestResult,
    read_report,
)
from nanoserve.stages import get_stage


@dataclass(frozen=True)
class GradedRun:
    """Every result of one run of a stage's graded file, plus pytest's own exit status."""

    stage_number: int
    impl: str
    results: tuple[TestResult, ...]
    returncode: int
    output: str

    def with_outcome(self, outcome: Outcome) -> list[TestResult]:
        """The results that ended with this outcome, in run order."""
        return [r for r in self.results if r.outcome is outcome]

    @property
    def is_success(self) -> bool:
        """True when tests ran and each passed or skipped only for want of a GPU."""
        excused = (Outcome.PASSED, Outcome.SKIPPED_NEEDS_GPU)
        ran_cleanly = self.returncode in (0, 1)  # 1 = some failed; anything else = pytest broke
        return (
            ran_cleanly and bool(self.results) and all(r.outcome in excused for r in self.results)
        )


def run_graded(
    stage: int, impl: str = "ref", keyword: str | None = None, progress: bool = False
) -> GradedRun:
    """Run stage `stage`'s graded test file against `impl` in a pytest subprocess (with a bar of
    finished tests on stderr when `progress`)."""
    root = grading.repo_root()
    test_file = root / get_stage(stage).test_file
    if not test_file.is_file():
        raise FileNotFoundError(f"stage {stage} has no graded test file yet ({test_file})")
    impl = grading.normalize_impl(impl)
    stem = get_stage(stage).stem
    with tqdm(desc=f"stage {stem}", unit="test", leave=False, disable=not progress) as bar:
        results, returncode, output = run_test_file(test_file, impl, keyword, cwd=root, bar=bar)
    return GradedRun(stage, impl, results, returncode, output)


def run_test_file(
    test_file: Path,
    impl: str,
    keyword: str | None = None,
    cwd: Path | None = None,
    extra_args: tuple[str, ...] = (),
    bar: tqdm | None = None,
    deadline_s: float | None = None,
) -> tuple[tuple[TestResult, ...], int, str]:
    """Results, pytest's exit status and its output for one test file run in a subprocess.

    The implementation travels in the environment (the root conftest.py reads it), so this
    works for any test file, graded or not. extra_args go to pytest as they are (e.g. "-x").
    `bar`, if given, counts the tests as they finish. deadline_s: kill a run that takes longer
    and raise TimeoutError with what it printed (None: wait as long as it takes).
    """
    with tempfile.TemporaryDirectory(prefix="nanoserve-check-") as tmp:
        report_path, progress_path = Path(tmp) / "outcomes.jsonl", Path(tmp) / "progress.txt"
        env = {**os.environ, grading.IMPL_ENV_VAR: impl, REPORT_ENV_VAR: str(report_path)}
        env[PROGRESS_ENV_VAR] = str(progress_path)
        command = [sys.executable, "-m", "pytest", str(test_file), "-q"]
        command += ["-p", "no:cacheprovider", "-p", "nanoserve.check_records"]
        command += ["-k", keyword] if keyword else []
        command += list(extra_args)
        with subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as proc:
            stdout, stderr = _wait(proc, progress_path, bar, (deadline_s, test_file.name))
        results = read_report(report_path)
    return results, proc.returncode, stdout + stderr


def _wait(
    proc: subprocess.Popen,
    progress_path: Path,
    bar: tqdm | None,
    deadline: tuple[float | None, str] = (None, "pytest"),
) -> tuple[str, str]:
    """(stdout, stderr) of the finished pytest; meanwhile `bar` follows its progress file.
    deadline (seconds or None, the test file's name): past it the run is killed and
    TimeoutError names the file and what it printed."""
    deadline_s, name = deadline
    start = time.monotonic()
    while True:
        try:
            output = proc.communicate(timeout=0.2)
        except subprocess.TimeoutExpired:  # no output is lost: the next call goes on reading
            output = None
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                proc.kill()
                printed = "".join(proc.communicate())
                raise TimeoutError(
                    f"pytest {name} ran past {deadline_s:g} s and "
                    f"was killed; its last output:\n{printed[-3000:]}"
                ) from None
        if bar is not None and progress_path.is_file():
            total, done = _progress(progress_path.read_text().splitlines())
            bar.total = total
            bar.update(done - bar.n)
        if output is not None:
            return output


def _progress(lines: list[str]) -> tuple[int | None, int]:
    """(tests collected or None before collection ends, tests finished) from the progress file."""
    collected = [int(line.split()[1]) for line in lines if line.startswith("collected ")]
    return (collected[0] if collected else None), sum(line == "finished" for line in lines)


def format_report(run: GradedRun) -> str:
    """A short, human report: passed, failed (with why), skipped (kept apart from passed)."""
    stage = get_stage(run.stage_number)
    lines = [f"stage {stage.stem} ({stage.title}), --impl {run.impl}"]
    lines.append(f"  {'passed':<10}{len(run.with_outcome(Outcome.PASSED))} of {len(run.results)}")
    for outcome, label, note in (
        (Outcome.FAILED, "failed", ""),
        (Outcome.SKIPPED, "skipped", "  (a skip is not a pass)"),
        (Outcome.SKIPPED_NEEDS_GPU, "needs GPU", "  (not run: no GPU here; excused, not passed)"),
    ):
        group = run.with_outcome(outcome)
        if group:
            lines.append(f"  {label:<10}{len(group)}{note}")
            lines += _listed(group)
    if not run.results or run.returncode not in (0, 1):
        tail = "\n".join(run.output.strip().splitlines()[-25:])
        lines.append(f"  pytest exited with status {run.returncode}; its last lines:\n{tail}")
    not_run = len(run.with_outcome(Outcome.SKIPPED_NEEDS_GPU))
    if not run.is_success:
        lines.append("  NOT PASSED")
    elif not_run:
        lines.append(
            f"  OK here: every graded test this machine can run passed; {not_run} "
            f"{'needs' if not_run == 1 else 'need'} a GPU and did not run, so the stage is not "
            f"done until `nanoserve check {run.stage_number}` with the same --impl passes on one"
        )
    else:
        lines.append("  OK: every graded test passed")
    return "\n".join(lines)


def _listed(results: list[TestResult]) -> list[str]:
    """One line per test, each followed by its message unless it repeats the one just shown."""
    lines, last_message = [], None
    for result in results:
        lines.append(f"    - {result.behaviour}")
        if result.message != last_message:
            lines.append(f"        {result.message}")
            last_message = result.message
    return lines


def run_check(
    stage: int, impl: str = "ref", keyword: str | None = None, quiet: bool = False
) -> int:
    """Run, print the report, and return 0 when every test this machine can run passed (a
    graded test skipped for want of a GPU is excused, and the report says it did not run; any
    other skip fails).

    An --impl that cannot be loaded (no such file, an import error, a missing API name) is one
    line on stderr and exit status 2, before any test runs. Unless `quiet`, a line on stderr says
    what runs, and on a terminal a bar counts the tests as they finish.
    """
    try:
        grading.load_impl(stage, grading.normalize_impl(impl))
        if not quiet:
            test_file = get_stage(stage).test_file
            print(f"nanoserve check: running {test_file} against --impl {impl}", file=sys.stderr)
        run = run_graded(stage, impl, keyword, progress=not quiet and sys.stderr.isatty())
    except (FileNotFoundError, ValueError, grading.ImplementationError) as err:
        print(f"nanoserve check: {err}", file=sys.stderr)
        return 2
    print(format_report(run))
    return 0 if run.is_success else 1
