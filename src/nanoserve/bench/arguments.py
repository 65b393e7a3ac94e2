"""`nanoserve bench`'s flags: its parser, and what they are checked against before anything loads.

Split out of bench/run.py (which runs what the flags ask for). Everything here is cheap: the
CLI builds the parser on every call, and a bad flag must be refused before a model loads.
"""

from __future__ import annotations

import argparse
import sys

from nanoserve.bench import serve
from nanoserve.bench.peer import PEER, check_peer_path
from nanoserve.bench.workload import Workload, make_workload, with_shared_prefix
from nanoserve.config import EngineConfig
from nanoserve.options import add_engine_source_args, positive_int, refusing_as
from nanoserve.stages import latest_stage, require_implemented


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand and its options to the CLI's subparsers."""
    p = subparsers.add_parser("bench", help="throughput on nano-vLLM's workload")
    p.add_argument("--num-seqs", type=positive_int, default=256, help="(default: %(default)s)")
    p.add_argument(
        "--max-input-len", type=positive_int, default=1024, help="(default: %(default)s)"
    )
    p.add_argument(
        "--max-output-len", type=positive_int, default=1024, help="(default: %(default)s)"
    )
    p.add_argument(
        "--first",
        type=positive_int,
        default=None,
        metavar="N",
        help="time only the first N requests of the --num-seqs workload (default: all)",
    )
    p.add_argument(
        "--shared-prefix",
        type=positive_int,
        default=None,
        metavar="N",
        help="every prompt starts with the same N tokens (prefix caching, stage 07; default: none)",
    )
    p.add_argument(
        "--workload",
        choices=["random", "repeat"],
        default="random",
        help="random: nano-vLLM's random ids; repeat: chat requests to copy or edit a given text, "
        "where stage 12's guesses can hit (needs the model's tokenizer; --max-input-len is "
        "unused) (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.6,
        help="sampling temperature of every nanoserve request; 0 is greedy (default: "
        "%(default)s, nano-vLLM's)",
    )
    p.add_argument(
        "--compare",
        choices=["hf", PEER],
        default=None,
        help=f"also time transformers (hf) or nano-vLLM ({PEER}: CUDA, flash_attn, a Qwen3 model)",
    )
    p.add_argument(
        "--peer-path",
        default=None,
        metavar="DIR",
        help=f"a nano-vLLM source checkout, for --compare {PEER} where nanovllm is not "
        "importable (default: none)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="N",
        help="run every engine N times, in interleaved rounds, and report each one's min, median "
        "(of an even N, the mean of the middle two) and max tok/s, the ratio of the medians and "
        "each round's ratio (default: %(default)s)",
    )
    p.add_argument(
        "--num-iters-warmup",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="first run N warm-up rounds, interleaved like --repeat's: they run and are printed "
        "but are not counted in any figure (vLLM's name; default: %(default)s)",
    )
    p.add_argument(
        "--alternate",
        action="store_true",
        help="run odd rounds in reverse order (the peer first) and even rounds in table order, "
        "so that no engine always runs first",
    )
    p.add_argument(
        "--hf-batch-size", type=positive_int, default=None, help="CPU (default: all requests)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars (they are shown only on a terminal anyway)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also draw throughput (and served latencies) into this image, e.g. bench.png "
        "(needs matplotlib)",
    )
    serve.add_serve_bench_args(p)
    add_engine_source_args(p, many_stages=True)
    return p


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def checked_stages(args) -> list[int]:
    """The stage numbers asked for, each implemented; ValueError naming --stage otherwise."""
    numbers = [n for group in args.stage or [[latest_stage().number]] for n in group]
    with refusing_as("--stage"):
        for n in numbers:
            require_implemented(n)
    return list(dict.fromkeys(numbers))  # drop repeats, keep order


def check_fits(config: EngineConfig, workload: Workload) -> None:
    """ValueError naming --max-model-len unless every request of the workload fits it."""
    longest = max(len(p) + m for p, m in zip(*workload))
    if longest > config.max_model_len:
        raise ValueError(
            f"argument --max-model-len: the longest request needs {longest} tokens "
            f"(prompt + max_tokens), more than max_model_len {config.max_model_len}; "
            "lower --max-input-len or --max-output-len"
        )


def bench_workload(args, vocab_size: int | None, source: str | None = None) -> Workload:
    """The workload the options describe, ids folded into the vocabulary when it is known;
    --workload repeat tokenizes its texts with the tokenizer of source (the model)."""
    if args.workload == "repeat":
        from nanoserve.bench.repeat_workload import repeat_workload
        from nanoserve.models.loader import load_tokenizer

        tokenizer = load_tokenizer(source) if source is not None else None
        if tokenizer is None:
            raise ValueError("argument --workload: repeat needs a model with a tokenizer")
        workload = repeat_workload(tokenizer, args.num_seqs, args.max_output_len)
    else:
        workload = make_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    if args.first is not None:  # e.g. the first 64 of 256: docs/benchmarks.md's GPU run
        first = args.first
        workload = Workload(workload.prompt_token_ids[:first], workload.max_tokens[:first])
    if args.shared_prefix is not None:
        workload = with_shared_prefix(workload, args.shared_prefix)
    return workload if vocab_size is None else workload.fold_ids(vocab_size)


def progress(args) -> bool:
    """Bars on stderr while engines run: on a terminal, unless --quiet."""
    return not args.quiet and sys.stderr.isatty()


CPU_OUTPUT_TOKENS = 5_000  # more than this on a CPU is a long wait (the small run makes 601)


def warn_if_large_on_cpu(device, workload: Workload) -> None:
    """A warning on stderr (no question: the run goes on) when a CPU is given a GPU-sized run."""
    output_tokens = sum(workload.max_tokens)
    if device.type != "cpu" or output_tokens <= CPU_OUTPUT_TOKENS:
        return
    print(
        f"warning: {len(workload.max_tokens)} requests and up to {output_tokens:,} output tokens "
        "is the GPU workload; on a CPU it takes hours. Ctrl-C stops it; a CPU-sized run is "
        "nanoserve bench --num-seqs 16 --max-input-len 256 --max-output-len 64",
        file=sys.stderr,
        flush=True,
    )


def check_bench_flags(args) -> None:
    """The flags that say what to compare and how often, checked before anything loads."""
    check_peer_path(args.peer_path, args.compare)
    if not (args.temperature >= 0 and args.temperature < float("inf")):
        raise ValueError(f"argument --temperature: expected a number >= 0, got {args.temperature}")
    if args.compare and args.temperature != 0.6:
        raise ValueError(
            f"argument --temperature: {args.compare} samples at 0.6, nano-vLLM's; compare at it"
        )
    if args.serve or args.url:
        served = "--serve" if args.serve else "--url"
        if args.workload != "random" or args.temperature != 0.6:
            raise ValueError(f"argument --workload/--temperature: {served} runs nano-vLLM's")
        if args.compare:
            raise ValueError(f"argument --compare: {served} times nanoserve only")
        if args.repeat > 1:
            raise ValueError(f"argument --repeat: {served} runs once")
        if args.num_iters_warmup > 0:
            raise ValueError(f"argument --num-iters-warmup: {served} runs once, no warm-up")
