"""The Hugging Face transformers side of `nanoserve bench --compare hf`, same requests and weights.

Introduced in stage 04. CPU: padded `generate` (left padding); CUDA: transformers' continuous
batching. It counts only the tokens each request asked for: what padding wastes is transformers'
cost, reported but not counted.
"""

from __future__ import annotations

import torch

from nanoserve.bench.workload import (
    WARMUP_MAX_TOKENS,
    WARMUP_PROMPT_LEN,
    BenchResult,
    Workload,
    release_memory,
    timer,
)
from nanoserve.models.build import checkpoint_state_dict

PAD_ID = 0  # any id: padded positions are masked out of attention


def hf_twin(model_name: str, model, device: torch.device, dtype: torch.dtype):
    """The transformers model nanoserve's `model` came from, eos disabled, in eval mode.

    A preset gets nanoserve's random weights copied in (the parameter names match); a GGUF file
    or a folder is loaded by transformers itself.
    """
    import transformers

    from nanoserve.models.loader import resolve_model_path
    from nanoserve.models.presets import PRESETS, preset_config

    if model_name in PRESETS:
        config = transformers.AutoConfig.for_model(**preset_config(model_name))
        with torch.device(device):
            hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        hf_model.load_state_dict(checkpoint_state_dict(model), strict=True)
    else:
        path = resolve_model_path(model_name)
        folder, gguf = (path.parent, path.name) if path.suffix == ".gguf" else (path, None)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf, dtype=dtype
        ).to(device)
    hf_model.generation_config.eos_token_id = None  # ignore_eos: every request runs to the end
    return hf_model.eval()


def left_padded(prompts: list[list[int]], device: torch.device):
    """input_ids and attention_mask (B, longest), prompts pushed right, pads on the left."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    return input_ids.to(device), mask.to(device)


@torch.inference_mode()
def padded_generate(hf_model, prompts: list[list[int]], max_new_tokens: int) -> int:
    """One `generate` call on a left-padded batch; returns the token slots it computed."""
    from transformers import GenerationConfig

    input_ids, mask = left_padded(prompts, hf_model.device)
    config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    out = hf_model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    num_new = out.shape[1] - input_ids.shape[1]
    if num_new != max_new_tokens:
        raise RuntimeError(f"transformers stopped after {num_new} of {max_new_tokens} tokens")
    return len(prompts) * num_new


def run_padded(hf_model, workload: Workload, batch_size: int | None) -> BenchResult:
    """Time padded `generate` over the workload in batches of `batch_size` requests."""
    prompts, max_tokens = workload
    batch_size = batch_size or len(prompts)
    padded_generate(hf_model, [prompts[0][:WARMUP_PROMPT_LEN]], WARMUP_MAX_TOKENS)
    start, slots = timer(hf_model.device), 0
    for i in range(0, len(prompts), batch_size):
        slots += padded_generate(
            hf_model, prompts[i : i + batch_size], max(max_tokens[i : i + batch_size])
        )
    seconds = timer(hf_model.device) - start
    asked = sum(max_tokens)
    note = (
        f"transformers (padded generate, batch {batch_size}) computed {slots:,} token slots "
        f"to give the {asked:,} asked for; only those are counted"
    )
    return BenchResult("transformers generate (padded)", asked, seconds, None, note)


def collect(manager, prompts: list[list[int]], max_tokens: list[int], tag: str) -> int:
    """Submit requests to a running continuous-batching manager; wait for all; tokens made."""
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):  # eos -1: no token stops early
        manager.add_request(prompt, request_id=f"{tag}-{i}", max_new_tokens=m, eos_token_id=-1)
    generated, pending = 0, len(prompts)
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
            continue
        if result.error is not None:
            raise RuntimeError(f"transformers request {result.request_id}: {result.error}")
        if result.is_finished():
            generated, pending = generated + len(result.generated_tokens), pending - 1
    return generated


@torch.no_grad()  # not inference_mode: transformers 5.17's generation thread runs outside it
def run_continuous(hf_model, workload: Workload) -> BenchResult:
    """Time transformers' continuous batching (CUDA) on the workload, one request per prompt."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    prompts, max_tokens = workload
    config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        eos_token_id=-1,
        max_new_tokens=max(max_tokens),
    )
    longest_prompt, most_tokens = max(len(p) for p in prompts), max(max_tokens)
    hints = WorkloadHints(
        max_prompt_length=longest_prompt,
        max_generated_length=most_tokens,
        num_requests=len(prompts),
    )
    manager = hf_model.init_continuous_batching(generation_config=config, workload_hints=hints)
    manager.warmup()  # captures CUDA graphs; the warm-up request below does the rest
    manager.start()
    try:
        collect(manager, [prompts[0][:WARMUP_PROMPT_LEN]], [WARMUP_MAX_TOKENS], "warmup")
        start = timer(hf_model.device)
        generated = collect(manager, prompts, max_tokens, "bench")
        seconds = timer(hf_model.device) - start
    finally:
        manager.stop(block=True)
    return BenchResult("transformers continuous batching", generated, seconds, None)


def run_transformers(model_name: str, model, workload: Workload, batch_size: int | None):
    """transformers on the same requests: continuous batching on CUDA, padded generate on CPU."""
    device = next(model.parameters()).device
    hf_model = hf_twin(model_name, model, device, model.dtype)
    try:
        if device.type == "cuda":
            return run_continuous(hf_model, workload)
        return run_padded(hf_model, workload, batch_size)
    finally:
        del hf_model
        release_memory(device)
