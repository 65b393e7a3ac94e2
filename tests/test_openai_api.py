"""The OpenAI API as clients send it (issue 23, item 4): what vLLM takes, the server takes.

A real uvicorn server on 127.0.0.1 over the tiny character-level chat model of test_serving.py,
driven by the official `openai` client (and httpx for bodies the client would not send): batch
prompts, content parts, the developer and tool roles, `null` for the default, vLLM's extra
fields; and what vLLM refuses, refused the same way: max_tokens past the context,
stream_options without stream. Every error names the field as the client wrote it.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.testing import ServerThread, save_tiny_chat_model

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from nanoserve.serving import protocol  # noqa: E402
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
def url(folder):
    with ServerThread(create_app(LLM(folder, **ENGINE), MODEL)) as base_url:
        yield base_url


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
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", "unsupported"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 0}, "logprobs", "unsupported"),
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
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
        "logprobs",
        "unsupported",
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


def test_the_openai_client_sees_n_above_one_refused_clearly(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=2
        )
    error = refused.value.body
    assert error["param"] == "n" and "n = 2 is unsupported" in error["message"]


def test_serving_n_is_one_entry_away(url, monkeypatch):
    """`NOT_YET` is all that refuses n > 1: without its entry, a prompt gets n choices."""
    monkeypatch.delitem(protocol.NOT_YET, "n")
    body = {"model": MODEL, "prompt": ["ab", "cd"], "max_tokens": 5, "n": 2, "seed": 3}
    response = post(url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["token_ids"] != choices[1]["token_ids"], "seeds 3 and 4 differ"


def counter(url: str, name: str) -> float:
    """A metric's value from /metrics; 0 for a counter not yet shown."""
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    found = re.search(rf"^nanoserve_{re.escape(name)} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_batch_whose_client_hangs_up_or_whose_prompt_is_refused_leaves_nothing_running(url):
    aborts, tokens = 'requests_total{finish_reason="abort"}', "generation_tokens_total"
    before = {name: counter(url, name) for name in (aborts, tokens)}
    body = {"model": MODEL, "prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 80}
    body |= {"ignore_eos": True, "stream": True, "temperature": 0}
    num_chunks = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            num_chunks += line.startswith("data: {")
            if num_chunks == 4:
                break  # leaving the block closes the connection mid-stream
    refused = post(url, "/v1/completions", {**body, "prompt": [[1, 2], [7] * 100], "stream": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt[1]"
    for _ in range(int(TIMEOUT / 0.01)):
        if counter(url, "requests_running") == 0 and counter(url, "kv_blocks_used") == 0:
            break
        threading.Event().wait(0.01)
    assert counter(url, "kv_blocks_used") == 0, "a refused batch-mate left its blocks behind"
    assert counter(url, aborts) - before[aborts] == 3, "every choice of the hung-up batch aborted"
    assert counter(url, tokens) - before[tokens] < 120, "3 x 80 tokens: the choices ran on"
