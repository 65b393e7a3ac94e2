"""`nanoserve bench --serve`: the HTTP server under load, beside the offline engine (stage 10).

Introduced in stage 10. It times the benchmark workload offline (`LLMEngine` driven directly, as
`nanoserve bench` does), then starts `nanoserve serve` in a subprocess on a free port of
127.0.0.1 (or targets `--url`) and sends the same requests over HTTP from concurrent streaming
clients (`bench/clients.py`), arriving all at once (`--request-rate inf`) or as a seeded Poisson
process. It reports output tokens/s on both sides, time to first token and inter-token latency
percentiles, as vLLM's serving benchmark does, and, when every request arrives at once, the
serving overhead. Like `bench`, it asserts nothing.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from nanoserve.bench import clients
from nanoserve.bench.clients import SERVED_NAME, Timing
from nanoserve.bench.workload import BenchResult, Workload
from nanoserve.options import engine_flags, positive_float, positive_int

STARTUP_TIMEOUT = 900  # seconds for the server to load, size its pool and capture its graphs


def add_serve_bench_args(parser) -> None:
    """The options of `bench --serve` and `bench --url`."""
    group = parser.add_argument_group("serving (stage 10)")
    group.add_argument(
        "--serve",
        action="store_true",
        help="start `nanoserve serve` and benchmark it over HTTP, beside offline",
    )
    group.add_argument(
        "--url", default=None, help="benchmark a server already running there (no offline run)"
    )
    group.add_argument(
        "--request-rate",
        type=positive_float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    group.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="clients with a request in flight, at most, shared out over the client processes "
        "(default: no limit)",
    )
    group.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    group.add_argument(
        "--client-processes",
        type=positive_int,
        default=None,
        help="processes the clients are spread over (default: one per 4 CPUs, 1 to 4)",
    )


def requested_client_processes(args) -> int:
    """--client-processes, or the default for this machine."""
    return args.client_processes or clients.default_client_processes()


def drive(url: str, workload: Workload, args) -> tuple[list[Timing], float]:
    """The workload from the clients the options ask for: (timings, seconds from the start)."""
    return clients.drive(
        url,
        workload,
        args.request_rate,
        args.max_concurrency,
        args.seed,
        requested_client_processes(args),
    )


def percentiles(values: list[float]) -> str:
    """p50 / p90 / p99 in milliseconds."""
    import numpy as np

    if not values:
        return "-"
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1000
    return f"p50 {p50:.1f}  p90 {p90:.1f}  p99 {p99:.1f} ms"


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(args, stage: int, device: str, dtype: str, port: int) -> list[str]:
    """`python -m nanoserve serve` with the bench's model, stage, device, dtype and engine flags."""
    command = [
        sys.executable,
        "-m",
        "nanoserve",
        "serve",
        "--model",
        args.model,
        "--stage",
        str(stage),
        "--device",
        device,
        "--dtype",
        dtype,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--log-level",
        "warning",
    ]
    if getattr(args, "impl", None) is not None:  # the server runs the learner's file too
        from nanoserve.grading import normalize_impl

        command += ["--impl", normalize_impl(args.impl)]
    return command + engine_flags(args)


class ServerProcess:
    """`nanoserve serve` in a subprocess, for the length of a `with` block; its log in a file."""

    def __init__(self, command: list[str], port: int):
        self.command, self.url = command, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="nanoserve-serve-")  # noqa: SIM115
        self.process: subprocess.Popen | None = None  # started by __enter__

    def __enter__(self) -> str:
        import httpx

        self.process = subprocess.Popen(
            self.command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nanoserve serve exited ({self.process.returncode}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"nanoserve serve was not ready in {STARTUP_TIMEOUT} s")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def log_tail(self, num_chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-num_chars:]


def served_result(timings: list[Timing], seconds: float, args) -> BenchResult:
    """The served run as a row of the bench table."""
    rate = "inf" if args.request_rate == math.inf else f"{args.request_rate:g}/s"
    num_clients = args.max_concurrency or len(timings)
    processes = clients.num_client_processes(
        requested_client_processes(args), len(timings), args.max_concurrency
    )
    name = f"served, rate {rate}, {num_clients} clients"
    name += f" in {processes} processes" if processes > 1 else ""
    return BenchResult(name, sum(t.num_tokens for t in timings), seconds, None)


def latency_lines(timings: list[Timing]) -> list[str]:
    """TTFT and ITL percentiles of the served run."""
    ttft = [t.token_times[0] - t.sent for t in timings if t.token_times]
    itl = [gap for t in timings for gap in t.inter_token_gaps()]
    return [
        f"time to first token   {percentiles(ttft)}",
        f"inter-token latency   {percentiles(itl)}",
    ]


def overhead_line(
    offline: BenchResult, served: BenchResult, rate: float, max_concurrency: int | None = None
) -> str:
    """How much throughput serving costs against the offline engine on the same requests, or
    why the two rows do not compare (then no number is printed).

    Only like for like compares: every request arriving at once (offline has them all from the
    start, so a served run paced by its arrivals would count the waiting as overhead), no cap on
    concurrent requests (offline batches them all), and the same output tokens (a served request
    that failed or was cut makes the served row smaller work, not faster serving).
    """
    why_not = None
    if rate != math.inf:
        why_not = f"the arrivals ({rate:g}/s) pace the served run, and offline has every request"
        why_not += " at once"
    elif max_concurrency is not None:
        why_not = f"--max-concurrency {max_concurrency} caps the served batch; offline batches all"
    elif served.output_tokens != offline.output_tokens:
        why_not = (
            f"the served run produced {served.output_tokens:,} output tokens and offline "
            f"{offline.output_tokens:,}: not the same work"
        )
    if why_not is not None:
        return f"serving overhead      not measured: {why_not}"
    overhead = 1 - served.tokens_per_s / offline.tokens_per_s
    line = f"serving overhead      {overhead:.1%} of offline throughput"
    if overhead < 0:  # served faster than offline: noise between two single runs, not a gain
        line += " (negative: the served run was faster; compare medians of --repeat runs)"
    return line
