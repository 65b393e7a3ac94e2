"""What flows between the engine's loop thread and the requests waiting on it (stage 10).

Introduced in stage 10. Two directions, two kinds of message: commands go down to the loop
(`Add`, `Abort`, through a thread-safe queue), and deliveries come up to one request's
`RequestStream` (a `TokenDelta`, or the `ValueError` that rejected it), handed over on the
request's own event loop. Plain data and one asyncio queue; the loop itself is async_engine.py.

    HTTP handlers (event loop thread)          engine loop thread
      add_request  --- Add(stream, ids) --->   engine.add_request / abort
      abort        --- Abort(request_id) -->   engine.step()
      stream.get() <-- Delivery(stream, TokenDelta([17, 4], None)) ---  fan out
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from nanoserve.logprobs import TokenLogprobs
from nanoserve.sampling import SamplingParams
from nanoserve.types import Sequence


class TokenDelta(NamedTuple):
    """The tokens one request gained since its last delta; the last delta carries the reason.

    The first delta of an accepted request is empty: the engine has queued it. finish_reason is
    None while the request runs, then "stop" or "length" (the engine's), or "abort" when it was
    aborted. Exactly one delta of a request has a finish_reason. `logprobs` has one entry per
    token when the request asks for them (SamplingParams.logprobs), else None: the loop thread
    adds them to what `fan_out` delivers (`with_logprobs`).
    """

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None

    def joined(self, later: TokenDelta) -> TokenDelta:
        """This delta and a later one of the same request as one."""
        logprobs = None
        if self.logprobs is not None and later.logprobs is not None:
            logprobs = self.logprobs + later.logprobs
        return TokenDelta(self.token_ids + later.token_ids, later.finish_reason, logprobs)


class RequestStream:
    """One request's deltas, consumed by one asyncio task on the event loop that made it.

    The loop thread never touches the queue itself: asyncio objects are not thread-safe, so a
    delivery is handed over with `loop.call_soon_threadsafe(stream.put, item)`, and `put` runs
    on this stream's own loop.

    With `coalesce=True` (what `EngineThread.add_request` asks for), a reader that falls behind
    the engine gets its waiting tokens as one delta: a TokenDelta put behind another that still
    waits and carries tokens is joined onto it. A server writing 256 streams then sends one
    event per stream per wake-up, not one per step it missed, so a slow event loop catches up
    instead of falling further behind (vLLM's output collector does the same). The empty
    "accepted" delta, an error, and anything after a finish_reason are never joined.
    """

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop, coalesce: bool = False):
        self.request_id = request_id
        self.loop = loop
        self.coalesce = coalesce
        self._items: deque[TokenDelta | Exception] = deque()
        self._ready = asyncio.Event()  # set while _items is not empty

    def put(self, item: TokenDelta | Exception) -> None:
        """Queue a delivery; call it on `self.loop`'s thread only."""
        last = self._items[-1] if self._items else None
        if self.coalesce and joinable(last, item):
            assert isinstance(last, TokenDelta) and isinstance(item, TokenDelta)  # joinable says
            self._items[-1] = last.joined(item)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> TokenDelta | Exception:
        """The next delivery, waiting for it if none is queued."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def joinable(waiting, item) -> bool:
    """True if `item` may be joined onto `waiting`: both TokenDeltas, and `waiting` carries
    tokens and no finish_reason."""
    return (
        isinstance(waiting, TokenDelta)
        and isinstance(item, TokenDelta)
        and bool(waiting.token_ids)
        and waiting.finish_reason is None
    )


class Delivery(NamedTuple):
    """An item for a stream, made on the loop thread and handed over to the stream's loop."""

    stream: RequestStream
    item: TokenDelta | Exception


@dataclass
class Request:
    """A request the loop thread tracks: its sequence, its stream, and how much it has sent."""

    seq: Sequence
    stream: RequestStream
    num_sent: int = 0  # completion tokens already delivered
    num_logprobs_sent: int = 0  # of them, how many went with their logprobs (`with_logprobs`)


class RequestTable(dict):
    """request_id -> Request: what the loop thread tracks (`EngineThread.requests`). `held` also
    keeps every request tracked since `start_turn`, dropped or not: one added and finished in a
    single turn (max_tokens=1) still gets its logprobs."""

    def __init__(self):
        super().__init__()
        self.held: dict[int, Request] = {}

    def start_turn(self) -> None:
        """Forget the requests dropped before now."""
        self.held = dict(self)

    def __setitem__(self, request_id: int, request: Request) -> None:
        super().__setitem__(request_id, request)
        self.held[request_id] = request


def with_logprobs(deliveries: list[Delivery], requests: dict[int, Request]) -> list[Delivery]:
    """`deliveries` with each TokenDelta of a request that asks for logprobs carrying those of
    its tokens (`requests`: request_id -> Request, finished ones included). A request's deltas
    come in order, so its next tokens' logprobs are the ones after those already sent."""
    out = []
    for delivery in deliveries:
        item, request = delivery.item, requests.get(delivery.stream.request_id)
        if isinstance(item, TokenDelta) and request is not None:
            seq = request.seq
            if seq.params.logprobs is not None:
                start = request.num_logprobs_sent
                end = start + len(item.token_ids)
                request.num_logprobs_sent = end
                logprobs = [seq.logprobs[i] for i in range(start, end)]
                delivery = Delivery(delivery.stream, item._replace(logprobs=logprobs))
        out.append(delivery)
    return out


class Add(NamedTuple):
    """Command: validate and queue a request whose deltas go to `stream`."""

    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(NamedTuple):
    """Command: drop a request for good and free its memory (unknown or finished: no-op)."""

    request_id: int


class EngineStats(NamedTuple):
    """What /metrics shows of the engine, copied by the loop thread after every iteration.

    The loop thread replaces the whole tuple (one reference assignment); other threads read it
    and never the engine itself. Block counts are None for a manager without blocks (stage 00);
    `unreported` says, per metric, what a manager that should report it lacks (a learner's).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int | None = None
    num_blocks_free: int | None = None
    prefix_cache_hit_rate: float | None = None
    num_steps: int = 0
    num_preemptions: int = 0
    unreported: tuple[str, ...] = ()  # "metric: why", e.g. a prefix cache without a hit_rate
    speculation: Any = None  # stage 12: the engine's SpeculationStats (None: it does not guess)

    @classmethod
    def of(cls, engine) -> EngineStats:
        """A snapshot of `engine` (an LLMEngine); call it on the thread that steps the engine."""
        manager, scheduler = engine.manager, engine.scheduler
        num_free = getattr(manager, "num_free_blocks", None)
        num_blocks = getattr(manager, "num_blocks", None)
        used = None if num_free is None or num_blocks is None else num_blocks - num_free
        hit_rate = getattr(manager, "hit_rate", None)
        return cls(
            len(scheduler.running),
            len(scheduler.waiting),
            used,
            num_free,
            hit_rate,
            engine.num_steps,
            scheduler.num_preemptions,
            lacks_hit_rate(manager) if hit_rate is None else (),
            getattr(engine, "speculation", None),
        )


def lacks_hit_rate(manager) -> tuple[str, ...]:
    """("prefix_cache_hit_rate: why",) for a prefix-caching manager (it has hash_blocks) that
    keeps no hit_rate, as a learner's may not; () for any other."""
    if not callable(getattr(manager, "hash_blocks", None)):
        return ()
    cls = type(manager)
    where = getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__
    return (
        f"prefix_cache_hit_rate: the engine's {cls.__name__} (from {os.path.basename(where)}) "
        "has no hit_rate property (prompt tokens found cached / prompt tokens admitted)",
    )
