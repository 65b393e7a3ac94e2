"""Hand-written mutants of the reference: each one realistic learner bug the graded tests must kill.

A mutant names what it edits by the stage's learner-API name and an attribute path ("BlockManager.
can_append", "chain_hash"), or by the name of a helper that an API module defines or imports
("pack_rows", "load_kv_tile"); never by module path, so the reference's modules may move. Each
(old, new) of its `edits` is matched on the syntax tree inside that def or class, exactly once, so
reformatting the reference does not break it (see edits.py). `write_mutant` writes the edited
module with imports of the stage's other API names from the reference appended: a learner file
that `--impl PATH` grades like any other. `tests/test_mutants.py` runs each stage's graded file
against each mutant and demands a failing test; `python -m tests.mutants` prints the kill score.

`grade` runs a graded file exactly as `pytest stages/NN_slug --impl FILE` does (the root
conftest's --impl, the `nanoserve.check_records` plugin recording outcomes), only in a fork of a
warm interpreter instead of a fresh one: importing torch once per worker, not once per mutant, is
what keeps two hundred-odd graded runs inside CI's budget. So does killers.txt: each mutant's
graded run starts with the test that killed it last time (`RunFirst`), and -x ends the run there
instead of after every earlier task (a stage 09 mutant: 6 s to 2). After adding or changing a
mutant, `python -m tests.mutants --write N` records its killer; a missing or stale entry only
costs time.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import multiprocessing
import os
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from nanoserve import check_records, grading
from nanoserve.check_records import TestResult
from nanoserve.learner_api import learner_api
from nanoserve.stages import get_stage
from tests.mutants.edits import EditError, apply_edit, definition_source

# imported once by a fork server, so each graded run starts warm (a second, not ten)
WARM_MODULES = [
    "torch",
    "transformers",
    "hypothesis",
    "pytest",
    "nanoserve.llm",
    "nanoserve.check_records",
]


@dataclass(frozen=True)
class Mutant:
    """One learner bug: the def or class `target` names, with every (old, new) of `edits` made."""

    stage: int
    name: str
    bug: str  # the mistake, as a learner would make it
    target: str  # an API name and attributes ("BlockManager.can_append"), or a helper's name
    edits: tuple[tuple[str, str], ...]  # (old, new): code inside target, and what replaces it
    # a helper outside the API's modules: the API name whose file gets the learner's buggy copy
    host: str | None = None

    @property
    def id(self) -> str:
        return f"stage_{self.stage:02d}-{self.name}"

    @property
    def module(self) -> str:
        """The reference module the mutant's learner file is made from."""
        return locate(self.stage, self.host or self.target)[0]


def maker(stage: int, within: str | None = None):
    """The `mutant(name, bug, target, *edits, host=None)` a stage's file builds its list with;
    `within`, a class whose methods the targets name (maker(2, "BlockAllocator"): target "free"
    is BlockAllocator.free, "" the class itself)."""

    def mutant(name: str, bug: str, target: str, *edits: tuple[str, str], host=None) -> Mutant:
        if within is not None:
            target = f"{within}.{target}" if target else within
        return Mutant(stage, name, bug, target, edits, host)

    return mutant


@functools.cache
def reference_source(module: str) -> str:
    """The text of a reference module, found without importing it."""
    return Path(importlib.util.find_spec(module).origin).read_text()


def locate(stage: int, target: str) -> tuple[str, list[str]]:
    """(module, names from its top level to the def or class) of a mutant's target."""
    head, *attributes = target.split(".")
    api = learner_api(stage)
    if head in api:  # the reference object knows its module and its name there
        return api[head].__module__, [*api[head].__qualname__.split("."), *attributes]
    homes = {home for obj in api.values() if (home := home_of(head, obj.__module__))}
    if len(homes) != 1:
        raise EditError(
            f"{head!r} is no stage {stage} API name, nor defined or imported by exactly one "
            f"module of the API (found in {sorted(homes)})"
        )
    return homes.pop(), [head, *attributes]


def home_of(name: str, module: str) -> str | None:
    """The module that defines the top-level `name` of `module`: itself, or the one it imports
    name from (followed through re-exports); None when module has no such name."""
    for node in ast.parse(reference_source(module)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return module
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported = [a.name for a in node.names if a.asname in (None, a.name)]
            if name in imported:
                return home_of(name, node.module) or node.module
    return None


def mutated_source(mutant: Mutant) -> str:
    """The source of the mutant's learner module: its reference module, with the edits made."""
    module, path = locate(mutant.stage, mutant.target)
    source = reference_source(module)
    for old, new in mutant.edits:
        try:
            source = apply_edit(source, path, old, new)
        except EditError as err:
            raise EditError(
                f"mutant {mutant.id}: {err} (in {module}; the reference changed: update the mutant)"
            ) from None
    if not mutant.host:
        if module not in {obj.__module__ for obj in learner_api(mutant.stage).values()}:
            raise EditError(
                f"mutant {mutant.id}: {mutant.target} is in {module}, which defines no API "
                "name: say which API name's file gets its copy (host=)"
            )
        return source
    # A learner writes a shared helper in the same file as the kernels; the buggy copy, defined
    # after the module's import of the helper, is the one its kernels call.
    helper = definition_source(source, path)
    return f"{reference_source(mutant.module)}\n\n# the helper, with the bug\n{helper}"


def api_footer(stage: int, module: str) -> str:
    """Imports of the stage's API names that `module` does not define, from the reference; an
    API name the reference defines under another name (stage 11's OverlapScheduler is the one
    Scheduler) is bound to it."""
    lines = ["", "", "# ---- the rest of the stage API, from the reference ----"]
    for name, obj in learner_api(stage).items():
        real = getattr(obj, "__name__", name)
        if obj.__module__ != module:
            alias = "" if real == name else f" as {name}"
            lines.append(f"from {obj.__module__} import {real}{alias}  # noqa: E402, F401")
        elif real != name:
            lines.append(f"{name} = {real}")
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
    """Every mutant of every stage, in stage order (one module stage_NN.py per stage)."""
    names = sorted(path.stem for path in Path(__file__).parent.glob("stage_[0-9][0-9].py"))
    stages = [importlib.import_module(f"tests.mutants.{name}") for name in names]
    return [m for stage in stages for m in stage.MUTANTS]


GRADE_DEADLINE_S = 900  # one graded file against one mutant: tens of seconds when it works


def grade(
    stage: int, impl: Path, extra_args=("-x",), first: str | None = None
) -> tuple[tuple[TestResult, ...], int, str]:
    """(results, pytest's exit status, output) of stage's graded file run against impl; `first`,
    a test's name (`item.name`, parameters included) to run before the others (`RunFirst`)."""
    test_file = grading.repo_root() / get_stage(stage).test_file
    args = [str(test_file), "-q", "-p", "no:cacheprovider", "-p", "nanoserve.check_records"]
    args += ["--impl", str(impl), *extra_args]
    with tempfile.TemporaryDirectory(prefix="nanoserve-mutant-") as tmp:
        report, log = Path(tmp) / "outcomes.jsonl", Path(tmp) / "output.txt"
        context = _warm_context()
        process = context.Process(target=_pytest_main, args=(args, str(report), str(log), first))
        process.start()
        process.join(GRADE_DEADLINE_S)
        if process.is_alive():  # a mutant that loops forever must not hang `make test`
            process.kill()
            process.join()
            printed = log.read_text() if log.is_file() else ""  # killed before it began
            raise TimeoutError(
                f"stage {stage}'s graded file ran past {GRADE_DEADLINE_S} s against {impl}; "
                f"killed. Its last output:\n{printed[-3000:]}"
            )
        return check_records.read_report(report), process.exitcode, log.read_text()


def _warm_context():
    plugins = [entry.value for entry in entry_points(group="pytest11")]  # what pytest loads
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*WARM_MODULES, *plugins, "anyio._backends._asyncio"])
    return context


def _pytest_main(args: list[str], report: str, log: str, first: str | None) -> None:
    """In the forked child: pytest with its output to log and outcomes to report."""
    import pytest

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ[check_records.REPORT_ENV_VAR] = report
    os.environ.pop(grading.IMPL_ENV_VAR, None)  # --impl says it
    os.chdir(grading.repo_root())
    sys.exit(int(pytest.main(args, plugins=[RunFirst(first)] if first else [])))


class RunFirst:
    """A pytest plugin: the test named `name` runs first, the others after it in file order.

    Only the order changes, never which tests run, so a mutant is killed exactly when the file in
    its own order would kill it (graded tests do not depend on each other's order); but with -x
    a run that fails the named test stops there, without running what precedes it in the file:
    the killer of a stage 09 mutant, first, spares it the two-rank groups of the earlier tasks."""

    def __init__(self, name: str):
        self.name = name

    def pytest_collection_modifyitems(self, items) -> None:
        items.sort(key=lambda item: item.name != self.name)  # stable: the rest keep their order


KILLERS_FILE = Path(__file__).with_name("killers.txt")


def recorded_killers() -> dict[str, str]:
    """{mutant id: the graded test that killed it when `python -m tests.mutants --write` last
    ran}: the test `grade` runs first. A missing or stale entry costs time, never a verdict."""
    if not KILLERS_FILE.is_file():
        return {}
    lines = KILLERS_FILE.read_text().splitlines()
    return dict(line.split(" ", 1) for line in lines if line and not line.startswith("#"))
