"""Stage 11's engine: stage 09's model, pool, kernels and graphs, run by the overlap loop.

Its learner writes the persistent batch's row updates and the overlap loop; the runner
(`OverlapRunner`) and the engine (`OverlapEngine`) are chosen by `overlaps=True`.
"""

from __future__ import annotations

import dataclasses

from nanoserve.recipes import tensor_parallel

RECIPE = dataclasses.replace(tensor_parallel.RECIPE, overlaps=True)
