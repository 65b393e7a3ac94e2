"""The OpenAI API as clients send it (issue 23, item 4): what vLLM takes, the server takes.

A real uvicorn server on 127.0.0.1 over the tiny character-level chat model of test_serving.py,
driven by the official `openai` client (and httpx for bodies the client would not send): batch
prompts, content parts, the developer and tool roles, `null` for the default, vLLM's extra
fields; and what vLLM refuses, refused the same way: max_tokens past the context,
stream_options without stream. Every error names the field as the client wrote it.
"""

from __future__ import annotations

import json
import logging
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
TIMEOUT = 60


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def offline(folder):
    """The oracle: an LLM like the served one, driven offline."""
    return LLM(folder, **ENGINE)


@pytest.fixture(scope="module")
def served(folder):
    """(base URL, the app) of a server of the newest stage that lives for the whole module."""
    app = create_app(LLM(folder, **ENGINE), MODEL)
    with ServerThread(app) as base_url:
        yield base_url, app


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=TIMEOUT, max_retries=0)


def offline_out(offline: LLM, prompt, **sampling):
    (out,) = offline.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
    return out


def chat_out(offline: LLM, messages, **sampling):
    (out,) = offline.chat(messages, SamplingParams(**sampling), use_tqdm=False)
    return out


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)


# ---- accepted, as vLLM accepts it ----


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_gets_one_choice_per_prompt_in_order(client, offline, stream):
    prompts = ["The sky is", "Once upon", "Hello"]
    want = [offline_out(offline, p, max_tokens=12, ignore_eos=True) for p in prompts]
    reply = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=12,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    texts, ids = ["", "", ""], [[], [], []]
    chunks = list(reply) if stream else [reply]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            ids[choice.index] += choice.model_extra["token_ids"]
    assert ids == [out.token_ids for out in want]
    assert texts == [out.text for out in want]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == sum(len(p) for p in prompts)  # one token per character
    assert usage.completion_tokens == 36


@pytest.mark.parametrize(
    "prompt", [[[5, 17, 99], [3, 42]], [[7, 7, 7]]], ids=["two-id-lists", "one-id-list"]
)
def test_a_batch_of_token_id_lists_equals_llm_generate(client, offline, prompt):
    want = [offline_out(offline, p, max_tokens=8).token_ids for p in prompt]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert [c.index for c in got.choices] == list(range(len(prompt)))
    assert [c.model_extra["token_ids"] for c in got.choices] == want


def test_content_parts_the_developer_role_and_null_fields_are_what_llm_chat_makes(client, offline):
    plain = [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Again"},
    ]
    want = chat_out(offline, plain, max_tokens=15)
    parts = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    as_sent = [
        {"role": "developer", "content": parts, "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "Hi!"}], "name": "ann"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"},
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=as_sent,
        max_tokens=15,
        temperature=0,
        top_p=None,
        seed=None,
        user="user-1234",
        extra_body={"top_k": None, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0},
    )
    assert reply.choices[0].model_extra["token_ids"] == want.token_ids
    assert reply.choices[0].message.content == want.text


def test_temperature_null_means_the_default_of_one(url, offline):
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 10, "ignore_eos": True}
    want = offline_out(offline, [9, 8, 7], max_tokens=10, ignore_eos=True, temperature=1.0, seed=5)
    got = post(url, "/v1/completions", {**body, "temperature": None, "seed": 5})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == want.token_ids


def test_a_tool_message_is_passed_to_the_template(client, offline):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    want = chat_out(offline, messages, max_tokens=6)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    assert reply.choices[0].model_extra["token_ids"] == want.token_ids


def test_an_unknown_field_is_served_and_logged_once_by_name(url, caplog):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi", "cache_hint": 1}],
        "max_tokens": 3,
        "my_field": "x",
    }
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        response = post(url, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    warnings = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(warnings) == 1 and "my_field" in warnings[0]
    assert "messages[0].cache_hint" in warnings[0]


def test_include_stop_str_in_output_keeps_the_stop_string(client, offline):
    want = offline_out(offline, "Hello", max_tokens=30, ignore_eos=True).text
    stop = want[7:9]
    cut = want[: want.index(stop)]
    for include, text in ((False, cut), (True, cut + stop)):
        got = client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=30,
            stop=stop,
            temperature=0,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
        )
        assert (got.choices[0].text, got.choices[0].finish_reason) == (text, "stop")


def test_skip_special_tokens_false_keeps_them_in_the_text(url, offline):
    sampling = dict(max_tokens=40, ignore_eos=True)  # [1] greedily makes <|im_start|> (255)
    out = offline_out(offline, [1], **sampling)
    assert 255 in out.token_ids, "the tiny model changed: pick a prompt that makes 255"
    body = {"model": MODEL, "prompt": [1], "temperature": 0, **sampling}
    kept = post(url, "/v1/completions", {**body, "skip_special_tokens": False}).json()
    want = offline.tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert kept["choices"][0]["text"] == want and "<|im_start|>" in want
    skipped = post(url, "/v1/completions", body).json()
    assert skipped["choices"][0]["text"] == out.text and "<|im_start|>" not in out.text


# ---- refused, as vLLM refuses it: a 400 naming the field ----

REFUSED = [  # (route, body past the model, param, words in the message)
    ("/v1/completions", {"prompt": [1] * 80, "max_tokens": 20}, "max_tokens", "80 prompt tokens"),
    ("/v1/completions", {"prompt": [1] * 90}, "max_tokens", "exceed the model's context of 96"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 95},
        "max_completion_tokens",
        "max_completion_tokens 95",
    ),
    ("/v1/completions", {"prompt": "hi", "stream_options": {}}, "stream_options", "stream: true"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n", "less than or equal to 128"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", "unsupported"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", "unsupported"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.2}, "repetition_penalty", "1.2"),
    ("/v1/completions", {"prompt": "hi", "min_p": 0.1}, "min_p", "unsupported"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 4}, "min_tokens", "unsupported"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", "0.5"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop", "at least 1 character"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", ""]}, "stop[1]", "at least 1"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, "stop", "a string or a list of strings"),
    ("/v1/completions", {"prompt": ["a", 5]}, "prompt[1]", "valid string"),
    ("/v1/completions", {"prompt": [[1, 2], [3, -1]]}, "prompt[1][1]", "greater than or equal"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt", "a list of token ids"),
    ("/v1/completions", {"prompt": ["ok", "x" * 100]}, "prompt[1]", "max_model_len"),
    ("/v1/completions", {"prompt": None}, "prompt", "string"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "number"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]},
        "messages[1].content",
        "a string or a list of content parts",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        "text only",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
        "needs its `text`",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content",
        "needs its content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
        "logprobs must be true",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "less than or equal to 20",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "tools",
        "unsupported",
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "param", "words"), REFUSED, ids=[f"{r[2]}-{r[3]}" for r in REFUSED]
)
def test_what_vllm_refuses_is_a_400_naming_the_field_as_sent(url, route, body, param, words):
    response = post(url, route, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


def counter(url: str, name: str) -> float:
    """A metric's value from /metrics; 0 for a counter not yet shown."""
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    found = re.search(rf"^nanoserve_{re.escape(name)} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_batch_whose_client_hangs_up_or_whose_prompt_is_refused_leaves_nothing_running(
    served, monkeypatch
):
    url, app = served
    loop, engine = app.state.served.loop, app.state.served.loop.engine
    all_aborted = threading.Event()
    monkeypatch.setattr(loop, "abort", signalling(loop.abort, all_aborted, times=3))
    # from a choice's 12th token on, a step waits until the server has aborted all three: the
    # client's four tokens come long before, and however late the server notices the hang-up,
    # no choice runs on meanwhile
    held_step = held(engine.step, all_aborted, lambda: most_completion_tokens(engine) >= 12)
    monkeypatch.setattr(engine, "step", held_step)
    aborts, tokens = 'requests_total{finish_reason="abort"}', "generation_tokens_total"
    before = {name: counter(url, name) for name in (aborts, tokens)}
    body = {"model": MODEL, "prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 80}
    body |= {"ignore_eos": True, "stream": True, "temperature": 0}
    num_tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                num_tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
            if num_tokens >= 4:  # tokens, not chunks: a chunk may carry several
                break  # leaving the block closes the connection mid-stream
    assert all_aborted.wait(TIMEOUT), "the hang-up did not abort the batch's three choices"
    refused = post(url, "/v1/completions", {**body, "prompt": [[1, 2], [7] * 100], "stream": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt[1]"
    for _ in range(int(TIMEOUT / 0.01)):
        if counter(url, "requests_running") == 0 and counter(url, "kv_blocks_used") == 0:
            break
        threading.Event().wait(0.01)
    assert counter(url, "kv_blocks_used") == 0, "a refused batch-mate left its blocks behind"
    assert counter(url, aborts) - before[aborts] == 3, "every choice of the hung-up batch aborted"
    assert counter(url, tokens) - before[tokens] < 120, "3 x 80 tokens: the choices ran on"


# ---- n choices per prompt, and logprobs: what vLLM serves ----


@pytest.fixture(scope="module")
def stage_11(folder):
    """(client, offline LLM) at stage 11, for seeded sampling: stage 12 draws a token differently
    on a step that guessed (the rejected guess masked), and whether a sequence guesses on a step
    depends on the engine's step count (Backoff), so on what else the server ran before."""
    with ServerThread(create_app(LLM(folder, stage=11, **ENGINE), MODEL)) as base_url:
        client = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="-", timeout=TIMEOUT, max_retries=0
        )
        yield client, LLM(folder, stage=11, **ENGINE)


def chunks_of(reply, stream: bool) -> list:
    """Every chunk of a streamed reply, or the whole reply as the one 'chunk'."""
    return list(reply) if stream else [reply]


def token_text(offline: LLM, token_id: int) -> str:
    """A token as a logprob names it: the decode of its id alone, as vLLM does."""
    return offline.tokenizer.decode([token_id])


@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_choices_differ_repeat_and_are_llm_generates_n(stage_11, stream):
    client, offline = stage_11
    sampling = dict(max_tokens=10, ignore_eos=True, temperature=1.0, seed=7)
    want = [offline_out(offline, p, n=3, **sampling) for p in ("ab", "cd")]

    def ask() -> tuple[dict[int, list[int]], object]:
        reply = client.completions.create(
            model=MODEL,
            prompt=["ab", "cd"],
            n=3,
            max_tokens=10,
            temperature=1.0,
            seed=7,
            stream=stream,
            extra_body={"ignore_eos": True},
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        chunks = chunks_of(reply, stream)
        ids: dict[int, list[int]] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                ids.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
        return ids, chunks[-1].usage

    ids, usage = ask()
    assert sorted(ids) == list(range(6)), "choice index = prompt index * n + j"
    assert [ids[i] for i in range(6)] == [o.token_ids for out in want for o in out.outputs]
    assert len({tuple(ids[j]) for j in range(3)}) == 3, "one prompt's seeded choices differ"
    assert ask()[0] == ids, "the same seed repeats them"
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 60), "each prompt counted once"


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_n_gives_n_equal_chat_choices(client, offline, stream):
    messages = [{"role": "user", "content": "Hi!"}]
    want = chat_out(offline, messages, max_tokens=8)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, n=3, max_tokens=8, temperature=0, stream=stream
    )
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    for chunk in chunks_of(reply, stream):
        for choice in chunk.choices:
            text = choice.delta.content if stream else choice.message.content
            texts[choice.index] = texts.get(choice.index, "") + (text or "")
            ids.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
    assert texts == {j: want.text for j in range(3)}
    assert ids == {j: want.token_ids for j in range(3)}


@pytest.mark.parametrize(
    ("stage", "sampling"),
    [(None, dict(temperature=0, logprobs=2)), (11, dict(temperature=1.0, seed=3, logprobs=0))],
    ids=["greedy-top-2", "stage-11-sampled-top-0"],
)
def test_completion_logprobs_are_llm_generates_in_openais_shape(request, stage, sampling):
    if stage is None:  # the newest stage
        client, offline = request.getfixturevalue("client"), request.getfixturevalue("offline")
    else:
        client, offline = request.getfixturevalue("stage_11")
    want = offline_out(offline, "Hello", max_tokens=12, ignore_eos=True, **sampling)
    got = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=12, extra_body={"ignore_eos": True}, **sampling
    )
    logprobs = got.choices[0].logprobs
    tokens = [token_text(offline, t) for t in want.token_ids]
    assert logprobs.tokens == tokens
    chosen = [ranked[t].logprob for t, ranked in zip(want.token_ids, want.logprobs)]
    assert logprobs.token_logprobs == pytest.approx(chosen, rel=1e-9)
    for top, ranked in zip(logprobs.top_logprobs, want.logprobs, strict=True):
        # the sampled token, then the top `logprobs` ones (k + 1 entries, or k if it is one)
        named = {token_text(offline, t): lp.logprob for t, lp in ranked.items()}
        assert top == pytest.approx(named, rel=1e-9)
        assert len(top) in (sampling["logprobs"], sampling["logprobs"] + 1)
    lengths = [len(token) for token in tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("top_logprobs", [None, 3])
def test_chat_logprobs_are_llm_chats_in_openais_shape(client, offline, top_logprobs):
    messages = [{"role": "user", "content": "Hi!"}]
    want = chat_out(offline, messages, max_tokens=8, logprobs=top_logprobs or 0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=top_logprobs,
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [token_text(offline, t) for t in want.token_ids]
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    chosen = [ranked[t].logprob for t, ranked in zip(want.token_ids, want.logprobs)]
    assert [c.logprob for c in content] == pytest.approx(chosen, rel=1e-9)
    for entry, ranked in zip(content, want.logprobs, strict=True):
        top = sorted((lp.rank, token_text(offline, t), lp.logprob) for t, lp in ranked.items())
        top = [(token, logprob) for rank, token, logprob in top if rank <= (top_logprobs or 0)]
        assert [t.token for t in entry.top_logprobs] == [token for token, _ in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in top])
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)


def test_a_streamed_completions_chunks_carry_the_logprobs_of_their_own_tokens(client):
    body = dict(model=MODEL, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="Once", logprobs=2, **body)
    chunks = list(client.completions.create(prompt="Once", logprobs=2, stream=True, **body))
    ids = whole.choices[0].model_extra["token_ids"]
    assert 254 not in ids and 255 not in ids, "a special token: its text is not its token's"
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    offsets = []
    for chunk in chunks:
        (choice,) = chunk.choices
        assert len(choice.logprobs.tokens) == len(choice.model_extra["token_ids"])
        for name, values in streamed.items():
            values += getattr(choice.logprobs, name)
        offsets += choice.logprobs.text_offset
    want = whole.choices[0].logprobs
    assert (streamed["tokens"], offsets) == (want.tokens, want.text_offset)
    assert streamed["token_logprobs"] == pytest.approx(want.token_logprobs, rel=1e-9)
    for top, want_top in zip(streamed["top_logprobs"], want.top_logprobs, strict=True):
        assert top == pytest.approx(want_top, rel=1e-9)  # another batch: the last bits may differ


def test_a_streamed_chat_choices_chunks_carry_the_logprobs_of_their_own_tokens(client):
    messages = [{"role": "user", "content": "Hi!"}]
    body = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True)
    whole_chat = client.chat.completions.create(top_logprobs=2, **body)
    content = []
    for chunk in client.chat.completions.create(top_logprobs=2, stream=True, **body):
        (choice,) = chunk.choices
        entries = choice.logprobs.content if choice.logprobs else []
        assert len(entries) == len(choice.model_extra["token_ids"])
        content += entries
    want_content = whole_chat.choices[0].logprobs.content
    named = [(c.token, c.bytes, [(t.token, t.bytes) for t in c.top_logprobs]) for c in content]
    assert named == [
        (c.token, c.bytes, [(t.token, t.bytes) for t in c.top_logprobs]) for c in want_content
    ]
    values = [[c.logprob] + [t.logprob for t in c.top_logprobs] for c in content]
    for got, want_entry in zip(values, want_content, strict=True):
        want_values = [want_entry.logprob] + [t.logprob for t in want_entry.top_logprobs]
        assert got == pytest.approx(want_values, rel=1e-9)


def test_a_request_without_logprobs_gets_null_logprobs(client):
    got = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, n=2)
    assert [c.logprobs for c in got.choices] == [None, None]


def test_a_request_that_ends_in_the_step_that_queued_it_still_gets_its_logprobs(client):
    got = client.completions.create(model=MODEL, prompt="ab", max_tokens=1, logprobs=1)
    (choice,) = got.choices
    assert len(choice.logprobs.tokens) == len(choice.model_extra["token_ids"]) == 1
    assert len(choice.logprobs.top_logprobs[0]) in (1, 2)
