"""`nanoserve bench --serve`: the HTTP server under load, beside the offline engine (stage 10).

Introduced in stage 10. It times the benchmark workload offline (`LLMEngine` driven directly, as
`nanoserve bench` does), then starts `nanoserve serve` in a subprocess on a free port of
127.0.0.1 (or targets `--url`) and sends the same requests over HTTP from concurrent streaming
clients, arriving all at once (`--request-rate inf`) or as a seeded Poisson process. It reports
output tokens/s on both sides, the serving overhead, and time to first token and inter-token
latency percentiles, as vLLM's serving benchmark does. Like `bench`, it asserts nothing.

The clients can be spread over several processes (`--client-processes`): one Python process
parsing 256 event streams falls behind a fast server, and then it times its own backlog (bursts
of chunks read at one instant) instead of the server. Every process reads the same monotonic
clock, so their times compare.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from nanoserve.bench.workload import WARMUP_MAX_TOKENS, WARMUP_PROMPT_LEN, BenchResult, Workload
from nanoserve.options import engine_options

SERVED_NAME = "bench"
STARTUP_TIMEOUT = 900  # seconds for the server to load, size its pool and capture its graphs


class Timing(NamedTuple):
    """What one streamed request looked like from the client."""

    sent: float
    token_times: list[float]  # arrival time of each chunk that carried tokens
    token_counts: list[int]  # tokens in each of those chunks
    done: float

    @property
    def num_tokens(self) -> int:
        return sum(self.token_counts)

    def inter_token_gaps(self) -> list[float]:
        """Seconds between consecutive tokens (a chunk of k tokens counts k equal gaps)."""
        gaps = []
        for prev, now, k in zip(self.token_times, self.token_times[1:], self.token_counts[1:]):
            gaps += [(now - prev) / k] * k
        return gaps


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
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    group.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="clients with a request in flight, at most, shared out over the client processes "
        "(default: no limit)",
    )
    group.add_argument("--seed", type=int, default=0, help="seeds the arrival times")  # fmt: skip
    group.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="processes the clients are spread over (default: one per 4 CPUs, 1 to 4)",
    )


def default_client_processes() -> int:
    """One client process per 4 CPUs, from 1 to 4: the server and the engine need the rest."""
    return min(4, max(1, (os.cpu_count() or 1) // 4))


async def stream_one(http, prompt: list[int], max_tokens: int) -> Timing:
    """Send one streaming completion and time its chunks; raises on an HTTP error."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.6, "ignore_eos": True}  # fmt: skip
    sent = time.perf_counter()
    times, counts = [], []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: "
                               f"{(await response.aread()).decode()[:300]}")  # fmt: skip
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                n = len(json.loads(line[6:])["choices"][0]["token_ids"])
                if n:
                    times.append(time.perf_counter())
                    counts.append(n)
    return Timing(sent, times, counts, time.perf_counter())


class Request(NamedTuple):
    """One request of the workload, and when to send it (seconds after the start)."""

    prompt: list[int]
    max_tokens: int
    send_at: float


def schedule(workload: Workload, rate: float, seed: int) -> list[Request]:
    """The workload's requests with their send times: all at 0, or seeded Poisson arrivals."""
    rng, send_at, requests = random.Random(seed), 0.0, []
    for prompt, max_tokens in zip(*workload):
        requests.append(Request(prompt, max_tokens, send_at))
        if rate != math.inf:
            send_at += rng.expovariate(rate)
    return requests


async def drive_share(url: str, requests: list[Request], max_concurrency: int | None,
                      start: float) -> list[Timing]:  # fmt: skip
    """Send these requests, each at start + its send_at, at most max_concurrency at a time."""
    import httpx

    limit = asyncio.Semaphore(max_concurrency or max(1, len(requests)))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

        async def send(request: Request) -> Timing:
            await asyncio.sleep(max(0.0, start + request.send_at - time.perf_counter()))
            async with limit:
                return await stream_one(http, request.prompt, request.max_tokens)

        return await asyncio.gather(*(send(r) for r in requests))


def client_process(conn, url: str, requests: list[Request], max_concurrency: int | None) -> None:
    """A client process: say "ready", wait for the start time, send its share, return timings."""
    import httpx  # noqa: F401  (imported before "ready", so the start is not spent importing)

    try:
        conn.send("ready")
        start = conn.recv()
        conn.send(("timings", asyncio.run(drive_share(url, requests, max_concurrency, start))))
    except Exception as err:  # the parent raises it, with what the server answered
        conn.send(("failed", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()


def drive_in_processes(url: str, shares: list[list[Request]],
                       limits: list[int | None]) -> tuple[list[Timing], float]:  # fmt: skip
    """Each share from a client process of its own, all starting at one instant of the clock."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    pipes, processes = [], []
    try:
        for share, limit in zip(shares, limits):
            ours, theirs = context.Pipe()
            process = context.Process(target=client_process, name="nanoserve-bench-client",
                                      args=(theirs, url, share, limit), daemon=True)  # fmt: skip
            process.start()
            theirs.close()
            pipes.append(ours)
            processes.append(process)
        for conn in pipes:
            if conn.recv() != "ready":
                raise RuntimeError("a client process did not start")
        start = time.perf_counter() + 0.05  # every process has the start before it comes
        for conn in pipes:
            conn.send(start)
        timings = []
        for conn in pipes:
            kind, detail = conn.recv()
            if kind != "timings":
                raise RuntimeError(f"a client process failed: {detail}")
            timings += detail
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
    return timings, max(t.done for t in timings) - start


def drive(url: str, workload: Workload, args) -> tuple[list[Timing], float]:
    """Send the workload (after one warm-up request); (timings, seconds from the start)."""
    num_processes = args.client_processes or default_client_processes()
    requests = schedule(workload, args.request_rate, args.seed)
    warm_up = Request(workload.prompt_token_ids[0][:WARMUP_PROMPT_LEN], WARMUP_MAX_TOKENS, 0.0)
    asyncio.run(drive_share(url, [warm_up], None, time.perf_counter()))
    if num_processes == 1:
        start = time.perf_counter()
        timings = asyncio.run(drive_share(url, requests, args.max_concurrency, start))
        return timings, max(t.done for t in timings) - start
    shares, limits = share_out(requests, num_processes, args.max_concurrency)
    return drive_in_processes(url, shares, limits)


def share_out(
    requests: list[Request], num_processes: int, max_concurrency: int | None
) -> tuple[list[list[Request]], list[int | None]]:
    """(requests, concurrency limit) of each client process: round robin, the limit exactly."""
    num_processes = min(num_processes, len(requests), max_concurrency or len(requests))
    shares = [requests[i::num_processes] for i in range(num_processes)]
    if not max_concurrency:
        return shares, [None] * num_processes
    whole, rest = divmod(max_concurrency, num_processes)  # the first processes take the rest
    return shares, [whole + (i < rest) for i in range(num_processes)]


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
    command = [sys.executable, "-m", "nanoserve", "serve", "--model", args.model, "--stage",
               str(stage), "--device", device, "--dtype", dtype, "--port", str(port),
               "--served-model-name", SERVED_NAME, "--log-level", "warning"]  # fmt: skip
    for name, value in engine_options(args).items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    return command


class ServerProcess:
    """`nanoserve serve` in a subprocess, for the length of a `with` block; its log in a file."""

    def __init__(self, command: list[str], port: int):
        self.command, self.url = command, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="nanoserve-serve-")  # noqa: SIM115
        self.process = None

    def __enter__(self) -> str:
        import httpx

        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nanoserve serve exited ({self.process.returncode}):\n"
                                   f"{self.log_tail()}")  # fmt: skip
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"nanoserve serve was not ready in {STARTUP_TIMEOUT} s")

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
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
    clients = args.max_concurrency or len(timings)
    processes = min(args.client_processes or default_client_processes(), len(timings), clients)
    name = f"served, rate {rate}, {clients} clients"
    name += f" in {processes} processes" if processes > 1 else ""
    return BenchResult(name, sum(t.num_tokens for t in timings), seconds, None)


def latency_lines(timings: list[Timing]) -> list[str]:
    """TTFT and ITL percentiles of the served run."""
    ttft = [t.token_times[0] - t.sent for t in timings if t.token_times]
    itl = [gap for t in timings for gap in t.inter_token_gaps()]
    return [f"time to first token   {percentiles(ttft)}",
            f"inter-token latency   {percentiles(itl)}"]  # fmt: skip


def overhead_line(offline: BenchResult, served: BenchResult) -> str:
    """How much throughput serving costs against the offline engine on the same requests."""
    overhead = 1 - served.tokens_per_s / offline.tokens_per_s
    return f"serving overhead      {overhead:.1%} of offline throughput"
