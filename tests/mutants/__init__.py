"""Hand-written mutants of the reference: each one realistic learner bug the graded tests must kill.

A mutant is a reference module with one small edit of its source text (`edits`, each `old`
occurring exactly once in that source). `write_mutant` applies it and appends imports of the
stage's other API names from the reference, so the result is a learner file that `--impl PATH`
grades like any other. `tests/test_mutants.py` runs each stage's graded file against each mutant
and demands a failing test; `python -m tests.mutants` prints the kill score per stage.

`grade` runs a graded file exactly as `pytest stages/NN_slug --impl FILE` does (the root
conftest's --impl, the `nanoserve.check` plugin recording outcomes), only in a fork of a warm
interpreter instead of a fresh one: importing torch once per worker, not once per mutant, is
what keeps fifty-odd graded runs inside CI's budget.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from nanoserve import check, grading
from nanoserve.check import TestResult
from nanoserve.learner_api import learner_api
from nanoserve.stages import get_stage

# imported once by a fork server, so each graded run starts warm (a second, not ten)
WARM_MODULES = ["torch", "transformers", "hypothesis", "pytest", "nanoserve.llm", "nanoserve.check"]


@dataclass(frozen=True)
class Mutant:
    """One learner bug: `module`'s source with every (old, new) of `edits` replaced."""

    stage: int
    name: str
    bug: str  # the mistake, as a learner would make it
    module: str  # dotted name of the reference module it edits
    edits: tuple[tuple[str, str], ...]

    @property
    def id(self) -> str:
        return f"stage_{self.stage:02d}-{self.name}"


def reference_source(module: str) -> str:
    """The text of a reference module, found without importing it."""
    return Path(importlib.util.find_spec(module).origin).read_text()


def mutated_source(mutant: Mutant) -> str:
    """The reference module's source with the mutant's edits; each `old` must occur once."""
    source = reference_source(mutant.module)
    for old, new in mutant.edits:
        count = source.count(old)
        if count != 1:
            raise ValueError(
                f"mutant {mutant.id}: {old!r} occurs {count} times in {mutant.module}, not once "
                "(the reference changed: update the mutant)"
            )
        source = source.replace(old, new)
    return source


def api_footer(stage: int, module: str) -> str:
    """Imports of the stage's API names that `module` does not define, from the reference."""
    lines = ["", "", "# ---- the rest of the stage API, from the reference ----"]
    for name, obj in learner_api(stage).items():
        if obj.__module__ != module:
            lines.append(f"from {obj.__module__} import {name}  # noqa: E402, F401")
    return "\n".join(lines) + "\n"


def write_mutant(mutant: Mutant, folder: Path) -> Path:
    """A learner-style file holding the whole stage API with the mutant's bug; its path."""
    path = folder / f"{mutant.id.replace('-', '__')}.py"
    path.write_text(mutated_source(mutant) + api_footer(mutant.stage, mutant.module))
    return path


def write_unmutated(stage: int, module: str, folder: Path) -> Path:
    """The same assembly with no edit: it must pass every graded test (proves the harness)."""
    path = folder / f"stage_{stage:02d}__unmutated_{module.rsplit('.', 1)[-1]}.py"
    path.write_text(reference_source(module) + api_footer(stage, module))
    return path


def all_mutants() -> list[Mutant]:
    """Every mutant of every stage, in stage order."""
    from tests.mutants import (
        stage_01,
        stage_02,
        stage_03,
        stage_04,
        stage_05,
        stage_06,
        stage_07,
        stage_08,
        stage_09,
        stage_10,
    )

    stages = (stage_01, stage_02, stage_03, stage_04, stage_05, stage_06, stage_07, stage_08,
              stage_09, stage_10)  # fmt: skip
    return [m for stage in stages for m in stage.MUTANTS]


def grade(stage: int, impl: Path, extra_args=("-x",)) -> tuple[tuple[TestResult, ...], int, str]:
    """(results, pytest's exit status, output) of stage's graded file run against impl."""
    test_file = grading.repo_root() / get_stage(stage).test_file
    args = [str(test_file), "-q", "-p", "no:cacheprovider", "-p", "nanoserve.check"]
    args += ["--impl", str(impl), *extra_args]
    with tempfile.TemporaryDirectory(prefix="nanoserve-mutant-") as tmp:
        report, log = Path(tmp) / "outcomes.jsonl", Path(tmp) / "output.txt"
        context = _warm_context()
        process = context.Process(target=_pytest_main, args=(args, str(report), str(log)))
        process.start()
        process.join()
        return check.read_report(report), process.exitcode, log.read_text()


def _warm_context():
    plugins = [entry.value for entry in entry_points(group="pytest11")]  # what pytest loads
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*WARM_MODULES, *plugins, "anyio._backends._asyncio"])
    return context


def _pytest_main(args: list[str], report: str, log: str) -> None:
    """In the forked child: pytest with its output to log and outcomes to report."""
    import pytest

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ[check.REPORT_ENV_VAR] = report
    os.environ.pop(grading.IMPL_ENV_VAR, None)  # --impl says it
    os.chdir(grading.repo_root())
    sys.exit(int(pytest.main(args)))
