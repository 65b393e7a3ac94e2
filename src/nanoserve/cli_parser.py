"""The `nanoserve` command's argument parser: every subcommand, its flags, defaults and help.

Introduced in stage 00 with the command (cli.py runs what it parses). The engine flags come from
options.py, bench's from bench/run.py, so each is declared once; torch and the engine are
imported only inside functions, so building the parser is quick.
"""

from __future__ import annotations

import argparse

from nanoserve import __version__
from nanoserve.models.registry import DEFAULT_MODEL

DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by the subcommands that generate: the engine's, and sampling."""
    from nanoserve.options import add_engine_source_args

    parser.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=None, help="(default: all tokens)")
    parser.add_argument("--seed", type=int, default=None, help="(default: none)")
    add_engine_source_args(parser)


class ModelArgument(argparse.Action):
    """`serve MODEL`, vLLM's form, or `serve --model MODEL`: one model, named at most once."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value is None:  # MODEL left out: --model or the default stands
            return
        named = getattr(namespace, "model_named", None)
        if named is not None and named != value:
            parser.error(f"two models named, {named!r} and {value!r}: give MODEL or --model")
        namespace.model = namespace.model_named = value


def add_serve_parser(subparsers) -> None:
    """`serve`: where to listen, who may ask, and the engine (sampling is per request)."""
    from nanoserve.options import add_engine_source_args

    serve = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_engine_source_args(serve, model_action=ModelArgument)
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        action=ModelArgument,
        metavar="MODEL",
        help=f"the model, as --model takes it (default: {DEFAULT_MODEL})",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health; visible in `ps`: "
        "prefer $NANOSERVE_API_KEY or --api-key-file (default: none)",
    )
    serve.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from the first line of this file (default: none)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: MODEL)",
    )
    add_limit_args(serve)
    serve.add_argument(
        "--log-level", default="info", help="uvicorn's: warning, info, debug (default: %(default)s)"
    )
    serve.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine loop as a thread of the server process, as stage 10 builds it "
        "(default: a process of its own, so HTTP work never waits on its GIL; with --impl, "
        "always here, where your file is loaded)",
    )


def limit_value(kind: type):
    """argparse type of a server limit: a number > 0, or `none` for no limit."""
    from nanoserve.options import positive_float, positive_int

    def parse(text: str):
        if text.lower() == "none":
            return None
        return positive_int(text) if kind is int else positive_float(text)

    return parse


def add_limit_args(serve: argparse.ArgumentParser) -> None:
    """One flag per ServerLimits field, with its default."""
    from dataclasses import fields

    from nanoserve.serving.limits import LIMIT_FLAGS, ServerLimits, limit_flag

    group = serve.add_argument_group("limits (a number, or none)")
    defaults = ServerLimits()
    for field in fields(ServerLimits):
        if field.name not in LIMIT_FLAGS:
            continue
        default = getattr(defaults, field.name)
        kind = float if field.name.endswith("_s") else int
        group.add_argument(
            limit_flag(field.name),
            dest=field.name,
            type=limit_value(kind),
            default=default,
            metavar="S" if kind is float else "N",
            help=f"{LIMIT_FLAGS[field.name]} (default: {default})",
        )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    from nanoserve.bench.arguments import add_bench_parser

    parser = argparse.ArgumentParser(
        prog="nanoserve",
        description="The nanoserve command: generate, chat, stages, check, serve, bench.",
    )
    parser.add_argument("--version", action="version", version=f"nanoserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts (chat template applied)")
    gen.add_argument("prompts", nargs="*", default=[DEFAULT_QUESTION])
    gen.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    gen.add_argument("--trace", action="store_true", help="print every step's batch and memory")
    add_model_args(gen)
    chat = sub.add_parser("chat", help="talk to the model; /exit quits")
    add_model_args(chat)
    sub.add_parser("stages", help="print the stage table")
    check = sub.add_parser("check", help="grade an implementation of one stage")
    check.add_argument("stage", type=int)
    check.add_argument("--impl", default="ref", help="ref, starter, a .py path or a module")
    check.add_argument(
        "--quiet", action="store_true", help="only the report: no progress line or bar on stderr"
    )
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser
