"""Repo-wide pytest wiring: the --impl option that graded stage tests read, and the markers.

`--impl` (or the NANOSERVE_IMPL environment variable, which reaches xdist workers and
subprocesses) picks what `stages/NN_slug/test_NN_slug.py` grades: ref, starter, a .py path or a
dotted module. Tests marked `gpu` skip with a reason when no CUDA device is visible; without one,
TRITON_INTERPRET=1 is set too, so the Triton kernels of stages 05-06 run through the interpreter.
Tests marked `slow` are left out of `make check` (`-m "not slow"`); SLOW_TESTS marks them by file.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from nanoserve import grading

if not torch.cuda.is_available():
    # Without a GPU, the Triton kernels of stages 05-06 run through Triton's interpreter. Triton
    # reads the variable when @triton.jit runs, i.e. when a kernel module is first imported:
    # nothing above imports one. An explicit TRITON_INTERPRET in the environment wins.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_FIXTURES_ENV = "NANOSERVE_TEST_FIXTURES"  # see tiny_llama_folder
_IMPL_KEY = pytest.StashKey[str]()  # the resolved --impl, set once per session
_LOADED: dict[tuple[int, str], object] = {}  # (stage number, impl) -> its API namespace

# Marked `slow` here, by node id prefix (a file, or one test of it), besides the tests marked in
# their own files: what takes seconds a test, or minutes a file, on a 2-core CPU.
SLOW_TESTS = (
    "tests/test_mutants.py",  # 140+ learner-bug mutants, each graded in a pytest run of its own
    "tests/test_harness.py",  # every stage's graded tests, on the reference and on the starter
    "tests/test_tensor_parallel.py",  # worker processes, started and killed
    "tests/test_serving.py",  # real servers, engine processes and client processes
    "tests/test_equivalence.py",  # the proof chain: every stage's engine, end to end
    "tests/test_hf_parity.py",  # nanoserve and transformers generate side by side
    "tests/test_overlap.py",  # stage 11's proof: engines end to end, two ranks
    "tests/test_speculative.py",  # stage 12's proof: engines end to end, two ranks
    "tests/test_openai_api.py",  # real servers, the openai client
    "tests/test_server_faults.py",  # servers started, signalled, starved
    "tests/test_progress.py",  # `nanoserve check` run in subprocesses, on and off a terminal
    "tests/test_admission.py",  # odd requests beside neighbours at four stages, hypothesis
    "tests/test_impl_refusal.py",  # every stage's learner file loaded, `check` in subprocesses
    "stages/06_paged_attention/test_06_paged_attention.py::test_task_5_",  # engine, interpreted
    "stages/09_tensor_parallel/",  # two- and four-rank process groups
    "tests/test_docs.py::test_every_python_block_of_the_page_runs[stages/09_tensor_parallel/",
    # single tests of 4-7 s (keeping `make check` under a minute)
    "tests/test_seams.py::test_every_stage_engine_is_built_from_the_three_contracts",
    "tests/test_mutant_edits.py::test_every_mutant_makes_the_same_program_from_the_reference_",
    "tests/test_impl_commands.py::test_metrics_say_plainly_that_your_prefix_manager_keeps_no_",
    "tests/test_bench.py::test_the_workload_steps_tool_splits_a_run_whose_steps_add_up_to_it",
    "tests/test_device_sampler.py::test_the_triton_kernel_draws_the_torch_expressions_tokens",
)


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        default=None,
        help="what the graded stage tests run against: ref (default), starter, a path to a .py "
        f"file, or a dotted module name; also read from ${grading.IMPL_ENV_VAR}",
    )


def pytest_configure(config):
    chosen = config.getoption("--impl") or os.environ.get(grading.IMPL_ENV_VAR)
    impl = grading.normalize_impl(chosen, base=config.invocation_params.dir)
    os.environ[grading.IMPL_ENV_VAR] = impl  # workers and child processes inherit it
    config.stash[_IMPL_KEY] = impl
    if not hasattr(config, "workerinput"):  # on an xdist worker, the controller has checked
        refuse_an_impl_that_cannot_load(impl, config.args, config.invocation_params.dir)


def refuse_an_impl_that_cannot_load(impl: str, args: list[str], base: Path) -> None:
    """Stop before any test runs, with one line, when --impl cannot be imported or (for the stage
    folders named on the command line) lacks part of a stage's API: otherwise every test of the
    stage would fail with the same traceback."""
    if impl == "ref":
        return
    try:
        stages = grading.stages_named_by(args, base)
        for stage in stages:
            grading.load_impl(stage.number, impl)
        if not stages and impl != "starter":
            grading.import_impl(impl)
    except grading.ImplementationError as err:
        raise pytest.UsageError(str(err)) from None


def pytest_report_header(config):
    return f"nanoserve graded stages run against --impl {config.stash[_IMPL_KEY]}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    needs_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none is visible here)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(needs_gpu)


@pytest.fixture
def impl(request):
    """The stage API under test, for the stage whose folder holds the requesting test file."""
    stage = grading.stage_for_path(request.path)
    chosen = request.config.stash[_IMPL_KEY]
    key = (stage.number, chosen)
    if key not in _LOADED:
        try:
            _LOADED[key] = grading.load_impl(stage.number, chosen)
        except grading.ImplementationError as err:
            _LOADED[key] = err  # the same one line for every test of the stage, loaded once
    loaded = _LOADED[key]
    if isinstance(loaded, grading.ImplementationError):
        pytest.fail(str(loaded), pytrace=False)  # outside `except`: no chained traceback
    return loaded


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory):
    """A tiny random Llama checkpoint (float64, saved with save_pretrained) shared by all tests.

    It is built once per test session and handed on to the pytest runs that session starts (the
    harness and the mutation self-test grade in subprocesses) through $NANOSERVE_TEST_FIXTURES:
    building it costs each run seconds, and it is the same checkpoint every time (seed 0).
    """
    from nanoserve.testing import save_tiny_model

    shared = shared_fixtures_folder(tmp_path_factory) / "tiny-llama"
    if not shared.is_dir():
        built = save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
        with contextlib.suppress(OSError):  # another run published it first: the same files
            os.rename(built, shared)  # atomic: a reader sees all of it or nothing
    return str(shared)


def shared_fixtures_folder(tmp_path_factory) -> Path:
    """The folder of fixtures this session shares with the pytest runs it starts."""
    inherited = os.environ.get(SHARED_FIXTURES_ENV)
    if inherited and Path(inherited).is_dir():
        return Path(inherited)
    folder = tmp_path_factory.mktemp("shared-fixtures")
    os.environ[SHARED_FIXTURES_ENV] = str(folder)  # read by the child runs, not by this one
    return folder


@pytest.fixture(scope="session")
def slab_engine_tokens(tiny_llama_folder, tmp_path_factory):
    """Stage 01's tokens for `nanoserve.testing.engine_requests()`: the engine-level oracle."""
    from nanoserve.testing import ENGINE_MAX_MODEL_LEN, engine_requests, greedy_token_ids

    shared = shared_fixtures_folder(tmp_path_factory) / "slab_engine_tokens.json"
    if shared.is_file():
        return json.loads(shared.read_text())
    tokens = greedy_token_ids(
        tiny_llama_folder, 1, engine_requests(), max_model_len=ENGINE_MAX_MODEL_LEN
    )
    written = shared.with_suffix(f".{os.getpid()}")
    written.write_text(json.dumps(tokens))
    os.replace(written, shared)  # atomic, as for the checkpoint
    return tokens
