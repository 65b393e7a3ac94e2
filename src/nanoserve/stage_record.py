"""What one stage of the curriculum is and has: the record each row of the manifest is.

Split out of stages.py (the manifest, which lists the stages and answers questions about them):
where a stage's lesson, starter, graded tests, docs page and notebook live follows from its stem.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StageStatus(Enum):
    """Whether a stage's reference code exists yet."""

    IMPLEMENTED = "implemented"
    PLANNED = "planned"


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One day-sized step of the curriculum."""

    number: int
    stem: str  # NN_slug: the folder stages/NN_slug, the page docs/stages/NN_slug.md, the recipe
    title: str
    summary: str  # what it adds, one line (the README table)
    oracle: int | None  # the earlier stage whose tokens it must reproduce; None: another proof
    proven_equal_to: str  # the proof in words (the README table)
    reference_modules: tuple[str, ...]  # where its reference code lives, under src/nanoserve/
    needs_gpu: bool = False
    status: StageStatus = StageStatus.IMPLEMENTED
    has_notebook: bool = False

    @property
    def lesson(self) -> str:
        """The lesson a learner follows."""
        return f"stages/{self.stem}/README.md"

    @property
    def starter(self) -> str:
        """The learner's file: the stage API with NotImplementedError bodies."""
        return f"stages/{self.stem}/starter.py"

    @property
    def test_file(self) -> str:
        """The graded contract, run with --impl."""
        return f"stages/{self.stem}/test_{self.stem}.py"

    @property
    def docs_page(self) -> str:
        """The stage's page on the docs site."""
        return f"docs/stages/{self.stem}.md"

    @property
    def notebook(self) -> str | None:
        """The jupytext notebook, for stages that draw something."""
        return f"notebooks/{self.stem}.py" if self.has_notebook else None

    @property
    def is_implemented(self) -> bool:
        """True when the reference code exists and `LLM(stage=number)` works."""
        return self.status is StageStatus.IMPLEMENTED
