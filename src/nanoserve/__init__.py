"""nanoserve: a paged-attention LLM inference engine, built stage by stage.

`LLM(model, stage=N)` builds the engine as of stage N; `SamplingParams` says how to pick tokens;
`__version__` is the installed package's version (pyproject.toml's). The names are imported on
first use, so that `nanoserve` (cli.py) starts inside its Ctrl-C handler before torch loads.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.llm import LLM, CompletionOutput, Logprob, RequestOutput
    from nanoserve.sampling import SamplingParams

try:
    __version__ = version("nanoserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]
_MODULE_OF = {
    "LLM": "nanoserve.llm",
    "CompletionOutput": "nanoserve.llm",
    "Logprob": "nanoserve.llm",
    "RequestOutput": "nanoserve.llm",
    "SamplingParams": "nanoserve.sampling",
}


def __getattr__(name: str):
    """`from nanoserve import LLM`: the public names, imported when first asked for."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
