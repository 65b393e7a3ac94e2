"""Logprobs in OpenAI's two shapes: the completions API's lists, chat's content entries.

Introduced with `logprobs` on stage 10's server. The engine gives one `TokenLogprobs` per token
(its logprob under the model's raw distribution, its rank, the top k ids -> logprobs, most likely
first); this names each token by the decode of its id alone, special tokens kept (vLLM's names),
and sends a logprob of -inf (a token the model rules out) as -9999.0, as vLLM does: JSON has no
infinity. It samples nothing and holds no state.

    completions  {"tokens": [str], "token_logprobs": [float], "text_offset": [int],
                  "top_logprobs": [{token: logprob}]}  each: the sampled token, then the top k
    chat         {"content": [{"token", "logprob", "bytes",
                               "top_logprobs": [{"token", "logprob", "bytes"}]}]}  the top k
"""

from __future__ import annotations

import functools

from nanoserve.logprobs import TokenLogprobs

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
