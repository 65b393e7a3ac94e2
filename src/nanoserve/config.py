"""Engine settings: one frozen, validated dataclass passed explicitly to whatever needs it.

Introduced in stage 00. Things measured at run time (how many KV blocks fit) are returned by the
function that measures them and never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How big batches may be and how the KV cache is sized."""

    max_model_len: int = 2048  # prompt + completion tokens of one sequence, at most (LLM and
    # bench build configs with `engine_config_for`, whose default is the model's, up to 4096)
    max_num_seqs: int = 64  # sequences in one batch, at most
    max_num_batched_tokens: int = 8192  # tokens in one prefill batch, at most
    num_slabs: int | None = None  # stage 01: slabs (default: what fits the budget, <= max_num_seqs)
    block_size: int = 16  # stage 03+: tokens per KV block
    num_kv_blocks: int | None = None  # stage 03+: pool size (default: what fits the budget)
    kv_cache_bytes: int | None = None  # stage 01+: CPU budget for the cache (default 1 GiB)
    gpu_memory_utilization: float = 0.9  # stage 01+: share of GPU memory the engine may use

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        for name in ("num_slabs", "num_kv_blocks", "kv_cache_bytes"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, value, "None or >= 1")
        _require(
            self.max_num_batched_tokens >= self.max_model_len,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f">= max_model_len ({self.max_model_len}), so any admitted prompt fits one batch",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]",
        )


def engine_config_for(model_config, **options) -> EngineConfig:
    """EngineConfig with defaults that depend on the model: max_model_len at most 4096 (or the
    model's own limit), and a prefill budget that always fits one max_model_len prompt."""
    options.setdefault("max_model_len", min(model_config.max_position_embeddings, 4096))
    options.setdefault("max_num_batched_tokens", max(8192, options["max_model_len"]))
    return EngineConfig(**options)


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name} = {value!r} is invalid; expected {allowed}")
