"""Requests and responses in OpenAI's shapes: completions, chat completions, errors (stage 10).

Introduced in stage 10. Pydantic checks each field's type and range, so a bad request is answered
with a 400 that names the field before anything is queued; `sampling_params` maps the rest onto
`SamplingParams`. Fields OpenAI defines that nanoserve cannot honour (n > 1, logprobs, penalties)
are rejected, never silently ignored; unknown fields are rejected too. Extensions, as vLLM names
them: `top_k`, `ignore_eos`, `stop_token_ids`; every choice also carries its `token_ids`.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nanoserve.sampling import SEED_LIMIT, SamplingParams


class APIError(Exception):
    """An error answered as OpenAI's error object, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type,
            code,
        )
        self.headers = headers  # of the response: Retry-After on a 503

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}, as OpenAI's API answers."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the token counts and no choices


class SamplingFields(BaseModel):
    """The fields both endpoints share: the model, sampling, stopping, streaming."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default, and range
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM's spelling), like None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice per request
    presence_penalty: Literal[0] = 0  # no penalties in nanoserve's sampler
    frequency_penalty: Literal[0] = 0
    logprobs: Literal[False] | None = None
    user: str | None = None  # accepted and unused

    @model_validator(mode="after")
    def _stops_are_nonempty(self):
        for s in self.stop_strings:
            if not s:
                raise ValueError("stop strings must not be empty")
        return self

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """These fields as SamplingParams; APIError naming the field SamplingParams rejects."""
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_k=self.top_k if self.top_k and self.top_k > 0 else None,
                top_p=self.top_p,
                max_tokens=self.max_tokens or default_max_tokens,
                ignore_eos=self.ignore_eos,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                seed=self.seed,
            )
        except ValueError as err:  # "SamplingParams.<field> = ... is invalid; expected ..."
            field = str(err).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(err), param=field) from None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, text or token ids."""

    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: a conversation; the model's chat template makes the prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    @property
    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


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


def completion_choice(text: str, token_ids: list[int], finish_reason: str | None) -> dict:
    """A /v1/completions choice (whole or a chunk's piece); token_ids is nanoserve's extension."""
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def chat_choice(text: str, token_ids: list[int], finish_reason: str | None) -> dict:
    """A whole /v1/chat/completions choice."""
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }


def chat_chunk_choice(delta: dict, token_ids: list[int], finish_reason: str | None) -> dict:
    """A chat chunk's choice: `delta` holds the role (first chunk) and the new content."""
    return {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }
