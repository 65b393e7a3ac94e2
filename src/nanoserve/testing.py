"""Tiny random checkpoints for tests, graded stage tests and notebooks.

Introduced in stage 00. Builds a few-layer Llama / Qwen2 / Qwen3 with transformers and saves it
with `save_pretrained`, so nanoserve's own loader reads it like any checkpoint. float64, so two
code paths doing the same arithmetic must agree token for token. Nothing here is used at serve
time.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY_FAMILIES = ("llama", "qwen2", "qwen3")
# per family: (config class, model class, what differs from TINY_SHAPE)
_FAMILY_EXTRAS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # head_dim != hidden / heads
}


def tiny_hf_model(family: str = "llama", seed: int = 0):
    """A random transformers model of the family (2 layers, hidden 64, GQA 4:2), float64, eval."""
    import transformers

    config_name, model_name, extra = _FAMILY_EXTRAS[family]
    config = getattr(transformers, config_name)(**TINY_SHAPE, **extra)
    config._attn_implementation = "eager"  # the plainest arithmetic, for logit comparisons
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).to(torch.float64).eval()


def save_tiny_model(folder: str | Path, family: str = "llama", seed: int = 0) -> str:
    """Save a tiny random checkpoint into folder; returns the folder as a string."""
    tiny_hf_model(family, seed).save_pretrained(folder)
    return str(folder)
