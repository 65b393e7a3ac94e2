"""Stage 10 end to end: a real uvicorn server on 127.0.0.1, the official openai client and httpx.

Served tokens must equal offline ones (`LLM.generate` / `LLM.chat` on a twin of the served LLM,
float64, greedy or seeded), streaming or not; 64 concurrent streaming clients, a quarter of them
hanging up at seeded random points, leave no block used and nothing queued; every bad request is
a 4xx with OpenAI's error object naming the field, and the engine serves on afterwards; the
server stops without leaving a thread behind. A tiny random model with a character tokenizer
(`nanoserve.testing.save_tiny_chat_model`) keeps the file to seconds; traffic is bounded in count
and time and goes to the loopback address only.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import threading

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.testing import (
    ServerThread,
    held,
    most_completion_tokens,
    save_tiny_chat_model,
    signalling,
)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from nanoserve.serving.server import create_app  # noqa: E402

MODEL = "tiny-chat"
ENGINE = dict(device="cpu", dtype="float64", max_model_len=96, block_size=4, num_kv_blocks=160)
TIMEOUT = 60  # seconds: any request, or the whole drain, must be done long before this


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def offline(folder):
    """The oracle: an LLM like the served one, driven offline."""
    return LLM(folder, **ENGINE)


@pytest.fixture(scope="module")
def served(folder):
    """(base URL, the served LLM, the app) of a server that lives for the whole module."""
    llm = LLM(folder, **ENGINE)
    app = create_app(llm, MODEL)
    with ServerThread(app) as url:
        yield url, llm, app


@pytest.fixture
def client(served):
    return openai.OpenAI(
        base_url=f"{served[0]}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0
    )


def offline_ids(offline: LLM, prompt, **sampling) -> tuple[list[int], str, str]:
    (out,) = offline.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
    return out.token_ids, out.text, out.finish_reason


def assert_engine_drained(llm: LLM, app) -> None:
    """No request queued, running or tracked; every block free; the manager consistent."""
    engine = llm.engine
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert app.state.served.loop.requests == {}
    assert engine.manager.num_free_blocks == engine.manager.num_blocks
    engine.manager.check_invariants()


def wait_until_idle(url: str) -> None:
    """Poll /metrics until the engine's queues are empty (the loop publishes after each step)."""
    for _ in range(int(TIMEOUT / 0.01)):
        text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        if gauge(text, "requests_running") == 0 and gauge(text, "requests_waiting") == 0:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the engine never became idle")


def gauge(metrics_text: str, name: str) -> float:
    return float(re.search(rf"^nanoserve_{name} (\S+)$", metrics_text, re.M).group(1))


# ---- served tokens equal offline ones ----


@pytest.mark.parametrize("prompt", ["The capital of France is", [5, 17, 99, 3, 42, 42, 7]])
def test_a_greedy_completion_equals_llm_generate(client, offline, prompt):
    want_ids, want_text, want_reason = offline_ids(offline, prompt, max_tokens=24)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    (choice,) = got.choices
    assert choice.model_extra["token_ids"] == want_ids
    assert (choice.text, choice.finish_reason) == (want_text, want_reason)
    assert got.usage.completion_tokens == len(want_ids)


def test_a_streamed_completion_equals_llm_generate_token_for_token(client, offline):
    want_ids, want_text, want_reason = offline_ids(offline, "Once upon a time", max_tokens=30)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Once upon a time", stream=True, max_tokens=30, temperature=0
        )
    )
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == want_ids
    assert "".join(c.choices[0].text for c in chunks) == want_text
    assert [c.choices[0].finish_reason for c in chunks][-1] == want_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_completion_equals_llm_chat(client, offline, stream):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    (want,) = offline.chat(messages, SamplingParams(max_tokens=20), use_tqdm=False)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=stream
    )
    if stream:
        chunks = list(reply)
        assert chunks[0].choices[0].delta.role == "assistant"
        ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        choice = reply.choices[0]
        ids, text, reason = choice.model_extra["token_ids"], choice.message.content, None
        reason = choice.finish_reason
    assert (ids, text, reason) == (want.token_ids, want.text, want.finish_reason)


def test_a_seeded_sampled_request_equals_its_offline_twin(client, offline):
    sampling = dict(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    want_ids, _, _ = offline_ids(offline, [9, 8, 7], ignore_eos=True, **sampling)
    got = client.completions.create(
        model=MODEL,
        prompt=[9, 8, 7],
        extra_body={"ignore_eos": True, "top_k": 50},
        **{k: v for k, v in sampling.items() if k != "top_k"},
    )
    assert got.choices[0].model_extra["token_ids"] == want_ids


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_text_and_finishes_with_stop(client, offline, stream):
    want_ids, want_text, _ = offline_ids(offline, "Hello", max_tokens=30, ignore_eos=True)
    stop = want_text[7:9]  # two characters the completion reaches at its 8th token
    cut = want_text[: want_text.index(stop)]
    reply = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=30, stop=[stop], temperature=0, stream=stream
    )
    chunks = list(reply) if stream else [reply]
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == want_ids[: len(ids)] and len(ids) < len(want_ids)


def test_a_stop_token_id_finishes_the_request_at_that_token(client, offline):
    want_ids, _, _ = offline_ids(offline, [1, 2, 3], max_tokens=20, ignore_eos=True)
    stop_id = want_ids[5]
    got = client.completions.create(
        model=MODEL,
        prompt=[1, 2, 3],
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    ids = got.choices[0].model_extra["token_ids"]
    assert ids == want_ids[: want_ids.index(stop_id) + 1]
    assert got.choices[0].finish_reason == "stop"


# ---- many clients, some of whom hang up ----


async def stream_tokens(http, prompt, max_tokens: int, hang_up_after: int | None) -> list[int]:
    """Stream one completion's token ids; with hang_up_after, close the connection once that
    many tokens have come (a client that disconnects). Tokens, not chunks: a reader that falls
    behind gets several tokens in one chunk, so a count of chunks may never be reached."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    ids = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids += json.loads(line[6:])["choices"][0]["token_ids"]
            if hang_up_after is not None and len(ids) >= hang_up_after:
                break  # leaving the block closes the connection mid-stream
    return ids


def test_64_streaming_clients_a_quarter_hanging_up_leave_nothing_behind(served, offline):
    url, llm, app = served
    rng = random.Random(10)
    prompts = [[rng.randrange(254) for _ in range(rng.randint(1, 12))] for _ in range(64)]
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    quitters = set(rng.sample(range(64), 16))
    hang_up = {i: rng.randint(1, max_tokens[i] - 1) for i in quitters}
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    want = [out.token_ids for out in offline.generate(prompts, params, use_tqdm=False)]

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as http:
            return await asyncio.gather(
                *[
                    stream_tokens(http, p, m, hang_up.get(i))
                    for i, (p, m) in enumerate(zip(prompts, max_tokens))
                ]
            )

    got = asyncio.run(asyncio.wait_for(run_all(), TIMEOUT))
    for i in range(64):
        if i in quitters:
            assert got[i] == want[i][: len(got[i])], f"client {i} got someone else's tokens"
        else:
            assert got[i] == want[i], f"client {i}"
    wait_until_idle(url)
    assert_engine_drained(llm, app)


def test_a_reader_that_falls_behind_gets_its_waiting_tokens_as_one_delta():
    from nanoserve.serving.request_stream import RequestStream, TokenDelta

    async def main(coalesce):
        stream = RequestStream(0, asyncio.get_running_loop(), coalesce=coalesce)
        items = [
            TokenDelta([]),
            TokenDelta([5]),
            TokenDelta([6, 7]),
            TokenDelta([8], "length"),
            TokenDelta([], "abort"),
            ValueError("late"),
        ]
        for item in items:  # all put before the reader looks: it is five deliveries behind
            stream.put(item)
        return [await stream.get() for _ in range(len(items) if not coalesce else 4)]

    joined = asyncio.run(main(coalesce=True))
    assert joined[:3] == [
        TokenDelta([]),
        TokenDelta([5, 6, 7, 8], "length"),
        TokenDelta([], "abort"),
    ]
    assert isinstance(joined[3], ValueError)  # the accepted delta, an end and an error stay alone
    one_by_one = [TokenDelta([]), TokenDelta([5]), TokenDelta([6, 7]), TokenDelta([8], "length")]
    assert asyncio.run(main(coalesce=False))[:4] == one_by_one


def test_a_reader_that_falls_behind_gets_the_joined_deltas_logprobs_in_order():
    from nanoserve.logprobs import TokenLogprobs
    from nanoserve.serving.request_stream import RequestStream, TokenDelta

    first, second, third = (TokenLogprobs(-i, i, {1: -0.5}) for i in (1.0, 2.0, 3.0))

    async def main():
        stream = RequestStream(0, asyncio.get_running_loop(), coalesce=True)
        stream.put(TokenDelta([5], None, [first]))
        stream.put(TokenDelta([6, 7], "stop", [second, third]))
        return await stream.get()

    assert asyncio.run(main()) == TokenDelta([5, 6, 7], "stop", [first, second, third])


def test_a_client_that_hangs_up_mid_stream_aborts_its_request(served, monkeypatch):
    url, llm, app = served
    loop = app.state.served.loop
    aborted_before = app.state.served.metrics.num_requests("abort")
    abort_sent = threading.Event()
    monkeypatch.setattr(loop, "abort", signalling(loop.abort, abort_sent))
    # from its 10th token on, a step waits until the server has sent the abort: however late
    # the server's event loop notices the hang-up, the engine cannot run on meanwhile
    held_step = held(llm.engine.step, abort_sent, lambda: most_completion_tokens(llm.engine) >= 10)
    monkeypatch.setattr(llm.engine, "step", held_step)
    steps_at_hang_up = []

    async def hang_up_early():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            ids = await stream_tokens(http, [3, 1, 4, 1, 5], 90, hang_up_after=3)
            steps_at_hang_up.append(app.state.served.loop.stats.num_steps)
            return ids

    num_received = len(asyncio.run(asyncio.wait_for(hang_up_early(), TIMEOUT)))
    assert 3 <= num_received < 90  # three tokens or more (coalescing: a chunk may carry several)
    assert abort_sent.wait(TIMEOUT), "the server never aborted the request of a client that left"
    wait_until_idle(url)
    steps_after = app.state.served.loop.stats.num_steps - steps_at_hang_up[0]
    assert steps_after < 30, f"{steps_after} steps ran after the hang-up; 90 tokens need 87 more"
    assert app.state.served.metrics.num_requests("abort") == aborted_before + 1
    assert_engine_drained(llm, app)


# ---- bad requests: a 4xx naming the field, and the engine serves on ----

TOO_LONG = list(range(100))  # 100 tokens; max_model_len is 96
BAD_COMPLETIONS = [  # (body, status, param)
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [-3]}, 400, "stop_token_ids[0]"),
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": TOO_LONG}, 400, "prompt"),
    ({"model": MODEL, "prompt": TOO_LONG, "stream": True}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 256]}, 400, "prompt"),
]


@pytest.mark.parametrize(
    ("body", "status", "param"), BAD_COMPLETIONS, ids=[f"{p}-{s}" for _, s, p in BAD_COMPLETIONS]
)
def test_a_bad_completion_request_is_a_4xx_naming_the_field(served, body, status, param):
    response = httpx.post(f"{served[0]}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and "type" in error and "code" in error


BAD_CHATS = [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 120}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_a_bad_chat_request_is_a_400_naming_the_field(served, body, param):
    response = httpx.post(f"{served[0]}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_malformed_json_and_an_oversized_body_are_4xx_and_the_engine_serves_on(served, client):
    url = served[0]
    headers = {"content-type": "application/json"}
    bad_json = httpx.post(
        f"{url}/v1/completions", content=b'{"model": "tiny', headers=headers, timeout=TIMEOUT
    )
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    huge = json.dumps({"model": MODEL, "prompt": "x" * 2**21})
    too_big = httpx.post(f"{url}/v1/completions", content=huge, headers=headers, timeout=TIMEOUT)
    assert too_big.status_code == 413 and too_big.json()["error"]["message"]
    no_length = (b"x" * 2**16 for _ in range(20))  # a generator: sent chunked, no Content-Length
    chunked = httpx.post(
        f"{url}/v1/completions", headers=headers, content=no_length, timeout=TIMEOUT
    )
    assert chunked.status_code == 413
    missing = httpx.get(f"{url}/v1/nothing-here", timeout=TIMEOUT)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    ok = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3)
    assert len(ok.choices[0].model_extra["token_ids"]) >= 1


# ---- the other routes ----


def test_models_health_and_metrics(served, client, monkeypatch):
    """/v1/models names the model, /health answers ok, /metrics has the engine's gauges and both
    latency histograms, and one streamed request adds one time to first token and a gap between
    tokens for every token after its first chunk's."""
    url, llm, _ = served
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    before = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    # from its first token on, each step waits until the client has read the first chunk: the
    # first chunk carries the prefill's token alone, and every later token comes a step later,
    # after a gap the server measures (a reader left behind would get all of them in one chunk)
    first_chunk_read = threading.Event()
    step = held(llm.engine.step, first_chunk_read, lambda: most_completion_tokens(llm.engine) >= 1)
    monkeypatch.setattr(llm.engine, "step", step)
    chunks = []
    stream = client.completions.create(
        model=MODEL, prompt="count me", max_tokens=5, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if chunk.choices[0].model_extra["token_ids"]:  # (a last chunk may carry none)
            chunks.append(chunk.choices[0].model_extra["token_ids"])
            first_chunk_read.set()
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    for name in (
        "requests_running",
        "requests_waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "prefix_cache_hit_rate",
        "generation_tokens_total",
    ):
        assert re.search(rf"^nanoserve_{name} \d", text, re.M), name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert f"# TYPE nanoserve_{name} histogram" in text
        assert re.search(rf'^nanoserve_{name}_bucket{{le="\+Inf"}} \d+(\.0)?$', text, re.M)
    # the request's first token, then a gap for each token after the first chunk's (k for a
    # chunk of k): counted, not timed, and none of it left to what earlier tests sent
    added = {
        name: gauge(text, f"{name}_count") - gauge(before, f"{name}_count")
        for name in ("time_to_first_token_seconds", "inter_token_latency_seconds")
    }
    gaps = sum(map(len, chunks[1:]))
    assert gaps > 0, f"all in the first chunk: {chunks}"
    want = {"time_to_first_token_seconds": 1, "inter_token_latency_seconds": gaps}
    assert added == want, f"added {added} for the chunks {chunks}"


def test_an_api_key_guards_every_route_but_health_and_the_server_stops_cleanly(folder):
    threads_before = set(threading.enumerate())
    llm = LLM(folder, **ENGINE)
    with ServerThread(create_app(llm, MODEL, api_key="s3cret")) as url:
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        for route in ("/v1/models", "/metrics"):
            assert httpx.get(f"{url}{route}", timeout=TIMEOUT).status_code == 401
            wrong = httpx.get(
                f"{url}{route}", headers={"Authorization": "Bearer s3cre"}, timeout=TIMEOUT
            )
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).status_code == 401
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    leaked = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert leaked == [], f"threads left running: {leaked}"


# ---- the serving benchmark, tiny ----


def test_bench_serve_times_the_workload_offline_and_over_http(folder, capsys, tmp_path):
    from nanoserve.cli import main

    args = [
        "bench",
        "--serve",
        "--model",
        folder,
        "--device",
        "cpu",
        "--dtype",
        "float64",
        "--num-seqs",
        "6",
        "--max-input-len",
        "16",
        "--max-output-len",
        "8",
        "--max-model-len",
        "64",
        "--block-size",
        "4",
        "--num-kv-blocks",
        "64",
        "--request-rate",
        "100",
        "--seed",
        "3",
        "--client-processes",
        "2",
        "--json",
        str(tmp_path / "bench.json"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    row = (
        r"^(?:nanoserve stage \d+ \(\w+\)|served, rate 100/s, 6 clients in 2 processes) +([\d,]+) "
    )
    offline, served = re.findall(row, out, re.M)
    assert offline == served, "the same output tokens on both sides"
    assert re.search(r"^time to first token   p50 [\d.]+  p90 [\d.]+  p99 [\d.]+ ms$", out, re.M)
    assert re.search(r"^inter-token latency   p50 [\d.]+", out, re.M)
    assert re.search(r"^serving overhead      not measured: the arrivals \(100/s\)", out, re.M)
    text = (tmp_path / "bench.json").read_text()
    report = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert len(report["requests"]) == 6 and report["latency_ms"]["ttft"]["p50"] > 0


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--client-processes", "0"),
        ("--max-concurrency", "-2"),
        ("--request-rate", "0"),
        ("--request-rate", "fast"),
        ("--request-rate", "nan"),
    ],
)
def test_bench_serve_refuses_a_bad_client_option_naming_it(flag, value, capsys):
    from nanoserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--serve", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "expected" in err and repr(value) in err


def test_bench_serve_counts_overhead_only_when_every_request_arrives_at_once():
    from nanoserve.bench.serve import overhead_line
    from nanoserve.bench.workload import BenchResult

    offline, served = BenchResult("offline", 1000, 10.0, 0), BenchResult("served", 1000, 12.5, None)
    assert overhead_line(offline, served, float("inf")).endswith(" 20.0% of offline throughput")
    assert "not measured" in overhead_line(offline, served, 40.0)
    capped = overhead_line(offline, served, float("inf"), max_concurrency=4)
    assert "not measured: --max-concurrency 4" in capped
    short = BenchResult("served", 990, 12.5, None)
    assert "not measured: the served run produced 990" in overhead_line(offline, short, math.inf)
    faster = overhead_line(offline, BenchResult("served", 1000, 9.0, None), math.inf)
    assert "-11.1%" in faster and "negative: the served run was faster" in faster


def test_bench_serve_schedules_seeded_arrivals_and_shares_them_out_exactly():
    from nanoserve.bench.clients import schedule, share_out
    from nanoserve.bench.workload import make_workload

    workload = make_workload(num_seqs=10, max_input_len=8, max_output_len=4)
    assert [r.send_at for r in schedule(workload, float("inf"), seed=0)] == [0.0] * 10
    arrivals = schedule(workload, 5.0, seed=1)
    assert arrivals == schedule(workload, 5.0, seed=1), "the same seed, the same arrivals"
    times = [r.send_at for r in arrivals]
    assert times[0] == 0.0 and times == sorted(times) and len(set(times)) == 10
    assert [(r.prompt, r.max_tokens) for r in arrivals] == list(zip(*workload))
    shares, limits = share_out(arrivals, 3, max_concurrency=7)
    assert sorted(r.send_at for share in shares for r in share) == times, "each request once"
    assert limits == [3, 2, 2], "the limit is shared out exactly"
    assert share_out(arrivals, 4, max_concurrency=2)[1] == [1, 1], "no process without a slot"
    two = arrivals[:2]
    assert share_out(two, 4, max_concurrency=None) == ([two[:1], two[1:]], [None, None])


# ---- the engine loop in a process of its own (what `nanoserve serve` runs) ----


def test_an_engine_process_serves_the_offline_tokens_and_a_killed_one_fails_cleanly(
    folder, offline
):
    import os
    import signal

    from nanoserve.serving.engine_process import EngineClient

    threads_before = set(threading.enumerate())
    client_side = EngineClient(folder, **ENGINE)
    app = create_app(client_side, MODEL, loop=client_side)
    with ServerThread(app, timeout=TIMEOUT) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=TIMEOUT, max_retries=0)
        want_ids, want_text, _ = offline_ids(offline, "Once upon a time", max_tokens=30)
        chunks = list(
            api.completions.create(
                model=MODEL, prompt="Once upon a time", stream=True, max_tokens=30, temperature=0
            )
        )
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == want_ids
        assert "".join(c.choices[0].text for c in chunks) == want_text
        messages = [{"role": "user", "content": "Hi!"}]
        (want,) = offline.chat(messages, SamplingParams(max_tokens=12, logprobs=2), use_tqdm=False)
        reply = api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        assert reply.choices[0].message.content == want.text
        chosen = [ranked[t].logprob for t, ranked in zip(want.token_ids, want.logprobs)]
        got = [entry.logprob for entry in reply.choices[0].logprobs.content]  # over the pipe
        assert got == pytest.approx(chosen, rel=1e-9)
        too_long = {"model": MODEL, "prompt": list(range(100))}  # max_model_len is 96
        rejected = httpx.post(f"{url}/v1/completions", json=too_long, timeout=TIMEOUT)
        assert rejected.status_code == 400 and rejected.json()["error"]["param"] == "prompt"
        wait_until_idle(url)
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        assert gauge(metrics, "kv_blocks_used") == 0 and gauge(metrics, "kv_blocks_free") == 160

        os.kill(client_side.process.pid, signal.SIGKILL)  # the engine process dies
        for _ in range(int(TIMEOUT / 0.01)):
            if httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503:
                break
            threading.Event().wait(0.01)
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503
        late = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=TIMEOUT
        )
        assert late.status_code == 503 and "killed by signal 9" in late.json()["error"]["message"]
    assert not client_side.process.is_alive()
    leaked = [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert [name for name in leaked if "tqdm" not in name] == [], leaked  # tqdm's is offline's


def test_an_engine_process_stops_with_the_server_and_aborts_what_runs(folder):
    from nanoserve.serving.engine_process import EngineClient

    client_side = EngineClient(folder, **ENGINE)
    got = []
    with ServerThread(create_app(client_side, MODEL, loop=client_side), timeout=TIMEOUT) as url:

        async def one_long_stream():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                got.append(await stream_tokens(http, [1, 2, 3], 90, hang_up_after=2))

        asyncio.run(asyncio.wait_for(one_long_stream(), TIMEOUT))
    assert len(got[0]) >= 2
    assert client_side.process.exitcode == 0, "Stop, not a kill, ended the engine process"
