"""Stage 10's engine is stage 09's: its learner writes the loop around it
(`serving/async_engine.py`'s AsyncEngine), which steps this engine unchanged."""

from __future__ import annotations

import dataclasses

from nanoserve.recipes import tensor_parallel

# the loop is a string here: serving sits above the recipes, and only learner_api.py imports it
RECIPE = dataclasses.replace(
    tensor_parallel.RECIPE, api={"AsyncEngine": "nanoserve.serving.async_engine:AsyncEngine"}
)
