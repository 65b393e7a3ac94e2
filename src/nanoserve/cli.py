"""The `nanoserve` command: generate, chat, stages, check, serve, bench.

Introduced in stage 00 (`check` with the grading harness, `bench` and `--trace` in stage 04,
`serve` in stage 10).
Each subcommand is a thin wrapper over the Python API; argument errors name the argument and
what was expected. `--impl` runs a learner's stage file inside the engine (learner_parts.py).
"""

from __future__ import annotations

import contextlib
import os
import sys

from nanoserve.cli_parser import build_parser

# torch, the engine and the parser's helpers (which need both) are imported inside functions, so
# that they load within main's Ctrl-C handler: importing this module is quick and quiet

EXIT_SIGINT, EXIT_SIGPIPE = 130, 141  # 128 + the signal's number, as a shell reports them


def sampling_params(args):
    """SamplingParams from the command line (ValueError names the bad field)."""
    from nanoserve.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )


def check_flags(args):
    """The engine flags of generate, chat and serve, checked as bench checks them (CheckedFlags,
    with --impl's pieces)."""
    from nanoserve.learner_parts import announce, require_engine_parts
    from nanoserve.options import check_engine_flags
    from nanoserve.stages import latest_stage

    flags = check_engine_flags(args, [latest_stage().number if args.stage is None else args.stage])
    if flags.parts is not None:
        require_engine_parts(flags.parts, args.command)
        note = announce(flags.parts)
        print(f"nanoserve {args.command}: {note or flags.parts.describe()}", file=sys.stderr)
    return flags


def make_llm(args, flags=None):
    """An LLM for the chosen model, stage, device and dtype, its flags checked first (unless
    `flags` holds them checked); --impl's pieces are its components."""
    from nanoserve.llm import LLM
    from nanoserve.options import engine_options

    parts = (flags or check_flags(args)).parts
    stage = args.stage if parts is None else parts.engine_stage
    components = None if parts is None else parts.components
    return LLM(
        args.model,
        stage=stage,
        device=args.device,
        dtype=args.dtype,
        components=components,
        **engine_options(args),
    )


def cmd_generate(args) -> int:
    params = sampling_params(args)
    llm = make_llm(args)
    if args.raw or llm.tokenizer is None or not llm.tokenizer.chat_template:
        prompts = args.prompts
    else:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompts]
    if args.trace:
        from nanoserve.engine.loop.trace import format_step

        llm.engine.on_step = lambda record: print(format_step(record, llm.engine.manager))
    if len(prompts) == 1 and llm.tokenizer is not None and not args.trace:
        outputs = [stream_one(llm, args.prompts[0], prompts[0], params)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.trace)
        for question, out in zip(args.prompts, outputs):
            print(f"> {question}\n{out.text.strip()}")
            print(f"[{len(out.token_ids)} tokens, {out.finish_reason}]")
    return 0


def stream_one(llm, question: str, prompt: str, params):
    """One prompt's completion printed as it is generated, then its token count and reason."""
    print(f"> {question}")
    pieces, started = llm.stream(prompt, params), False
    while True:
        try:
            piece = next(pieces)
        except StopIteration as end:
            out = end.value
            break
        if not started:  # the reply's leading whitespace, as the batch path strips it
            piece, started = piece.lstrip(), bool(piece.strip())
        print(piece, end="", flush=True)
    print(f"\n[{len(out.token_ids)} tokens, {out.finish_reason}]")
    return out


def cmd_chat(args) -> int:
    params = sampling_params(args)
    llm = make_llm(args)
    history: list[dict] = []
    print(f"nanoserve chat: {args.model}, stage {llm.stage.number}. /exit quits.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            return 0
        if line == "/exit":
            return 0
        if not line:
            continue
        history.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        history.append({"role": "assistant", "content": chat_reply(llm, history, params)})


def chat_reply(llm, history: list[dict], params) -> str:
    """Stream the reply to the conversation; Ctrl-C cuts it short and keeps what came. A reply
    cut by max_tokens (or the context) ends with [length]."""
    reply = ""
    pieces = llm.stream(llm.apply_chat_template(history), params)
    try:
        while True:
            try:
                piece = next(pieces)
            except StopIteration as end:  # the generator returns the finished request
                if end.value.finish_reason == "length":
                    print(" [length]", end="")
                break
            print(piece, end="", flush=True)
            reply += piece
    except KeyboardInterrupt:  # the stream's generator aborted the request as it closed
        print(" [interrupted]", end="")
    print()
    return reply


def cmd_stages(args) -> int:
    from nanoserve.stages import STAGES

    print(f"{'#':>2}  {'stem':<22} {'status':<12} {'gpu':<4} adds")
    for s in STAGES:
        gpu = "yes" if s.needs_gpu else ""
        print(f"{s.number:>2}  {s.stem:<22} {s.status.value:<12} {gpu:<4} {s.summary}")
    return 0


def cmd_check(args) -> int:
    from nanoserve.check import run_check

    return run_check(args.stage, args.impl, quiet=args.quiet)


def cmd_serve(args) -> int:
    try:
        from nanoserve.serving.server import create_app, run_server
    except ImportError as err:
        raise ValueError(
            f"serving needs FastAPI and uvicorn ({err}); install them with "
            "pip install 'nanoserve[serve]'"
        ) from None
    from nanoserve.serving.startup import (
        api_key_from,
        exposure_warning,
        limits_from,
        open_files_for,
    )

    name = args.served_model_name or args.model
    api_key = api_key_from(args.api_key, args.api_key_file)
    limits = limits_from(args)
    flags = check_flags(args)  # before the engine process starts
    parts = flags.parts
    if args.engine_in_process or parts is not None:  # --impl: loaded here, so run here
        llm = make_llm(args, flags)
        loop = None if parts is None or parts.loop is None else parts.loop(llm.engine)
        app = create_app(llm, name, api_key, limits, loop=loop)
    else:
        from nanoserve.options import engine_options
        from nanoserve.serving.engine_process import EngineClient

        llm = EngineClient(
            args.model,
            stage=args.stage,
            device=args.device,
            dtype=args.dtype,
            **engine_options(args),
        )
        # EngineClient stands in for both the LLM and its AsyncEngine (duck-typed, no Protocol)
        app = create_app(llm, name, api_key, limits, loop=llm)  # type: ignore[arg-type]
    where = "this process" if args.engine_in_process or parts else "its own process"
    print(
        f"nanoserve serve: {args.model}, stage {llm.stage.number} (engine loop in {where}), "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    for warning in (exposure_warning(args.host, api_key), open_files_for(limits)):
        if warning:
            print(warning, file=sys.stderr, flush=True)
    try:
        run_server(app, args.host, args.port, args.log_level)
    except KeyboardInterrupt:  # SIGINT, raised again by uvicorn once everything has stopped
        print(file=sys.stderr)
        exit_at_once(EXIT_SIGINT)
    return 0


def exit_at_once(status: int) -> None:
    """Flush and exit without the interpreter's teardown: a server that has stopped its engine
    has nothing left to clean up, and unloading torch's modules took 2 s of its shutdown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def cmd_bench(args) -> int:
    from nanoserve.bench.run import run_bench

    return run_bench(args)


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "stages": cmd_stages,
    "check": cmd_check,
    "serve": cmd_serve,
    "bench": cmd_bench,
}


def run_command(args) -> int:
    """Run the parsed command; a bad argument is one line on stderr and status 2."""
    from nanoserve.options import apply_threads

    try:
        if "threads" in vars(args):  # the commands that run an engine
            apply_threads(args)
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at exit
        return status
    except (ValueError, FileNotFoundError) as err:
        print(f"nanoserve {args.command}: error: {err}", file=sys.stderr)
        return 2
    except NotImplementedError as err:
        if getattr(args, "impl", None) is None:
            raise
        print(
            f"nanoserve {args.command}: error: --impl {args.impl}: {unfinished(err)}",
            file=sys.stderr,
        )
        return 1


def unfinished(err: NotImplementedError) -> str:
    """A starter's NotImplementedError as one line: which task is not done yet."""
    return f"not implemented yet ({err})" if str(err) else "a piece is not implemented yet"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nanoserve` console script: Ctrl-C and a closed pipe end it quietly,
    with the status a shell gives a process those signals ended (130 and 141)."""
    try:
        return run_command(build_parser().parse_args(argv))
    except KeyboardInterrupt:
        print(file=sys.stderr)  # after the terminal's ^C, so the shell prompt starts a line
        return EXIT_SIGINT
    except BrokenPipeError:
        silence_stdout()
        return EXIT_SIGPIPE


def silence_stdout() -> None:
    """Point stdout at /dev/null, so the flush at exit cannot raise BrokenPipeError again."""
    with contextlib.suppress(OSError, ValueError):  # no file (a test's capture): no flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
