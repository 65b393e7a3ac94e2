"""nanoserve: a paged-attention LLM inference engine, built stage by stage.

`LLM(model, stage=N)` builds the engine as of stage N; `SamplingParams` says how to pick tokens;
`__version__` is the installed package's version (pyproject.toml's).
"""

from importlib.metadata import PackageNotFoundError, version

from nanoserve.llm import LLM, RequestOutput
from nanoserve.sampling import SamplingParams

try:
    __version__ = version("nanoserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
