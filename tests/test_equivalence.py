"""The equivalence chain: every stage reproduces its oracle stage's greedy tokens exactly.

Tiny random checkpoints in float64 (prompts just below, at and above block boundaries) and the
real SmolLM2 in float32. Stages are taken from the manifest, so a new stage joins the chain by
declaring `oracle=NN`. The Triton stages (05, 06) run on a CPU through
Triton's interpreter, which is slow: they have their own tests below, on small workloads.
"""

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.cache.paged import PagedKVPool
from nanoserve.engine.runner.input_packer import prepare_decode, prepare_prefill
from nanoserve.kernels.torch_paged import TorchPagedAttention
from nanoserve.recipes.assemble import recipe_for
from nanoserve.stages import implemented_stages
from nanoserve.types import Sequence

from .conftest import TINY_FAMILIES, needs_smollm2

# On a CPU, "auto" gives a Triton stage stage 04's torch path: the chain runs their kernels below.
KERNEL_STAGES = {
    s.number for s in implemented_stages() if "triton" in recipe_for(s.number).backends
}
CHAINED = [
    s for s in implemented_stages() if s.oracle is not None and s.number not in KERNEL_STAGES
]
# Stage 03 is proven by a property (decode growth == bulk allocation), but it also runs an engine
# (block tables over the allocator, K/V at flat slots), which must reproduce stage 01's tokens.
PAIRS = [(s.number, s.oracle) for s in CHAINED] + [
    (s.number, 1) for s in implemented_stages() if s.number == 3
]
PROMPT_LENGTHS = [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49]  # around 4, 8, 16


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def greedy_tokens(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(("stage", "oracle"), PAIRS, ids=lambda n: f"stage{n:02d}")
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_stage_reproduces_its_oracle_on_tiny_models_in_float64(
    tiny_checkpoints, family, stage, oracle
):
    folder, _ = tiny_checkpoints[family]
    prompts = random_prompts(256)
    small = dict(max_model_len=128, max_num_seqs=6, block_size=4)  # several batches, many blocks
    oracle = LLM(str(folder), stage=oracle, device="cpu", dtype="float64", **small)
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
    oracle = LLM("smollm2", stage=stage.oracle, device="cpu", dtype="float32")
    candidate = LLM("smollm2", stage=stage.number, device="cpu", dtype="float32")
    expected = greedy_tokens(oracle, SMOLLM2_PROMPTS, 24)
    assert greedy_tokens(candidate, SMOLLM2_PROMPTS, 24) == expected


# ---- stage 08 on a CPU: a documented pass-through. There is nothing to capture off CUDA, so
# its engine is stage 07's (the chain above leaves it out: it offers the Triton kernels) ----


def test_stage08_on_a_cpu_captures_nothing_and_reproduces_stage07(tiny_checkpoints):
    folder, _ = tiny_checkpoints["qwen3"]  # one family: on a CPU the engine is stage 07's own
    small = dict(device="cpu", dtype="float64", max_model_len=128, max_num_seqs=6, block_size=4)
    stage08 = LLM(str(folder), stage=8, **small)
    assert stage08.engine.runner.graphs is None, "no CUDA graph on a CPU"
    oracle = LLM(str(folder), stage=stage08.stage.oracle, **small)
    prompts = random_prompts(256)
    assert greedy_tokens(stage08, prompts, 64) == greedy_tokens(oracle, prompts, 64)


# ---- the Triton stages: through the interpreter on a CPU (conftest.py sets TRITON_INTERPRET),
# compiled on a GPU; float64 either way ----

KERNEL_PROMPT_LENGTHS = (1, 4, 5, 9, 17)  # at and around block boundaries of 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(device=DEVICE, dtype="float64", block_size=4, max_model_len=64, num_kv_blocks=64)


def kernel_prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(n)] for n in KERNEL_PROMPT_LENGTHS]


def greedy_run(folder, stage: int, max_tokens: int = 10, **options):
    """(tokens, pool tensor after the run, number of preemptions) of one small engine run."""
    llm = LLM(str(folder), stage=stage, **{**SMALL, **options})
    tokens = greedy_tokens(llm, kernel_prompts(), max_tokens)
    return tokens, llm.engine.runner.cache.kv.cpu(), llm.engine.scheduler.num_preemptions


@pytest.fixture(scope="module")
def stage_04_runs(tiny_checkpoints):
    """Stage 04 (torch) on every tiny family: the oracle of the kernel stages."""
    return {f: greedy_run(tiny_checkpoints[f][0], 4) for f in TINY_FAMILIES}


def test_stage05_triton_store_leaves_stage04_pool_bytes_and_tokens(tiny_checkpoints, stage_04_runs):
    pytest.importorskip("triton")
    folder, _ = tiny_checkpoints["qwen3"]
    tokens, pool, _ = greedy_run(folder, 5, attention_backend="triton")
    want_tokens, want_pool, _ = stage_04_runs["qwen3"]
    assert tokens == want_tokens
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8)), "pool bytes differ"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # llama: the preemption test below
def test_stage06_triton_kernels_give_the_torch_paths_tokens_in_float64(
    tiny_checkpoints, stage_04_runs, family
):
    # Stage 05's torch attention is stage 04's; float64 leaves the kernels' other summation
    # order ~1e-16 from it, far below any gap between two tokens: tokens must be identical.
    pytest.importorskip("triton")
    tokens, _, _ = greedy_run(tiny_checkpoints[family][0], 6, attention_backend="triton")
    assert tokens == stage_04_runs[family][0]


def test_stage06_triton_kernels_with_forced_preemption_give_the_same_tokens(
    tiny_checkpoints, stage_04_runs
):
    pytest.importorskip("triton")
    folder, _ = tiny_checkpoints["llama"]
    tokens, _, preemptions = greedy_run(folder, 6, attention_backend="triton", num_kv_blocks=9)
    assert preemptions > 0, "the pool was meant to run dry"
    assert tokens == stage_04_runs["llama"][0]


def step_logits(model, make_attention, prompts, block_size: int = 4) -> torch.Tensor:
    """Logits (2B, V) of one prefill of `prompts` and one decode step after it, through a fresh
    pool with the attention `make_attention(pool)` builds; block tables set by hand."""
    config, weight = model.config, next(model.parameters())
    seqs, num_blocks = [], 0
    for prompt in prompts:
        seq = Sequence(list(prompt), SamplingParams())
        needed = -(-(len(prompt) + 1) // block_size)  # room for the decode token too
        seq.block_table = list(range(num_blocks, num_blocks + needed))
        num_blocks += needed
        seqs.append(seq)
    pool = PagedKVPool(
        num_blocks,
        block_size,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        weight.dtype,
        weight.device,
    )
    attention = make_attention(pool)
    logits = []
    with torch.inference_mode():
        for prepare in (prepare_prefill, prepare_decode):
            step = prepare(seqs, block_size, weight.device)
            hidden = model(step.input_ids, step.positions, attention, step.metadata)
            last_rows = step.metadata.cu_seqlens_q[1:].long() - 1
            logits.append(model.compute_logits(hidden[last_rows]).double())
            for seq in seqs:  # its K/V is stored now; feed one more token
                seq.num_cached_tokens = len(seq)
                seq.append_token(7)
    return torch.cat(logits)


def test_stage06_triton_logits_equal_the_torch_references_in_float64(tiny_checkpoints):
    pytest.importorskip("triton")
    from nanoserve.kernels.triton_backend import TritonPagedAttention

    folder, _ = tiny_checkpoints["qwen3"]
    model = LLM(str(folder), stage=4, **SMALL).model
    want = step_logits(model, TorchPagedAttention, kernel_prompts())
    got = step_logits(model, TritonPagedAttention, kernel_prompts())
    # measured: 5e-16 on the CPU interpreter (logits ~0.6); on a GPU Triton rounds the softmax
    # scale to a float32 scalar, so there the logits agree to ~1e-7
    tolerance = 1e-12 if model.lm_head.weight.device.type == "cpu" else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance, rtol=0)


# ---- stage 07 against stage 06: the same tokens from fewer computed prompt tokens. Each workload
# is a script of generate() calls, played on both engines; later calls and later waves (at most
# max_num_seqs are admitted per step) find the blocks earlier ones computed ----

SHARING_MAX_TOKENS = 12


def system_prompt(generate):
    """Ten requests behind one 32-token system prompt (8 full blocks), in waves of four."""
    rng = random.Random(1)
    system = [rng.randrange(256) for _ in range(32)]
    suffixes = (1, 3, 4, 5, 8, 9, 12, 2, 7, 16)
    return generate([system + [rng.randrange(256) for _ in range(n)] for n in suffixes])


def multi_turn(generate):
    """Three chats of three turns: each prompt is the whole chat so far plus a new message."""
    rng = random.Random(2)
    chats = [[rng.randrange(256) for _ in range(n)] for n in (5, 9, 12)]
    outputs = []
    for turn in range(3):
        replies = generate(chats)
        outputs += replies
        chats = [
            chat + reply + [rng.randrange(256) for _ in range(3 + turn)]
            for chat, reply in zip(chats, replies)
        ]
    return outputs


def identical_prompts(generate):
    """Four identical prompts admitted in one step (nothing computed yet: each computes its own
    blocks), then the same prompt twice more."""
    prompt = [random.Random(3).randrange(256) for _ in range(18)]
    return generate([prompt] * 4) + generate([prompt] * 2)


def block_multiples(generate):
    """Prompts of exactly 1, 2, 3, 4 and 6 blocks, then the same again: fully cached, each still
    computes its last block."""
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (4, 8, 12, 16, 24)]
    return generate(prompts) + generate(prompts)


SHARING_WORKLOADS = {
    "system-prompt": (system_prompt, 256),
    "system-prompt-preempting": (system_prompt, 24),
    "multi-turn": (multi_turn, 256),
    "identical-prompts": (identical_prompts, 256),
    "block-multiples": (block_multiples, 256),
}


def play(folder, stage: int, workload, num_kv_blocks: int):
    """(tokens, prompt tokens computed, preemptions) of one workload on one stage's engine."""
    llm = LLM(
        str(folder),
        stage=stage,
        device=DEVICE,
        dtype="float64",
        block_size=4,
        max_model_len=96,
        max_num_seqs=4,
        num_kv_blocks=num_kv_blocks,
    )

    def generate(prompts):
        params = SamplingParams(max_tokens=SHARING_MAX_TOKENS, ignore_eos=True)
        return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    tokens = workload(generate)
    engine = llm.engine
    assert engine.manager.num_free_blocks == num_kv_blocks, f"stage {stage} leaked blocks"
    return tokens, engine.num_prefill_tokens, engine.scheduler.num_preemptions


@pytest.mark.parametrize("name", SHARING_WORKLOADS)
def test_stage07_gives_stage06_tokens_from_fewer_computed_prompt_tokens(
    tiny_checkpoints, name, record_property
):
    workload, num_kv_blocks = SHARING_WORKLOADS[name]
    folder, _ = tiny_checkpoints["qwen3"]
    expected, stage06_prefill, _ = play(folder, 6, workload, num_kv_blocks)
    tokens, stage07_prefill, preemptions = play(folder, 7, workload, num_kv_blocks)
    report = (
        f"{name}: prompt tokens computed, stage 06 {stage06_prefill}, stage 07 {stage07_prefill}"
    )
    record_property("prefill_tokens", report)
    print(report)
    assert tokens == expected
    assert stage07_prefill < stage06_prefill, report
    if num_kv_blocks < 256:
        assert preemptions > 0, "the pool was meant to run dry"
