"""Hugging Face Hub ids resolve through the local Hub cache, offline, as the ecosystem does.

A tiny checkpoint is placed into a temporary Hub cache in huggingface_hub's own layout (blobs,
snapshot symlinks, refs/main); HF_HUB_OFFLINE is set, so nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from nanoserve import LLM, SamplingParams
from nanoserve.models.hub import HubModelUnavailable, is_hub_id
from nanoserve.models.loader import checkpoint_folder, resolve_model_path
from nanoserve.testing import save_tiny_model

REPO_ID = "tiny-owner/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # any 40-hex id: the cache does not check it
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11]]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hub cache in tmp_path. huggingface_hub read both settings into its
    `constants` at import, so those are patched too; monkeypatch undoes all of it."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def place_in_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """Store folder's files as a download would: content-addressed blobs, a snapshot of symlinks
    to them, and refs/main naming the commit. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)  # no newline: the hub reads it verbatim
    return snapshot


@pytest.fixture
def cached_repo(hub_cache, tmp_path) -> tuple[Path, Path]:
    """(the original folder, its snapshot in the Hub cache) for REPO_ID."""
    folder = Path(save_tiny_model(tmp_path / "original", "llama"))
    return folder, place_in_hub_cache(hub_cache, REPO_ID, folder)


def greedy_tokens(model: str) -> list[list[int]]:
    llm = LLM(model, stage=0, device="cpu", dtype="float64")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_placed_cache_is_one_huggingface_hub_recognises(hub_cache, cached_repo):
    repos = huggingface_hub.scan_cache_dir(hub_cache).repos
    assert [(r.repo_id, [rev.commit_hash for rev in r.revisions]) for r in repos] == [
        (REPO_ID, [COMMIT])
    ]


def test_a_hub_id_resolves_to_its_snapshot_offline(cached_repo):
    _, snapshot = cached_repo
    assert resolve_model_path(REPO_ID) == snapshot
    assert checkpoint_folder(REPO_ID) == snapshot


def test_a_hub_id_generates_the_same_tokens_as_the_folder_it_came_from(cached_repo):
    folder, _ = cached_repo
    assert greedy_tokens(REPO_ID) == greedy_tokens(str(folder))


def test_an_existing_local_path_wins_over_a_hub_id(cached_repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Path(save_tiny_model(tmp_path / REPO_ID, "qwen2"))
    assert resolve_model_path(REPO_ID) == Path(REPO_ID)
    assert local.resolve() == Path(REPO_ID).resolve()


def test_a_hub_id_in_no_cache_fails_saying_it_could_not_be_downloaded_or_found(hub_cache):
    with pytest.raises(HubModelUnavailable) as caught:
        LLM("nobody-here/no-such-model", stage=0, device="cpu", dtype="float64")
    message = str(caught.value)
    assert "'nobody-here/no-such-model'" in message
    assert "could not be downloaded or found in the Hub cache" in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE is set" in message
    assert "\n" not in message  # the CLI prints it as one line
    assert isinstance(caught.value, ValueError)  # so the CLI reports it without a traceback


def test_a_name_that_is_not_hub_shaped_never_goes_to_the_hub(hub_cache):
    with pytest.raises(ValueError, match="nor a Hugging Face Hub id") as caught:
        resolve_model_path("no/such/nested/path")
    assert not isinstance(caught.value, HubModelUnavailable)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("smollm2", False),  # a known name
        ("qwen3-0.6b", False),  # a preset
        ("/abs/model", False),
        ("./rel/model", False),
        ("a/b/c", False),
        ("owner/", False),
    ],
)
def test_only_owner_slash_name_strings_look_like_hub_ids(name, expected):
    assert is_hub_id(name) is expected
