"""Stage 10 mutants: the engine loop (serving/async_engine.py's AsyncEngine), one learner bug each:
commands, fan-out, the turn's order, the handoff between threads, and the caller's generator."""

from __future__ import annotations

from tests.mutants import Mutant

LOOP = "nanoserve.serving.async_engine"


def mutant(name: str, bug: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(10, name, bug, LOOP, edits)


MUTANTS = (
    # ---- commands ----
    mutant(
        "abort_leaks_blocks", "an abort forgets the request and tells its stream, but never "
        "calls engine.abort: the sequence runs on, holding its blocks",
        ("        self.engine.abort([request.seq])  # out of the queues", "        # ("),
    ),
    mutant(
        "abort_unknown_raises", "an abort of a request that already finished raises KeyError "
        "(pop without a default), which stops the loop's turn for everyone",
        ("request = self.requests.pop(command.request_id, None)",
         "request = self.requests.pop(command.request_id)"),
    ),
    mutant(
        "rejection_escapes", "a request the engine rejects raises out of apply instead of "
        "reaching its own stream: one bad request fails every request in flight",
        ("            except ValueError as err:  # a bad request is its own caller's problem",
         "            except KeyError as err:  # a bad request is its own caller's problem"),
    ),
    mutant(
        "tracked_by_seq_id", "requests are tracked by the sequence's id, not the stream's "
        "request id: an abort finds nothing, or another request",
        ("self.requests[command.stream.request_id] = Request(seq, command.stream)",
         "self.requests[seq.seq_id] = Request(seq, command.stream)"),
    ),
    mutant(
        "no_queued_delta", "an accepted request hears nothing until its first token: the "
        "handler cannot tell 'queued' from 'still waiting for an answer'",
        ("            return [Delivery(command.stream, TokenDelta([]))]", "            return []"),
    ),
    # ---- fan-out ----
    mutant(
        "last_token_dropped", "a finished request's last delta carries only the reason: its "
        "last token is never sent",
        ("TokenDelta(new_token_ids,\n",
         "TokenDelta(new_token_ids if not seq.is_finished else [],\n"),
    ),
    mutant(
        "finish_not_signalled", "the last delta has no finish_reason: the caller waits forever",
        ("                                                                  seq.finish_reason)))",
         "                                                                  None)))"),
    ),
    mutant(
        "num_sent_not_advanced", "num_sent is never advanced: every delta repeats all the "
        "tokens so far",
        ("            request.num_sent += len(new_token_ids)\n", ""),
    ),
    mutant(
        "finished_kept", "a finished request stays tracked: it is sent a finish every step",
        ("                del self.requests[request_id]\n", "                pass\n"),
    ),
    mutant(
        "wrong_stream", "tokens are paired with streams by position in the running queue, "
        "which preemption and finishing reorder: tokens reach the wrong request",
        ("            seq = request.seq\n",
         "            running = list(self.engine.scheduler.running)\n"
         "            seq = running[len(deliveries)] if len(deliveries) < len(running) "
         "else request.seq\n"),
    ),
    # ---- one turn ----
    mutant(
        "steps_before_commands", "the turn steps first and applies commands after: an abort "
        "costs one more step, a new request waits a step longer",
        ("        deliveries = []\n        for command in commands:\n"
         "            deliveries += self.apply(command)\n"
         "        if self.engine.has_unfinished():\n            self.engine.step()\n",
         "        deliveries = []\n        if self.engine.has_unfinished():\n"
         "            self.engine.step()\n        for command in commands:\n"
         "            deliveries += self.apply(command)\n"),
    ),
    mutant(
        "steps_when_idle", "the turn always steps, also with nothing queued (step raises)",
        ("        if self.engine.has_unfinished():\n            self.engine.step()\n"
         "        return deliveries + self.fan_out()",
         "        self.engine.step()\n        return deliveries + self.fan_out()"),
    ),
    # ---- the handoff ----
    mutant(
        "put_from_the_loop_thread", "deliver puts into the asyncio queues from the loop "
        "thread: nobody wakes the event loop (debug mode raises)",
        ("                loop.call_soon_threadsafe(put_all, batch)",
         "                put_all(batch)"),
    ),
    mutant(
        "one_wakeup_per_item", "deliver makes one call_soon_threadsafe per item: 256 wake-ups "
        "in a step of 256 requests",
        ("            by_loop[delivery.stream.loop].append(delivery)",
         "            delivery.stream.loop.call_soon_threadsafe(put_all, [delivery])"),
    ),
    # ---- the caller's generator ----
    mutant(
        "hang_up_not_aborted", "a caller that leaves early (a client that disconnected) "
        "leaves its request running in the engine, holding its blocks",
        ("            if not finished:\n                self.abort(stream.request_id)",
         "            pass"),
    ),
    mutant(
        "rejection_swallowed", "a rejected request's error is yielded as if it were a delta",
        ("                    finished = True  # nothing left to abort\n"
         "                    raise item\n",
         "                    finished = True  # nothing left to abort\n"
         "                    yield TokenDelta([], 'stop')\n"
         "                    return\n"),
    ),
)  # fmt: skip
