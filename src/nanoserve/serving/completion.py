"""One HTTP request's answer: its choices' generations, sent whole or as one event stream.

Introduced in stage 10. /v1/completions takes a batch of prompts, and each prompt gets `n`
choices: choice i * n + j is prompt i's j-th, each its own request in the engine
(`choice_requests`). Every choice is started at once; if the engine rejects one, the others are
aborted and the request is a 400 naming that prompt (`prompt[2]`). A stream carries each choice's
chunks as they come, then the usage of them all, then `data: [DONE]`; a client that hangs up
aborts every choice.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

from nanoserve.sampling import SamplingParams, child_params
from nanoserve.serving import responses
from nanoserve.serving.engine_thread import EngineError
from nanoserve.serving.generation import Generation
from nanoserve.serving.protocol import APIError


class ChoiceRequest(NamedTuple):
    """What one choice asks the engine for."""

    choice_index: int  # its index in the response
    prompt_index: int
    params: SamplingParams


def choice_requests(params: list[SamplingParams]) -> list[ChoiceRequest]:
    """Each prompt's params.n choices (`params` has one per prompt), numbered prompt * n + j
    (vLLM's order), with the params `LLM.generate` gives them (`child_params`): a seeded
    request's choices draw from seeds derived from its own, so they differ and repeat."""
    return [
        ChoiceRequest(i * prompt_params.n + j, i, child)
        for i, prompt_params in enumerate(params)
        for j, child in enumerate(child_params(prompt_params))
    ]


def sse(data: dict | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class Completion:
    """A request's generations, one per choice; `prompts` are the token ids of each prompt."""

    def __init__(
        self, generations: list[Generation], prompts: list[list[int]], model: str, chat: bool
    ):
        self.generations, self.prompts, self.model = generations, prompts, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.kind = "chat.completion" if chat else "text_completion"
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    async def start(self) -> None:
        """Queue every choice; if one is rejected, abort the rest and raise its APIError."""
        started = await asyncio.gather(
            *(g.start() for g in self.generations), return_exceptions=True
        )
        errors = [e for e in started if isinstance(e, BaseException)]
        if errors:
            await asyncio.gather(*(g.close() for g in self.generations))
            raise errors[0]

    async def response(self) -> dict:
        """The whole response, once every choice is done."""
        tasks = [asyncio.ensure_future(g.choice()) for g in self.generations]
        try:
            choices = await asyncio.gather(*tasks)
        except BaseException:  # one failed, or the client left: abort the others too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return {**self._envelope(list(choices)), "usage": self.usage()}

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """The response as server-sent events, one chunk per choice's delta, then [DONE]."""
        if len(self.generations) == 1:
            chunk_choices = self.generations[0].chunk_choices()
        else:
            chunk_choices = merged([g.chunk_choices() for g in self.generations])
        try:
            async for choice in chunk_choices:
                yield sse(self._envelope([choice], self.chunk_kind))
        except EngineError as err:  # the headers are sent: the error becomes an event
            yield sse(APIError(500, str(err), type="server_error").body())
        if include_usage:
            yield sse({**self._envelope([], self.chunk_kind), "usage": self.usage()})
        yield sse("[DONE]")

    def usage(self) -> dict:
        """OpenAI's usage object: every prompt once, every choice's tokens."""
        num_prompt_tokens = sum(len(ids) for ids in self.prompts)
        return responses.usage(num_prompt_tokens, sum(g.num_tokens for g in self.generations))

    def _envelope(self, choices: list[dict], kind: str | None = None) -> dict:
        return responses.envelope(self.id, self.model, kind or self.kind, choices)


async def merged(iterators: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators in the order they come. Closing it (a client that
    hung up) cancels every iterator's task; an iterator's exception is raised here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                await queue.put((item, None))
            await queue.put((None, None))  # this one is done
        except Exception as err:
            await queue.put((None, err))

    tasks = [asyncio.ensure_future(pump(iterator)) for iterator in iterators]
    try:
        num_running = len(tasks)
        while num_running:
            item, err = await queue.get()
            if err is not None:
                raise err
            if item is None:
                num_running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(receive) -> None:
    """Return when the client hangs up (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def response_unless_disconnected(completion: Completion, receive) -> dict | None:
    """The whole response, or None when the client hung up first (every choice is aborted)."""
    work = asyncio.ensure_future(completion.response())
    watch = asyncio.ensure_future(until_disconnected(receive))
    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if work.done():
        return work.result()
    work.cancel()  # CancelledError inside the loop's generators: they abort the requests
    await asyncio.gather(work, return_exceptions=True)
    return None
