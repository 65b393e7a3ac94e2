"""Stage 10 mutants: the engine loop (AsyncEngine), one learner bug each: commands, fan-out, the
turn's order, the handoff between threads, and the caller's generator."""

from __future__ import annotations

from tests.mutants import maker

APPLY = "for command in commands:\n    deliveries += self.apply(command)"
STEP = "if self.engine.has_unfinished():\n    self.engine.step()"
DELTA = "TokenDelta(new_token_ids, seq.finish_reason)"


mutant = maker(10, "AsyncEngine")


MUTANTS = (
    # ---- commands ----
    mutant(
        "abort_leaks_blocks",
        "an abort forgets the request and tells its stream, but never "
        "calls engine.abort: the sequence runs on, holding its blocks",
        "apply",
        ("self.engine.abort([request.seq])", ""),
    ),
    mutant(
        "abort_unknown_raises",
        "an abort of a request that already finished raises KeyError "
        "(pop without a default), which stops the loop's turn for everyone",
        "apply",
        ("self.requests.pop(command.request_id, None)", "self.requests.pop(command.request_id)"),
    ),
    mutant(
        "rejection_escapes",
        "a request the engine rejects raises out of apply instead of "
        "reaching its own stream: one bad request fails every request in flight",
        "apply",
        ("ValueError", "KeyError"),  # the exception its except catches
    ),
    mutant(
        "tracked_by_seq_id",
        "requests are tracked by the sequence's id, not the stream's "
        "request id: an abort finds nothing, or another request",
        "apply",
        ("self.requests[command.stream.request_id]", "self.requests[seq.seq_id]"),
    ),
    mutant(
        "no_queued_delta",
        "an accepted request hears nothing until its first token: the "
        "handler cannot tell 'queued' from 'still waiting for an answer'",
        "apply",
        ("return [Delivery(command.stream, TokenDelta([]))]", "return []"),
    ),
    # ---- fan-out ----
    mutant(
        "last_token_dropped",
        "a finished request's last delta carries only the reason: its last token is never sent",
        "fan_out",
        (DELTA, DELTA.replace("(new_token_ids,", "(new_token_ids if not seq.is_finished else [],")),
    ),
    mutant(
        "finish_not_signalled",
        "the last delta has no finish_reason: the caller waits forever",
        "fan_out",
        (DELTA, DELTA.replace("seq.finish_reason", "None")),
    ),
    mutant(
        "num_sent_not_advanced",
        "num_sent is never advanced: every delta repeats all the tokens so far",
        "fan_out",
        ("request.num_sent += len(new_token_ids)", ""),
    ),
    mutant(
        "finished_kept",
        "a finished request stays tracked: it is sent a finish every step",
        "fan_out",
        ("del self.requests[request_id]", "pass"),
    ),
    mutant(
        "wrong_stream",
        "tokens are paired with streams by position in the running queue, "
        "which preemption and finishing reorder: tokens reach the wrong request",
        "fan_out",
        (
            "seq = request.seq",
            "running = list(self.engine.scheduler.running)\n"
            "seq = running[len(deliveries)] if len(deliveries) < len(running) "
            "else request.seq",
        ),
    ),
    # ---- one turn ----
    mutant(
        "steps_before_commands",
        "the turn steps first and applies commands after: an abort "
        "costs one more step, a new request waits a step longer",
        "run_once",
        (f"{APPLY}\n{STEP}", f"{STEP}\n{APPLY}"),
    ),
    mutant(
        "steps_when_idle",
        "the turn always steps, also with nothing queued (step raises)",
        "run_once",
        (STEP, "self.engine.step()"),
    ),
    # ---- the handoff ----
    mutant(
        "put_from_the_loop_thread",
        "deliver puts into the asyncio queues from the loop "
        "thread: nobody wakes the event loop (debug mode raises)",
        "deliver",
        ("loop.call_soon_threadsafe(put_all, batch)", "put_all(batch)"),
    ),
    mutant(
        "one_wakeup_per_item",
        "deliver makes one call_soon_threadsafe per item: 256 wake-ups in a step of 256 requests",
        "deliver",
        (
            "by_loop[delivery.stream.loop].append(delivery)",
            "delivery.stream.loop.call_soon_threadsafe(put_all, [delivery])",
        ),
    ),
    # ---- the caller's generator ----
    mutant(
        "hang_up_not_aborted",
        "a caller that leaves early (a client that disconnected) "
        "leaves its request running in the engine, holding its blocks",
        "generate",
        ("if not finished:\n    self.abort(stream.request_id)", "pass"),
    ),
    mutant(
        "done_marked_after_the_yield",
        "the request is marked done after its last delta is yielded: a caller that closes the "
        "generator on that delta aborts a request that has already finished",
        "generate",
        (
            "finished = item.finish_reason is not None\nyield item",
            "yield item\nfinished = item.finish_reason is not None",
        ),
    ),
    mutant(
        "rejection_swallowed",
        "a rejected request's error is yielded as if it were a delta",
        "generate",
        ("raise item", "yield TokenDelta([], 'stop')\nreturn"),
    ),
    # ---- a blind spot: an engine failure ----
    mutant(
        "generate_raises_only_value_errors",
        "generate re-raises only ValueError items: a failing step's EngineError reaches the "
        "caller as an AttributeError on its finish_reason",
        "generate",
        ("isinstance(item, Exception)", "isinstance(item, ValueError)"),
    ),
)
