"""Repo-wide pytest wiring: the --impl option that graded stage tests read, and the gpu marker.

`--impl` (or the NANOSERVE_IMPL environment variable, which reaches xdist workers and
subprocesses) picks what `stages/NN_slug/test_NN_slug.py` grades: ref, starter, a .py path or a
dotted module. Tests marked `gpu` skip with a reason when no CUDA device is visible; without one,
TRITON_INTERPRET=1 is set too, so the Triton kernels of stages 05-06 run through the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve import grading

if not torch.cuda.is_available():
    # Without a GPU, the Triton kernels of stages 05-06 run through Triton's interpreter. Triton
    # reads the variable when @triton.jit runs, i.e. when a kernel module is first imported:
    # nothing above imports one. An explicit TRITON_INTERPRET in the environment wins.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_IMPL_KEY = pytest.StashKey[str]()  # the resolved --impl, set once per session
_LOADED: dict[tuple[int, str], object] = {}  # (stage number, impl) -> its API namespace


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


def pytest_report_header(config):
    return f"nanoserve graded stages run against --impl {config.stash[_IMPL_KEY]}"


def pytest_collection_modifyitems(config, items):
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
            pytest.fail(str(err), pytrace=False)
    return _LOADED[key]


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory):
    """A tiny random Llama checkpoint (float64, saved with save_pretrained) shared by all tests."""
    from nanoserve.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def slab_engine_tokens(tiny_llama_folder):
    """Stage 01's tokens for `nanoserve.testing.engine_requests()`: the engine-level oracle."""
    from nanoserve.testing import ENGINE_MAX_MODEL_LEN, engine_requests, greedy_token_ids

    return greedy_token_ids(
        tiny_llama_folder, 1, engine_requests(), max_model_len=ENGINE_MAX_MODEL_LEN
    )
