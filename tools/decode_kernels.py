"""A decode step's device time by kernel, against the step's wall time under CUDA graphs.

    PYTHONPATH=src python3 tools/decode_kernels.py --stage 11 --batch 256 --context 1024
    PYTHONPATH=src python3 tools/decode_kernels.py --stage 13 --kv-cache-dtype fp8

Builds the stage's engine on the Qwen3-0.6B preset (random bfloat16 weights) twice: with CUDA
graphs it prefills `batch` random prompts of `context` tokens and times --steps decode steps
between two synchronizations (wall ms per step); eager (`enforce_eager`, so each kernel is a
launch of its own) it records 8 decode steps under torch.profiler and sums each kernel's device
time per step. Compare the attention kernel's time with the K/V bytes a step reads. It asserts
nothing: a measuring tool for docs/benchmarks.md ("Where a decode step's time goes"), never a
test. Needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve.bench.nanoserve_engine import load_bench_model
from nanoserve.bench.workload import release_memory
from nanoserve.cli_parser import build_parser
from nanoserve.llm_arguments import prefix_caching_components
from nanoserve.options import check_engine_flags
from nanoserve.recipes.assemble import build_engine
from nanoserve.sampling import SamplingParams

PROFILED_STEPS = 8


def decoding(engine, prompts: list[list[int]], max_tokens: int) -> None:
    """Admit the prompts and step until every one has its first token, then 4 steps more."""
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    for prompt in prompts:
        engine.add_request(prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_completion_tokens == 0 for seq in scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()


def kernel_times(engine) -> collections.Counter:
    """Microseconds of device time per kernel name over PROFILED_STEPS steps."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
        torch.cuda.synchronize()
    times: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time_total
    return times


def mean_context(engine) -> float:
    running = engine.scheduler.running
    return sum(len(seq) for seq in running) / max(1, len(running))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=11)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    bench = ["bench", "--model", "qwen3-0.6b", "--kv-cache-dtype", args.kv_cache_dtype]
    flags = check_engine_flags(build_parser().parse_args(bench), [args.stage])
    spec, model = load_bench_model(flags)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 1000, (args.context,), generator=generator).tolist()
        for _ in range(args.batch)
    ]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"weights {weights / 1e9:.3f} GB; {args.batch} requests of {args.context} tokens")
    components = prefix_caching_components(args.stage, None, None)
    for eager in (False, True):
        config = dataclasses.replace(flags.config, enforce_eager=eager)
        engine = build_engine(
            args.stage, config, spec, model.config.eos_token_ids, components, model
        )
        decoding(engine, prompts, args.steps + PROFILED_STEPS + 40)
        if not eager:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            ms = 1000 * (time.perf_counter() - start) / args.steps
            print(f"graphs: {ms:.3f} ms per decode step, mean context {mean_context(engine):.0f}")
        else:
            times = kernel_times(engine)
            total = sum(times.values())
            print(f"eager: {total / PROFILED_STEPS / 1000:.3f} ms of kernels per decode step, "
                  f"mean context {mean_context(engine):.0f}")  # fmt: skip
            for name, us in times.most_common(14):
                share = 100 * us / total
                print(f"  {us / PROFILED_STEPS / 1000:8.3f} ms {share:5.1f} %  {name[:90]}")
        engine.shutdown()
        del engine
        release_memory(spec.device)


if __name__ == "__main__":
    main()
