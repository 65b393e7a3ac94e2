"""The model a server serves: its name, its tokenizer, its engine loop, and what each request
passes through on its way to the engine (stage 10).

Introduced in stage 10, beside server.py's routes. `ServedModel` checks a parsed request (the
model's name, what nanoserve cannot do yet, the limits), logs the fields it does not know,
tokenises the prompts (a long text off the event loop), checks that each leaves room for
max_tokens in the context, and makes the request's `Completion`: a Generation per choice. It
knows no HTTP but the Request it answers; the routes and error objects are server.py's.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.llm import LLM
from nanoserve.serving import admission
from nanoserve.serving.async_engine import AsyncEngine
from nanoserve.serving.completion import Completion, choice_requests, response_unless_disconnected
from nanoserve.serving.generation import Generation
from nanoserve.serving.limits import ServerLimits
from nanoserve.serving.metrics import Metrics
from nanoserve.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from nanoserve.serving.text import TextStream

logger = logging.getLogger("nanoserve")
INLINE_TOKENIZE_CHARS = 4096  # longer texts are tokenised on a worker thread, off the event loop


class ServedModel:
    """The LLM behind the routes: its name, its tokenizer and its engine loop."""

    def __init__(self, llm: LLM, name: str, loop: AsyncEngine, limits: ServerLimits):
        self.llm, self.name, self.loop, self.limits = llm, name, loop, limits
        self.metrics = Metrics()
        self.num_starting = 0  # requests sent to the engine loop and not yet accepted by it

    def check_model(self, model: str) -> None:
        """404 unless the request names the model this server serves."""
        if model != self.name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    async def encode(self, text: str, param: str) -> list[int]:
        """Token ids of a prompt text, as `LLM.generate` makes them (no special tokens added);
        a long text is tokenised on a worker thread, so the event loop serves on meanwhile."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer; send the prompt as token ids", param=param
            )
        return await off_loop_if_long(len(text), tokenizer.encode, text, add_special_tokens=False)

    async def chat_prompt(self, body: ChatCompletionRequest) -> str:
        """The conversation through the model's chat template (off the loop when it is long)."""
        num_chars = admission.num_chars(body.conversation)
        admission.check_prompt_chars(num_chars, "messages", self.limits)
        try:
            return await off_loop_if_long(
                num_chars, self.llm.apply_chat_template, body.conversation
            )
        except Exception as err:  # no tokenizer, no template, or a template that refuses
            raise APIError(400, f"the chat template failed: {err}", param="messages") from None

    def check(self, body: SamplingFields, route: str, num_choices: int = 1) -> None:
        """Every check a parsed request passes before its prompt is tokenised (the cheap ones,
        and room in the queue, so a busy server does not tokenise what it will refuse)."""
        unknown = body.unknown_fields()
        if unknown:  # vLLM's way: served, and said once, at warning level
            logger.warning("%s: ignored the fields nanoserve does not know: %s", route, unknown)
        admission.check_text(body)
        self.check_model(body.model)
        body.check_supported()
        admission.check_stops(body.stop_strings, self.limits)
        num_queued = self.loop.stats.num_waiting + self.num_starting + num_choices - 1
        admission.check_queue(num_queued, self.limits)

    async def prompt_ids(self, body: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of a completion request (text is tokenised)."""
        prompts = body.prompts
        num_chars = sum(len(p) for p in prompts if isinstance(p, str))
        admission.check_prompt_chars(num_chars, "prompt", self.limits)
        return [
            await self.encode(p, body.prompt_param(i)) if isinstance(p, str) else p
            for i, p in enumerate(prompts)
        ]

    def completion(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        param: str,
    ) -> Completion:
        """The Completion of this request: n choices per prompt, each a Generation whose fields
        are checked and mapped to SamplingParams. max_tokens None: to the context's end (chat's
        default); `param` is the field the client set it with."""
        self.check_model(body.model)
        max_model_len = self.llm.config.max_model_len
        params = []
        for ids in prompts:
            want = max_tokens or max(1, max_model_len - len(ids))
            admission.check_context(len(ids), want, max_model_len, param)
            params.append(body.sampling_params(want))
        chat = isinstance(body, ChatCompletionRequest)
        generations = [
            Generation(
                self.loop,
                self.metrics,
                prompts[choice.prompt_index],
                choice.params,
                self.text_stream(body),
                chat,
                choice.choice_index,
                body.prompt_param(choice.prompt_index),
            )
            for choice in choice_requests(params)
        ]
        return Completion(generations, prompts, self.name, chat)

    def text_stream(self, body: SamplingFields) -> TextStream:
        """A TextStream for one choice of this request: its stop strings, its decoding."""
        return TextStream(
            self.llm.tokenizer,
            body.stop_strings,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
        )

    async def answer(self, completion: Completion, body, request: Request) -> Response:
        """Start every choice (a rejection is a 400), then stream them or send them whole."""
        num_choices = len(completion.generations)
        self.num_starting += num_choices  # counted as queued until the loop has queued them
        try:
            await completion.start()
        finally:
            self.num_starting -= num_choices
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                completion.events(include_usage), media_type="text/event-stream"
            )
        result = await response_unless_disconnected(completion, request.receive)
        return JSONResponse(result) if result is not None else Response(status_code=499)


async def off_loop_if_long(num_chars: int, function, *args, **kwargs):
    """function(*args, **kwargs), on a worker thread when its text is long (the tokenizer and
    the chat template release the event loop then; a short text is not worth the hop)."""
    if num_chars <= INLINE_TOKENIZE_CHARS:
        return function(*args, **kwargs)
    return await asyncio.to_thread(function, *args, **kwargs)
