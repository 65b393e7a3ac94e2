"""The streaming clients of `nanoserve bench --serve`: the workload as timed requests (stage 10).

Introduced in stage 10. Each request is one streaming completion whose chunks are timed as they
arrive; the requests go out all at once or as seeded Poisson arrivals, from one process or
spread over several (`--client-processes`). One Python process parsing 256 event streams falls
behind a fast server, and then it times its own backlog (bursts of chunks read at one instant)
instead of the server. Every process reads the same monotonic clock, so their times compare.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from typing import NamedTuple

from nanoserve.bench.workload import WARMUP_MAX_TOKENS, WARMUP_PROMPT_LEN, Workload
from nanoserve.child_process import ChildProcess, Ready, broadcast, receive_all, stop_all

SERVED_NAME = "bench"  # the model name the benchmark's server answers to


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


async def stream_one(http, prompt: list[int], max_tokens: int) -> Timing:
    """Send one streaming completion and time its chunks; raises on an HTTP error."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.6,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    times, counts = [], []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"the server answered {response.status_code}: "
                f"{(await response.aread()).decode()[:300]}"
            )
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


async def drive_share(
    url: str, requests: list[Request], max_concurrency: int | None, start: float
) -> list[Timing]:
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
    """A client process: say Ready, wait for the start time, send its share, return timings.
    An error (say, what the server answered) goes to the parent as its last word."""
    import httpx  # noqa: F401  (imported before Ready, so the start is not spent importing)

    conn.send(Ready())
    start = conn.recv()
    conn.send(asyncio.run(drive_share(url, requests, max_concurrency, start)))


def drive_in_processes(
    url: str, shares: list[list[Request]], limits: list[int | None]
) -> tuple[list[Timing], float]:
    """Each share from a client process of its own, all starting at one instant of the clock."""
    clients = []
    try:
        for i, (share, limit) in enumerate(zip(shares, limits), start=1):
            clients.append(
                ChildProcess(client_process, (url, share, limit), name=f"bench client process {i}")
            )
        receive_all(clients, Ready, doing="start")
        start = time.perf_counter() + 0.05  # every process has the start before it comes
        broadcast(clients, start)
        timings = [t for share_timings in receive_all(clients, list) for t in share_timings]
    finally:
        stop_all(clients)
    return timings, max(t.done for t in timings) - start


def drive(
    url: str,
    workload: Workload,
    rate: float,
    max_concurrency: int | None,
    seed: int,
    num_processes: int,
) -> tuple[list[Timing], float]:
    """Send the workload (after one warm-up request); (timings, seconds from the start)."""
    requests = schedule(workload, rate, seed)
    num_processes = num_client_processes(num_processes, len(requests), max_concurrency)
    warm_up = Request(workload.prompt_token_ids[0][:WARMUP_PROMPT_LEN], WARMUP_MAX_TOKENS, 0.0)
    asyncio.run(drive_share(url, [warm_up], None, time.perf_counter()))
    if num_processes == 1:
        start = time.perf_counter()
        timings = asyncio.run(drive_share(url, requests, max_concurrency, start))
        return timings, max(t.done for t in timings) - start
    shares, limits = share_out(requests, num_processes, max_concurrency)
    return drive_in_processes(url, shares, limits)


def share_out(
    requests: list[Request], num_processes: int, max_concurrency: int | None
) -> tuple[list[list[Request]], list[int | None]]:
    """(requests, concurrency limit) of each client process: round robin, the limit exactly."""
    num_processes = num_client_processes(num_processes, len(requests), max_concurrency)
    shares = [requests[i::num_processes] for i in range(num_processes)]
    if not max_concurrency:
        return shares, [None] * num_processes
    whole, rest = divmod(max_concurrency, num_processes)  # the first processes take the rest
    return shares, [whole + (i < rest) for i in range(num_processes)]


def num_client_processes(requested: int, num_requests: int, max_concurrency: int | None) -> int:
    """How many client processes run: no more than there are requests, or slots to send them."""
    return max(1, min(requested, num_requests, max_concurrency or num_requests))


def default_client_processes() -> int:
    """One client process per 4 CPUs, from 1 to 4: the server and the engine need the rest."""
    usable = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    return min(4, max(1, len(usable) // 4))
