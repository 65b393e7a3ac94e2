"""nanoserve: a paged-attention LLM inference engine, built stage by stage.

`LLM(model, stage=N)` builds the engine as of stage N; `SamplingParams` says how to pick tokens.
"""

from nanoserve.llm import LLM, RequestOutput
from nanoserve.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
