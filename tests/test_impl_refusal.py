"""A learner file that only re-exports the reference is refused, in one line, before any test
runs (issue 29): `from nanoserve.engine.runner.persistent_batch import *` would otherwise pass
every graded test of its stage in its author's name; so is a class that inherits, from the
reference, a method its starter asks for. The starter and a genuine copy of the reference load."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from nanoserve import check, grading
from nanoserve.learner_api import has_learner_api, learner_api
from nanoserve.stages import STAGES

GRADED = [stage.number for stage in STAGES if has_learner_api(stage.number)]

REEXPORTS_11 = {
    "star": (
        "from nanoserve.engine.runner.persistent_batch import *\n"
        "from nanoserve.engine.loop.scheduler import Scheduler as OverlapScheduler\n"
    ),
    "names": (
        "from nanoserve.engine.runner.persistent_batch import PersistentBatch\n"
        "from nanoserve.engine.loop.scheduler import Scheduler as OverlapScheduler\n"
    ),
}


def reexport(stage: int) -> str:
    """A file importing each of the stage's API objects from the reference module defining it."""
    return "".join(
        f"from {obj.__module__} import {obj.__name__} as {name}\n"
        for name, obj in learner_api(stage).items()
    )


def genuine_copy(stage: int) -> str:
    """The reference modules of the stage's API, copied into one learner file, as a learner who
    typed the solution in would have it."""
    api = learner_api(stage)
    modules = dict.fromkeys(obj.__module__ for obj in api.values())
    sources = [source_of(module) for module in modules]
    # stages 11 and 12 name the one Scheduler after their own task (OverlapScheduler, ...)
    aliases = [f"{name} = {obj.__name__}" for name, obj in api.items() if obj.__name__ != name]
    return "from __future__ import annotations\n" + "\n".join(sources + aliases) + "\n"


def source_of(module: str) -> str:
    """A reference module's text without its `from __future__` line (one leads the copy)."""
    text = Path(importlib.util.find_spec(module).origin).read_text()
    return re.sub(r"^from __future__ import annotations\n", "", text, flags=re.MULTILINE)


@pytest.mark.parametrize("content", REEXPORTS_11.values(), ids=REEXPORTS_11.keys())
def test_a_stage_11_file_that_reexports_the_reference_is_refused_naming_the_first_name(
    tmp_path, content
):
    mine = tmp_path / "my_overlap.py"
    mine.write_text(content)
    with pytest.raises(grading.ImplementationError) as refused:
        grading.load_impl(11, str(mine))
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"--impl {mine} defines none of stage 11_overlap's API"), message
    assert "PersistentBatch is the reference's own" in message, message


@pytest.mark.parametrize(
    ("stage", "name"), [(11, "OverlapScheduler"), (12, "SpeculativeScheduler")]
)
def test_a_class_that_inherits_its_tasks_from_the_reference_is_refused(tmp_path, stage, name):
    mine = tmp_path / "mine.py"
    starter = (Path(grading.repo_root()) / STAGES[stage].starter).read_text()
    first_task = grading.starter_classes(stage)[name][1][0]
    for body in ("pass", f"{first_task} = Scheduler.{first_task}"):  # inherited, or assigned
        mine.write_text(starter + f"\n\nclass {name}(Scheduler):\n    {body}\n")
        with pytest.raises(grading.ImplementationError, match=rf"{name}\.{first_task} is the ref"):
            grading.load_impl(stage, str(mine))


@pytest.mark.parametrize("stage", GRADED)
def test_every_stage_refuses_a_file_of_the_references_own_objects(tmp_path, stage):
    mine = tmp_path / "mine.py"
    mine.write_text(reexport(stage))
    first = next(iter(learner_api(stage)))
    with pytest.raises(grading.ImplementationError, match=f": {first} is the reference's own"):
        grading.load_impl(stage, str(mine))


@pytest.mark.parametrize("stage", GRADED)
def test_no_starter_is_refused(stage):
    assert set(vars(grading.load_impl(stage, "starter"))) == set(learner_api(stage))


@pytest.mark.parametrize("stage", [2, 11, 12])
def test_a_genuine_copy_of_the_reference_is_not_refused(tmp_path, stage):
    mine = tmp_path / "mine.py"
    mine.write_text(genuine_copy(stage))
    loaded = grading.load_impl(stage, str(mine))
    assert all(grading.reference_module(obj) is None for obj in vars(loaded).values())


def test_check_refuses_a_reexport_with_one_line_and_exit_2_before_pytest(
    tmp_path, monkeypatch, capsys
):
    mine = tmp_path / "my_overlap.py"
    mine.write_text(REEXPORTS_11["star"])

    def no_pytest(*args, **kwargs):
        raise AssertionError("pytest must not run for a file that re-exports the reference")

    monkeypatch.setattr(check, "run_graded", no_pytest)
    assert check.run_check(11, str(mine)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "defines none of stage 11_overlap's API itself" in err and str(mine) in err, err
