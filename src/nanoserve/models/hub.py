"""Hugging Face Hub ids (`owner/name`) resolved to a local snapshot folder, as the ecosystem does.

Introduced with the stage 00 loaders. `huggingface_hub.snapshot_download` downloads the files the
loader reads when online and finds them in the local Hub cache when offline; it honours
HF_HUB_OFFLINE, HF_HOME and HF_HUB_CACHE itself. Nothing here reads weights or picks revisions.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypeGuard

# Hub repo names: letters, digits, '-', '_' and '.', one owner and one name
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

# What `checkpoint_folder` and the tokenizer read; README, images, .bin/.pth/.gguf copies are not.
HUB_FILE_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
# fnmatch's `*` crosses '/': skip sub-folders (`original/`, `onnx/`), which the loader never reads
HUB_IGNORE_PATTERNS = ["*/*"]


class HubModelUnavailable(ValueError):
    """A Hub id that is in no local Hub cache and could not be downloaded."""


def is_hub_id(model: object) -> TypeGuard[str]:
    """True for a string shaped like a Hub id, `owner/name` (callers check local paths first)."""
    return isinstance(model, str) and HUB_ID.fullmatch(model) is not None


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot folder of repo_id, downloaded if needed; HubModelUnavailable otherwise."""
    # lazy: importing snapshot_download costs ~0.2 s, and only Hub ids need it
    from huggingface_hub import constants, snapshot_download

    try:
        folder = snapshot_download(
            repo_id, allow_patterns=HUB_FILE_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS
        )
    except (OSError, ValueError) as err:  # not found, gated, offline, no network, invalid id
        offline = constants.is_offline_mode()
        message = unavailable_message(repo_id, err, constants.HF_HUB_CACHE, offline)
        raise HubModelUnavailable(message) from err
    return Path(folder)


def unavailable_message(repo_id: str, err: Exception, cache: str, offline: bool) -> str:
    """Why repo_id could not be had, and what to try next, for a one-line CLI error."""
    reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
    hint = (
        "HF_HUB_OFFLINE is set, so nothing is downloaded: download it once online, or unset it"
        if offline
        else "check the id, the network, and for a gated model your token (`hf auth login`)"
    )
    return (
        f"model {repo_id!r} is not a local file or folder, and as a Hugging Face Hub id it could "
        f"not be downloaded or found in the Hub cache {cache} ({reason}); {hint}"
    )
