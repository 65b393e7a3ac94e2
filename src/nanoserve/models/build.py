"""Building a `CausalLM` on a device: random weights, or filled from a Hugging Face state dict.

Introduced in stage 00. The loader (checkpoints) and the presets (random weights) both build here;
each tensor goes in through its module's `weight_loader` (stage 09 shards there). It reads no
files and knows no checkpoint formats, so its errors name tensors; the loader adds the file.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nanoserve.layers.linear import default_weight_loader
from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM


class WeightMismatch(ValueError):
    """A state dict that does not fit the decoder; `name` is the offending tensor, if just one."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


def build_model(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor] | None,
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
        # dtype first, on meta where it costs nothing: weights are copied once, straight into
        # dtype, never through a float32 copy of the whole model.
        model.to(dtype=dtype).to_empty(device=device)
        model.tie_weights()  # to_empty makes new tensors, which unties shared ones
        model.model.rotary.reset_inv_freq()  # a computed buffer: no checkpoint holds it
        load_weights(model, state_dict)
    return model.to(dtype=dtype).eval().requires_grad_(False)  # inference only: no autograd


def skipped_names(config: ModelConfig) -> set[str]:
    """Checkpoint tensors that are not loaded: with tied embeddings the head *is* the embedding."""
    return {"lm_head.weight"} if config.tie_word_embeddings else set()


@torch.no_grad()
def load_weights(model: CausalLM, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a Hugging Face-named state dict in, each tensor through its module's `weight_loader`.

    Raises WeightMismatch for a tensor of the wrong shape (naming it) or for names that are
    missing or left over.
    """
    params = dict(model.named_parameters())  # a tied tensor appears once, under its first name
    skipped = skipped_names(model.config)
    loaded, unexpected = set(), []
    for name, tensor in state_dict.items():
        if name in skipped or name.endswith("rotary_emb.inv_freq"):  # inv_freq is computed
            continue
        if name not in params:
            unexpected.append(name)
            continue
        try:
            weight_loader_of(model, name)(params[name], tensor)
        except ValueError as err:
            raise WeightMismatch(f"tensor {name}: {err}", name) from None
        loaded.add(name)
    missing = sorted(params.keys() - loaded)
    if missing or unexpected:
        raise WeightMismatch(
            f"checkpoint does not match the {model.config.model_type} decoder: "
            f"missing {missing[:5]}, unexpected {sorted(unexpected)[:5]}"
        )


def weight_loader_of(model: nn.Module, param_name: str):
    """The `weight_loader` of the module owning param_name, else the whole-tensor copy."""
    module = model.get_submodule(param_name.rpartition(".")[0])
    return getattr(module, "weight_loader", default_weight_loader)
