"""Harness self-tests: the graded stage files have teeth, and the grading machinery reports truly.

Every implemented stage with a stage folder must pass all its graded tests against the reference
and fail every one of them against its untouched starter: two pytest runs over every graded file,
one per implementation, side by side. Set NANOSERVE_HARNESS_STAGES=2,3 to run the graded-file
checks for exactly those stages (e.g. before flipping them to implemented).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from nanoserve import check, grading
from nanoserve.check import GradedRun
from nanoserve.check_records import Outcome, TestResult
from nanoserve.stages import get_stage, implemented_stages

ROOT = grading.repo_root()
HARNESS_STAGES_ENV = "NANOSERVE_HARNESS_STAGES"
IMPLS = ("ref", "starter")


def graded_stages():
    """The stages whose graded files are checked: implemented ones with a folder, or the env's."""
    chosen = os.environ.get(HARNESS_STAGES_ENV, "").strip()
    if chosen:
        return [get_stage(int(n)) for n in chosen.split(",")]
    return [s for s in implemented_stages() if (ROOT / "stages" / s.stem).is_dir()]


GRADED = pytest.mark.parametrize("stage", graded_stages(), ids=lambda s: s.stem)


@functools.cache
def all_graded_runs() -> dict[str, tuple]:
    """impl -> (results, exit status, output) of every chosen graded file run against it: one
    pytest subprocess per impl (both at once), as a learner's `pytest stages/NN --impl` runs."""
    files = [str(ROOT / stage.test_file) for stage in graded_stages()]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            impl: pool.submit(
                check.run_test_file,
                ROOT / files[0],
                impl,
                cwd=ROOT,
                extra_args=tuple(files[1:]),
                deadline_s=1800,  # every graded file at once: minutes; a hang fails, named
            )
            for impl in IMPLS
        }
    return {impl: future.result() for impl, future in futures.items()}


def graded_runs(stage) -> dict[str, GradedRun]:
    """The stage's share of all_graded_runs, for ref and for the starter."""
    runs = {}
    for impl, (results, returncode, output) in all_graded_runs().items():
        own = tuple(r for r in results if r.nodeid.startswith(stage.test_file))
        runs[impl] = GradedRun(stage.number, impl, own, returncode, output)
    return runs


def describe(results) -> str:
    return "\n".join(f"{r.outcome.value}: {r.nodeid}: {r.message}" for r in results)


@pytest.fixture(autouse=True, scope="module")
def shared_fixtures(tiny_llama_folder, slab_engine_tokens):
    """Built before the first graded run starts, so every run reuses them (see conftest.py)."""


# ---- the graded files have teeth ----


def test_every_graded_test_passes_on_the_reference_and_fails_on_the_starter():
    problems = {stage.stem: graded_file_problems(stage) for stage in graded_stages()}
    problems = {stem: found for stem, found in problems.items() if found}
    assert problems == {}, "\n\n".join(f"{stem}:\n{found}" for stem, found in problems.items())


def graded_file_problems(stage) -> str:
    """What is wrong with the stage's graded file ('' if nothing): it must pass on the reference
    and, on the untouched starter, reach every test and fail each for want of an implementation."""
    runs = graded_runs(stage)
    ref, starter = runs["ref"], runs["starter"]
    if not ref.results:
        return f"no graded test ran:\n{ref.output[-3000:]}"
    excused = (Outcome.PASSED, Outcome.SKIPPED_NEEDS_GPU)
    checks = [
        ("fail on the reference", describe(r for r in ref.results if r.outcome not in excused)),
        ("the reference run broke", "" if ref.is_success else ref.output[-3000:]),
        (
            "the starter run must reach every test",
            ""
            if len(starter.results) == len(ref.results)
            else f"{len(starter.results)} of {len(ref.results)} reached",
        ),
        ("pass on the starter", describe(starter.with_outcome(Outcome.PASSED))),
        ("skip on the starter", describe(starter.with_outcome(Outcome.SKIPPED))),
        (
            "fail on the starter for another reason than NotImplementedError",
            describe(
                r
                for r in starter.with_outcome(Outcome.FAILED)
                if "NotImplementedError" not in r.message
            ),
        ),
    ]
    return "\n".join(f"{what}:\n{found}" for what, found in checks if found)


@GRADED
def test_each_starter_defines_exactly_the_reference_api(stage):
    assert grading.starter_names(stage.number) == grading.api_names(stage.number)


@pytest.mark.parametrize("stage", implemented_stages(), ids=lambda s: s.stem)
def test_every_path_the_manifest_names_for_an_implemented_stage_exists(stage):
    paths = [stage.lesson, stage.starter, stage.test_file, stage.docs_page]
    paths += [stage.notebook] if stage.has_notebook else []
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"stage {stage.stem} is implemented but lacks: {', '.join(missing)}"


# ---- loading an implementation ----


def test_reference_and_starter_load_the_same_names():
    ref, starter = grading.load_impl(2, "ref"), grading.load_impl(2, "starter")
    assert sorted(vars(ref)) == sorted(vars(starter)) == ["BlockAllocator", "OutOfBlocks"]
    assert ref.BlockAllocator.__module__ == "nanoserve.engine.memory.allocator"


# A learner's stage-02 file: its own BlockAllocator (a file of nothing but the reference's objects
# is refused: tests/test_impl_refusal.py).
MINE = (
    "from nanoserve.engine.memory.allocator import BlockAllocator as Reference, OutOfBlocks\n"
    "class BlockAllocator(Reference):\n    pass\n"
)


def test_a_learner_file_is_loaded_by_path_relative_or_absolute(tmp_path, monkeypatch):
    mine = tmp_path / "mine.py"
    mine.write_text(MINE)
    monkeypatch.chdir(tmp_path)
    assert grading.normalize_impl("mine.py") == str(mine.resolve())
    assert grading.load_impl(2, "mine.py").BlockAllocator(3).allocate(2) == [0, 1]
    assert grading.load_impl(2, str(mine)).OutOfBlocks.__name__ == "OutOfBlocks"


def test_a_module_missing_part_of_the_api_is_refused_with_the_missing_names():
    with pytest.raises(grading.ImplementationError, match=r"does not define rotate_half, "):
        grading.load_impl(0, "nanoserve.layers.norm")


@pytest.mark.parametrize("impl", ["no_such_module_anywhere", "missing/file.py"])
def test_an_impl_that_does_not_exist_is_refused_clearly(impl):
    with pytest.raises(grading.ImplementationError, match="--impl"):
        grading.load_impl(2, impl)


def test_a_relative_path_is_taken_from_base_a_file_or_a_folder(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(MINE)
    monkeypatch.chdir(tmp_path.parent)  # somewhere else: mine.py is not in the working directory
    with pytest.raises(grading.ImplementationError, match="no such file"):
        grading.load_impl(2, "mine.py")
    for base in (tmp_path / "my_pool.py", tmp_path):  # base=__file__ of a neighbour, or its folder
        assert grading.load_impl(2, "mine.py", base=base).BlockAllocator(2).allocate(1) == [0]


def test_the_stage_04_starter_pattern_loads_your_stage_02_03_files_wherever_pytest_runs(
    tmp_path, monkeypatch
):
    starter = (ROOT / get_stage(4).starter).read_text()
    pattern = [
        line.removeprefix("#   ") for line in starter.splitlines() if line.startswith("#   ")
    ]
    assert any("base=__file__" in line for line in pattern), pattern
    learner = tmp_path / "learner"
    learner.mkdir()
    (learner / "my_allocator.py").write_text(
        "from nanoserve.engine.memory.allocator import BlockAllocator as Reference, OutOfBlocks\n"
        "class BlockAllocator(Reference):\n    pass\n"
    )
    (learner / "my_block_table.py").write_text(
        "from nanoserve.engine.memory.block_table import BlockPosition, BlockTable as Reference\n"
        "class BlockTable(Reference):\n    pass\n"
    )
    (learner / "my_pool.py").write_text(
        "\n".join(pattern) + "\n"
        "from nanoserve.engine.runner.input_packer import prepare_decode, prepare_prefill\n"
        "from nanoserve.kernels.torch_paged import gather_kv, store_kvcache\n"
        "from nanoserve.engine.memory.block_manager import BlockManager as Reference\n"
        "class BlockManager(Reference):\n"
        "    def __init__(self, num_blocks, block_size):\n"
        "        super().__init__(num_blocks, block_size, BlockAllocator, BlockTable)\n"
    )
    monkeypatch.chdir(tmp_path)  # not the learner's folder, as under `nanoserve check`
    manager = grading.load_impl(4, str(learner / "my_pool.py")).BlockManager(4, 4)
    assert type(manager.allocator).__module__.startswith("nanoserve_impl_my_allocator_")
    assert manager.table_cls.__module__.startswith("nanoserve_impl_my_block_table_")


def test_a_test_file_finds_its_stage_from_its_folder():
    assert grading.stage_for_path(ROOT / "stages/03_block_table/test_03_block_table.py").number == 3
    with pytest.raises(ValueError, match="not inside a stage folder"):
        grading.stage_for_path(ROOT / "tests/test_harness.py")


# ---- nanoserve check: an implementation that cannot load stops before pytest runs ----


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        ("import no_such_module_anywhere\n", "failed to import: ModuleNotFoundError"),
        ("def broken(:\n", "failed to import: SyntaxError"),
        ("x = 1\n", "does not define OutOfBlocks, BlockAllocator"),
    ],
    ids=["missing", "import-error", "syntax-error", "missing-api"],
)
def test_check_refuses_an_impl_that_cannot_load_with_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys, content, expected
):
    mine = tmp_path / "my_allocator.py"
    if content is not None:
        mine.write_text(content)

    def no_pytest(*args, **kwargs):
        raise AssertionError("pytest must not run for an implementation that cannot load")

    monkeypatch.setattr(check, "run_graded", no_pytest)
    assert check.run_check(2, str(mine)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert expected in err and str(mine) in err, err


def test_the_cli_check_of_a_missing_file_prints_one_line_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nanoserve", "check", "3", "--impl", "my_block_table.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip() == (
        f"nanoserve check: --impl {tmp_path.resolve() / 'my_block_table.py'}: no such file"
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            "x = 1\ny = x +\n",
            "failed to import: SyntaxError: invalid syntax (my_allocator.py, line 2)",
        ),
        ("x = 1\ny = undefined + 1\n", "NameError: name 'undefined' is not defined (line 2 of"),
        ("x = 1\n", "does not define OutOfBlocks, BlockAllocator"),
    ],
    ids=["syntax-error", "import-error", "missing-api"],
)
def test_pytest_on_a_file_that_cannot_load_stops_with_one_line_before_any_test(
    tmp_path, content, expected
):
    mine = tmp_path / "my_allocator.py"
    mine.write_text(content)
    PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    proc = subprocess.run(
        [*PYTEST, "-n", "2", str(ROOT / "stages" / get_stage(2).stem), "--impl", mine.name],
        cwd=tmp_path,  # the learner's folder: --impl is taken from here
        capture_output=True,
        text=True,
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, lines
    assert len(lines) == 1 and lines[0].startswith(f"ERROR: --impl {mine.resolve()}"), lines
    assert expected in lines[0], lines


# ---- reporting: a skip is never a pass ----


def fake_run(*results: TestResult, returncode: int = 0) -> GradedRun:
    return GradedRun(0, "ref", results, returncode, output="")


def test_a_test_skipped_for_want_of_a_gpu_is_excused_and_reported_apart():
    run = fake_run(
        TestResult("f.py::test_task_1_a", Outcome.PASSED),
        TestResult("f.py::test_task_2_b", Outcome.SKIPPED_NEEDS_GPU, "needs a CUDA GPU"),
    )
    assert run.is_success
    report = check.format_report(run)
    assert "needs GPU 1" in report and "not passed" in report
    assert "OK here" in report and "every graded test passed" not in report, (
        "a check with a GPU test left unrun must not read as every test passed"
    )


def test_any_other_skip_fails_the_check_and_shows_its_reason():
    run = fake_run(
        TestResult("f.py::test_task_1_a", Outcome.PASSED),
        TestResult("f.py::test_task_2_b", Outcome.SKIPPED, "hypothesis is not installed"),
    )
    report = check.format_report(run)
    assert not run.is_success
    assert "a skip is not a pass" in report and "hypothesis is not installed" in report
    assert "NOT PASSED" in report


def test_a_failure_is_reported_as_a_behaviour_sentence_with_its_message():
    failed = TestResult("f.py::test_task_3_append_is_atomic[bs=4]", Outcome.FAILED, "assert 1 == 2")
    assert failed.behaviour == "task 3: append is atomic [bs=4]"
    report = check.format_report(fake_run(failed, returncode=1))
    assert "task 3: append is atomic [bs=4]\n        assert 1 == 2" in report


def test_a_run_where_no_test_ran_is_not_a_pass():
    assert not fake_run(returncode=5).is_success


def test_the_plugin_records_pass_fail_skip_and_gpu_skip_from_a_real_pytest_run(tmp_path):
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(
        textwrap.dedent(
            """
            import pytest

            def test_task_1_passes():
                pass

            def test_task_2_fails():
                assert 1 == 2, "one is not two"

            @pytest.mark.skip(reason="not today")
            def test_task_3_skips():
                pass

            @pytest.mark.gpu
            @pytest.mark.skip(reason="needs a CUDA GPU")
            def test_task_4_needs_a_gpu():
                pass
            """
        )
    )
    results, returncode, _ = check.run_test_file(test_file, "ref", cwd=tmp_path)
    outcomes = {r.behaviour: (r.outcome, r.message) for r in results}
    assert returncode == 1
    assert outcomes == {
        "task 1: passes": (Outcome.PASSED, ""),
        "task 2: fails": (Outcome.FAILED, "AssertionError: one is not two"),
        "task 3: skips": (Outcome.SKIPPED, "not today"),
        "task 4: needs a gpu": (Outcome.SKIPPED_NEEDS_GPU, "needs a CUDA GPU"),
    }


# ---- stage 09's rank harness: one test's failure stays in that test ----


def test_a_rank_that_fails_to_load_fails_its_test_alone_and_the_next_test_runs_clean(tmp_path):
    # Rank 0 of this learner file cannot load a column-parallel weight; rank 1 can, and its
    # reply to that test comes later. The column tests must fail with rank 0's error, and the
    # merged tests after them, on the same two ranks, must pass: no reply of a failed test may
    # be read as the answer to the next one.
    from tests.mutants import Mutant, grade, write_mutant

    check_shape = "check_shape(loaded, (self.output_size, *param.shape[1:]))"
    rank_0_fails = Mutant(
        9,
        "rank_0_cannot_load_columns",
        "rank 0's column-parallel weight_loader raises; every other rank loads",
        "ColumnParallelLinear.weight_loader",
        (
            (
                check_shape,
                "if self.tp.rank == 0:\n"
                '    raise ValueError("rank 0 cannot load this weight")\n' + check_shape,
            ),
        ),
    )
    learner_file = write_mutant(rank_0_fails, tmp_path)
    results, _, output = grade(9, learner_file, extra_args=("-k", "task_2 and not four_ranks"))
    column = [r for r in results if "each_rank_computes_its_rows" in r.nodeid]
    merged = [r for r in results if "merged" in r.nodeid]
    assert len(column) == 4 and len(merged) == 3, output[-3000:]
    for r in column:
        assert r.outcome is Outcome.FAILED and "rank 0 cannot load" in r.message, describe([r])
    assert all(r.outcome is Outcome.PASSED for r in merged), describe(merged)
