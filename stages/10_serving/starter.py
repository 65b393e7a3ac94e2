"""Stage 10 starter: the engine loop of a server. One thread owns the engine and steps it; requests
arrive as commands, and each request's new tokens go out to that request's own stream.

Fill in each method (the lesson, stages/10_serving/README.md, walks through them in task order)
in a copy: `cp stages/10_serving/starter.py my_loop.py`, then grade it with
`pytest stages/10_serving --impl my_loop.py`; this file itself must keep failing. Everything
runs on a CPU.

    event loop thread (HTTP handlers)                 engine loop thread (yours)
      generate(ids, params)                             while True:
        add_request --- Add(stream, ids, params) --->     commands = everything queued
        ...                                               run_once(commands):
        stream.get() <--- call_soon_threadsafe ------       apply each command
        (client gone) abort --- Abort(request_id) -->       engine.step()   (if anything is left)
                                                            fan_out()       (new tokens, finishes)
                                                          deliver(deliveries)
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from nanoserve.sampling import SamplingParams
from nanoserve.serving.engine_thread import EngineThread, put_all  # noqa: F401  (given)
from nanoserve.serving.request_stream import (  # noqa: F401  (given: the messages)
    Abort,
    Add,
    Delivery,
    Request,
    TokenDelta,
)

# Given (nanoserve/serving/engine_thread.py, EngineThread): `self.engine` (an LLMEngine),
# `self.requests` (request_id -> Request(seq, stream, num_sent), yours to keep), `start()`,
# `shutdown()`, `add_request(ids, params) -> RequestStream` and `abort(request_id)` (both put a
# command on the queue and return at once), and the thread body that takes every queued command,
# calls your `run_once(commands)`, then your `deliver(...)` with what it returned.


class AsyncEngine(EngineThread):
    """An LLMEngine served to many asyncio callers. Only the loop thread calls task 1 to 4's
    methods, so only that thread touches the engine; `generate` runs on a caller's event loop."""

    # ---- task 1: commands ----

    def apply(self, command: Add | Abort) -> list[Delivery]:
        """Carry out one command on the engine; return what the affected stream must hear.

        Add: `self.engine.add_request(command.prompt_token_ids, command.params)`. If it raises
        ValueError (a prompt too long, a bad token id), deliver that error to the command's
        stream and track nothing: a bad request is its caller's problem and nobody else's. If it
        is accepted, track it in `self.requests` under `command.stream.request_id` and deliver
        an empty TokenDelta (no tokens, no finish_reason): "you are queued".

        Abort: stop tracking the request, `self.engine.abort([seq])` (out of the queues, its
        blocks back in the pool, now), and deliver TokenDelta([], "abort"). A request that is not
        tracked (it finished and its last delta is on its way, or it was never accepted) is no
        error: return [].
        """
        raise NotImplementedError("task 1: apply")

    # ---- task 2: fanning tokens out ----

    def fan_out(self) -> list[Delivery]:
        """After a step: one Delivery of a TokenDelta for each tracked request that has tokens
        it has not sent yet, or that finished.

        A request's unsent tokens are its sequence's completion tokens past `num_sent`; advance
        `num_sent` by what you send. A finished request (`seq.is_finished`) gets its last tokens
        and `seq.finish_reason` in one delta, and leaves `self.requests`: exactly one delta of a
        request carries a finish_reason, and it is the last. A request with nothing new (still
        waiting, or preempted and recomputing) gets no delivery.

        Hint: seq.token_ids[seq.num_prompt_tokens + request.num_sent :] are the unsent tokens;
        iterate over list(self.requests.items()) when you delete from the dict as you go.
        """
        raise NotImplementedError("task 2: fan_out")

    # ---- task 3: one turn of the loop ----

    def run_once(self, commands: list) -> list[Delivery]:
        """Apply every command (in order), then one `self.engine.step()` if the engine has
        anything unfinished (`has_unfinished()`; stepping an idle engine raises), then fan out.
        Return the commands' deliveries followed by fan_out's.

        Commands first: an abort that arrived during the last step frees its blocks before the
        next one is scheduled, so a client that hangs up costs at most one more step.
        """
        raise NotImplementedError("task 3: run_once")

    # ---- task 4: the handoff between threads ----

    def deliver(self, deliveries: list[Delivery]) -> None:
        """Hand each item to its stream, on the stream's own event loop (`delivery.stream.loop`).

        This runs on the loop thread, and asyncio objects may only be touched on their own
        loop's thread: `stream.put` called from here would wake nobody (and raises in asyncio's
        debug mode). `loop.call_soon_threadsafe(fn, *args)` runs fn on that loop's thread and
        wakes it. Group the deliveries by loop and make one call per loop (`put_all(batch)` puts
        each item in order), so a step wakes each event loop once, not once per token. A loop
        that is closed raises RuntimeError there: nobody is left to read, so skip it.
        """
        raise NotImplementedError("task 4: deliver")

    # ---- task 5: what a caller sees ----

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Queue the request (`self.add_request`) and yield its deltas (`await stream.get()`)
        until one carries a finish_reason, that one included. The first is the empty "queued"
        delta. If an item is an exception (the engine's ValueError), raise it.

        A caller may stop early: `aclose()` on this generator, or a cancelled task (an HTTP
        client that hung up). Then the request is still in the engine, generating tokens nobody
        reads and holding blocks: `self.abort(stream.request_id)` in a `finally`, unless the
        request already finished (or was rejected).
        """
        raise NotImplementedError("task 5: generate")
        yield  # unreachable; it makes this function an async generator, as the reference's is
