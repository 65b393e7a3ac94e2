"""What `LLM`'s arguments mean: the device, the dtype, prompts and conversations, prefix caching.

Introduced in stage 00 (stage 07 adds `prefix_caching_components`). Each reader turns one
argument into what the engine takes, or raises a ValueError naming the argument and what was
expected; the command line (options.py) reads its flags through the same functions. It builds
nothing and loads nothing.
"""

from __future__ import annotations

import numbers

import torch

from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.recipes.assemble import recipe_for
from nanoserve.stages import implemented_stages

DTYPES = {
    "half": torch.float16,  # vLLM's and torch's other names: half and float
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES = ("auto", *DTYPES)  # auto: the device's default, as dtype=None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """cuda when available, else cpu, unless one is named."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device; expected cpu or cuda") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA GPU here")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bfloat16 on cuda and float32 on cpu, unless one is named ("auto" names none)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPE_NAMES)}")


PREFIX_PART = "PrefixBlockManager"  # the part a recipe with a prefix cache builds its manager from


def prefix_caching_components(stage: int, enable: bool | None, components: dict | None):
    """The components that give `stage` the prefix caching asked for (None: the stage's own).

    False, from stage 07 on, puts stage 04's BlockManager where the PrefixBlockManager goes: the
    same pool and kernels, no sharing. True before stage 07 is a ValueError: there is no prefix
    cache to turn on.
    """
    has_cache = PREFIX_PART in recipe_for(stage).parts
    if enable and not has_cache:
        first = next(
            s.number for s in implemented_stages() if PREFIX_PART in recipe_for(s.number).parts
        )
        raise ValueError(
            f"enable_prefix_caching=True needs stage {first} or later (the prefix cache); stage "
            f"{stage}'s engine has none: pick a later stage or leave enable_prefix_caching unset"
        )
    if enable is not False or not has_cache:
        return components
    if PREFIX_PART in (components or {}):
        raise ValueError(
            f"enable_prefix_caching=False builds no {PREFIX_PART}, so yours would go unused: "
            "leave enable_prefix_caching unset to run it"
        )
    return {**(components or {}), PREFIX_PART: BlockManager}


def checked_ids(prompt, index: int) -> list[int]:
    """A prompt given as token ids, as a list of Python ints; ValueError naming a bad entry."""
    for position, token_id in enumerate(prompt):
        if isinstance(token_id, bool) or not isinstance(token_id, (int, numbers.Integral)):
            raise ValueError(
                f"prompts[{index}][{position}] is {token_id!r}; token ids must be ints"
            )
    return [int(t) for t in prompt]


def checked_conversations(messages) -> list[list[dict]]:
    """`chat`'s messages as a list of conversations; ValueError naming the part that is wrong."""
    expected = 'expected a list of {"role": ..., "content": ...} dicts, or a list of such lists'
    if not isinstance(messages, list):
        raise ValueError(f"messages is {article(messages)}; {expected}")
    if not messages:
        raise ValueError(f"messages is empty; {expected}")
    one = isinstance(messages[0], dict)
    conversations = [messages] if one else messages
    for i, conversation in enumerate(conversations):
        where = "messages" if one else f"messages[{i}]"
        if not isinstance(conversation, list):
            raise ValueError(f"{where} is {article(conversation)}; {expected}")
        if not conversation:
            raise ValueError(f"{where} is empty; {expected}")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise ValueError(f"{where}[{j}] is {article(message)}; expected a dict")
    return conversations


def article(value) -> str:
    """ "a str", "an int", "a NoneType": what a value is, for an error message."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def chat_prompt(tokenizer, conversation: list[dict]) -> str:
    """The prompt text for a conversation, ending where the assistant's turn begins."""
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
