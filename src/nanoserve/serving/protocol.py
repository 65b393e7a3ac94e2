"""Requests in OpenAI's shapes: completions, chat completions, and the error answer (stage 10).

Introduced in stage 10. Pydantic checks each field's type and range, so a bad request is answered
with a 400 that names the field before anything is queued; `sampling_params` maps the rest onto
`SamplingParams` (`n` choices per prompt, `logprobs`: completions' int, chat's `logprobs: true` +
`top_logprobs`). A field nanoserve cannot honour yet (penalties, min_p, min_tokens) is a 400
saying so (`NOT_YET`), never silently ignored; so is a known OpenAI or vLLM field it has no use
for (`UNSUPPORTED`: tools, logit_bias, guided decoding...). Any other field is kept and logged.
Extensions, as vLLM names them: `top_k`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`; every choice carries its `token_ids`.
"""

from __future__ import annotations

from typing import Annotated, cast

from pydantic import Field

from nanoserve.sampling import MAX_LOGPROBS, SEED_LIMIT, SamplingParams
from nanoserve.serving.chat_messages import ChatMessage
from nanoserve.serving.openai_fields import OpenAIModel, Prompt, Stop, TokenId, unknown_fields


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
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code = code
        self.headers = headers  # of the response: Retry-After on a 503

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}, as OpenAI's API answers."""
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": self.code}}


MAX_N = 128  # choices per prompt at most (OpenAI's limit); each is a sequence in the engine
# Fields SamplingParams has no room for yet -> the values that ask for nothing. To serve one:
# drop its entry and pass it on in `sampling_params`.
NOT_YET: dict[str, tuple] = {
    "min_p": (0,),
    "min_tokens": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
}
# Known OpenAI and vLLM fields nanoserve has no use for -> the values that ask for nothing
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None, 0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
}


def is_neutral(value, neutral: tuple) -> bool:
    """True if `value` is one of `neutral`, where a bool equals only itself (not 0 or 1)."""
    return any(
        v is value if isinstance(v, bool) or isinstance(value, bool) else v == value
        for v in neutral
    )


class StreamOptions(OpenAIModel):
    include_usage: bool = False  # a last chunk with the token counts and no choices


class SamplingFields(OpenAIModel):
    """The fields both endpoints share: the model, sampling, stopping, streaming."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default, and range
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM's spelling), like None
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the end user's id, for OpenAI's abuse monitoring: unused here

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unknown_fields(self) -> list[str]:
        """The fields, at any depth, that nanoserve does not know (to log, not to refuse)."""
        return [name for name in unknown_fields(self) if name not in UNSUPPORTED]

    def check_supported(self) -> None:
        """400 naming the first field that asks for what nanoserve cannot do, or that makes no
        sense with the others (`stream_options` without `stream`)."""
        extra = self.model_extra or {}
        for name, neutral in (*NOT_YET.items(), *UNSUPPORTED.items()):
            value = getattr(self, name) if name in NOT_YET else extra.get(name)
            if not is_neutral(value, neutral):
                hint = " or ".join(repr(v) for v in neutral if v is not None) or "null"
                raise APIError(
                    400,
                    f"{name} = {value!r} is unsupported by nanoserve (for now); "
                    f"leave it out or send {hint}",
                    param=name,
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream: true", param="stream_options"
            )

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many top tokens per position, None for no logprobs."""
        raise NotImplementedError  # each endpoint spells it its own way

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """These fields as SamplingParams; APIError naming the field SamplingParams rejects."""
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_k=self.top_k if self.top_k and self.top_k > 0 else None,
                top_p=self.top_p,
                max_tokens=max_tokens,
                ignore_eos=self.ignore_eos,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                seed=self.seed,
                n=self.n,
                logprobs=self.num_logprobs,
            )
        except ValueError as err:  # "SamplingParams.<field> = ... is invalid; expected ..."
            field = str(err).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(err), param=field) from None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt (text or token ids), or a batch of them."""

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top tokens per position

    @property
    def num_logprobs(self) -> int | None:
        """`logprobs` itself."""
        return self.logprobs

    @property
    def is_batch(self) -> bool:
        """True when `prompt` is a list of prompts (of strings, or of token-id lists)."""
        return isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt, text or token ids."""
        return cast(list, self.prompt) if self.is_batch else [cast(str | list[int], self.prompt)]

    def prompt_param(self, index: int) -> str:
        """The field that names prompt `index`, as the client wrote it."""
        return f"prompt[{index}]" if self.is_batch else "prompt"


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: a conversation; the model's chat template makes the prompt."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # with logprobs: true

    @property
    def num_logprobs(self) -> int | None:
        """`top_logprobs` (0 if unset) when `logprobs` is true, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        """SamplingFields' checks, and top_logprobs > 0 only with logprobs: true (vLLM's)."""
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                400,
                f"top_logprobs = {self.top_logprobs} asks for the top tokens of logprobs that "
                "were not asked for: logprobs must be true to use top_logprobs",
                param="top_logprobs",
            )

    def prompt_param(self, index: int) -> str:
        """The field a rejected prompt is named by: the messages make it."""
        return "messages"

    @property
    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them."""
        return [message.for_template() for message in self.messages]
