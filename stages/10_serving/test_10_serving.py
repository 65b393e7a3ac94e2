"""Stage 10's graded contract: your engine loop (`AsyncEngine`) applies commands, fans tokens out,
hands them across threads and streams them to callers, and its tokens are the offline engine's.

Run against any implementation with `pytest stages/10_serving --impl ref|starter|yours.py`.
Tasks 1 to 3 call your methods on the loop's side by hand, with no thread: the tests step the
reference engine themselves. Task 4 calls `deliver` from a second thread into an event loop in
asyncio's debug mode. Task 5 starts your loop's thread and consumes `generate`. Task 6 puts 64
concurrent callers on it, a quarter hanging up, and then serves it over HTTP to the official
openai client. The oracle is `LLM.generate` on an identical engine: a tiny random Llama in
float64, block size 4, so the tokens must be equal, preemptions included.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.serving.request_stream import (
    Abort,
    Add,
    Delivery,
    Request,
    RequestStream,
    TokenDelta,
)

STAGE = 10
ENGINE = dict(stage=STAGE, device="cpu", dtype="float64", block_size=4, max_model_len=48)
TIMEOUT = 30  # seconds; every wait below is bounded by it
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28, 29], [31], [41, 42, 43, 44, 45]]
MAX_TOKENS = [12, 7, 20, 15]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def new_llm(folder, **options) -> LLM:
    return LLM(str(folder), **{**ENGINE, "num_kv_blocks": 64, **options})


def offline(folder, prompts, max_tokens, **options) -> list:
    """(token ids, finish reason) per prompt, from LLM.generate on an identical engine."""
    outs = new_llm(folder, **options).generate(
        prompts, [greedy(m) for m in max_tokens], use_tqdm=False
    )
    return [(out.token_ids, out.finish_reason) for out in outs]


@pytest.fixture
def idle_loop():
    """An event loop that never runs: the streams of tasks 1 to 3 only need one to exist."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def track(engine_loop, request_id: int, prompt, params, loop) -> RequestStream:
    """Queue a request in the engine and track it as `apply` would (tasks 2 and 3)."""
    stream = RequestStream(request_id, loop)
    seq = engine_loop.engine.add_request(prompt, params)
    engine_loop.requests[request_id] = Request(seq, stream)
    return stream


def run_to_end(engine_loop) -> list[Delivery]:
    """Step the engine until it is idle, fanning out after every step (the loop, by hand)."""
    deliveries = []
    for _ in range(1000):
        if not engine_loop.engine.has_unfinished():
            return deliveries
        engine_loop.engine.step()
        deliveries += engine_loop.fan_out()
    raise AssertionError("the engine never finished")


def per_stream(deliveries: list[Delivery], streams) -> list[list]:
    return [[d.item for d in deliveries if d.stream is s] for s in streams]


def described(deliveries: list[Delivery]) -> list[tuple]:
    """(request_id, item) per delivery: what a failure message shows instead of stream objects."""
    return [(d.stream.request_id, d.item) for d in deliveries]


def tokens_message(who: str, got: list[int], want: list[int]) -> str:
    """got != want, said in tokens, with the cause when it is a lost first token."""
    message = f"{who} got tokens {got}, offline gave {want}"
    if want and got == want[1:]:
        message += (
            ": the first token is missing. A caller takes the first delta of an accepted request "
            "for 'queued' and drops it: does apply deliver an empty TokenDelta([]) for an Add "
            "it accepts, before any token?"
        )
    return message


def assert_idle(engine) -> None:
    num_waiting, num_running = len(engine.scheduler.waiting), len(engine.scheduler.running)
    assert num_waiting == num_running == 0, (
        f"requests left in the engine: {num_waiting} waiting, {num_running} running"
    )
    free, total = engine.manager.num_free_blocks, engine.manager.num_blocks
    assert free == total, f"{total - free} KV blocks still held"
    engine.manager.check_invariants()


# ---- task 1: commands ----


def test_task_1_an_accepted_request_is_queued_tracked_and_told_so(
    impl, tiny_llama_folder, idle_loop
):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    stream = RequestStream(7, idle_loop)
    out = engine_loop.apply(Add(stream, [1, 2, 3], greedy(4)))
    assert out == [Delivery(stream, TokenDelta([], None))], (
        f"apply(Add) of request 7 returned (request_id, item) {described(out)}; expected "
        "[(7, TokenDelta([], None))]: an accepted request's stream hears an empty 'queued' delta "
        "at once, and callers drop that first delta"
    )
    tracked = list(engine_loop.requests)
    assert tracked == [7], f"tracked request ids {tracked}: track it under its stream's request_id"
    seq = engine_loop.requests[7].seq
    waiting = list(engine_loop.engine.scheduler.waiting)
    assert seq.prompt_token_ids == [1, 2, 3] and waiting == [seq], (
        f"the tracked sequence has prompt {seq.prompt_token_ids} and the scheduler's waiting "
        f"queue holds {len(waiting)} sequence(s): engine.add_request([1, 2, 3]) must queue it"
    )


def test_task_1_a_rejected_request_gets_its_error_and_disturbs_nobody(
    impl, tiny_llama_folder, idle_loop
):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    good, bad = RequestStream(0, idle_loop), RequestStream(1, idle_loop)
    engine_loop.apply(Add(good, [1, 2], greedy(4)))
    out = engine_loop.apply(Add(bad, list(range(48)), greedy(4)))  # 48 tokens: max_model_len
    assert len(out) == 1 and out[0].stream is bad, (
        f"apply(Add) of a 48-token prompt (request 1) returned (request_id, item) "
        f"{described(out)}; expected one delivery, to request 1"
    )
    assert isinstance(out[0].item, ValueError) and "max_model_len" in str(out[0].item), (
        f"the rejected stream got {out[0].item!r}: deliver the ValueError add_request raised"
    )
    tracked = list(engine_loop.requests)
    assert tracked == [0], f"tracked request ids {tracked}, expected [0]: a rejected one is not"
    num_waiting = len(engine_loop.engine.scheduler.waiting)
    assert num_waiting == 1, f"{num_waiting} requests waiting, expected 1: the good one, request 0"


def test_task_1_an_abort_frees_the_requests_blocks_at_once(impl, tiny_llama_folder, idle_loop):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    engine, streams = engine_loop.engine, [RequestStream(i, idle_loop) for i in (3, 5)]
    for stream, prompt in zip(streams, PROMPTS[:2]):
        engine_loop.apply(Add(stream, prompt, greedy(10)))
    engine.step()  # both prefill: 1 and 3 blocks of 4
    kept = engine_loop.requests[5].seq
    out = engine_loop.apply(Abort(3))
    assert out == [Delivery(streams[0], TokenDelta([], "abort"))], (
        f"Abort(3) returned {out}: the aborted stream hears TokenDelta([], 'abort')"
    )
    assert list(engine_loop.requests) == [5], (
        f"tracked after Abort(3): {list(engine_loop.requests)}"
    )
    assert list(engine.scheduler.running) == [kept] and not engine.scheduler.waiting, (
        "after Abort(3) only request 5 may be in the scheduler: call engine.abort([seq])"
    )
    num_held = engine.manager.num_blocks - engine.manager.num_free_blocks
    assert num_held == 3, (
        f"{num_held} blocks held after Abort(3), expected 3 (request 5's): free its blocks now"
    )
    engine.manager.check_invariants()


def test_task_1_an_abort_takes_a_waiting_request_off_the_queue(impl, tiny_llama_folder, idle_loop):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    stream = RequestStream(0, idle_loop)
    engine_loop.apply(Add(stream, [1, 2, 3], greedy(4)))
    out = engine_loop.apply(Abort(0))
    assert out == [Delivery(stream, TokenDelta([], "abort"))], (
        f"Abort(0) of a waiting request returned {out}: its stream hears TokenDelta([], 'abort')"
    )
    assert engine_loop.requests == {}, f"still tracked after its abort: {engine_loop.requests}"
    assert_idle(engine_loop.engine)


def test_task_1_aborting_an_unknown_or_finished_request_does_nothing(
    impl, tiny_llama_folder, idle_loop
):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    engine_loop.apply(Add(RequestStream(0, idle_loop), [1, 2, 3], greedy(4)))
    out = engine_loop.apply(Abort(99))
    assert out == [], f"Abort(99), of an id never tracked, delivered {described(out)}; expected []"
    assert list(engine_loop.requests) == [0] and len(engine_loop.engine.scheduler.waiting) == 1, (
        "Abort(99), of an id never tracked, must leave request 0 tracked and queued"
    )
    engine_loop.apply(Abort(0))
    out = engine_loop.apply(Abort(0))
    assert out == [], f"a second Abort(0) delivered {described(out)}: aborting twice is once"


def test_task_3_an_abort_after_a_request_finished_does_nothing(impl, tiny_llama_folder, idle_loop):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    engine_loop.apply(Add(RequestStream(0, idle_loop), [1, 2, 3], greedy(2)))
    delivered = []
    while engine_loop.engine.has_unfinished():
        delivered += engine_loop.run_once([])
    reasons = [item.finish_reason for _, item in described(delivered)]
    assert reasons[-1] == "length", f"request 0 (max_tokens 2) ended with {reasons}"
    out = engine_loop.apply(Abort(0))
    assert out == [], (
        f"Abort(0) after request 0 finished (its last delta, reason 'length', was sent) "
        f"delivered {described(out)}; expected []: a finished request is not aborted"
    )


# ---- task 2: fanning tokens out ----


def test_task_2_each_request_gets_exactly_its_offline_tokens_through_preemption(
    impl, tiny_llama_folder, idle_loop
):
    small = dict(num_kv_blocks=10)  # 4 requests need up to 12 blocks: some are preempted
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder, **small).engine)
    streams = [
        track(engine_loop, i, p, greedy(m), idle_loop)
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))
    ]
    items = per_stream(run_to_end(engine_loop), streams)
    assert engine_loop.engine.scheduler.num_preemptions > 0, "the pool of 10 was meant to run dry"
    want = offline(tiny_llama_folder, PROMPTS, MAX_TOKENS, **small)
    for i, (got, (want_ids, _)) in enumerate(zip(items, want)):
        ids = [t for delta in got for t in delta.token_ids]
        assert ids == want_ids, f"request {i}: its deltas add up to {ids}, want {want_ids}"


def test_task_2_the_last_delta_and_only_it_carries_the_finish_reason(
    impl, tiny_llama_folder, idle_loop
):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    streams = [
        track(engine_loop, i, p, greedy(m), idle_loop)
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))
    ]
    items = per_stream(run_to_end(engine_loop), streams)
    want = offline(tiny_llama_folder, PROMPTS, MAX_TOKENS)
    for i, (got, (want_ids, want_reason)) in enumerate(zip(items, want)):
        reasons = [delta.finish_reason for delta in got]
        assert reasons == [None] * (len(got) - 1) + [want_reason], (
            f"request {i}: its deltas carry finish reasons {reasons}; expected None on each but "
            f"the last, and {want_reason!r} on the last"
        )
        assert got[-1].token_ids == want_ids[-1:], (
            f"request {i}: the last delta holds {got[-1].token_ids}, expected the last token "
            f"{want_ids[-1:]}"
        )
        assert all(delta.token_ids for delta in got), (
            f"request {i}: a delta with no tokens among {[d.token_ids for d in got]}"
        )


def test_task_2_a_finished_request_is_dropped_and_nothing_is_sent_twice(
    impl, tiny_llama_folder, idle_loop
):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    short = track(engine_loop, 0, [1, 2], greedy(2), idle_loop)
    long = track(engine_loop, 1, [3, 4], greedy(6), idle_loop)
    for step in range(1, 7):
        engine_loop.engine.step()
        out = engine_loop.fan_out()
        expected = [long] if step > 2 else [short, long]
        assert [d.stream for d in out] == expected, (
            f"step {step}: fan_out delivered (request_id, item) {described(out)}; expected one "
            f"delta for each of requests {[s.request_id for s in expected]}"
        )
        assert all(len(d.item.token_ids) == 1 for d in out), (
            f"step {step}: fan_out delivered {described(out)}; expected one token each"
        )
        tracked = list(engine_loop.requests)
        assert (0 in engine_loop.requests) == (step < 2), (
            f"after step {step}, tracked request ids {tracked}: request 0 (2 tokens) finishes "
            "at step 2 and is dropped then, not before"
        )
    assert engine_loop.requests == {}, f"finished requests still tracked: {engine_loop.requests}"
    out = engine_loop.fan_out()
    assert out == [], f"fan_out after everything finished delivered {described(out)}; expected []"


def test_task_2_a_waiting_request_gets_no_delivery(impl, tiny_llama_folder, idle_loop):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder, num_kv_blocks=4).engine)
    first = track(engine_loop, 0, list(range(1, 9)), greedy(3), idle_loop)  # 2 blocks, then 3
    track(engine_loop, 1, list(range(20, 29)), greedy(3), idle_loop)  # 3 blocks: it must wait
    for step in range(1, 4):
        engine_loop.engine.step()
        num_waiting = len(engine_loop.engine.scheduler.waiting)
        assert num_waiting == 1, f"step {step}: {num_waiting} waiting; request 1 waits for blocks"
        out = engine_loop.fan_out()
        assert [d.stream for d in out] == [first], (
            f"step {step}: fan_out delivered (request_id, item) {described(out)}; expected one "
            "delta, to request 0, the only running one (request 1 waits and hears nothing)"
        )


# ---- task 3: one turn of the loop ----


def count_steps(engine, hold_after: int | None = None, until: threading.Event | None = None):
    """Wrap engine.step to record, at each call, the sequences about to be scheduled. With
    hold_after, every call after the first hold_after waits for `until` (TIMEOUT at most) before
    it records and runs: the loop thread cannot step on while the test does what it checks."""
    calls, step = [], engine.step

    def recording_step():
        if hold_after is not None and len(calls) >= hold_after:
            until.wait(TIMEOUT)
        calls.append(list(engine.scheduler.running) + list(engine.scheduler.waiting))
        return step()

    engine.step = recording_step
    return calls


def test_task_3_an_idle_engine_is_not_stepped(impl, tiny_llama_folder):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    calls = count_steps(engine_loop.engine)
    out = engine_loop.run_once([])
    assert out == [] and calls == [], (
        f"run_once([]) on an idle engine stepped it {len(calls)} time(s) and returned {out}: "
        "step only when engine.has_unfinished()"
    )


def test_task_3_commands_come_first_then_one_step_then_the_fan_out(
    impl, tiny_llama_folder, idle_loop
):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    calls = count_steps(engine_loop.engine)
    a, b, bad = (RequestStream(i, idle_loop) for i in range(3))
    out = engine_loop.run_once(
        [Add(a, [1, 2, 3], greedy(9)), Add(bad, [999], greedy(2)), Add(b, [4, 5], greedy(9))]
    )
    assert len(calls) == 1, (
        f"run_once with three Adds stepped the engine {len(calls)} time(s); expected exactly one "
        "step, after the commands are applied (stepped first, the engine has nothing queued yet)"
    )
    assert [d.stream for d in out] == [a, bad, b, a, b], (
        f"run_once delivered (request_id, item) {described(out)}; expected requests "
        "[0, 2, 1, 0, 1]: the three Adds' deliveries in order ('queued', the ValueError, "
        "'queued'), then fan_out's first token for 0 and for 1"
    )
    assert (
        isinstance(out[1].item, ValueError) and out[3].item.token_ids and out[4].item.token_ids
    ), (
        f"deliveries {[d.item for d in out]}: the bad Add's ValueError second, then a first "
        "token each for the two good requests"
    )
    a_seq = engine_loop.requests[0].seq
    out = engine_loop.run_once([Abort(0)])
    assert a_seq not in calls[-1], (
        "request 0 was still in the scheduler when run_once([Abort(0)]) stepped the engine: "
        "apply the abort before the step"
    )
    got = [(d.stream.request_id, d.item.finish_reason) for d in out]
    assert [(d.stream, d.item.finish_reason) for d in out] == [(a, "abort"), (b, None)], (
        f"the turn with Abort(0) delivered (request, finish_reason) {got}; expected the abort "
        "first, (0, 'abort'), then b's token, (1, None)"
    )
    manager = engine_loop.engine.manager
    assert manager.num_free_blocks == manager.num_blocks - 1, (
        f"{manager.num_blocks - manager.num_free_blocks} blocks held after the abort; only b's 1"
    )


# ---- task 4: the handoff between threads ----


def deliver_from_a_thread(engine_loop, deliveries) -> None:
    """Call deliver on a second thread, as the loop thread does; raise what it raised there."""
    errors = []

    def run():
        try:
            engine_loop.deliver(deliveries)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(TIMEOUT)
    if errors:
        raise errors[0]


async def receive(stream: RequestStream, n: int) -> list:
    return [await stream.get() for _ in range(n)]


def run_on_a_daemon_thread(main, timeout: float = 5):
    """asyncio.run(main()) on a thread of its own, waited for at most `timeout` seconds.

    An item put into an asyncio queue from a foreign thread can leave the consumer's task
    wedged for good: even cancelling it never returns. Here that fails the test instead of
    hanging it (the wedged thread is a daemon, and dies with the test process).
    """
    result = concurrent.futures.Future()

    def run():
        try:
            result.set_result(asyncio.run(main()))
        except BaseException as err:
            result.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    try:
        return result.result(timeout)
    except concurrent.futures.TimeoutError:
        raise AssertionError(
            f"the items never reached their stream in {timeout} s: was its event "
            "loop woken with call_soon_threadsafe?"
        ) from None


def test_task_4_items_reach_a_waiting_stream_in_order_from_another_thread(impl, tiny_llama_folder):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_debug(True)  # asyncio then raises when touched from a foreign thread
        stream = RequestStream(0, loop)
        waiting = asyncio.ensure_future(receive(stream, 3))
        await asyncio.sleep(0.05)  # the consumer is parked in stream.get()
        items = [TokenDelta([]), TokenDelta([5]), TokenDelta([6], "length")]
        deliver_from_a_thread(engine_loop, [Delivery(stream, i) for i in items])
        got = await asyncio.wait_for(waiting, 2)
        assert got == items, f"the stream received {got}, delivered {items} in that order"

    run_on_a_daemon_thread(main)


def test_task_4_one_wake_up_per_event_loop_and_each_stream_its_own_items(impl, tiny_llama_folder):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    other = asyncio.new_event_loop()  # a second event loop, running on its own thread
    runner = threading.Thread(target=other.run_forever)
    runner.start()
    try:

        async def main():
            loop = asyncio.get_running_loop()
            wakeups, original = [], loop.call_soon_threadsafe
            loop.call_soon_threadsafe = lambda *a, **k: wakeups.append(a) or original(*a, **k)
            mine = [RequestStream(0, loop), RequestStream(1, loop)]
            theirs = RequestStream(2, other)
            deliveries = [
                Delivery(mine[0], TokenDelta([1])),
                Delivery(theirs, TokenDelta([2])),
                Delivery(mine[1], TokenDelta([3])),
                Delivery(mine[0], TokenDelta([4])),
            ]
            deliver_from_a_thread(engine_loop, deliveries)
            got = await asyncio.wait_for(
                asyncio.gather(receive(mine[0], 2), receive(mine[1], 1)), 2
            )
            assert got == [[TokenDelta([1]), TokenDelta([4])], [TokenDelta([3])]], (
                f"stream 0 received {got[0]} (want [1], [4]), stream 1 {got[1]} (want [3])"
            )
            assert len(wakeups) == 1, f"{len(wakeups)} call_soon_threadsafe calls for one loop"
            theirs_got = asyncio.run_coroutine_threadsafe(receive(theirs, 1), other)
            theirs = theirs_got.result(2)
            assert theirs == [TokenDelta([2])], f"the other loop's stream received {theirs}"

        run_on_a_daemon_thread(main)
    finally:
        other.call_soon_threadsafe(other.stop)
        runner.join(TIMEOUT)
        other.close()


def test_task_4_a_closed_event_loop_is_skipped_without_raising(impl, tiny_llama_folder):
    engine_loop = impl.AsyncEngine(new_llm(tiny_llama_folder).engine)
    closed = asyncio.new_event_loop()
    closed.close()

    async def main():
        alive = RequestStream(1, asyncio.get_running_loop())
        deliveries = [
            Delivery(RequestStream(0, closed), TokenDelta([1])),
            Delivery(alive, TokenDelta([2])),
        ]
        deliver_from_a_thread(engine_loop, deliveries)
        got = await asyncio.wait_for(receive(alive, 1), 2)
        assert got == [TokenDelta([2])], f"the live stream received {got}, not [TokenDelta([2])]"

    run_on_a_daemon_thread(main)


# ---- task 5: what a caller sees ----


class Running:
    """Your loop's thread, started for a `with` block and shut down after it."""

    def __init__(self, impl, llm: LLM):
        self.engine_loop = impl.AsyncEngine(llm.engine)

    def __enter__(self):
        self.engine_loop.start()
        return self.engine_loop

    def __exit__(self, *exc):
        self.engine_loop.shutdown(TIMEOUT)


async def wait_until_idle(engine_loop) -> None:
    """Until the loop has published a snapshot with nothing queued or running. The snapshot is
    the last thing a turn does: after it, the loop thread leaves the engine alone until the
    next command comes."""
    deadline = time.monotonic() + TIMEOUT
    while engine_loop.stats.num_running or engine_loop.stats.num_waiting:
        assert time.monotonic() < deadline, "the engine never became idle"
        await asyncio.sleep(0.005)


async def collect(agen) -> list[TokenDelta]:
    return [delta async for delta in agen]


def bounded(main):
    """asyncio.run(main), failed with a hint rather than a bare TimeoutError after TIMEOUT s."""
    try:
        return asyncio.run(asyncio.wait_for(main, TIMEOUT))
    except (asyncio.TimeoutError, TimeoutError):
        raise AssertionError(
            f"a caller still waited for a delta after {TIMEOUT} s: does generate return once it "
            "has yielded the delta that carries a finish_reason, and does every turn's fan-out "
            "reach deliver?"
        ) from None


def test_task_5_generate_yields_queued_then_the_offline_tokens(impl, tiny_llama_folder):
    want_ids, want_reason = offline(tiny_llama_folder, PROMPTS[:1], [12])[0]
    with Running(impl, new_llm(tiny_llama_folder)) as engine_loop:
        got = bounded(collect(engine_loop.generate(PROMPTS[0], greedy(12))))
    assert got[0] == TokenDelta([], None), (
        f"generate's first delta is {got[0]}; expected TokenDelta([], None), which says: queued"
    )
    ids = [t for delta in got for t in delta.token_ids]
    assert ids == want_ids, tokens_message("generate", ids, want_ids)
    reasons = [delta.finish_reason for delta in got]
    assert reasons[-1] == want_reason, f"finish reasons {reasons}; the last must be {want_reason!r}"
    assert all(delta.finish_reason is None for delta in got[:-1]), (
        f"finish reasons {reasons}: only the last delta has one"
    )


def test_task_5_a_rejected_request_raises_and_the_loop_serves_on(impl, tiny_llama_folder):
    with Running(impl, new_llm(tiny_llama_folder)) as engine_loop:

        async def main():
            with pytest.raises(ValueError, match="token id 999"):
                await collect(engine_loop.generate([1, 999], greedy(3)))
            return await collect(engine_loop.generate([1, 2], greedy(3)))

        got = bounded(main())
        num_tokens = sum(len(delta.token_ids) for delta in got)
        assert num_tokens == 3, f"the request after a rejected one got {num_tokens} tokens of 3"
        assert_idle(engine_loop.engine)


def test_task_5_a_failing_step_reaches_the_caller_as_an_engine_error(impl, tiny_llama_folder):
    from nanoserve.serving.engine_thread import EngineError

    llm = new_llm(tiny_llama_folder)

    def broken_step():
        raise RuntimeError("the device fell over")

    llm.engine.step = broken_step
    with Running(impl, llm) as engine_loop:

        async def main():
            with pytest.raises(EngineError, match="the device fell over"):
                await collect(engine_loop.generate([1, 2, 3], greedy(3)))

        try:
            bounded(main())
        except AttributeError as err:
            pytest.fail(
                f"a failing step reached generate's caller as {err!r}: generate must raise every "
                "Exception the stream carries (the engine's EngineError too), not only ValueError",
                pytrace=False,
            )


def test_task_5_a_request_that_finished_or_was_rejected_is_not_aborted(impl, tiny_llama_folder):
    with Running(impl, new_llm(tiny_llama_folder)) as engine_loop:
        aborted, abort = [], engine_loop.abort

        def spy(request_id: int) -> None:
            aborted.append(request_id)
            abort(request_id)

        engine_loop.abort = spy

        async def main():
            await collect(engine_loop.generate(PROMPTS[0], greedy(3)))  # read to its end
            with pytest.raises(ValueError, match="token id 999"):
                await collect(engine_loop.generate([1, 999], greedy(3)))
            agen = engine_loop.generate(PROMPTS[1], greedy(2))
            async for delta in agen:  # a caller that stops at the delta with a finish reason
                if delta.finish_reason is not None:
                    break
            await agen.aclose()

        bounded(main())
    assert aborted == [], (
        f"generate called abort({aborted}) for requests that had ended: one read to its finish "
        "reason, one rejected, one closed right after its last delta. Only a caller that leaves "
        "before the finish reason aborts its request (mark the request done before yielding "
        "its last delta, so closing the generator then does not abort it)"
    )


def test_task_5_closing_the_generator_aborts_the_request_within_one_step(impl, tiny_llama_folder):
    llm = new_llm(tiny_llama_folder)
    caller_left = threading.Event()
    calls = count_steps(llm.engine, hold_after=2, until=caller_left)  # two steps: two tokens
    with Running(impl, llm) as engine_loop:

        async def main():
            agen = engine_loop.generate([1, 2, 3], greedy(40))
            num_tokens = 0
            while num_tokens < 2:  # queued, then two tokens (in one delta or two)
                num_tokens += len((await agen.__anext__()).token_ids)
            await agen.aclose()  # the caller leaves: a client hung up
            caller_left.set()  # the third step, held until now, may run
            await wait_until_idle(engine_loop)
            return calls[2:]

        later_steps = bounded(main())
        assert sum(bool(running) for running in later_steps) <= 1, (
            f"{len(later_steps)} steps ran the request after the caller left: abort it"
        )
        assert_idle(llm.engine)


def test_task_5_a_cancelled_caller_aborts_its_request(impl, tiny_llama_folder):
    llm = new_llm(tiny_llama_folder)
    caller_cancelled = threading.Event()
    count_steps(llm.engine, hold_after=2, until=caller_cancelled)  # two steps: two tokens
    with Running(impl, llm) as engine_loop:

        async def main():
            received = []

            async def consume():
                async for delta in engine_loop.generate([4, 5, 6], greedy(40)):
                    received.append(delta)

            task = asyncio.ensure_future(consume())
            while sum(len(d.token_ids) for d in received) < 2 and not task.done():
                await asyncio.sleep(0.001)
            if task.done():
                await task  # it failed before its second token: say why
            task.cancel()  # what the server does to a request whose client disconnected
            await asyncio.gather(task, return_exceptions=True)
            caller_cancelled.set()  # the third step, held until now, may run
            await wait_until_idle(engine_loop)
            return received

        received = bounded(main())
        num_tokens = sum(len(delta.token_ids) for delta in received)
        num_steps = engine_loop.engine.num_steps
        assert num_tokens < 40, (
            f"the caller's task was cancelled after two tokens, yet it received all {num_tokens}: "
            "the cancellation never reached generate"
        )
        assert num_steps < 30, (
            f"the caller's task was cancelled after two tokens, yet the engine ran {num_steps} "
            "steps (fewer than 30 expected): the request ran on towards its 40 tokens. Cancelling "
            "raises CancelledError at `await stream.get()` in generate: abort the request in its "
            "finally"
        )
        assert_idle(llm.engine)


# ---- task 6: many callers, then HTTP ----


def test_task_6_64_callers_a_quarter_hanging_up_get_their_tokens_and_leave_nothing(
    impl, tiny_llama_folder
):
    rng = random.Random(6)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(64)]
    max_tokens = [rng.randint(2, 16) for _ in prompts]
    quitters = {i: rng.randint(1, max_tokens[i]) for i in rng.sample(range(64), 16)}
    small = dict(num_kv_blocks=120)  # 64 requests need up to 448 blocks: many preemptions
    want = offline(tiny_llama_folder, prompts, max_tokens, **small)
    llm = new_llm(tiny_llama_folder, **small)
    with Running(impl, llm) as engine_loop:

        async def one(i):
            got, agen = [], engine_loop.generate(prompts[i], greedy(max_tokens[i]))
            try:
                async for delta in agen:
                    got += delta.token_ids
                    if i in quitters and len(got) >= quitters[i]:
                        break
            finally:
                await agen.aclose()
            return got

        async def main():
            got = await asyncio.gather(*[one(i) for i in range(64)])
            await wait_until_idle(engine_loop)
            return got

        got = bounded(main())
        for i, (ids, (want_ids, _)) in enumerate(zip(got, want)):
            expected = want_ids[: len(ids)] if i in quitters else want_ids
            who = f"caller {i}" + (" (it hung up)" if i in quitters else "")
            assert ids == expected, tokens_message(who, ids, expected)
        tracked = list(engine_loop.requests)
        assert tracked == [], f"requests {tracked} are still tracked: every one leaves the table"
        assert_idle(llm.engine)
    left = [t for t in threading.enumerate() if t.name == "nanoserve-engine-loop"]
    assert not left, f"{len(left)} loop thread(s) still alive after shutdown()"


def test_task_6_the_openai_client_gets_the_offline_tokens_from_your_loop(impl, tiny_llama_folder):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from nanoserve.serving.server import create_app
    from nanoserve.testing import ServerThread

    want_ids, want_reason = offline(tiny_llama_folder, PROMPTS[1:2], [15])[0]
    llm = new_llm(tiny_llama_folder)
    app = create_app(llm, "tiny", loop=impl.AsyncEngine(llm.engine))
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=TIMEOUT)
        request = dict(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=15,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        chunks = list(client.completions.create(stream=True, **request))
        whole = client.completions.create(**request)
    streamed = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == want_ids, tokens_message("the streamed completion", streamed, want_ids)
    reason = chunks[-1].choices[0].finish_reason
    assert reason == want_reason, (
        f"the stream ended with finish_reason {reason!r}, offline with {want_reason!r}"
    )
    whole_ids = whole.choices[0].model_extra["token_ids"]
    assert whole_ids == want_ids, tokens_message("the whole completion", whole_ids, want_ids)
    assert_idle(llm.engine)
