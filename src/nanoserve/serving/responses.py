"""Responses and chunks in OpenAI's shapes: the envelope, the choices, the usage (stage 10).

Introduced in stage 10. Plain dicts, built the same way whole or streamed. Every choice carries
its `index` (prompt i's j-th of n: i * n + j) and its `token_ids`, nanoserve's extension that
lets tests compare tokens rather than text. `logprobs` is null unless the request asks for them;
then it holds those of the choice's (or the chunk's) tokens, in the endpoint's shape. The engine
gives one `TokenLogprobs` per token (its logprob under the model's raw distribution, its rank,
the top k ids -> logprobs); a token is named by the decode of its id alone, special tokens kept
(vLLM's names), and a logprob of -inf is sent as -9999.0, as vLLM does: JSON has no infinity.

    completions  {"tokens": [str], "token_logprobs": [float], "text_offset": [int],
                  "top_logprobs": [{token: logprob}]}  each: the sampled token, then the top k
    chat         {"content": [{"token", "logprob", "bytes",
                               "top_logprobs": [{"token", "logprob", "bytes"}]}]}  the top k
"""

from __future__ import annotations

import functools
import time

from nanoserve.logprobs import TokenLogprobs


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def envelope(request_id: str, model: str, kind: str, choices: list[dict]) -> dict:
    """The fields every response and chunk shares; kind is the `object` field."""
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def choice(
    index: int,
    content: dict,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: dict | None = None,
) -> dict:
    """One choice of a response or a chunk; `content` is its body, which the endpoints name
    differently: {"text": ...} (/v1/completions), {"message": {...}} (a whole chat reply) or
    {"delta": {...}} (a chat chunk: the role first, then the new content)."""
    return {
        "index": index,
        **content,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def completion_choice(index: int, text: str, *rest) -> dict:
    """A /v1/completions choice (whole or a chunk's piece)."""
    return choice(index, {"text": text}, *rest)


def chat_choice(index: int, text: str, *rest) -> dict:
    """A whole /v1/chat/completions choice."""
    return choice(index, {"message": {"role": "assistant", "content": text}}, *rest)


def chat_chunk_choice(index: int, delta: dict, *rest) -> dict:
    """A chat chunk's choice: `delta` holds the role (first chunk) and the new content."""
    return choice(index, {"delta": delta}, *rest)


MIN_LOGPROB = -9999.0  # what -inf is sent as


@functools.lru_cache(maxsize=2**18)
def token_text(tokenizer, token_id: int) -> str:
    """A token as logprobs name it: its id decoded alone (`token_id:17` without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer, token_ids: list[int], entries: list[TokenLogprobs], text_offset: int
) -> dict:
    """A /v1/completions choice's `logprobs` for these tokens; text_offset: where in the
    choice's text the first one starts (then each starts where its predecessor's name ends)."""
    tokens = [token_text(tokenizer, token_id) for token_id in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top_logprobs = []
    for token, entry in zip(tokens, entries, strict=True):
        top = {token: _clamped(entry.logprob)}  # the sampled token first, as vLLM and OpenAI
        top |= {token_text(tokenizer, i): _clamped(lp) for i, lp in entry.top.items()}
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [_clamped(entry.logprob) for entry in entries],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprobs]) -> dict:
    """A /v1/chat/completions choice's (or chunk's) `logprobs` for these tokens."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        top = [_chat_token(tokenizer, i, lp) for i, lp in entry.top.items()]
        content.append({**_chat_token(tokenizer, token_id, entry.logprob), "top_logprobs": top})
    return {"content": content}


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    token = token_text(tokenizer, token_id)
    utf8 = list(token.encode("utf-8", errors="replace"))
    return {"token": token, "logprob": _clamped(logprob), "bytes": utf8}


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
