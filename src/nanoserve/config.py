"""Engine settings: one frozen, validated dataclass passed explicitly to whatever needs it.

Introduced in stage 00. Things measured at run time (how many KV blocks fit) are returned by the
function that measures them and never written back here. Validation checks each field's type and
range on its own; what needs the model or the device (backend names, CUDA) is checked above.
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass, fields
from typing import NamedTuple

SPECULATIVE_METHODS = ("ngram", "draft")  # stage 12's proposers
KV_CACHE_DTYPES = ("auto", "fp8")  # vLLM's names: auto keeps the model's dtype; fp8 is e4m3


@dataclass(frozen=True)
class EngineConfig:
    """How big batches may be, how the KV cache is sized and which attention backend runs."""

    max_model_len: int = 2048  # prompt + completion tokens of one sequence, at most (LLM and
    # bench build configs with `engine_config_for`, whose default is the model's, up to 4096)
    max_num_seqs: int = 64  # sequences in one batch, at most (engine_config_for: 512 on CUDA)
    max_num_batched_tokens: int = 8192  # tokens in one prefill batch, at most (16384 on CUDA)
    num_slabs: int | None = None  # stage 01: slabs (default: what fits the budget, <= max_num_seqs)
    block_size: int = 16  # stage 03+: tokens per KV block
    num_kv_blocks: int | None = None  # stage 03+: pool size (default: what fits the budget)
    kv_cache_bytes: int | None = None  # stage 01+: CPU budget for the cache (default 1 GiB)
    gpu_memory_utilization: float = 0.9  # stage 01+: share of GPU memory the engine may use
    enable_chunked_prefill: bool = False  # stage 07+: prefill long prompts over several steps
    enforce_eager: bool = False  # stage 08: never capture CUDA graphs (debugging, profiling)
    attention_backend: str = "auto"  # stage 04+: "auto" picks per device; the engine's backend
    # selector checks the name (it lives above config), so here it need only be a non-empty str
    tensor_parallel_size: int = 1  # stage 09: processes (ranks) that each hold a slice of the model
    enable_prefix_caching: bool | None = None  # stage 07+: share cached prefix blocks, as vLLM's
    # option does. None: the stage's own choice (on from 07). No recipe reads it: `LLM` turns
    # False into stage 04's BlockManager in place of the stage's PrefixBlockManager (llm.py)
    speculative_method: str | None = None  # stage 12: "ngram" (prompt lookup) or "draft" (the
    # target's first layers as its own draft); None: off, unless speculative_model (draft) or
    # num_speculative_tokens (ngram) asks for guessing. Opt-in, as vLLM's: measured on the H200,
    # guessing did not yet beat stage 11 at every batch size (docs/benchmarks.md, issue 30)
    num_speculative_tokens: int | None = None  # stage 12: tokens proposed per sequence and step,
    # at most; None: by batch size (engine/speculation/policy.py, GUESSES_BY_BATCH)
    prompt_lookup_max: int = 4  # stage 12, ngram: the longest suffix looked up in the sequence
    prompt_lookup_min: int = 1  # stage 12, ngram: the shortest suffix that may propose
    draft_num_layers: int | None = None  # stage 12, draft: the target's layers the draft runs
    # (default: half of them, at least one)
    speculative_model: str | None = None  # stage 12, draft: a separate draft model of the same
    # vocabulary (a known name, a preset, a GGUF file or a folder) instead of the target's layers
    kv_cache_dtype: str = "auto"  # stage 13: "fp8" stores K/V as e4m3 codes with a power-of-two
    # scale per (block, KV head): half the bytes, lossy; "auto" keeps the model's dtype (exact)

    def __post_init__(self):
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "tensor_parallel_size",
        ):
            self._require_count(name, optional=False)
        for name in ("num_slabs", "num_kv_blocks", "kv_cache_bytes", "draft_num_layers"):
            self._require_count(name, optional=True)
        self._check_speculation()
        model = self.speculative_model
        _require(
            model is None or (isinstance(model, str) and model.strip() != ""),
            "speculative_model",
            model,
            "None (the target's own first layers) or a model name, GGUF file or folder",
        )
        _require(
            model is None or self.speculative_method != "ngram",
            "speculative_model",
            model,
            "None with speculative_method='ngram' (a draft model drafts; n-gram looks tokens up)",
        )
        fraction = self.gpu_memory_utilization
        _require(
            is_real(fraction) and 0 < fraction <= 1,
            "gpu_memory_utilization",
            fraction,
            "a finite number in (0, 1]",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"one of {', '.join(map(repr, KV_CACHE_DTYPES))}",
        )
        backend = self.attention_backend
        _require(
            isinstance(backend, str) and backend.strip() != "",
            "attention_backend",
            backend,
            'a non-empty backend name such as "auto"',
        )
        for name in ("enable_chunked_prefill", "enforce_eager"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        prefix = self.enable_prefix_caching
        _require(
            prefix is None or isinstance(prefix, bool),
            "enable_prefix_caching",
            prefix,
            "None (the stage's choice) or a bool",
        )
        _require(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f">= max_model_len ({self.max_model_len}), so any admitted prompt fits one batch "
            "(or enable_chunked_prefill, which prefills a long prompt over several steps)",
        )

    def _check_speculation(self) -> None:
        self._require_count("num_speculative_tokens", optional=True)
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            self._require_count(name, optional=False)
        method = self.speculative_method
        _require(
            method is None or method in SPECULATIVE_METHODS,
            "speculative_method",
            method,
            f"None (the stage's choice) or one of {', '.join(map(repr, SPECULATIVE_METHODS))}",
        )
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min",
            self.prompt_lookup_min,
            f"<= prompt_lookup_max ({self.prompt_lookup_max})",
        )

    def _require_count(self, name: str, optional: bool) -> None:
        value = getattr(self, name)
        if optional and value is None:
            return
        expected = "None or an int >= 1" if optional else "an int >= 1"
        _require(is_int(value) and value >= 1, name, value, expected)
        object.__setattr__(self, name, int(value))  # numpy ints in, Python ints out


ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig))


class BatchLimits(NamedTuple):
    """The batch limits an engine gets when none are asked for."""

    max_num_seqs: int
    max_num_batched_tokens: int


# device type -> defaults. CUDA takes nano-vLLM's (a GPU step costs about the same for 64 or 512
# sequences, so a wide batch is nearly free throughput); a CPU keeps EngineConfig's small ones
BATCH_LIMITS = {
    "cpu": BatchLimits(EngineConfig.max_num_seqs, EngineConfig.max_num_batched_tokens),
    "cuda": BatchLimits(max_num_seqs=512, max_num_batched_tokens=16384),
}


def engine_config_for(model_config, device="cpu", **options) -> EngineConfig:
    """EngineConfig with defaults that depend on the model and the device (a torch.device or its
    type): max_model_len at most 4096 (or the model's own limit), the device's BATCH_LIMITS, and
    a prefill budget that always fits one max_model_len prompt. Options given always win."""
    _reject_unknown(options)
    limits = BATCH_LIMITS.get(getattr(device, "type", device), BATCH_LIMITS["cpu"])
    limit = model_config.max_position_embeddings
    max_model_len = options.setdefault("max_model_len", min(limit, 4096))
    options.setdefault("max_num_seqs", limits.max_num_seqs)
    if is_int(max_model_len):  # otherwise EngineConfig names the bad value
        budget = max(limits.max_num_batched_tokens, max_model_len)
        options.setdefault("max_num_batched_tokens", budget)
    config = EngineConfig(**options)
    _require(
        config.max_model_len <= limit,
        "max_model_len",
        config.max_model_len,
        f"<= the model's max_position_embeddings ({limit})",
    )
    return config


def _reject_unknown(options: dict) -> None:
    unknown = [name for name in options if name not in ENGINE_OPTIONS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, ENGINE_OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{name!r} is not an engine option{hint}; valid options: {', '.join(ENGINE_OPTIONS)}"
        )


def is_int(value) -> bool:
    """An integer (numpy's too) that is not a bool: True is no count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite int or float (numpy's too), not a bool: nan and inf pass no range check."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class InvalidOption(ValueError):
    """An engine option with a bad value: which field, the value, and what it expected.

    Typed so that the command line can name the flag (`--max-num-seqs`) where Python names the
    field (`EngineConfig.max_num_seqs`), from one check.
    """

    def __init__(self, name: str, value, expected: str):
        super().__init__(f"EngineConfig.{name} = {value!r} is invalid; expected {expected}")
        self.name, self.value, self.expected = name, value, expected


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise InvalidOption(name, value, allowed)
