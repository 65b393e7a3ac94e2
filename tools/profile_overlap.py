"""How much host time a decode step leaves exposed: the engine's own timestamps, host and device.

    PYTHONPATH=src python3 tools/profile_overlap.py --stage 9 --stage 11 --batch 256 --context 1024
    PYTHONPATH=src python3 tools/profile_overlap.py --stage 11 --batch 1 --json timeline.json
    PYTHONPATH=src python3 tools/profile_overlap.py --stage 11 --stage 12 --guesses 4 --batch 1

Builds each stage's engine on a random-weight preset, admits `batch` requests of `context` prompt
tokens, prefills them, then runs decode steps with `engine.step()` exactly as `LLM.generate`
does. Each step's phases are stamped on the host (time.perf_counter) and, on a GPU, the device
work of each step is bracketed by two CUDA events (enqueued before its first kernel and after its
last). Per stage it prints the median step (wall), the device busy time of a step (between its
events) and the rest: host time the device waited for. --json writes every stamp, for the
timeline picture of stage 11's notebook. On a CPU there is no device clock: only host phases.

--guesses K (stage 12): every prompt is one stretch repeated, the n-gram lookup's proposal is
padded to K guesses with the newest token, and the back-off is off: every decode step is a
verify step (random weights keep few guesses; the step's cost is what is measured). The phases
inside a step (lookup, inputs, replays, LM head, verdict) are stamped too. --kernels: per
step, the CUDA runtime calls the host makes (kernel launches, copies, graph replays), from
torch.profiler.
It asserts nothing: a measuring tool for docs/benchmarks.md, never a test.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.runner import verifier


class Stamps:
    """Host phases (start, end in ms since the run began) and device intervals, per step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.origin = self._event() if self.cuda else None
        self.phases: list[tuple[str, float, float]] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wrapped: list[tuple[object, str, object]] = []

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def wrap(self, obj, name: str, device_work: bool = False) -> None:
        """Stamp every call of obj.name as a host phase (and, for device_work, as a device
        interval: an event before its first kernel, one after its last)."""
        inner = getattr(obj, name)

        @functools.wraps(inner)
        def stamped(*args, **kwargs):
            start = self.now()
            before = self._event() if device_work and self.cuda else None
            result = inner(*args, **kwargs)
            if before is not None:
                self.events.append((before, self._event()))
            self.phases.append((name, start, self.now()))
            return result

        self.wrapped.append((obj, name, inner))
        setattr(obj, name, stamped)

    def unwrap(self) -> None:
        """Put every wrapped callable back (a module function outlives this engine)."""
        for obj, name, inner in reversed(self.wrapped):
            setattr(obj, name, inner)

    def device_intervals(self) -> list[tuple[float, float]]:
        """(start, end) ms of each step's device work, on the host's clock (CUDA only)."""
        torch.cuda.synchronize()
        offset = 0.0  # the origin event was recorded at t0 on an idle device
        return [
            (offset + self.origin.elapsed_time(a), offset + self.origin.elapsed_time(b))
            for a, b in self.events
        ]


PHASES = (  # (the runner's attribute, method): the parts of a step, stamped where they exist
    ("steps", "run"),  # stage 11: a decode step replayed whole
    ("proposer", "propose"),
    ("state", "send"),
    ("verifier", "launch_ahead"),  # stage 12: a verify step launched ahead
    ("steps", "run_verify"),  # ... replayed whole
    ("state", "decode_inputs"),
    ("graphs", "replay_filled"),
    ("model", "compute_logits"),
)


def prompt(i: int, args) -> list[int]:
    """Request i's prompt: ids below 500 (every preset has them), or (--guesses) one stretch
    of 50 repeated."""
    if args.guesses:
        return [(i * 97 + (j % 50) * 31) % 500 for j in range(args.context)]
    return [(i * 31 + j) % 500 for j in range(args.context)]


def profile(args, stage: int) -> dict:
    spec = {}
    if stage == 12 and args.guesses:
        spec = dict(speculative_method="ngram", num_speculative_tokens=args.guesses)
    # with --guesses, room for a verify step's rows in the largest graph, at both stages
    rows = max(args.batch, 1) * (args.guesses + 1)
    llm = LLM(args.model, stage=stage, max_num_seqs=rows, max_model_len=4096, **spec)
    engine, runner = llm.engine, llm.engine.runner
    if spec:  # every step verifies K guesses: the lookup's, padded with the newest token
        engine.scheduler.speculation.backoff.MAX_WAIT = 1
        lookup = runner.proposer.lookup

        def padded(token_ids, k, max_n, min_n):
            found = lookup(token_ids, k, max_n, min_n)
            return found + [token_ids[-1]] * (k - len(found))

        runner.proposer.lookup = padded
    params = SamplingParams(temperature=args.temperature, ignore_eos=True,
                            max_tokens=(2 * args.steps + 10) * (args.guesses + 1) + 64)  # fmt: skip
    for i in range(args.batch):
        engine.add_request(prompt(i, args), params)
    while engine.scheduler.waiting:
        engine.step()  # prefill everyone (the scheduler prefers prefills)
    for _ in range(5):
        engine.step()  # steady decode
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    stamps = Stamps(runner.device)
    stamps.wrap(engine.scheduler, "schedule")
    if hasattr(runner, "launch"):  # stage 11: launch, then wait for the step before
        stamps.wrap(runner, "launch", device_work=True)
    else:  # earlier stages: prepare, run (forward + sample + wait)
        stamps.wrap(runner, "prepare")
        stamps.wrap(runner, "run", device_work=True)
    stamps.wrap(engine.scheduler, "land")  # the tokens appended, requests finished
    stamps.wrap(engine.scheduler, "commit")
    if getattr(runner, "verifier", None) is not None:  # a verify step run op by op
        stamps.wrap(verifier, "verify_ahead")  # the module function the verifier calls
    for owner, name in PHASES:
        if hasattr(getattr(runner, owner, None), name):
            stamps.wrap(getattr(runner, owner), name)
    verified = engine.speculation.num_verify_steps if engine.speculation else 0
    starts = []
    for _ in range(args.steps):
        starts.append(stamps.now())
        engine.step()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    starts.append(stamps.now())
    walls = [b - a for a, b in itertools.pairwise(starts)]
    result = {
        "stage": stage,
        "backend": engine.attention.name,
        "graphs": runner.graphs is not None,
        "batch": args.batch,
        "context": args.context,
        "step_starts_ms": starts,
        "phases": stamps.phases,
        "wall_ms": statistics.median(walls),
        "verify_steps": (engine.speculation.num_verify_steps - verified) if spec else 0,
        "runtime_calls_per_step": {},
    }
    if stamps.cuda:
        intervals = stamps.device_intervals()
        busy = [b - a for a, b in intervals]
        result["device"] = intervals
        result["busy_ms"] = statistics.median(busy)
        result["exposed_host_ms"] = result["wall_ms"] - result["busy_ms"]
    stamps.unwrap()
    if args.kernels and stamps.cuda:
        result["runtime_calls_per_step"] = runtime_calls(engine, args.steps)
    engine.shutdown()
    return result  # one stage per process on a GPU: each engine sizes its pool from what is free


def runtime_calls(engine, steps: int) -> dict[str, float]:
    """CUDA runtime calls per step (kernel launches, copies, graph launches) over `steps` more
    steps, from torch.profiler's CPU-side records."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    counts: dict[str, float] = {}
    for event in prof.key_averages():
        if (event.key.startswith("cuda") and "Launch" in event.key) or "Memcpy" in event.key:
            counts[event.key] = event.count / steps
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--stage", type=int, action="append", help="repeatable (default: 11)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--guesses", type=int, default=0, help="stage 12: K guesses every step")
    parser.add_argument("--kernels", action="store_true", help="CUDA runtime calls per step")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every stamp here")
    args = parser.parse_args()
    results = [profile(args, stage) for stage in args.stage or [11]]
    for r in results:
        line = f"stage {r['stage']:>2} ({r['backend']}, graphs {'on' if r['graphs'] else 'off'}), "
        line += f"batch {r['batch']}, context ~{r['context']}: step {r['wall_ms']:.3f} ms"
        if "busy_ms" in r:
            line += (
                f", device busy {r['busy_ms']:.3f} ms, host exposed {r['exposed_host_ms']:.3f} ms"
            )
        print(line)
        by_phase: dict[str, list[float]] = {}
        for name, start, end in r["phases"]:
            by_phase.setdefault(name, []).append(end - start)
        if r["verify_steps"]:
            print(f"  verify steps: {r['verify_steps']} of {args.steps}")
        if r["runtime_calls_per_step"]:
            print(
                "  CUDA runtime calls per step: "
                + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["runtime_calls_per_step"].items()))
            )
        print(
            "  host phases (median ms): "
            + ", ".join(f"{name} {statistics.median(ms):.3f}" for name, ms in by_phase.items())
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
