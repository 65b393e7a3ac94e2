"""Read a llama-architecture GGUF file into a Hugging Face-style config, state dict and tokenizer.

Introduced in stage 00. The `gguf` package parses the container and decodes the blocks
(`gguf.quants.dequantize`: Q4_1, Q8_0, the K-quants...; no lesson has you decode one by hand).
It deliberately does not keep weights quantized, or load other architectures.
"""

from __future__ import annotations

import enum
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:  # both imported where used: only GGUF files need them (no `gguf` on some GPUs)
    import gguf
    import transformers


class GGUFCheckpoint(NamedTuple):
    """What `read_gguf` returns: the pieces a Hugging Face Llama checkpoint folder would hold."""

    config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase


# ---- block formats -------------------------------------------------------------------------------
# A tensor is a run of little-endian blocks; a block never spans two rows. SmolLM2's file has two
# block formats (docs/glossary.md, "GGUF"), and `gguf.quants` decodes those and the rest:
#
# Q4_1: 32 elements in 20 bytes.  x[i] = d * q[i] + m,  q: 4-bit code 0..15
#   byte  0   1   2   3   4             19
#       +-------+-------+--------+     +---------+
#       |   d   |   m   | q16|q0 | ... | q31|q15 |      d, m: float16 scale and minimum
#       +-------+-------+--------+     +---------+      each byte: high nibble | low nibble
# Q8_0: 32 elements in 34 bytes.  x[i] = d * q[i],  q: int8
#   byte  0   1   2    3         33
#       +-------+----+----+     +-----+
#       |   d   | q0 | q1 | ... | q31 |      d: float16 scale
#       +-------+----+----+     +-----+


def dequantize(data: np.ndarray, tensor_type: enum.IntEnum, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a GGUF tensor's raw data into a float32 array of numpy (row-major) `shape`."""
    import gguf  # lazy: only GGUF files need the package
    from gguf.quants import dequantize as decode

    qtype = gguf.GGMLQuantizationType(int(tensor_type))
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.asarray(data).reshape(-1).view(np.uint8)  # whatever dtype the reader gave, as bytes
    count = math.prod(shape)
    if count % block_elements or raw.size != count // block_elements * block_bytes:
        raise ValueError(
            f"{raw.size} bytes of {qtype.name} do not hold a tensor of shape {tuple(shape)}"
        )
    try:
        values = decode(raw.reshape(-1, block_bytes), qtype)
    except NotImplementedError:
        raise ValueError(
            f"tensor type {qtype.name} is not supported (gguf {_version()} cannot dequantize it)"
        ) from None
    if np.may_share_memory(values, raw):  # F32 comes back as a view: never hand out the memmap
        values = values.copy()
    return values.astype(np.float32, copy=False).reshape(shape)


def _version() -> str:
    from importlib.metadata import version

    return version("gguf")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation, giving Hugging Face's rotate-half RoPE layout."""
    # HF's RoPE rotates row i of a head together with row i + head_dim/2; llama.cpp rotates
    # adjacent rows (2j, 2j+1). Its converter therefore stored each head's rows as
    # (0, half, 1, half+1, ...): a (head_dim/2, 2) grid per head. Swap the grid back to (2, half).
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows cannot be split into {num_heads} heads of even size")
    grid = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grid.transpose(1, 2).reshape(weight.shape)


# ---- names and config ----------------------------------------------------------------------------
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str:
    """A GGUF tensor name in HF Llama terms: blk.3.attn_q.weight -> model.layers.3.self_attn..."""
    if (m := re.fullmatch(r"(\w+)\.weight", name)) and m[1] in _TOP_LEVEL:
        return f"{_TOP_LEVEL[m[1]]}.weight"
    if (m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)) and m[2] in _PER_LAYER:
        return f"model.layers.{m[1]}.{_PER_LAYER[m[2]]}.weight"
    raise ValueError("not part of a plain llama checkpoint (no Hugging Face Llama name)")


def _f32(value: float) -> float:
    """GGUF floats are float32: 1e-5 arrives as 9.99999974e-06. Give back the short decimal."""
    return float(str(np.float32(value)))


_REQUIRED = object()


def _config(meta: dict, tensor_names: set[str], path: str | os.PathLike) -> dict:
    """The LlamaConfig-style dict described by the `llama.*` and `tokenizer.*` metadata."""

    def llama(key, default=_REQUIRED):
        if default is _REQUIRED and f"llama.{key}" not in meta:
            raise ValueError(f"{path}: GGUF metadata has no llama.{key}")
        return meta.get(f"llama.{key}", default)

    heads, hidden = llama("attention.head_count"), llama("embedding_length")
    scaling = llama("rope.scaling.type", None)
    rope_scaling = None
    if scaling not in (None, "none"):
        rope_scaling = {"rope_type": scaling, "factor": _f32(llama("rope.scaling.factor", 1.0))}
        if (original := llama("rope.scaling.original_context_length", None)) is not None:
            rope_scaling["original_max_position_embeddings"] = original
    head_dim = llama("attention.key_length", None) or llama("rope.dimension_count", None)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "vocab_size": llama("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", ())),
        "hidden_size": hidden,
        "intermediate_size": llama("feed_forward_length"),
        "num_hidden_layers": llama("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": llama("attention.head_count_kv", heads),
        "head_dim": head_dim or hidden // heads,
        "rms_norm_eps": _f32(llama("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(llama("rope.freq_base", 10000.0)),
        "max_position_embeddings": llama("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "rope_scaling": rope_scaling,
    }


# ---- the file ------------------------------------------------------------------------------------
def _open(path: str | os.PathLike) -> gguf.GGUFReader:
    """A reader over a llama GGUF file; ValueError for anything else."""
    import gguf  # lazy: only GGUF files need the package

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError) as e:  # bad magic, empty, or cut short somewhere
        raise ValueError(f"{path} is not a GGUF file: {e}") from None
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture != "llama":
        raise ValueError(f"{path}: architecture {architecture!r} is not supported (only 'llama')")
    return reader


def _tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer transformers builds for this GGUF (vocab, merges, specials, chat template)."""
    # Reuse transformers' own conversion so that ids match AutoTokenizer(gguf_file=...) exactly.
    # It re-reads only the metadata (~0.2 s); going through AutoTokenizer would cost ~4 s.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:  # an older transformers (5.17 lacks the conversion): the public route
        where = Path(path)
        return AutoTokenizer.from_pretrained(where.parent, gguf_file=where.name)
    architecture, vocab, tokenizer_config = get_gguf_tokenizer(os.fspath(path))
    backend, extra = convert_gguf_tokenizer(architecture, vocab)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def read_gguf(path: str | os.PathLike, progress: bool = False) -> GGUFCheckpoint:
    """Read a llama GGUF file: HF-style config, float32 HF-named state dict, and tokenizer
    (with a bar of dequantized tensors on stderr when `progress`)."""
    from tqdm import tqdm

    reader = _open(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = _config(meta, {t.name for t in reader.tensors}, path)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state_dict = {}
    bar = tqdm(reader.tensors, "dequantizing", unit="tensor", leave=False, disable=not progress)
    for tensor in bar:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        try:
            name = _hf_name(tensor.name)
            values = dequantize(tensor.data, tensor.tensor_type, shape)
        except ValueError as e:
            raise ValueError(f"{path}: tensor {tensor.name}: {e}") from None
        weight = torch.from_numpy(values)
        if (kind := tensor.name.split(".")[-2]) in heads:
            weight = unpermute_qk(weight, heads[kind])
        state_dict[name] = weight
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}.weight"
        for i in range(config["num_hidden_layers"])
        for name in _PER_LAYER.values()
    }
    if missing := sorted(expected - state_dict.keys()):
        raise ValueError(f"{path}: missing {len(missing)} tensors, e.g. {missing[:3]}")
    return GGUFCheckpoint(config, state_dict, _tokenizer(path))
