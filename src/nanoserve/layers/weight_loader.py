"""What a layer's `weight_loader(param, loaded)` is handed, and the loader of a replicated weight.

Introduced in stage 09, given to the learner. `loaded` is the WHOLE checkpoint tensor: a torch
tensor, or a safetensors slice that has not been read yet (it knows its shape and `[a:b]`
indexing, nothing else), so a loader reads only its rank's rows. It shards nothing itself:
the sharded layers (`linear.py`, `embedding.py`) do.
"""

from __future__ import annotations

import torch


def full_shape(loaded) -> tuple[int, ...]:
    """The shape of a checkpoint tensor: a torch tensor, or a safetensors slice not yet read."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def check_shape(loaded, expected: tuple[int, ...]) -> None:
    """ValueError when the checkpoint tensor is not the whole (unsharded) shape we expect."""
    if full_shape(loaded) != tuple(expected):
        raise ValueError(f"expected shape {tuple(expected)}, found {full_shape(loaded)}")


def default_weight_loader(param: torch.Tensor, loaded) -> None:
    """Copy a whole checkpoint tensor into param (norm scales, anything replicated)."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded[:])  # [:] reads a safetensors slice whole; .data: no autograd
