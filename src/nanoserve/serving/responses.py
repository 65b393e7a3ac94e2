"""Responses and chunks in OpenAI's shapes: the envelope, the choices, the usage (stage 10).

Introduced in stage 10. Plain dicts, built the same way whole or streamed. Every choice carries
its `index` (the prompt's, in a batch) and its `token_ids`, nanoserve's extension that lets tests
compare tokens rather than text. `logprobs` is null unless the request asks for them; then it
holds those of the choice's (or the chunk's) tokens, in openai_logprobs.py's shapes.
"""

from __future__ import annotations

import time


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


def completion_choice(
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: dict | None = None,
) -> dict:
    """A /v1/completions choice (whole or a chunk's piece)."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def chat_choice(
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: dict | None = None,
) -> dict:
    """A whole /v1/chat/completions choice."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def chat_chunk_choice(
    index: int,
    delta: dict,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: dict | None = None,
) -> dict:
    """A chat chunk's choice: `delta` holds the role (first chunk) and the new content."""
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }
