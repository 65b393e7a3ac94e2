"""Each stage's learner API, imported: the names its starter.py defines -> the reference objects.

Introduced with the recipes (after stage 10), out of the engine: grading (`--impl ref`),
`nanoserve check` and the mutation self-test read it; no engine code does. The list is the
recipe's (`Recipe.api`, name -> "module:attr"); this module only imports what it names, on first
use, so Triton (stages 05-06) stays a dev/gpu dependency and stage 10's serving loop never becomes
an import of the recipes. A starter defines exactly these names (tests/test_harness.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from nanoserve.recipes.assemble import recipe_for
from nanoserve.stages import implemented_stages


def has_learner_api(stage: int) -> bool:
    """True for a stage whose starter defines an API graded with --impl."""
    implemented = [s.number for s in implemented_stages()]
    return stage in implemented and bool(recipe_for(stage).api)


def learner_api(stage: int) -> dict[str, Any]:
    """API name -> reference object, for every name stage's starter.py defines."""
    return {name: reference(where) for name, where in recipe_for(stage).api.items()}


def reference(where: str) -> Any:
    """The object a recipe's "module:attr" names, its module imported now."""
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)
