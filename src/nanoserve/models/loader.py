"""Loaders: a name, path or Hub id in; the model's config, its weights, or its tokenizer out.

Introduced in stage 00. Reads a Hugging Face folder (`config.json` + `*.safetensors`, sharded or
not), a GGUF file (`models/gguf.py`), a known name (`models/registry.py`) or a Hub id
(`models/hub.py`); a preset name builds random weights (`models/presets.py`). A broken checkpoint
raises CheckpointError naming the file; config, weights and tokenizer load apart.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeGuard

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from nanoserve.layers.tensor_parallel import ONE_RANK, TensorParallel
from nanoserve.models.build import WeightMismatch, build_model
from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.models.gguf import read_gguf
from nanoserve.models.hub import hub_snapshot, is_hub_id
from nanoserve.models.presets import PRESETS, preset_config, random_model
from nanoserve.models.registry import KNOWN_MODELS, known_model_path


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong with it."""


def resolve_model_path(model: str | Path) -> Path:
    """An existing path, a known name's file, or a Hub id's snapshot folder; ValueError otherwise.

    In that order: a local file or folder always wins, and only an `owner/name` string that is
    neither goes to the Hugging Face Hub (download, or its local cache when offline).
    """
    path = Path(model)
    if path.exists():
        return path
    if isinstance(model, str) and model in KNOWN_MODELS:
        return known_model_path(model)
    if is_hub_id(model):
        return hub_snapshot(model)
    raise ValueError(
        f"model {str(model)!r} is neither a known model name ({', '.join(KNOWN_MODELS)}), "
        f"a random-weight preset ({', '.join(PRESETS)}), an existing file or folder, "
        "nor a Hugging Face Hub id (owner/name)"
    )


def checkpoint_folder(model: str | Path) -> Path:
    """The safetensors folder behind a path, known name or Hub id (a GGUF is converted once)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return checked_folder(path)
    if path.suffix == ".gguf":
        return converted_gguf(path)
    raise ValueError(
        f"model path {str(path)!r} is not a .gguf file or a folder with config.json "
        "and *.safetensors"
    )


def is_preset(model: str | Path) -> TypeGuard[str]:
    """True for a random-weight preset name (`qwen3-0.6b`, ...) that is not a local path."""
    return isinstance(model, str) and model in PRESETS and not Path(model).exists()


def model_source(model: str | Path) -> str:
    """What a model spec names: a preset as it is, anything else as its checkpoint folder."""
    return model if is_preset(model) else str(checkpoint_folder(model))


def load_model_config(model: str | Path) -> ModelConfig:
    """The model's shape, without loading any weights."""
    if is_preset(model):
        return ModelConfig.from_hf_dict(preset_config(model))
    return read_model_config(checkpoint_folder(model))


def load_tokenizer(model: str | Path):
    """The checkpoint's tokenizer, or None (presets and folders without tokenizer files)."""
    if is_preset(model):
        return None
    return read_tokenizer(checkpoint_folder(model))


def load_model(
    model: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel = ONE_RANK,
    progress: bool | None = None,
) -> CausalLM:
    """The model's weights from a known name, a GGUF file, a safetensors folder or a Hub id.

    With tensor parallelism each rank reads only its slices of the safetensors files. A preset
    name (`qwen3-0.6b`, ...) builds that shape with random weights, for benchmarks that need no
    weight files. `progress`: a bar of tensors loaded on stderr (None: when stderr is a terminal).
    """
    if is_preset(model):
        return random_model(model, device, dtype, tp=tp)
    folder = checkpoint_folder(model)
    config = read_model_config(folder)
    show = (sys.stderr.isatty() if progress is None else progress) and tp.rank == 0
    try:
        with open_state_dict(folder) as state_dict:
            items = state_dict.items()
            tensors = tqdm(items, "loading weights", len(items), leave=False, disable=not show)
            return build_model(config, tensors, device, dtype, tp)
    except WeightMismatch as err:  # name the shard that holds the bad tensor, when one does
        raise CheckpointError(f"{shard_holding(folder, err.name) or folder}: {err}") from None


def checked_folder(folder: Path) -> Path:
    """folder itself, once it is seen to hold config.json and at least one *.safetensors."""
    config_file = folder / "config.json"
    num_shards = len(list(folder.glob("*.safetensors")))
    if not config_file.is_file() or num_shards == 0:
        raise ValueError(
            f"folder {str(folder)!r} needs config.json and *.safetensors "
            f"(found config.json: {config_file.is_file()}, shards: {num_shards})"
        )
    return folder


def read_config(folder: Path) -> dict:
    """The folder's config.json as a dict; CheckpointError when it is not a JSON object."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(config).__name__}")
    return config


def read_model_config(folder: Path) -> ModelConfig:
    """The folder's config.json as a ModelConfig; CheckpointError names the file and the key."""
    try:
        return ModelConfig.from_hf_dict(read_config(folder))
    except CheckpointError:
        raise
    except ValueError as err:  # a missing key, a bad size, an unsupported model_type
        raise CheckpointError(f"{folder / 'config.json'}: {err}") from None


@contextmanager
def open_state_dict(folder: Path) -> Iterator[dict]:
    """Every tensor of the folder's safetensors shards as a slice that reads nothing until it is
    indexed (`t[a:b]`, `t[:]`); CheckpointError names a shard that cannot be read."""
    state_dict: dict[str, object] = {}
    shard: Path | None = None
    try:
        with ExitStack() as stack:
            for shard in sorted(folder.glob("*.safetensors")):
                handle = stack.enter_context(safe_open(shard, framework="pt"))
                state_dict.update((name, handle.get_slice(name)) for name in handle.keys())  # noqa: SIM118
            yield state_dict
    except (SafetensorError, OSError) as err:  # cut short, bad header, unreadable
        raise CheckpointError(
            f"{shard} is not a readable safetensors file (truncated or corrupt?): {err}"
        ) from None


def shard_holding(folder: Path, name: str | None) -> Path | None:
    """The shard of folder that holds tensor `name` (headers only), or None."""
    if name is None:
        return None
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not a dict: no `in f`)
                return shard
    return None


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
    try:
        checkpoint = read_gguf(path, progress=sys.stderr.isatty())
    except ValueError as err:  # its messages already name the file
        raise CheckpointError(str(err)) from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
    save_file(
        {k: v.contiguous() for k, v in checkpoint.state_dict.items()}, staging / "model.safetensors"
    )
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
    from transformers import AutoTokenizer  # lazy: ~2 s to import, and presets never need it

    return AutoTokenizer.from_pretrained(folder)
