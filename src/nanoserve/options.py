"""Engine options on the command line: every `EngineConfig` field as a `--flag`, for all commands.

Introduced in stage 04 (`generate`, `chat` and `bench` all take them). It maps flags to field
names and to the field's Python type, nothing more; `EngineConfig` validates the values. The
argparse types of the other commands' number flags live here too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields

from nanoserve.config import EngineConfig


def flag_bool(text: str) -> bool:
    """argparse type: true/false (also 1/0, yes/no)."""
    lowered = text.lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered in ("true", "1", "yes")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (inf allowed)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number > 0 (or inf), got {text!r}")
    return value


# field annotation -> the flag's type
FLAG_TYPES: dict[str, Callable[[str], object]] = {
    "int": int,
    "int | None": int,
    "float": float,
    "str": str,
    "bool": flag_bool,
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """EngineConfig fields as --flags; unset ones keep the engine's defaults."""
    group = parser.add_argument_group("engine options")
    for field in fields(EngineConfig):
        group.add_argument(
            "--" + field.name.replace("_", "-"), default=None, type=FLAG_TYPES[str(field.type)]
        )


def engine_options(args) -> dict:
    """The engine flags the user set."""
    names = [field.name for field in fields(EngineConfig)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
