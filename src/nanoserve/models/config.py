"""The model's shape: one frozen dataclass read from a Hugging Face `config.json` dict.

Introduced in stage 00. It describes the Llama / Qwen2 / Qwen3 decoder family only; it holds no
engine settings (those live in `nanoserve.config.EngineConfig`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

# model_type in config.json -> (qkv projections have a bias, q/k get a per-head RMSNorm)
ARCHITECTURES = {
    "llama": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
# config.json keys with no sensible default: without them the decoder has no shape
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
SIZE_FIELDS = (*REQUIRED_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_sizes(sizes: dict) -> None:
    """ValueError naming the first size that is not a positive integer (a bool is not a size)."""
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_sizes({key: getattr(self, key) for key in SIZE_FIELDS})
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; "
                f"expected one of {sorted(ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict; ValueError names a missing or bad key."""
        if missing := [key for key in REQUIRED_KEYS if d.get(key) is None]:
            raise ValueError(f"config lacks required key(s): {', '.join(missing)}")
        check_sizes({key: d[key] for key in REQUIRED_KEYS})  # before head_dim divides by them
        model_type = d.get("model_type", "llama")
        bias, qk_norm = ARCHITECTURES.get(model_type, (False, False))  # __post_init__ rejects
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        params = d.get("rope_parameters")  # transformers 5 folds theta + scaling into this dict
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", bias)),
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
