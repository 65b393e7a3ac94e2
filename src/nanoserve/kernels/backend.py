"""The attention-backend seam: the contract every backend meets, and the one place that picks one.

Introduced in stage 04, when a second backend was coming. A backend stores this step's K/V and
attends over the cache it was built on; every backend lives in this package (torch: attention.py,
slab_attention.py, slot_attention.py, torch_paged.py; Triton: triton_backend.py).
`select_attention_backend` picks one per engine from what the stage offers and what the device can
run, with the reason, logged once. It builds nothing: the stage's recipe constructs the one named.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from nanoserve.types import AttentionMetadata

logger = logging.getLogger("nanoserve")

BACKEND_NAMES = ("torch", "triton", "flash_attn")  # what attention_backend= may name, or "auto"


@runtime_checkable
class AttentionBackend(Protocol):
    """One model call's attention, layer by layer, over the cache the backend was built on.

    Contract: `forward(layer_id, q, k, v, scale, metadata)` takes this step's packed queries
    q (T, H, D) and new keys/values k, v (T, H_kv, D), writes k and v into the cache at
    `metadata.slot_mapping` (skipping slot -1) if the backend has a cache, and returns (T, H, D):
    causal attention of each sequence's new tokens over its whole context (cached prefix + new
    tokens). It must not change q, k, v or the metadata; rows past `metadata.num_seqs` are padding
    whose output is never read. `name` is what `attention_backend=` calls it.
    """

    name: str

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


class BackendChoice(NamedTuple):
    """Which backend an engine runs, and why."""

    name: str
    reason: str


def is_importable(module: str) -> bool:
    """True when `module` could be imported (without importing it)."""
    return importlib.util.find_spec(module) is not None


def select_attention_backend(
    requested: str, device: torch.device, offered: tuple[str, ...], dtype=None
) -> BackendChoice:
    """The backend to run: the requested one if the stage offers it, or the best for the device.

    `offered` lists what the stage's composition can build, best first. "auto" takes the first
    offered that the device runs natively: a GPU kernel on CUDA, the torch oracle on a CPU
    (Triton runs on a CPU only through its slow interpreter, for tests). dtype: the model's
    (the interpreter cannot compute in bfloat16).
    """
    if requested not in ("auto", *BACKEND_NAMES):
        raise ValueError(
            f"attention_backend {requested!r} is unknown; expected 'auto' or one of "
            f"{', '.join(BACKEND_NAMES)}"
        )
    if requested != "auto":
        if requested not in offered:
            raise ValueError(
                f"attention_backend {requested!r} is not offered at this stage; it offers "
                f"{', '.join(offered)} (the Triton kernels arrive in stages 05-06)"
            )
        if requested == "flash_attn" and not is_importable("flash_attn"):
            raise ValueError("attention_backend 'flash_attn' needs the flash-attn package")
        if requested == "triton":
            check_triton_runs_on(device, dtype)
        return BackendChoice(requested, "asked for")
    if device.type != "cuda":
        return BackendChoice("torch", f"auto on {device.type}: the torch oracle")
    for name in offered:
        if name == "torch" or is_importable(name):
            return BackendChoice(name, f"auto on cuda: the first of {', '.join(offered)} found")
    return BackendChoice("torch", "auto on cuda: no kernel package importable")


def check_triton_runs_on(device: torch.device, dtype=None) -> None:
    """ValueError unless Triton can run on device: a GPU, or a CPU through the interpreter,
    in a dtype the interpreter computes (dtype None: not known yet)."""
    if not is_importable("triton"):
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    if device.type == "cuda":
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend 'triton' on a CPU runs through Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before Python starts (it is slow; for tests)"
        )
    if dtype == torch.bfloat16:  # NumPy has no bfloat16 (triton#11584): tokens would be wrong
        raise ValueError(
            "dtype='bfloat16' with attention_backend 'triton' on a CPU: Triton's interpreter "
            "keeps bfloat16 as raw 16-bit integers and tl.dot multiplies their bit patterns; "
            "pass dtype='float32' (or 'float16')"
        )


FLASH_ATTN_PAGE_MULTIPLE = 256  # flash-attn 2 refuses paged KV in blocks of any other size


def check_block_size(backend: str, block_size: int) -> None:
    """ValueError unless `backend` can read the pool in blocks of block_size tokens."""
    if backend == "flash_attn" and block_size % FLASH_ATTN_PAGE_MULTIPLE:
        raise ValueError(
            f"attention_backend 'flash_attn' reads the pool through flash-attn's paged KV, which "
            f"needs block_size to be a multiple of {FLASH_ATTN_PAGE_MULTIPLE}; got {block_size}: "
            f"pass block_size={FLASH_ATTN_PAGE_MULTIPLE} or attention_backend='triton'"
        )


def log_choice(choice: BackendChoice) -> None:
    """Say once per engine which backend runs and why."""
    logger.info("attention backend: %s (%s)", choice.name, choice.reason)
