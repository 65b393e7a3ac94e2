"""Building a `CausalLM` on a device: random weights, or filled from a Hugging Face state dict.

Introduced in stage 00. The loader (checkpoints) and the presets (random weights) both build here;
each tensor goes in through its module's `weight_loader`, which keeps only this tensor-parallel
rank's slice (stage 09). It reads no files and knows no checkpoint formats, so its errors name
tensors; the loader adds the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from nanoserve.layers.tensor_parallel import ONE_RANK, TensorParallel
from nanoserve.layers.weight_loader import default_weight_loader
from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM


class WeightMismatch(ValueError):
    """A state dict that does not fit the decoder; `name` is the offending tensor, if just one."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


# Hugging Face keeps q/k/v and gate/up apart; the decoder merges each group into one matmul.
# (checkpoint name part, the decoder's name part, which slice of the merged weight it fills)
STACKED_PARAMS = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)

StateDict = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def build_model(
    config: ModelConfig,
    state_dict: StateDict | None,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel = ONE_RANK,
) -> CausalLM:
    """A CausalLM on device in dtype holding rank tp.rank's slices, filled from state_dict
    (Hugging Face names, whole tensors or safetensors slices) or random when it is None."""
    if state_dict is None:
        with torch.device(device):
            model = CausalLM(config, tp)
    else:  # skip the random init that the checkpoint would overwrite anyway
        with torch.device("meta"):
            model = CausalLM(config, tp)
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


def param_for(checkpoint_name: str) -> tuple[str, str | int | None]:
    """The decoder's parameter that a checkpoint tensor fills, and which slice (None: all of it).

    "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "k")
    """
    for theirs, ours, shard_id in STACKED_PARAMS:
        if f".{theirs}." in checkpoint_name:
            return checkpoint_name.replace(f".{theirs}.", f".{ours}."), shard_id
    return checkpoint_name, None


def unstacked(param_name: str) -> list[str]:
    """The checkpoint names a decoder parameter is filled from, in slice order.

    "...self_attn.qkv_proj.weight" -> [...q_proj.weight, ...k_proj.weight, ...v_proj.weight]
    """
    names = [
        param_name.replace(f".{ours}.", f".{theirs}.")
        for theirs, ours, _ in STACKED_PARAMS
        if f".{ours}." in param_name
    ]
    return names or [param_name]


def checkpoint_names(model: CausalLM) -> list[str]:
    """The Hugging Face names of the tensors the decoder needs, in parameter order."""
    return [name for param_name, _ in model.named_parameters() for name in unstacked(param_name)]


@torch.no_grad()
def load_weights(model: CausalLM, state_dict: StateDict) -> None:
    """Copy Hugging Face-named tensors in, each through its module's `weight_loader` (which takes
    this rank's slice); merged parameters take one checkpoint tensor per slice.

    Raises WeightMismatch for a tensor of the wrong shape (naming it) or for names that are
    missing or left over.
    """
    params = dict(model.named_parameters())
    skipped = skipped_names(model.config)
    loaded, unexpected = set(), []
    pairs = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    for name, tensor in pairs:
        if name in skipped or name.endswith("rotary_emb.inv_freq"):  # inv_freq is computed
            continue
        param_name, shard_id = param_for(name)
        if param_name not in params:
            unexpected.append(name)
            continue
        loader = weight_loader_of(model, param_name)
        try:
            if shard_id is None:
                loader(params[param_name], tensor)
            else:
                loader(params[param_name], tensor, shard_id)
        except ValueError as err:
            raise WeightMismatch(f"tensor {name}: {err}", name) from None
        loaded.add(name)
    missing = [name for name in checkpoint_names(model) if name not in loaded]
    if missing or unexpected:
        raise WeightMismatch(
            f"checkpoint does not match the {model.config.model_type} decoder: "
            f"missing {missing[:5]}, unexpected {sorted(unexpected)[:5]}"
        )


def weight_loader_of(model: nn.Module, param_name: str):
    """The `weight_loader` of the module owning param_name, else the whole-tensor copy."""
    module = model.get_submodule(param_name.rpartition(".")[0])
    return getattr(module, "weight_loader", default_weight_loader)


def checkpoint_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's names (merged ones split apart); one rank only.

    What `transformers` loads, e.g. to run a twin of a random-weight preset.
    """
    if model.tp.size != 1:
        raise ValueError("checkpoint_state_dict needs the whole model (tensor_parallel_size 1)")
    out = {}
    for name, tensor in model.state_dict().items():
        names = unstacked(name)
        if len(names) == 1:
            out[name] = tensor
            continue
        module = model.get_submodule(name.rpartition(".")[0])
        out.update(zip(names, tensor.split(module.output_sizes)))
    return out
