"""The Hugging Face folder nano-vLLM loads in `nanoserve bench --compare nano-vllm`.

Introduced with the peer comparison (after stage 10). nano-vLLM reads only a folder (config.json,
safetensors, a tokenizer), so a model nanoserve built from a preset, or a folder in another dtype
or without a tokenizer, is written out from the weights nanoserve loaded: both engines then run
the very same numbers. It runs no engine.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class PeerFolder(NamedTuple):
    """The Hugging Face folder nano-vLLM loads, and a sentence saying what it holds."""

    path: str
    note: str


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def folder_dtype(folder: Path) -> str | None:
    """The dtype a checkpoint folder's config.json names (transformers 5's key, or the older)."""
    config = json.loads((folder / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype")


@contextlib.contextmanager
def peer_folder(source: str, model, hf_config: dict | None) -> Iterator[PeerFolder]:
    """The folder nano-vLLM loads: `source` itself when it is a folder with a tokenizer in the
    dtype nanoserve runs, else the weights nanoserve loaded (`model`) written to a temporary
    folder, removed on exit (`hf_config`: the preset's config.json dict; None for a folder)."""
    dtype = dtype_name(model.dtype)
    folder = Path(source)
    if folder.is_dir():
        has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
        if has_tokenizer and folder_dtype(folder) == dtype:
            yield PeerFolder(str(folder), f"nano-vLLM loaded {folder} itself")
            return
        hf_config = json.loads((folder / "config.json").read_text())
    if hf_config is None:
        raise ValueError(f"model {source!r} is neither a folder nor a preset: no config to write")
    with tempfile.TemporaryDirectory(prefix="nanoserve-peer-") as tmp:
        write_hf_folder(model, hf_config, Path(tmp))
        yield PeerFolder(
            tmp,
            f"nano-vLLM loaded the weights nanoserve loaded ({dtype}), written to a temporary "
            "folder with a stub tokenizer",
        )


def write_hf_folder(model, hf_config: dict, out: Path) -> None:
    """A Hugging Face folder of `model`'s weights, in its dtype: config.json, one safetensors
    file, and a stub tokenizer (nano-vLLM loads one; the workload is token ids)."""
    import transformers
    from safetensors.torch import save_file

    from nanoserve.models.build import checkpoint_state_dict, skipped_names

    config = transformers.AutoConfig.for_model(**hf_config)
    config.dtype = model.dtype  # what nano-vLLM builds its model in
    config.save_pretrained(str(out))
    weights = checkpoint_state_dict(model)
    for name in skipped_names(model.config):  # a tied head is the embedding: not saved twice
        weights.pop(name, None)
    # own copies on the host: split views of a merged matrix share storage, which safetensors
    # refuses to write
    weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_stub_tokenizer(out, config.eos_token_id, config.vocab_size)


def write_stub_tokenizer(out: Path, eos_token_id, vocab_size: int) -> None:
    """A word-level tokenizer of names `t0`, `t1`, ... whose eos is the model's eos id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id
    eos = vocab_size - 1 if eos is None else eos
    vocab = {f"t{i}": i for i in range(min(1000, vocab_size)) if i != eos}
    vocab["<eos>"] = eos
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="t0")
    fast.save_pretrained(str(out))
