"""Mutation self-test: each stage's graded file kills every hand-written mutant of the reference.

A mutant (tests/mutants/stage_NN.py) is the reference with one realistic learner bug, named by the
stage's API names and matched on the syntax tree, so a reformatted or moved reference keeps it
(tests/test_mutant_edits.py). Each one is written out as a learner file and graded exactly as
`pytest stages/NN_slug --impl FILE` grades a learner's, stopping at the first failing test (-x);
it must fail. The same assembly without the edit must pass the unit tasks, so a kill is the bug's
doing. `python -m tests.mutants` prints the score per stage and which test killed each mutant.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanoserve import grading
from nanoserve.check_records import Outcome
from tests.mutants import (
    Mutant,
    RunFirst,
    all_mutants,
    grade,
    mutated_source,
    recorded_killers,
    write_mutant,
    write_unmutated,
)

MUTANTS = all_mutants()
KILLERS = recorded_killers()  # run first: a killed mutant's run stops at once (-x)
MIN_MUTANTS_PER_STAGE = 8
# the slow, engine-level task of each stage
ENGINE_TASK = {
    0: "task_7",
    1: "task_4",
    2: "task_6",
    3: "task_6",
    4: "task_6",
    5: "task_5",
    6: "task_5",
    7: "task_6",
    8: "task_4",
    9: "task_6",
    10: "task_6",
    11: "task_4",
    12: "task_4",
    13: "task_4",
}


@pytest.fixture(autouse=True, scope="module")
def shared_fixtures(tiny_llama_folder, slab_engine_tokens):
    """Built before the first graded run starts, so every run reuses them (see conftest.py)."""


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_the_graded_file_kills_the_mutant(mutant: Mutant, tmp_path):
    path = write_mutant(mutant, tmp_path)
    grading.load_impl(mutant.stage, str(path))  # it imports and defines the whole stage API
    results, returncode, output = grade(mutant.stage, path, first=KILLERS.get(mutant.id))
    failed = [r for r in results if r.outcome is Outcome.FAILED]
    assert returncode == 1 and failed, (
        f"mutant {mutant.id} survived: {mutant.bug}\n{output[-2000:]}"
    )
    assert not any("--impl" in r.message for r in failed), f"not graded at all: {failed[0]}"


@pytest.mark.parametrize(
    ("stage", "module"),
    sorted({(m.stage, m.module) for m in MUTANTS}),
    ids=lambda x: str(x).rsplit(".", 1)[-1],
)
def test_the_unmutated_assembly_passes_the_graded_unit_tests(stage, module, tmp_path):
    # the engine-level task is left out for time: test_harness.py runs it on the reference
    path = write_unmutated(stage, module, tmp_path)
    results, returncode, output = grade(stage, path, extra_args=("-k", f"not {ENGINE_TASK[stage]}"))
    assert returncode == 0 and results, output[-3000:]
    assert all(r.outcome in (Outcome.PASSED, Outcome.SKIPPED_NEEDS_GPU) for r in results)


@pytest.mark.parametrize("stage", sorted(ENGINE_TASK))
def test_each_stage_has_enough_distinct_mutants(stage):
    mutants = [m for m in MUTANTS if m.stage == stage]
    assert len(mutants) >= MIN_MUTANTS_PER_STAGE
    assert len({m.name for m in mutants}) == len(mutants), "two mutants share a name"
    sources = [mutated_source(m) for m in mutants]  # each edit applies exactly once
    assert len(set(sources)) == len(sources), "two mutants make the same program"


def test_a_graded_run_past_its_deadline_is_killed_and_named(monkeypatch, tmp_path):
    """A mutant that makes the graded file loop forever fails its test; it never hangs CI."""
    import tests.mutants

    monkeypatch.setattr(tests.mutants, "GRADE_DEADLINE_S", 0.5)  # no graded file is that fast
    path = write_unmutated(2, next(m.module for m in MUTANTS if m.stage == 2), tmp_path)
    with pytest.raises(TimeoutError, match=r"stage 2's graded file ran past 0\.5 s"):
        grade(2, path)


def test_run_first_moves_the_named_test_to_the_front_and_keeps_the_rest_in_order():
    items = [SimpleNamespace(name=name) for name in ("t1", "t2[a]", "t2[b]", "t3")]
    RunFirst("t2[b]").pytest_collection_modifyitems(items)
    assert [item.name for item in items] == ["t2[b]", "t1", "t2[a]", "t3"]
    RunFirst("renamed_since").pytest_collection_modifyitems(items)  # stale: the order stays
    assert [item.name for item in items] == ["t2[b]", "t1", "t2[a]", "t3"]


def test_every_recorded_killer_belongs_to_a_mutant_that_exists():
    """killers.txt keeps no entry of a renamed or deleted mutant (`--write` drops them)."""
    assert set(KILLERS) <= {m.id for m in MUTANTS}
