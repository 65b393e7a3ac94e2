"""Where one decode step's time goes on a GPU: host packing, the forward pass, sampling.

    PYTHONPATH=src python3 tools/profile_decode.py --stage 6 --batch 256 --context 1024

Builds the stage's engine on a random-weight preset, admits `batch` requests of `context` prompt
tokens, runs their prefill, then times decode steps piece by piece (CUDA synchronized around each
piece, so the pieces add up to a step; the sum is slower than an unsynchronized step). It asserts
nothing: it is a measuring tool for docs/benchmarks.md, never a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.runner.cuda_graphs import DecodeGraphs, table_width
from nanoserve.layers.compiled import fuse_small_ops
from nanoserve.types import StepOutput


class Laps:
    """Milliseconds per named piece, with CUDA synchronized at every lap."""

    def __init__(self, device):
        self.device, self.ms = device, defaultdict(list)

    def now(self) -> float:
        torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str, since: float) -> float:
        end = self.now()
        self.ms[name].append((end - since) * 1e3)
        return end


def decode_step(engine, laps: Laps) -> int:
    """One engine step, timed piece by piece; returns the batch size."""
    runner, t = engine.runner, laps.now()
    batch = engine.scheduler.schedule()
    t = laps.lap("schedule", t)
    inputs = runner.prepare(batch)
    t = laps.lap("prepare", t)
    logits = runner.forward(inputs, runner.attention, len(batch.seqs))
    t = laps.lap("forward", t)
    seqs = batch.seqs
    token_ids = runner.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
    t = laps.lap("sample", t)
    engine.scheduler.update(batch, StepOutput.of(token_ids, inputs))
    laps.lap("update", t)
    return len(seqs)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--stage", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--graphs", action="store_true", help="capture decode graphs first")
    parser.add_argument("--fuse", action="store_true", help="torch.compile the small ops first")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        stage=args.stage,
        max_num_seqs=max(args.batch, 1),
        attention_backend=args.attention_backend,
    )
    engine, runner = llm.engine, llm.engine.runner
    if args.fuse:
        fuse_small_ops(runner.model)
    if args.graphs and runner.graphs is None:
        runner.graphs = DecodeGraphs(
            runner.model,
            runner.attention,
            args.batch,
            table_width(llm.config.max_model_len, llm.config.block_size),
            runner.device,
        )
        runner.graphs.capture()
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.steps + 8)
    for i in range(args.batch):
        engine.add_request([(i * 31 + j) % 10000 for j in range(args.context)], params)
    while engine.scheduler.waiting:
        engine.step()  # prefill everyone (the scheduler prefers prefills)
    laps = Laps(runner.device)
    batch_size = [decode_step(engine, laps) for _ in range(args.steps)][-1]
    medians = {name: statistics.median(ms) for name, ms in laps.ms.items()}
    total = sum(medians.values())
    graphs = "on" if runner.graphs else "off"
    print(
        f"stage {args.stage} ({engine.attention.name}, graphs {graphs}), batch {batch_size}, "
        f"context ~{args.context}: median ms per decode step"
    )
    for name, median in medians.items():
        print(f"  {name:<12} {median:8.3f} ms  {100 * median / total:5.1f} %")
    print(f"  {'total':<12} {total:8.3f} ms  = {batch_size / total * 1e3:,.0f} tok/s at this batch")


if __name__ == "__main__":
    main()
