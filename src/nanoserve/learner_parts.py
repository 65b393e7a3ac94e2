"""A learner's stage file inside the engine: what `--impl` means to generate, chat, serve, bench.

Introduced with `--impl` on the engine commands (after stage 11). The file is loaded exactly as
`nanoserve check` loads it (`grading.load_impl`); its names that the stage's recipe can replace
become `components=`, and stage 10's `AsyncEngine` becomes the server's loop. It builds nothing:
a file no engine has a place for (stage 00's model pieces, stage 08's graph bookkeeping, stage
09's sharded layers) is a one-line ValueError that names the `check` command instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from nanoserve import grading
from nanoserve.kernels.backend import check_triton_runs_on
from nanoserve.recipes.assemble import recipe_for
from nanoserve.stages import get_stage, implemented_stages

LOOP_NAME = "AsyncEngine"  # stage 10's learner writes the server's loop, not a part of the engine


class LearnerParts(NamedTuple):
    """What of one stage's learner file runs, and in which stage's engine."""

    impl: str  # normalised: ref, starter, an absolute path or a dotted module
    file_stage: int  # the stage whose API the file defines
    engine_stage: int  # the engine it runs in (stage 02's allocator: stage 03's)
    components: dict[str, Any]  # recipe part name -> the learner's object, for LLM(components=)
    loop: type | None = None  # stage 10: the learner's AsyncEngine, run by `serve`

    @property
    def label(self) -> str:
        """`my_prefix.py`, `starter`, `ref`: the file as a table row or a banner names it."""
        return Path(self.impl).name if grading.is_path_like(self.impl) else self.impl

    def describe(self) -> str:
        """One line: whose pieces run where, e.g. "PrefixBlockManager from my_prefix.py"."""
        names = [*self.components, *([LOOP_NAME] if self.loop else [])]
        return f"{', '.join(names)} from {self.label}"


def learner_parts(stage: int, impl: str, base=None) -> LearnerParts:
    """Stage `stage`'s file `impl`, sorted into engine parts and a server loop.

    ImplementationError (one line, as `nanoserve check` says it) for a file that cannot be
    loaded; ValueError when no engine can run any of it. A stage whose own engine has no place
    for its names runs them in the first later engine that has (stage 02 -> 03).
    """
    impl = grading.normalize_impl(impl, base)
    api = vars(grading.load_impl(stage, impl))
    for engine_stage in [stage, *(s.number for s in implemented_stages() if s.number > stage)]:
        parts = recipe_for(engine_stage).parts
        taken = {name: value for name, value in api.items() if name in parts}
        if taken:
            return LearnerParts(impl, stage, engine_stage, taken)
    if LOOP_NAME in api:
        return LearnerParts(impl, stage, stage, {}, api[LOOP_NAME])
    raise ValueError(nothing_to_run(stage, impl, list(api)))


def nothing_to_run(stage: int, impl: str, names: list[str]) -> str:
    """Why a stage's file cannot run inside an engine, and the command that grades it."""
    takes = recipe_for(stage).parts
    engine = f"its engine takes {', '.join(takes)}" if takes else "its engine takes no part"
    return (
        f"--impl {impl}: stage {get_stage(stage).stem}'s {', '.join(names)} are graded on their "
        f"own, not run in an engine ({engine}); grade them with: nanoserve check {stage} "
        f"--impl {impl}"
    )


def require_engine_parts(parts: LearnerParts, command: str) -> None:
    """ValueError unless `parts` has something the engine itself runs (`serve` alone runs a
    loop)."""
    if parts.components or command == "serve":
        return
    raise ValueError(
        f"--impl {parts.impl}: stage {get_stage(parts.file_stage).stem}'s {LOOP_NAME} is a "
        f"server's loop, not a part of the engine: run it with nanoserve serve --stage "
        f"{parts.file_stage} --impl {parts.impl} (or bench --serve)"
    )


def announce(parts: LearnerParts) -> str | None:
    """A line for stderr when the pieces run in a later stage's engine than the one asked for."""
    if parts.engine_stage == parts.file_stage:
        return None
    return (
        f"--impl: stage {get_stage(parts.file_stage).stem}'s engine has no place for "
        f"{', '.join(parts.components)}; it runs in stage "
        f"{get_stage(parts.engine_stage).stem}'s engine"
    )


def checked_impl(args, stages: list[int], device: torch.device) -> LearnerParts:
    """The command line's --impl, loaded before any weights; ValueError, one line, naming the
    flag (options.check_engine_flags calls it).

    A file whose parts run on one attention backend only (stages 05-06: Triton) picks it when
    --attention-backend is auto, and is refused beside another."""
    if getattr(args, "stage", None) is None:  # the newest stage's API is rarely the file's
        raise ValueError(
            f"argument --impl: name the stage {args.impl} is written for, as `nanoserve check` "
            f"does: --stage N --impl {args.impl}"
        )
    if len(stages) != 1:
        raise ValueError("argument --impl: a learner's file is one stage's; name that stage alone")
    if (getattr(args, "tensor_parallel_size", None) or 1) > 1:
        raise ValueError(
            "argument --impl: your pieces are loaded in this process only; the workers that "
            "--tensor-parallel-size starts could not load them: leave it at 1"
        )
    try:
        parts = learner_parts(stages[0], args.impl)
    except grading.ImplementationError as err:  # the very line `nanoserve check` prints
        raise ValueError(str(err)) from None
    runs_on = recipe_for(parts.engine_stage).parts_run_on
    if runs_on is None or not parts.components:
        return parts
    if args.attention_backend in (None, "auto"):
        args.attention_backend = runs_on  # the backend the learner's pieces need
    elif args.attention_backend != runs_on:
        raise ValueError(
            f"argument --attention-backend: {parts.describe()} runs only on the {runs_on} "
            f"backend, not {args.attention_backend}"
        )
    if runs_on == "triton":
        try:
            check_triton_runs_on(device)
        except ValueError as err:
            raise ValueError(f"argument --impl: {err}") from None
    return parts
