"""Loaders: a name or path in, a `CausalLM` with weights and its tokenizer out.

Introduced in stage 00. Reads a Hugging Face folder (`config.json` + `*.safetensors`, sharded or
not) or a GGUF file (`models/gguf.py`), or a known name from the registry; a preset name builds a
random-weight model of a real shape (`models/presets.py`). It never downloads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file

from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.models.presets import PRESETS, random_model
from nanoserve.models.registry import KNOWN_MODELS, known_model_path


class LoadedModel(NamedTuple):
    """A ready model and its tokenizer (None when the checkpoint has none)."""

    model: CausalLM
    tokenizer: Any


def resolve_model_path(model: str | Path) -> Path:
    """A known name's file, or an existing path; ValueError otherwise."""
    if isinstance(model, str) and model in KNOWN_MODELS:
        return known_model_path(model)
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"model {str(model)!r} is neither a known model name ({', '.join(KNOWN_MODELS)}), "
            f"a random-weight preset ({', '.join(PRESETS)}), nor an existing file or folder"
        )
    return path


def load_model(model: str | Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load weights and tokenizer from a known name, a GGUF file or a safetensors folder.

    A preset name (`qwen3-0.6b`, ...) builds that shape with random weights and no tokenizer,
    for benchmarks that need no weight files.
    """
    if isinstance(model, str) and model in PRESETS:
        return LoadedModel(random_model(model, device, dtype), None)
    path = resolve_model_path(model)
    if path.is_dir():
        hf_config, state_dict, tokenizer = read_hf_folder(path)
    elif path.suffix == ".gguf":
        hf_config, state_dict, tokenizer = read_hf_folder(converted_gguf(path))
    else:
        raise ValueError(
            f"model path {str(path)!r} is not a .gguf file or a folder with config.json "
            "and *.safetensors"
        )
    config = ModelConfig.from_hf_dict(hf_config)
    return LoadedModel(build_model(config, state_dict, device, dtype), tokenizer)


def read_hf_folder(folder: Path) -> tuple[dict, dict[str, torch.Tensor], Any]:
    """config.json, every safetensors shard, and the tokenizer if the folder has one."""
    config_file = folder / "config.json"
    shards = sorted(folder.glob("*.safetensors"))
    if not config_file.is_file() or not shards:
        raise ValueError(
            f"folder {str(folder)!r} needs config.json and *.safetensors "
            f"(found config.json: {config_file.is_file()}, shards: {len(shards)})"
        )
    state_dict = {}
    for shard in shards:
        state_dict.update(load_file(shard))
    return json.loads(config_file.read_text()), state_dict, read_tokenizer(folder)


def cache_root() -> Path:
    """Where converted checkpoints are kept: $NANOSERVE_CACHE, else ~/.cache/nanoserve."""
    return Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))


def converted_gguf(path: Path) -> Path:
    """A safetensors folder holding the GGUF's dequantized weights, converted on first use.

    Dequantizing and building the tokenizer takes seconds; reading safetensors takes a fraction
    of one. The folder name carries the file's size and mtime, so a changed file converts again.
    """
    stat = path.stat()
    folder = cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (folder / "config.json").is_file():
        return folder
    from nanoserve.models.gguf import read_gguf  # lazy: `gguf` is only needed here

    checkpoint = read_gguf(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
    save_file({k: v.contiguous() for k, v in checkpoint.state_dict.items()},
              staging / "model.safetensors")  # fmt: skip
    checkpoint.tokenizer.save_pretrained(staging)
    (staging / "config.json").write_text(json.dumps(checkpoint.config, indent=2))
    try:
        staging.rename(folder)  # atomic: a concurrent loader sees all of it or none
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def read_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def build_model(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor] | None,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """A CausalLM on device in dtype, filled from state_dict (random init when it is None)."""
    if state_dict is None:
        with torch.device(device):
            model = CausalLM(config)
    else:  # skip the random init that the checkpoint would overwrite anyway
        with torch.device("meta"):
            model = CausalLM(config)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty makes new tensors, which unties shared ones
        model.model.rotary.reset_inv_freq()  # a computed buffer: no checkpoint holds it
        load_weights(model, state_dict)
    return model.to(dtype=dtype).eval()


def load_weights(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a Hugging Face-named state dict in, checking that nothing is missing or left over."""
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # the head *is* the embedding
    result = model.load_state_dict(state_dict, strict=False)
    missing = set(result.missing_keys) - (
        {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    )
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint does not match the {model.config.model_type} decoder: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )
