"""What a parsed request must pass before it is tokenised or queued (stage 10's server).

Introduced with stage 10's server, after hostile requests were tried on it. Pydantic has checked
each field's type and range; these are the checks that need the whole request or the server's
limits, each a 4xx naming the field as the client wrote it:

- valid Unicode in every string: JSON may carry a lone UTF-16 surrogate ("\\ud800"), which Python
  keeps in a str and a tokenizer refuses (it was a 500 and a dropped connection);
- stop strings: how many, how long (each is searched for at every token);
- prompt characters, counted before the tokenizer runs (it is not free: ~1 s per MB);
- prompt tokens + max_tokens within the model's context (checked once the prompt is tokenised);
- room in the queue: past `max_queued_requests` waiting, a 503 with Retry-After.

It does not tokenise, and it knows nothing of the engine but the number it is told is waiting.
"""

from __future__ import annotations

from pydantic import BaseModel

from nanoserve.serving.limits import ServerLimits, limit_flag
from nanoserve.serving.openai_fields import field_path
from nanoserve.serving.protocol import APIError

NOT_UNICODE = "the text is not valid Unicode (a lone UTF-16 surrogate, such as \\ud800)"


def invalid_text_field(value, path: tuple = ()) -> str | None:
    """The path (`messages[0].content`) of the first string in `value` that is not valid Unicode
    (a lone surrogate cannot be encoded as UTF-8), or None if every string is."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return field_path(path) or "body"
        return None
    items: list[tuple[object, object]]
    if isinstance(value, BaseModel):  # its fields, then any it kept unvalidated (extra)
        items = list(value)
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple):
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        found = invalid_text_field(key, path) if isinstance(key, str) else None
        found = found or invalid_text_field(item, (*path, key))
        if found:
            return found
    return None


def num_chars(value) -> int:
    """Characters in every string of `value` (a conversation: its messages' text)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(num_chars(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(num_chars(item) for item in value)
    return 0


def check_text(body: BaseModel) -> None:
    """400 naming the first field whose text is not valid Unicode."""
    field = invalid_text_field(body)
    if field is not None:
        raise APIError(
            400,
            f"{field}: {NOT_UNICODE}",
            param=field,
        )


def check_stops(stop_strings: list[str], limits: ServerLimits) -> None:
    """400 naming `stop` when there are too many stop strings, or one is too long."""
    if limits.max_stop_strings is not None and len(stop_strings) > limits.max_stop_strings:
        raise APIError(
            400,
            f"stop: {len(stop_strings)} stop strings; this server takes at most "
            f"{limits.max_stop_strings} ({limit_flag('max_stop_strings')})",
            param="stop",
        )
    longest = max(map(len, stop_strings), default=0)
    if limits.max_stop_chars is not None and longest > limits.max_stop_chars:
        raise APIError(
            400,
            f"stop: a stop string of {longest} characters; this server takes at most "
            f"{limits.max_stop_chars} ({limit_flag('max_stop_chars')})",
            param="stop",
        )


def check_prompt_chars(num_chars: int, param: str, limits: ServerLimits) -> None:
    """400 naming `param` when its text is over max_prompt_chars, before it is tokenised."""
    if limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise APIError(
            400,
            f"{param}: {num_chars} characters of text; this server tokenises at most "
            f"{limits.max_prompt_chars} ({limit_flag('max_prompt_chars')})",
            param=param,
        )


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, param: str) -> None:
    """400 naming `param` (max_tokens as the client spelt it) when a prompt that fits leaves
    less room than max_tokens asks for (a prompt that does not fit is the engine's 400)."""
    if num_prompt_tokens < max_model_len < num_prompt_tokens + max_tokens:
        raise APIError(
            400,
            f"{param}: {num_prompt_tokens} prompt tokens + {param} {max_tokens} = "
            f"{num_prompt_tokens + max_tokens} tokens exceed the model's context of "
            f"{max_model_len} tokens (max_model_len); lower {param} to at most "
            f"{max_model_len - num_prompt_tokens}, or shorten the prompt",
            param=param,
        )


def check_queue(num_queued: int, limits: ServerLimits) -> None:
    """503 with Retry-After when max_queued_requests are already waiting for the engine."""
    if limits.max_queued_requests is not None and num_queued >= limits.max_queued_requests:
        raise APIError(
            503,
            f"the server is busy: {num_queued} requests are waiting for the engine "
            f"(at most {limits.max_queued_requests}); retry after {limits.retry_after_s} s",
            type="server_error",
            code="server_busy",
            headers={"retry-after": str(limits.retry_after_s)},
        )
