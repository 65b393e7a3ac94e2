"""The child's side of `nanoserve bench --compare nano-vllm`: nano-vLLM runs the requests here.

Introduced with the peer comparison (after stage 10). bench/peer.py starts it as
`python -m nanoserve.bench.peer_driver REQUEST RESULT` with nano-vLLM on PYTHONPATH; it drives
nano-vLLM as nano-vLLM's own bench.py does and writes what it timed as JSON. It imports only the
standard library and `nanovllm`, never nanoserve's engine, so this process holds the peer alone.

    REQUEST (JSON)                                 RESULT (JSON, written once the run is done)
    {"model": folder, "engine": {LLM keywords},    {"output_tokens": int, "seconds": float,
     "temperature", "warmup": {...},                "preemptions": int or null}
     "prompt_token_ids": [[...]], "max_tokens": [...]}
"""

from __future__ import annotations

import json
import os
import sys
import time


def count_preemptions(llm) -> list[int] | None:
    """A counter that nano-vLLM's scheduler bumps at each preemption; None if it has no
    `preempt` to count (its LLM keeps the count nowhere, so the method is wrapped)."""
    scheduler = getattr(llm, "scheduler", None)
    preempt = getattr(scheduler, "preempt", None)
    if preempt is None:
        return None
    count = [0]

    def counted(seq):
        count[0] += 1
        return preempt(seq)

    scheduler.preempt = counted  # type: ignore[union-attr]
    return count


def run(request: dict) -> dict:
    """Build nano-vLLM's LLM on the folder, warm it up, time `generate` on the requests."""
    from nanovllm import LLM, SamplingParams

    llm = LLM(request["model"], **request["engine"])
    temperature = request["temperature"]
    warmup = request["warmup"]
    warmup_params = SamplingParams(
        temperature=temperature, ignore_eos=True, max_tokens=warmup["max_tokens"]
    )
    llm.generate([warmup["prompt_token_ids"]], warmup_params, use_tqdm=False)
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m)
        for m in request["max_tokens"]
    ]
    preemptions = count_preemptions(llm)  # after the warm-up, which cannot preempt anyway
    start = time.perf_counter()  # generate returns token ids on the host: the GPU is done
    outputs = llm.generate(request["prompt_token_ids"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "output_tokens": sum(len(out["token_ids"]) for out in outputs),
        "seconds": seconds,
        "preemptions": None if preemptions is None else preemptions[0],
    }


def main(argv: list[str]) -> int:
    """Read the request, run it, write the result (renamed into place: all or nothing)."""
    if len(argv) != 2:
        print("usage: python -m nanoserve.bench.peer_driver REQUEST RESULT", file=sys.stderr)
        return 2
    request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    result = run(request)
    with open(result_path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".part", result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
