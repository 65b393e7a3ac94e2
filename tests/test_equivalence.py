"""The equivalence chain: every stage reproduces its oracle stage's greedy tokens exactly.

Tiny random checkpoints in float64 (prompts just below, at and above block boundaries) and the
real SmolLM2 in float32. Stages are taken from the manifest, so a new stage joins the chain by
declaring `proven_equal_to = "stage NN"`.
"""

import random

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.stages import implemented_stages

from .conftest import TINY_FAMILIES, needs_smollm2

CHAINED = [s for s in implemented_stages() if s.oracle_stage is not None]
# Stage 03 is proven by a property (decode growth == bulk allocation), but it also runs an engine
# (block tables over the allocator, K/V at flat slots), which must reproduce stage 01's tokens.
PAIRS = [(s.number, s.oracle_stage) for s in CHAINED] + [
    (s.number, 1) for s in implemented_stages() if s.number == 3
]
PROMPT_LENGTHS = [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49]  # around 4, 8, 16


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def greedy_tokens(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(("stage", "oracle_stage"), PAIRS, ids=lambda n: f"stage{n:02d}")
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_stage_reproduces_its_oracle_on_tiny_models_in_float64(
    tiny_checkpoints, family, stage, oracle_stage
):
    folder, _ = tiny_checkpoints[family]
    prompts = random_prompts(256)
    small = dict(max_model_len=128, max_num_seqs=6, block_size=4)  # several batches, many blocks
    oracle = LLM(str(folder), stage=oracle_stage, device="cpu", dtype="float64", **small)
    candidate = LLM(str(folder), stage=stage, device="cpu", dtype="float64", **small)
    assert greedy_tokens(candidate, prompts, 64) == greedy_tokens(oracle, prompts, 64)


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("stage", CHAINED, ids=lambda s: s.stem)
def test_stage_reproduces_its_oracle_on_smollm2_in_float32(smollm2_llm, stage):
    oracle = LLM("smollm2", stage=stage.oracle_stage, device="cpu", dtype="float32")
    candidate = LLM("smollm2", stage=stage.number, device="cpu", dtype="float32")
    expected = greedy_tokens(oracle, SMOLLM2_PROMPTS, 24)
    assert greedy_tokens(candidate, SMOLLM2_PROMPTS, 24) == expected
