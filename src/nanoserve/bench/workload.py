"""The benchmark's requests and results: nano-vLLM's workload, and how a timed run is reported.

Introduced in stage 04 with `nanoserve bench`. Shared by the nanoserve side (`bench/run.py`) and
the transformers side (`bench/hf.py`); it runs no engine. torch is imported inside the timing
helpers so that building the CLI's parser stays quick.
"""

from __future__ import annotations

import gc
import math
import random
import time
from typing import NamedTuple

TOKEN_ID_HIGH = 10000  # nano-vLLM draws prompt ids in 0..10000
MIN_LEN = 100  # lengths are uniform in 100..max, as nano-vLLM's are (1..max when max < 100)
WARMUP_PROMPT_LEN, WARMUP_MAX_TOKENS = 16, 8


class Workload(NamedTuple):
    """The requests of one benchmark: prompt ids and each request's max_tokens."""

    prompt_token_ids: list[list[int]]
    max_tokens: list[int]

    def fold_ids(self, vocab_size: int) -> Workload:
        """The same requests with ids taken modulo vocab_size (only models of <= 10000 ids)."""
        if vocab_size > TOKEN_ID_HIGH:
            return self
        return self._replace(
            prompt_token_ids=[[t % vocab_size for t in p] for p in self.prompt_token_ids]
        )


class BenchResult(NamedTuple):
    """One engine's timed run."""

    engine: str
    output_tokens: int
    seconds: float
    preemptions: int | None  # None for engines that do not report it
    note: str | None = None
    prefill_tokens: int | None = None  # prompt tokens computed (fewer with a prefix cache)
    acceptance_rate: float | None = None  # stage 12: guesses kept per guess
    tokens_per_step: float | None = None  # stage 12: tokens a verified sequence gains per step
    startup_compile_s: float | None = None  # Triton's seconds building kernels before the clock
    timed_compiles: int | None = None  # Triton kernels built while the clock ran (should be 0)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of wall-clock time (inf for a run timed at 0 s)."""
        return self.output_tokens / self.seconds if self.seconds > 0 else math.inf


def make_workload(num_seqs=256, max_input_len=1024, max_output_len=1024, seed=0) -> Workload:
    """nano-vLLM's bench requests: all prompts are drawn first, then all max_tokens."""
    rng = random.Random(seed)  # the same stream as nano-vLLM's random.seed(0) + randint
    low_in, low_out = (MIN_LEN if n >= MIN_LEN else 1 for n in (max_input_len, max_output_len))
    prompts = [
        [rng.randint(0, TOKEN_ID_HIGH) for _ in range(rng.randint(low_in, max_input_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [rng.randint(low_out, max_output_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens)


def with_shared_prefix(workload: Workload, num_tokens: int, seed: int = 1) -> Workload:
    """The same requests, each prompt's first num_tokens replaced by one common prefix.

    Lengths do not change (a prompt shorter than the prefix becomes its start), and the prefix is
    drawn from its own stream, so the rest of nano-vLLM's workload stays exactly as it was.
    """
    rng = random.Random(seed)
    prefix = [rng.randint(0, TOKEN_ID_HIGH) for _ in range(num_tokens)]
    prompts = [prefix[: len(p)] + p[num_tokens:] for p in workload.prompt_token_ids]
    return workload._replace(prompt_token_ids=prompts)


def timer(device) -> float:
    """perf_counter() after queued GPU work is done, so a time covers the work, not its launch."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def release_memory(device) -> None:
    """Return freed cache memory, so the next engine sizes its KV pool from what is free."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
