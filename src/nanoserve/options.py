"""The flags of every command that runs an engine, and the one place they are checked.

Introduced in stage 04 (`generate`, `chat` and `bench` all take them; `serve` since stage 10).
`add_engine_source_args` adds the model, stage, --impl, device, dtype and thread flags and every
`EngineConfig` field as a `--flag` spelt as vLLM spells it; `check_engine_flags` checks them all
before any weights load and words each refusal `argument --flag: why`, whichever command asked.
It validates nothing itself: `EngineConfig`, `LLM`'s resolvers and the stage manifest do.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from nanoserve.config import (
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    EngineConfig,
    InvalidOption,
    engine_config_for,
)
from nanoserve.kernels.backend import BACKEND_NAMES
from nanoserve.llm_arguments import (
    DTYPE_NAMES,
    prefix_caching_components,
    resolve_device,
    resolve_dtype,
)
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import load_model_config, model_source
from nanoserve.models.registry import DEFAULT_MODEL
from nanoserve.recipes.assemble import recipe_for
from nanoserve.stages import require_implemented

if TYPE_CHECKING:  # a learner's file imports every stage's API: only when --impl asks
    from nanoserve.learner_parts import LearnerParts


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


# field -> (what it does, its default in words); the defaults are EngineConfig's and
# engine_config_for's, and `test_cli_conventions` holds every field to having one here
ENGINE_FLAG_HELP: dict[str, tuple[str, str]] = {
    "max_model_len": ("prompt + completion tokens of one sequence", "the model's limit, <= 4096"),
    "max_num_seqs": ("sequences in one batch, at most", "64 on a CPU, 512 on CUDA"),
    "max_num_batched_tokens": (
        "tokens in one prefill batch",
        "8192 on a CPU, 16384 on CUDA, or --max-model-len if more",
    ),
    "num_slabs": ("stage 01: K/V slabs", "as many as fit the KV budget, <= --max-num-seqs"),
    "block_size": ("stage 03+: tokens per KV block", "16"),
    "num_kv_blocks": ("stage 03+: blocks in the KV pool", "as many as fit the KV budget"),
    "kv_cache_bytes": ("on a CPU: the KV budget in bytes", "1 GiB"),
    "gpu_memory_utilization": ("on CUDA: share of GPU memory the engine may use", "0.9"),
    "enable_chunked_prefill": ("stage 07+: prefill a long prompt over several steps", "off"),
    "enforce_eager": ("stage 08+: never capture CUDA graphs (debugging, profiling)", "off"),
    "attention_backend": ("auto picks the best the stage offers for the device", "auto"),
    "tensor_parallel_size": ("stage 09+: processes that each hold a shard of the model", "1"),
    "enable_prefix_caching": (
        "stage 07+: share the K/V blocks of a cached prompt prefix; off builds stage 04's "
        "block manager into the stage's engine instead",
        "on from stage 07",
    ),
    "speculative_method": (
        "stage 12: who proposes tokens: ngram (prompt lookup) or draft (the target's first layers)",
        "off (opt in: this flag, or --num-speculative-tokens for ngram)",
    ),
    "num_speculative_tokens": (
        "stage 12: tokens proposed per sequence and step, at most",
        "by batch size (GUESSES_BY_BATCH, measured on the H200)",
    ),
    "prompt_lookup_max": ("stage 12, ngram: the longest suffix looked up", "4"),
    "prompt_lookup_min": ("stage 12, ngram: the shortest suffix that may propose", "1"),
    "draft_num_layers": ("stage 12, draft: the target's layers the draft runs", "half of them"),
    "speculative_model": (
        "stage 12, draft: a separate draft model of the same vocabulary",
        "none: the target's own first layers",
    ),
    "kv_cache_dtype": (
        "stage 13: fp8 stores K/V as e4m3 codes (half the bytes, lossy); auto keeps the model's",
        "auto",
    ),
}
SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}  # vLLM's


def flag_name(field: str) -> str:
    """`max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """EngineConfig fields as --flags; unset ones (None) keep the engine's defaults."""
    group = parser.add_argument_group("engine options")
    for field in fields(EngineConfig):
        does, default = ENGINE_FLAG_HELP[field.name]
        kind: dict[str, Any] = dict(help=f"{does} (default: {default})", default=None)
        if str(field.type).startswith("bool"):  # --enforce-eager / --no-enforce-eager
            kind.update(action=argparse.BooleanOptionalAction)
        elif field.name == "attention_backend":
            kind.update(choices=("auto", *BACKEND_NAMES))
        elif field.name == "speculative_method":
            kind.update(choices=SPECULATIVE_METHODS)
        elif field.name == "kv_cache_dtype":
            kind.update(choices=KV_CACHE_DTYPES)
        elif field.name == "speculative_model":
            kind.update(metavar="MODEL")
        else:
            is_float = field.type == "float"
            kind.update(type=float if is_float else int, metavar="F" if is_float else "N")
        group.add_argument(flag_name(field.name), *SHORT_FLAGS.get(field.name, []), **kind)


def stage_list(text: str) -> list[int]:
    """argparse type: one stage number or a comma list (`4`, `1,4`)."""
    return [int(part) for part in text.split(",")]  # argparse reports a ValueError


def add_engine_source_args(
    parser: argparse.ArgumentParser, many_stages: bool = False, model_action=None
) -> None:
    """The model, the stage(s), the device, the dtype, the threads and the engine options
    (`model_action`: serve's, which lets MODEL stand for --model)."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        action=model_action,
        help="a known name, a preset, a GGUF file, a HF folder or Hub id (default: %(default)s)",
    )
    if many_stages:
        parser.add_argument(
            "--stage",
            type=stage_list,
            action="append",
            metavar="N[,M...]",
            help="N, N,M, or repeated (default: the newest stage)",
        )
    else:
        parser.add_argument(
            "--stage",
            type=int,
            default=None,
            metavar="N",
            help="the engine as of stage N (default: the newest)",
        )
    parser.add_argument(
        "--impl",
        default=None,
        metavar="FILE",
        help="your file of --stage, as `nanoserve check` takes it (a .py path, a dotted module, "
        "starter or ref): its pieces run inside that stage's engine (default: the reference's)",
    )
    parser.add_argument(
        "--device", default=None, metavar="D", help="cpu or cuda (default: cuda if present)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPE_NAMES,
        help="half is float16, float is float32 (default: auto: bfloat16 on cuda, float32 on cpu)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch threads on the CPU (default: $OMP_NUM_THREADS, else one fewer than the CPUs "
        "this process may use, at least 1: a busy CPU slows every thread of a matmul)",
    )
    add_engine_args(parser)


def engine_options(args) -> dict:
    """The engine flags the user set."""
    names = [field.name for field in fields(EngineConfig)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def engine_flags(args) -> list[str]:
    """The engine flags the user set, as a command line again (for a command run as a child)."""
    line = []
    for name, value in engine_options(args).items():
        if isinstance(value, bool):
            line.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        else:
            line += [flag_name(name), str(value)]
    return line


class CheckedFlags(NamedTuple):
    """What the engine flags resolve to, checked, with no weights loaded."""

    source: str  # model_source's: a path, a known name or a Hub id resolved once
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    config: EngineConfig
    parts: LearnerParts | None = None  # --impl: the learner's pieces and the engine they run in


@contextlib.contextmanager
def refusing_as(flag: str) -> Iterator[None]:
    """Reword a ValueError from the block as argparse words a bad flag."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"argument {flag}: {err}") from None


def check_engine_flags(args, stages: list[int]) -> CheckedFlags:
    """Every engine flag checked for these stages, before any weights load (a model's config and
    nothing more is read); ValueError `argument --flag: why` for the first bad one."""
    with refusing_as("--stage"):
        for stage in stages:
            require_implemented(stage)
    with refusing_as("--device"):
        device = resolve_device(args.device)
    parts = None
    if getattr(args, "impl", None) is not None:
        from nanoserve.learner_parts import checked_impl  # imports every stage's API: only here

        parts = checked_impl(args, stages, device)
    stages = stages if parts is None else [parts.engine_stage]
    with refusing_as("--dtype"):
        dtype = resolve_dtype(args.dtype, device)
    with refusing_as("--model"):
        source = model_source(args.model)
        model_config = load_model_config(source)
    try:
        config = engine_config_for(model_config, device, **engine_options(args))
    except InvalidOption as err:
        why = f"{err.value!r} is invalid; expected {err.expected}"
        raise ValueError(f"argument {flag_name(err.name)}: {why}") from None
    with refusing_as("--kv-cache-dtype"):
        if not any(config.kv_cache_dtype in recipe_for(n).kv_cache_dtypes for n in stages):
            raise ValueError(f"{config.kv_cache_dtype!r} needs stage 13 or later (its e4m3 pool)")
    with refusing_as("--enable-prefix-caching"):
        for stage in stages:
            components = None if parts is None else parts.components
            prefix_caching_components(stage, config.enable_prefix_caching, components)
    return CheckedFlags(source, model_config, device, dtype, config, parts)


def default_num_threads(num_cpus: int | None = None) -> int:
    """torch threads when nothing says otherwise: one fewer than the usable CPUs, at least 1.

    Every thread of a CPU matmul waits for the slowest; one that shares its core with another
    process (a tokenizer, a test run, the OS) stalls them all. Measured on a loaded 2-core VM
    (docs/getting-started.md): 1 thread 12.9-14 tok/s, 2 threads 1.05-1.5 tok/s.
    """
    if num_cpus is None:
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        num_cpus = len(usable) if usable else os.cpu_count() or 1
    return max(1, num_cpus - 1)


def apply_threads(args) -> int:
    """Set torch's threads from --threads, else $OMP_NUM_THREADS, else the default; children
    (tensor-parallel workers, the serve engine process) inherit it through $OMP_NUM_THREADS."""
    from_env = os.environ.get("OMP_NUM_THREADS", "")
    num_threads = args.threads or (int(from_env) if from_env.isdigit() else 0)
    num_threads = num_threads or default_num_threads()
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    return num_threads
