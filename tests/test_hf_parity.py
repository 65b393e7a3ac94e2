"""Stage 00 against its oracle, Hugging Face transformers: greedy tokens must be identical.

Tiny random Llama / Qwen2 / Qwen3 checkpoints in float64, and the real SmolLM2 GGUF in float32
(transformers dequantizes the same file with the `gguf` package).
"""

import pytest
import torch

from nanoserve import LLM, SamplingParams

from .conftest import TINY_FAMILIES, needs_smollm2

PROMPTS = [[1], [5, 9, 200, 3], list(range(10, 40)), [7, 7, 7, 7, 7, 7, 7], list(range(100, 197))]
NUM_NEW_TOKENS = 64


def hf_greedy(model, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, never stopping early."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_greedy_tokens_equal_transformers_in_float64(tiny_checkpoints, family):
    folder, hf_model = tiny_checkpoints[family]
    llm = LLM(str(folder), stage=0, device="cpu", dtype="float64")
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)
        assert out.finish_reason == "length"


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers and explain why they are prime.",
    "How do I reverse a list in Python?",
    "Tell me a story about a robot who learns to paint.",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
]


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    from nanoserve.models.registry import known_model_path

    path = known_model_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_transformers_on_the_same_gguf(smollm2_llm, hf_smollm2):
    num_new_tokens = 32
    prompts = [
        smollm2_llm.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS
    ]
    params = SamplingParams(max_tokens=num_new_tokens, ignore_eos=True)
    outputs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        assert len(out.token_ids) == num_new_tokens
        assert out.token_ids == hf_greedy(hf_smollm2, out.prompt_token_ids, num_new_tokens)
