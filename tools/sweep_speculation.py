"""Stage 12 beside stage 11 by batch size and guess count, in one process, rounds interleaved.

    PYTHONPATH=src python3 tools/sweep_speculation.py --model smol.gguf --out sweep.jsonl
    PYTHONPATH=src python3 tools/sweep_speculation.py --model smol.gguf --part backoff ...
    PYTHONPATH=src python3 tools/sweep_speculation.py --model smol.gguf --part drafts ...

Each engine is built once, on the same loaded model, with a fixed pool (--num-kv-blocks) so
that all of them fit the card together, and kept; every round runs each engine on the same
requests (`--workload repeat`'s), stage 11 first. A stage 12 run sets its guess count through
the engine's policy (k at every batch size, no GUESSES_BY_BATCH). A run of batch size N is
REPS[N] batches of N requests at once, one after the other, so that even one request alone runs
long enough to time; with --concurrent, the REPS[N] x N requests are queued at once and at most N
run (the scheduler's max_num_seqs set to N for the run), so a request that finishes early is
replaced at once instead of leaving its batch to wait for the slowest. Prints, and appends to
--out, one JSON line per run: tokens, seconds, steps, and for stage 12 the verify steps, the
share of guesses kept and the tokens gained per verified sequence-step. It asserts nothing:
a measuring tool for docs/benchmarks.md ("Stage 12 by batch size"), never a test.

Parts: `ngram` (batch sizes x guess counts, greedy and T 0.6); `backoff` (the back-off as it
is, finding nothing counted as no miss, and none at all); `drafts` (the self-speculative draft
and a separate draft model, here the target itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from nanoserve.bench.arguments import bench_workload
from nanoserve.bench.nanoserve_engine import drive, load_bench_model
from nanoserve.bench.workload import timer
from nanoserve.cli_parser import build_parser
from nanoserve.llm_arguments import prefix_caching_components
from nanoserve.options import check_engine_flags
from nanoserve.recipes.assemble import build_engine
from nanoserve.sampling import SamplingParams

REPS = {1: 8, 2: 6, 4: 4, 8: 4, 16: 2, 32: 1, 64: 1}  # batches per run: 2,048+ tokens each


class Sweep:
    """The loaded model, the workload's prompts and the engines built on them."""

    def __init__(
        self, model_path: str, num_kv_blocks: int, max_tokens: int, out: str, concurrent: bool
    ):
        args = build_parser().parse_args(
            [
                "bench",
                "--model",
                model_path,
                "--workload",
                "repeat",
                "--num-seqs",
                "256",
                "--max-output-len",
                str(max_tokens),
            ]
        )
        self.flags = check_engine_flags(args, [11, 12])
        self.spec, self.model = load_bench_model(self.flags)
        workload = bench_workload(args, self.flags.model_config.vocab_size, self.flags.source)
        self.prompts = workload.prompt_token_ids
        self.config = dataclasses.replace(self.flags.config, num_kv_blocks=num_kv_blocks)
        self.max_tokens, self.out, self.concurrent = max_tokens, out, concurrent

    def build(self, stage: int, **changes):
        config = dataclasses.replace(self.config, **changes)
        start = time.perf_counter()
        components = prefix_caching_components(stage, None, None)
        eos = self.model.config.eos_token_ids
        engine = build_engine(stage, config, self.spec, eos, components, self.model)
        print(f"built stage {stage} {changes} in {time.perf_counter() - start:.1f} s", flush=True)
        return engine

    def run(self, name: str, engine, n: int, temperature: float, k: int | None = None, **extra):
        """REPS[n] batches of n requests on engine; one JSON line."""
        policy = engine.scheduler.speculation
        if k is not None and (policy.k, policy.by_batch) != (k, ()):  # k at every batch size
            policy.k, policy.by_batch = k, ()
            engine.runner.plan_guesses(policy.guesses_per_sequence)  # its verify shapes, now
        params = SamplingParams(
            temperature=temperature, ignore_eos=True, max_tokens=self.max_tokens
        )
        steps, before = engine.num_steps, engine.speculation
        scheduler = engine.scheduler
        start, tokens = timer(self.spec.device), 0
        if self.concurrent:  # every request queued at once, n running: a place freed is taken
            config = scheduler.config
            scheduler.config = dataclasses.replace(config, max_num_seqs=n)
            prompts = [self.prompts[i % len(self.prompts)] for i in range(REPS[n] * n)]
            seqs = drive(engine, prompts, [params] * len(prompts))
            tokens = sum(seq.num_completion_tokens for seq in seqs)
            scheduler.config = config
        for r in range(0 if self.concurrent else REPS[n]):
            first = (r * n) % (len(self.prompts) - n)
            seqs = drive(engine, self.prompts[first : first + n], [params] * n)
            tokens += sum(seq.num_completion_tokens for seq in seqs)
        seconds = timer(self.spec.device) - start
        steps = engine.num_steps - steps
        row = dict(
            engine=name,
            n=n,
            concurrent=self.concurrent,
            temp=temperature,
            k=k,
            **extra,
            tokens=tokens,
            s=round(seconds, 4),
            tok_s=round(tokens / seconds, 1),
            steps=steps,
            ms_step=round(1000 * seconds / steps, 3),
            ms_tok_seq=round(1000 * seconds * n / tokens, 3),
        )
        if before is not None:
            after = engine.speculation
            proposed = after.num_proposed - before.num_proposed
            kept = after.num_accepted - before.num_accepted
            verified = after.num_verified_seqs - before.num_verified_seqs
            row.update(
                kept=round(kept / proposed, 3) if proposed else 0.0,
                tps=round((kept + verified) / verified, 3) if verified else 0.0,
                verify_steps=after.num_verify_steps - before.num_verify_steps,
            )
        print(json.dumps(row), flush=True)
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")


def back_off(engine, variant: str) -> None:
    """Set the stage 12 engine's back-off: `rule` (as it is), `found` (a lookup that finds
    nothing is no miss) or `none` (every step that finds a guess verifies)."""
    policy = engine.scheduler.speculation
    policy.__dict__.pop("judged", None)  # the class's own judged
    policy.backoff.MAX_WAIT = 1 if variant == "none" else 64
    if variant == "found":

        def judged(plan, tokens, guesses=None):
            found = [None] * len(plan.seqs) if guesses is None else guesses
            for i, (seq, budget) in enumerate(zip(plan.seqs, plan.guesses)):
                if len(tokens[i]) > 1:
                    policy.backoff.hit(seq)
                elif budget and found[i]:
                    policy.backoff.missed(seq)

        policy.judged = judged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model with a tokenizer (SmolLM2's GGUF)")
    parser.add_argument("--part", choices=("ngram", "backoff", "drafts"), default="ngram")
    parser.add_argument("--out", required=True, help="a JSON-lines file to append to")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batches", default=None, help="ngram part: batch sizes, e.g. 1,4,16")
    parser.add_argument("--ks", default=None, help="ngram part: guess counts, e.g. 2,4")
    parser.add_argument("--temperatures", default="0,0.6", help="ngram part, e.g. 0")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="a run queues all its REPS[N] x N requests at once, at most N running (a finished "
        "request's place is taken at once, as a server's is), not REPS[N] closed batches",
    )
    args = parser.parse_args()
    sweep = Sweep(args.model, args.num_kv_blocks, args.max_tokens, args.out, args.concurrent)
    s11 = sweep.build(11)
    if args.part == "drafts":
        drafts = {
            "self": sweep.build(12, speculative_method="draft", num_speculative_tokens=4),
            "model": sweep.build(12, speculative_model=args.model, num_speculative_tokens=4),
        }
        for _ in range(args.rounds):
            for n in (1, 16):
                sweep.run("s11", s11, n, 0.0)
                for name, engine in drafts.items():
                    sweep.run(f"s12{name}", engine, n, 0.0, 4)
        return
    s12 = sweep.build(12, speculative_method="ngram", num_speculative_tokens=8)
    if args.part == "ngram":
        plan = [(0.0, (1, 2, 4, 8, 16, 32, 64)), (0.6, (1, 4, 16, 64))]
        if args.batches:  # the same batches at every temperature asked for
            batches = tuple(int(n) for n in args.batches.split(","))
            plan = [(float(t), batches) for t in args.temperatures.split(",")]
        for temperature, batches in plan:
            for _ in range(args.rounds):
                for n in batches:
                    sweep.run("s11", s11, n, temperature)
                    ks = (2, 4, 8) if n <= 4 else (1, 2, 4)
                    for k in [int(k) for k in args.ks.split(",")] if args.ks else ks:
                        sweep.run(f"s12k{k}", s12, n, temperature, k)
        return
    for temperature, batches in [(0.0, (1, 2, 4, 8)), (0.6, (1, 4))]:
        for _ in range(args.rounds):
            for n in batches:
                sweep.run("s11", s11, n, temperature)
                for k in (4, 8):
                    for variant in ("rule", "found", "none"):
                        back_off(s12, variant)
                        sweep.run(f"s12k{k}{variant}", s12, n, temperature, k, variant=variant)
                back_off(s12, "rule")


if __name__ == "__main__":
    main()
