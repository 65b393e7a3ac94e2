"""Stage 10's engine is stage 09's: its learner writes the loop around it
(`serving/async_engine.py`'s AsyncEngine), which steps this engine unchanged."""

from __future__ import annotations

from nanoserve.recipes import tensor_parallel

RECIPE = tensor_parallel.RECIPE
