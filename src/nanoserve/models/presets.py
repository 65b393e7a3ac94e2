"""Presets: named model shapes that build with random weights, for benchmarks and tests.

Introduced with `nanoserve bench` (stage 04). Each preset is a Hugging Face-style `config.json`
dict copied from the real checkpoint, so a preset runs at the real model's speed without its
weights. It has no tokenizer and says nothing sensible: use it to measure, never to read text.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nanoserve.layers.tensor_parallel import ONE_RANK, TensorParallel
from nanoserve.models.build import build_model, checkpoint_state_dict, skipped_names
from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M-Instruct
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "tiny-llama": {  # not a real model: small enough for a test to run it end to end in seconds
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

INIT_STD = 0.02  # Hugging Face's `initializer_range` for all three families


def preset_config(name: str) -> dict:
    """A copy of a preset's config dict; ValueError naming the presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; presets: {', '.join(PRESETS)}")
    return {k: dict(v) if isinstance(v, dict) else v for k, v in PRESETS[name].items()}


def random_tensor(name: str, shape: torch.Size, device, dtype, generator) -> torch.Tensor:
    """One weight as a fresh Hugging Face model has it: N(0, 0.02), norm scales 1, biases 0."""
    if name.endswith("norm.weight"):  # RMSNorm scales (layer norms, Qwen3 q/k norms)
        return torch.ones(shape, device=device, dtype=dtype)
    if name.endswith("bias"):
        return torch.zeros(shape, device=device, dtype=dtype)
    out = torch.empty(shape, device=device, dtype=dtype)  # linear and embedding weights
    return out.normal_(0.0, INIT_STD, generator=generator)


def random_state_dict(
    config: ModelConfig, device, dtype: torch.dtype, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """The preset's whole tensors under Hugging Face's names, made one at a time from `seed`.

    Small weights keep activations finite in bf16 through dozens of layers. The same seed on the
    same device type gives the same tensors, so every tensor-parallel rank slices the same model.
    """
    with torch.device("meta"):
        shapes = checkpoint_state_dict(CausalLM(config))  # names and shapes, no memory
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, meta in shapes.items():
        if name not in skipped_names(config):  # a tied head is the embedding
            yield name, random_tensor(name, meta.shape, device, dtype, generator)


def random_model(
    name: str, device, dtype: torch.dtype, seed: int = 0, tp: TensorParallel = ONE_RANK
) -> CausalLM:
    """The preset's model on device in dtype (rank tp.rank's slices), random from `seed`."""
    config = ModelConfig.from_hf_dict(preset_config(name))
    device = torch.device(device)
    return build_model(config, random_state_dict(config, device, dtype, seed), device, dtype, tp)
