"""A broken checkpoint fails with one clear error naming the file and the problem.

Each test saves a valid tiny checkpoint, breaks one thing, and checks the loader's CheckpointError
(a ValueError, so the CLI prints it as one line) names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM
from nanoserve.models.loader import CheckpointError, load_model, load_model_config
from nanoserve.testing import save_tiny_model

CPU, F64 = torch.device("cpu"), torch.float64
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    """The files of one valid tiny llama checkpoint, saved once, by name."""
    folder = Path(save_tiny_model(tmp_path_factory.mktemp("valid"), "llama"))
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


@pytest.fixture
def checkpoint(tmp_path, tiny_files) -> Path:
    """A fresh copy of the valid tiny checkpoint, for one test to break."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    for name, data in tiny_files.items():
        (folder / name).write_bytes(data)
    return folder


def raises_naming(path: Path, problem: str):
    """pytest.raises for a CheckpointError whose message names path and matches problem."""
    return pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*" + problem)


def rewrite_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}  # None: drop the key
    (folder / "config.json").write_text(json.dumps(config))


def test_a_truncated_safetensors_shard_is_named(checkpoint):
    shard = checkpoint / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with raises_naming(shard, "not a readable safetensors file"):
        load_model(str(checkpoint), CPU, F64)


def test_a_safetensors_shard_with_a_garbage_header_is_named(checkpoint):
    shard = checkpoint / "model.safetensors"
    shard.write_bytes(b"\xff" * 8 + b"this is not a safetensors header")
    with raises_naming(shard, "truncated or corrupt"):
        load_model(str(checkpoint), CPU, F64)


def test_a_config_that_is_not_json_is_named(checkpoint):
    config = checkpoint / "config.json"
    config.write_text('{"hidden_size": 64,')
    with raises_naming(config, "is not valid JSON"):
        load_model_config(str(checkpoint))
    with raises_naming(config, "is not valid JSON"):
        load_model(str(checkpoint), CPU, F64)


def test_a_config_that_is_not_an_object_is_named(checkpoint):
    config = checkpoint / "config.json"
    config.write_text("[1, 2, 3]")
    with raises_naming(config, "must hold a JSON object, found list"):
        load_model_config(str(checkpoint))


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_attention_heads"])
def test_a_config_without_a_required_key_names_file_and_key(checkpoint, key):
    rewrite_config(checkpoint, **{key: None})
    with raises_naming(checkpoint / "config.json", f"lacks required key.*{key}"):
        load_model_config(str(checkpoint))


@pytest.mark.parametrize("value", ["64", 0, -4, 64.0, True])
def test_a_config_with_a_size_that_is_not_a_positive_int_names_it(checkpoint, value):
    rewrite_config(checkpoint, hidden_size=value)
    problem = re.escape(f"hidden_size must be a positive integer, got {value!r}")
    with raises_naming(checkpoint / "config.json", problem):
        load_model_config(str(checkpoint))


def test_a_config_of_an_unsupported_architecture_is_named(checkpoint):
    rewrite_config(checkpoint, model_type="gpt2")
    with raises_naming(checkpoint / "config.json", "model_type 'gpt2' is not supported"):
        load_model_config(str(checkpoint))


def test_a_tensor_of_the_wrong_shape_names_shard_tensor_and_both_shapes(checkpoint):
    shard = checkpoint / "model.safetensors"
    state_dict = load_file(shard)
    expected = tuple(state_dict[Q_PROJ].shape)
    state_dict[Q_PROJ] = state_dict[Q_PROJ][:, : expected[1] // 2].contiguous()
    save_file(state_dict, shard, metadata={"format": "pt"})
    found = (expected[0], expected[1] // 2)
    problem = re.escape(f"tensor {Q_PROJ}: expected shape {expected}, found {found}")
    with raises_naming(shard, problem):
        load_model(str(checkpoint), CPU, F64)


def test_a_bad_tensor_in_a_sharded_checkpoint_names_its_shard(checkpoint):
    state_dict = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    names = sorted(state_dict)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    state_dict[second[0]] = torch.zeros(3, 5, dtype=torch.float64)
    shards = [checkpoint / f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for shard, part in zip(shards, (first, second)):
        save_file({name: state_dict[name] for name in part}, shard, metadata={"format": "pt"})
    with raises_naming(shards[1], re.escape(f"tensor {second[0]}: expected shape")):
        load_model(str(checkpoint), CPU, F64)


def test_missing_and_unexpected_tensors_name_the_folder_and_the_tensors(checkpoint):
    shard = checkpoint / "model.safetensors"
    state_dict = load_file(shard)
    del state_dict[Q_PROJ]
    state_dict["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(state_dict, shard, metadata={"format": "pt"})
    problem = re.escape(f"missing ['{Q_PROJ}'], unexpected ['model.layers.0.self_attn.extra")
    with raises_naming(checkpoint, problem):
        load_model(str(checkpoint), CPU, F64)


def test_a_gguf_that_is_not_a_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF but not really" * 10)
    with raises_naming(fake, "is not a GGUF file"):
        load_model(str(fake), CPU, F64)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_llm_reports_a_broken_checkpoint_as_a_value_error_naming_the_file(checkpoint):
    config = checkpoint / "config.json"
    config.write_text("not json at all")
    with pytest.raises(ValueError, match=re.escape(str(config))):
        LLM(str(checkpoint), stage=0, device="cpu", dtype="float64")
