"""The server under faults and hostile clients: invalid Unicode, shutdown with streams in flight,
API keys, and every limit (connections, slow headers and bodies, prompt characters, stop strings,
the queue). Each case is a real uvicorn server on 127.0.0.1 (`ServerThread`, or `nanoserve serve`
in a subprocess for the signals) over the tiny character-level model of test_serving.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest

from nanoserve import LLM
from nanoserve.testing import (
    ServerThread,
    held,
    most_completion_tokens,
    save_tiny_chat_model,
    signalling,
    with_default_sigint,
)

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from nanoserve.serving import server as server_module  # noqa: E402
from nanoserve.serving.limits import ServerLimits  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402

MODEL = "tiny-chat"
ENGINE = dict(device="cpu", dtype="float64", max_model_len=96, block_size=4, num_kv_blocks=160)
TIMEOUT = 60


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, **ENGINE)


LIMITS = ServerLimits(max_prompt_chars=500, max_stop_strings=3, max_stop_chars=8)


@pytest.fixture(scope="module")
def url(llm):
    with ServerThread(create_app(llm, MODEL, limits=LIMITS)) as base_url:
        yield base_url


def wait_until(condition, what: str) -> None:
    """Poll `condition` until it holds: the server acts on its own thread. TIMEOUT at most."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"{TIMEOUT} s passed and still not: {what}"
        time.sleep(0.01)


def raw_post(conn: http.client.HTTPConnection, path: str, body: str, headers=None):
    """POST a body written by hand (json.dumps would escape what these tests need raw)."""
    conn.request(
        "POST", path, body.encode(), {"content-type": "application/json", **(headers or {})}
    )
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)


# ---- invalid Unicode: a 400 naming the field, and the connection stays open ----

LONE_SURROGATE = r"\ud800"  # valid JSON, not valid Unicode; a tokenizer refuses it
BAD_TEXT = [  # (path, body with the surrogate somewhere, param)
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi {LONE_SURROGATE}"}}', "prompt"),
    (
        "/v1/completions",
        f'{{"model": "{MODEL}", "prompt": "hi", "stop": ["a", "{LONE_SURROGATE}"]}}',
        "stop[1]",
    ),
    (
        "/v1/chat/completions",
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{LONE_SURROGATE}"}}]}}',
        "messages[0].content",
    ),
    ("/v1/completions", f'{{"model": "x{LONE_SURROGATE}", "prompt": "hi"}}', "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_TEXT, ids=[p for *_, p in BAD_TEXT])
def test_invalid_unicode_in_a_text_field_is_a_400_naming_it_and_the_connection_is_kept(
    url, path, body, param
):
    conn = connect(url)
    status, _, content = raw_post(conn, path, body)
    assert status == 400, content
    error = json.loads(content)["error"]
    assert error["param"] == param and "Unicode" in error["message"]
    sock = conn.sock
    assert sock is not None, "the server closed the keep-alive connection"
    ok = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2}}'
    status, _, content = raw_post(conn, "/v1/completions", ok)
    assert status == 200 and conn.sock is sock, "the next request reused the same connection"
    conn.close()


# ---- the request limits ----


@pytest.mark.parametrize(
    ("extra", "why"),
    [({"stop": ["a", "b", "c", "d"]}, "4 stop strings"), ({"stop": "x" * 9}, "9 characters")],
)
def test_too_many_or_too_long_stop_strings_are_a_400_naming_stop(url, extra, why):
    body = {"model": MODEL, "prompt": "hi", **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop" and why in error["message"] and "--max-stop" in error["message"]


def test_a_prompt_over_the_character_limit_is_refused_before_it_is_tokenised(url, llm, monkeypatch):
    calls = []
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    long_prompt = {"model": MODEL, "prompt": "x" * 501}
    response = httpx.post(f"{url}/v1/completions", json=long_prompt, timeout=TIMEOUT)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    messages = [{"role": "user", "content": "x" * 300}, {"role": "user", "content": "y" * 300}]
    chat = {"model": MODEL, "messages": messages}
    response = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=TIMEOUT)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert calls == [], "the tokenizer never ran"


def test_a_long_prompt_is_tokenised_off_the_event_loop(llm, monkeypatch):
    threads = []
    encode = llm.tokenizer.encode

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", recording_encode)
    limits = ServerLimits(max_prompt_chars=None)
    with ServerThread(create_app(llm, MODEL, limits=limits)) as base_url:
        body = {"model": MODEL, "prompt": "ab" * 5000, "max_tokens": 1}  # 10,000 characters
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 400  # too long for the engine: tokenised, then refused
        short = {"model": MODEL, "prompt": "ab", "max_tokens": 1}
        response = httpx.post(f"{base_url}/v1/completions", json=short, timeout=TIMEOUT)
        assert response.status_code == 200
    long_thread, short_thread = threads
    assert short_thread.name == "uvicorn-test", "a short prompt stays on the event loop"
    assert long_thread is not short_thread, "the long one went to a worker thread"


def test_past_the_queue_limit_a_request_is_a_503_with_retry_after(llm):
    from nanoserve.serving.request_stream import EngineStats

    app = create_app(llm, MODEL, limits=ServerLimits(max_queued_requests=3))
    loop = app.state.served.loop
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with ServerThread(app) as base_url:
        # what the loop thread publishes after a step; an idle loop keeps it until a command comes
        loop.stats = EngineStats(num_running=64, num_waiting=3)
        full = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "server_busy"
        loop.stats = EngineStats(num_running=64, num_waiting=2)
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 200


# ---- the socket limits ----


def open_socket(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the socket."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_connections_past_the_limit_are_answered_503_and_closed(llm):
    server = ServerThread(create_app(llm, MODEL, limits=ServerLimits(max_connections=2)))
    with server as base_url:
        connections = server.server.server_state.connections  # what the limit counts

        idle = [open_socket(base_url) for _ in range(2)]
        wait_until(lambda: len(connections) == 2, "both idle sockets accepted")
        refused = read_all(open_socket(base_url))
        assert refused.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in refused
        idle[0].close()
        wait_until(lambda: len(connections) == 1, "the closed and the refused socket gone")
        assert httpx.get(f"{base_url}/health", timeout=TIMEOUT).status_code == 200
        idle[1].close()


def test_slow_headers_and_a_slow_body_are_answered_408_and_closed(llm, monkeypatch):
    """Headers not in within header_timeout_s, and a body not in within body_timeout_s, are each
    answered 408 naming that limit, and the socket is closed; on a kept-alive socket the header
    clock stops while a request runs and starts again after each response."""
    from nanoserve.serving.connections import GuardedH11Protocol

    # one short clock per server, the other one far off: only the clock a case is about can fire,
    # however long this machine takes to send what comes before it
    slow_headers = ServerLimits(header_timeout_s=0.3, body_timeout_s=TIMEOUT)
    with ServerThread(create_app(llm, MODEL, limits=slow_headers)) as base_url:
        silent = open_socket(base_url)  # never sends a byte
        partial = open_socket(base_url)
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # no blank line yet
        # the message names the limit that fired: this 0.3 s one, not the default (10 s)
        for sock in (silent, partial):
            answer = read_all(sock)
            words = b"no complete request headers within 0.3 s"
            assert answer.startswith(b"HTTP/1.1 408") and words in answer, answer

    slow_body = ServerLimits(header_timeout_s=TIMEOUT, body_timeout_s=0.3)
    with ServerThread(create_app(llm, MODEL, limits=slow_body)) as base_url:
        sock = open_socket(base_url)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model"'
        )
        answer = read_all(sock)  # not the default's 30 s
        words = b"the request body did not arrive within 0.3 s"
        assert answer.startswith(b"HTTP/1.1 408") and words in answer, answer

        # A client that keeps up is not timed out between requests: the header clock is stopped
        # while a request runs and started again after each response. What the server's event
        # loop does to the clock is recorded, not timed: a wall clock would tell only on an idle
        # machine (the silent socket above shows that a started clock fires).
        responses = []  # (connection, what its header clock did), in the server's order
        response_complete = GuardedH11Protocol.on_response_complete

        def recording_response_complete(self):
            during = "running" if self.header_timer is not None else "stopped"
            response_complete(self)
            after = "started" if self.header_timer is not None else "not started"
            responses.append((self, f"clock {during} during the request, {after} after it"))

        monkeypatch.setattr(GuardedH11Protocol, "on_response_complete", recording_response_complete)
        kept = connect(base_url)
        for _ in range(3):
            kept.request("GET", "/health")
            assert kept.getresponse().read() == b'{"status":"ok"}'
        # the client may read a response before the server's loop is done with it
        wait_until(lambda: len(responses) == 3, "three responses complete")
        happened = [what for _, what in responses]
        assert happened == ["clock stopped during the request, started after it"] * 3, happened
        assert len({id(connection) for connection, _ in responses}) == 1, "one kept-alive socket"
        kept.close()


def test_a_request_pipelined_behind_another_is_not_timed_out_while_it_runs(llm, monkeypatch):
    """Two requests in one write (HTTP/1.1 pipelining): when the first response completes, the
    second request starts at once, and its headers are in, so the header clock must stay stopped
    while it runs (it was started again, and a running request got 408 after header_timeout_s).
    After the last response the clock starts, for the next request's headers."""
    from nanoserve.serving.connections import GuardedH11Protocol

    responses = []  # per response: did the next request start, and the header clock after it
    response_complete = GuardedH11Protocol.on_response_complete

    def recording_response_complete(self):
        cycle = self.cycle
        response_complete(self)
        started = "the next request started" if self.cycle is not cycle else "nothing waiting"
        clock = "clock running" if self.header_timer is not None else "clock stopped"
        responses.append(f"{started}, {clock}")

    monkeypatch.setattr(GuardedH11Protocol, "on_response_complete", recording_response_complete)
    limits = ServerLimits(header_timeout_s=TIMEOUT)  # observed, never waited for
    with ServerThread(create_app(llm, MODEL, limits=limits)) as base_url:
        sock = open_socket(base_url)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" * 2)
        wait_until(lambda: len(responses) == 2, "both responses complete")
        sock.close()
    assert responses == [
        "the next request started, clock stopped",
        "nothing waiting, clock running",
    ], responses


# ---- API keys: checked first, from a file or the environment, never empty ----


def test_a_wrong_key_is_a_401_before_the_body_is_read_and_the_schema_is_guarded(llm):
    with ServerThread(create_app(llm, MODEL, api_key="s3cret")) as base_url:
        sock = open_socket(base_url)  # declares 10 MB and sends none of it
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 10000000\r\n\r\n"
        )
        answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer
        bad_json = httpx.post(f"{base_url}/v1/completions", content=b"{", timeout=TIMEOUT)
        assert bad_json.status_code == 401
        assert httpx.get(f"{base_url}/openapi.json", timeout=TIMEOUT).status_code == 401
        keyed = dict(headers={"Authorization": "Bearer s3cret"}, timeout=TIMEOUT)
        assert httpx.get(f"{base_url}/openapi.json", **keyed).status_code == 200
        assert httpx.get(f"{base_url}/docs", **keyed).status_code == 404  # off
        assert httpx.get(f"{base_url}/health", timeout=TIMEOUT).status_code == 200


def test_an_empty_api_key_is_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        create_app(llm, MODEL, api_key="")


def test_the_api_key_comes_from_the_flag_or_a_file_else_the_environment(tmp_path):
    from nanoserve.serving.startup import api_key_from

    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    assert api_key_from(None, str(key_file), environ={}) == "from-a-file"
    assert api_key_from(None, None, environ={"NANOSERVE_API_KEY": "from-env"}) == "from-env"
    assert api_key_from("k", None, environ={}) == "k"
    assert api_key_from(None, None, environ={}) is None
    assert api_key_from("k", None, environ={"NANOSERVE_API_KEY": "from-env"}) == "k"
    with pytest.raises(ValueError, match="twice"):
        api_key_from("k", str(key_file), environ={})
    (tmp_path / "empty").write_text("\n")
    for flag, file, environ in [
        ("", None, {}),
        (None, str(tmp_path / "empty"), {}),
        (None, None, {"NANOSERVE_API_KEY": ""}),
    ]:
        with pytest.raises(ValueError, match="empty"):
            api_key_from(flag, file, environ=environ)
    with pytest.raises(ValueError, match="cannot read"):
        api_key_from(None, str(tmp_path / "missing"), environ={})


def test_serve_refuses_an_empty_key_at_startup_before_loading_anything(capsys, monkeypatch):
    from nanoserve.cli import main

    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    assert main(["serve", "--model", "no-such-model", "--api-key", ""]) == 2
    assert "--api-key: the API key is empty" in capsys.readouterr().err


def test_a_server_beyond_the_loopback_without_a_key_gets_a_loud_warning():
    from nanoserve.serving.startup import exposure_warning

    assert "WARNING" in exposure_warning("0.0.0.0", None)
    assert "WARNING" in exposure_warning("my-host.example", None)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", "a-key") is None


def test_the_open_file_limit_is_raised_to_fit_the_connection_limit():
    import resource

    from nanoserve.serving.startup import SPARE_FILES, open_files_for

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert open_files_for(ServerLimits(max_connections=512)) is None
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 512 + SPARE_FILES
        if hard != resource.RLIM_INFINITY:
            warning = open_files_for(ServerLimits(max_connections=hard))
            assert "ulimit -n" in warning
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---- shutdown with streams in flight ----


async def stream_until_done(base_url: str, body: dict, first_chunk: asyncio.Event) -> list[str]:
    """Every `data:` line of one stream; sets first_chunk once its first token has come."""
    lines = []
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                first_chunk.set()
    return lines


def finish_reason_with_done(lines: list[str]) -> str:
    """The finish reason of a stream that ended properly: its last chunk names one, then [DONE]."""
    assert lines[-1] == "[DONE]", lines[-3:]
    return json.loads(lines[-2])["choices"][0]["finish_reason"]


def assert_aborted_with_done(lines: list[str]) -> None:
    assert finish_reason_with_done(lines) == "abort", lines[-3:]


STREAM = {"model": MODEL, "prompt": "hi", "max_tokens": 90, "ignore_eos": True, "stream": True}


def test_a_server_told_to_stop_ends_every_request_with_abort_and_every_stream_with_done(
    folder, monkeypatch
):
    """A server told to stop (what a signal does) ends every request in the engine with "abort"
    and every stream with its last chunk and [DONE]: nothing is left for uvicorn to cancel, and
    every block is free."""
    llm = LLM(folder, stage=10, max_num_seqs=2, **ENGINE)  # two run, two wait
    app = create_app(llm, MODEL)
    loop = app.state.served.loop
    all_queued, stopping = threading.Event(), threading.Event()
    monkeypatch.setattr(loop, "add_request", signalling(loop.add_request, all_queued, times=4))
    monkeypatch.setattr(loop, "request_stop", signalling(loop.request_stop, stopping))
    # The engine's first step waits until all four requests are queued, and from a request's
    # third token on, each step waits until the server is told to stop: whatever the machine's
    # pace, every request is in the engine when the stop comes and none has finished.
    step = held(llm.engine.step, all_queued)
    step = held(step, stopping, when=lambda: most_completion_tokens(llm.engine) >= 3)
    monkeypatch.setattr(llm.engine, "step", step)
    # uvicorn cancels what is still running once its grace period is over, and logs that as an
    # error. A grace period of 20 s (make_server reads it when it builds the server; ServerThread
    # waits 30 s for the stop) leaves no wall clock in the check below: no error means nothing
    # was left to cancel, however slow the machine.
    monkeypatch.setattr(server_module, "SHUTDOWN_GRACE_S", 20)
    server = ServerThread(app)
    assert server.server.config.timeout_graceful_shutdown == 20, "the server has the 20 s"
    base_url = server.__enter__()
    uvicorn_errors = ErrorRecords("uvicorn.error")  # its logger does not propagate to pytest's

    async def whole(body: dict) -> dict:
        async with httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT) as http:
            return (await http.post("/v1/completions", json=body)).json()

    async def three_streams_and_a_whole_one_then_stop():
        first = asyncio.Event()
        streams = [
            asyncio.ensure_future(stream_until_done(base_url, STREAM, first)) for _ in range(3)
        ]
        not_streamed = asyncio.ensure_future(whole({**STREAM, "stream": False}))
        await first.wait()  # a stream has a token; and all four are in the engine:
        while loop.stats.num_running + loop.stats.num_waiting < 4:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(server.__exit__)
        return await asyncio.gather(*streams, not_streamed)

    with uvicorn_errors:
        results = asyncio.run(asyncio.wait_for(three_streams_and_a_whole_one_then_stop(), TIMEOUT))
    *streamed, not_streamed = results
    for lines in streamed:
        assert_aborted_with_done(lines)
    assert not_streamed["choices"][0]["finish_reason"] == "abort"
    # every request ended on its own: nothing was left for uvicorn to cancel
    assert uvicorn_errors.messages == [], uvicorn_errors.messages
    assert llm.engine.scheduler.is_finished()
    assert llm.engine.manager.num_free_blocks == llm.engine.manager.num_blocks


class ErrorRecords(logging.Handler):
    """The messages of the errors a logger logs inside a `with` block."""

    def __init__(self, logger_name: str):
        super().__init__(logging.ERROR)
        self.logger, self.messages = logging.getLogger(logger_name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> ErrorRecords:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


STARTUP_TIMEOUT = 180  # seconds: `nanoserve serve` imports torch and starts its engine process
EXIT_TIMEOUT = 30  # seconds for the process to exit once its streams have ended


def start_serve(folder: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`nanoserve serve folder` in a session of its own, once GET /health answers 200: (the
    process, its base URL). free_port() finds a port that was free: if something else binds it
    before the server does, the server exits with EADDRINUSE and one more try takes another."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for attempt in range(2):
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "nanoserve", "serve", folder, "--port", str(port), *flags],
            env=env,
            start_new_session=True,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=with_default_sigint,  # a Ctrl-C reaches it however the suite was started
        )
        base_url = f"http://127.0.0.1:{port}"
        if answers_health(server, base_url):
            return server, base_url
        exited = server.poll()  # None: STARTUP_TIMEOUT passed and it still runs
        stderr = end_and_read_stderr(server)
        port_taken = "address already in use" in stderr.lower()
        why = f"{STARTUP_TIMEOUT} s passed" if exited is None else f"it exited with {exited}"
        assert port_taken and attempt == 0, (
            f"`nanoserve serve` did not answer GET /health with 200 ({why}); its stderr:\n{stderr}"
        )
    raise AssertionError("not reached: the second try returns or fails above")


def answers_health(server: subprocess.Popen, base_url: str) -> bool:
    """Poll GET /health until it answers 200 (True), the process exits or STARTUP_TIMEOUT passes."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def end_and_read_stderr(server: subprocess.Popen) -> str:
    """What `server` wrote to stderr, once it and its process group are gone (SIGKILL if not)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    return server.stderr.read()


def requests_in_the_engine(metrics_text: str) -> int:
    """Requests the engine has taken: running, waiting, or finished (by any finish reason)."""
    numbers = [
        float(re.search(rf"^nanoserve_requests_{queue} (\S+)$", metrics_text, re.M).group(1))
        for queue in ("running", "waiting")
    ]
    numbers += map(float, re.findall(r"^nanoserve_requests_total\{.*\} (\S+)$", metrics_text, re.M))
    return round(sum(numbers))


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the group"])
def test_nanoserve_serve_stops_on_a_signal_in_under_3_s_ending_every_stream(folder, how):
    """`nanoserve serve` told to stop by SIGTERM, or by a terminal's Ctrl-C (SIGINT to its
    process group), ends every stream in flight with "abort" (or its own end) and [DONE] within
    3 s of the signal, exits with the status a shell expects, prints no traceback and leaves no
    child process behind."""
    flags = ["--served-model-name", MODEL, "--log-level", "warning", "--max-num-seqs", "1"]
    flags += ["--device", "cpu", "--dtype", "float64", "--max-model-len", "96"]
    server, base_url = start_serve(folder, flags)
    try:
        children = children_of(server.pid)  # the engine process (and multiprocessing's tracker)

        async def streams_then_signal():
            first = asyncio.Event()
            # one runs at a time (--max-num-seqs 1): 6 x 90 tokens take far longer than the
            # signal takes to arrive, however fast the engine guesses, so some stream is cut
            body = {**STREAM, "max_tokens": 90}
            streams = [
                asyncio.ensure_future(stream_until_done(base_url, body, first)) for _ in range(6)
            ]
            await first.wait()  # one has a token
            # and all six are in the engine (the engine publishes its queues after each step):
            # none can arrive after the stop, when the server no longer takes requests
            async with httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT) as http:
                deadline = time.monotonic() + TIMEOUT
                while requests_in_the_engine((await http.get("/metrics")).text) != 6:
                    assert time.monotonic() < deadline, "the six requests never reached the engine"
                    await asyncio.sleep(0.01)
            started = time.monotonic()
            if how == "SIGTERM":
                server.send_signal(signal.SIGTERM)
            else:  # a terminal's Ctrl-C: the server and its engine process both get it
                os.killpg(server.pid, signal.SIGINT)
            results = await asyncio.gather(*streams)
            return results, time.monotonic() - started

        results, seconds = asyncio.run(asyncio.wait_for(streams_then_signal(), TIMEOUT))
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(EXIT_TIMEOUT)  # generous: on a busy machine the exit is not timed
        returncode = server.returncode  # None: still running
    finally:
        stderr = end_and_read_stderr(server)
    # a stream may have run to its end before the signal came; every other one is cut by it
    reasons = [finish_reason_with_done(lines) for lines in results]
    assert set(reasons) <= {"length", "abort"}, reasons
    assert "abort" in reasons, f"no stream was cut by the signal: {reasons}"
    assert seconds < 3, f"the streams took {seconds:.1f} s to end after the signal"
    assert returncode is not None, f"still running {EXIT_TIMEOUT} s after the streams:\n{stderr}"
    assert returncode == (-signal.SIGTERM if how == "SIGTERM" else 130), stderr
    assert "Traceback" not in stderr, stderr
    deadline = time.monotonic() + 30  # the resource tracker exits on its own EOF (free if at once)
    while any(map(is_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [cmdline(pid) for pid in children if is_alive(pid)]
    assert left == [], "child processes were left behind"


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return f"pid {pid}, gone"


def is_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie is dead: it only waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
