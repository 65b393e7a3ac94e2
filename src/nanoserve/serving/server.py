"""The OpenAI-compatible HTTP server: FastAPI routes over one engine loop, run by uvicorn.

Introduced in stage 10. `create_app(llm, name)` builds the app; its lifespan starts the engine loop
(`AsyncEngine`) and stops it. Routes: GET /v1/models, POST /v1/completions and
/v1/chat/completions (whole or `stream: true`), GET /health, GET /metrics. Every error is
OpenAI's error object with a 4xx status that names the field: a bad request never reaches the
engine's step, and never takes another request down with it. What a request passes on its way in
(key, sockets, body) is connections.py's, what it must pass before it is queued admission.py's;
`run_server` stops like a production server: every stream ends with "abort" and [DONE], at once.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanoserve.llm import LLM
from nanoserve.serving import admission
from nanoserve.serving.async_engine import AsyncEngine
from nanoserve.serving.connections import APIKeyGuard, BodyReader, guarded_protocol
from nanoserve.serving.generation import Generation, response_unless_disconnected
from nanoserve.serving.limits import ServerLimits
from nanoserve.serving.metrics import CONTENT_TYPE, Metrics
from nanoserve.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanoserve.serving.text import TextStream

INLINE_TOKENIZE_CHARS = 4096  # longer texts are tokenised on a worker thread, off the event loop
SHUTDOWN_GRACE_S = 2  # after every generation is aborted: time for the last bytes to go out


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

    def check(self, body) -> None:
        """Every check a parsed request passes before its prompt is tokenised (the cheap ones,
        and room in the queue, so a busy server does not tokenise what it will refuse)."""
        admission.check_text(body)
        self.check_model(body.model)
        admission.check_stops(body.stop_strings, self.limits)
        admission.check_queue(self.loop.stats.num_waiting + self.num_starting, self.limits)

    def generation(self, body, prompt_token_ids: list[int], default_max_tokens: int) -> Generation:
        """A Generation of this request, its fields checked and mapped to SamplingParams."""
        self.check_model(body.model)
        params = body.sampling_params(default_max_tokens)
        text = TextStream(self.llm.tokenizer, body.stop_strings)
        chat = isinstance(body, ChatCompletionRequest)
        return Generation(self.loop, self.metrics, self.name, prompt_token_ids, params, text, chat)

    async def answer(self, generation: Generation, body, request: Request) -> Response:
        """Start the generation (a rejection is a 400), then stream it or send it whole."""
        self.num_starting += 1  # counted as queued until the loop has queued it
        try:
            await generation.start()
        finally:
            self.num_starting -= 1
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                generation.events(include_usage), media_type="text/event-stream"
            )
        result = await response_unless_disconnected(generation, request.receive)
        return JSONResponse(result) if result is not None else Response(status_code=499)


def create_app(
    llm: LLM,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    loop: AsyncEngine | None = None,
) -> FastAPI:
    """The app serving `llm` as `model_name`; `loop` defaults to an AsyncEngine over its engine.
    With `api_key`, every route but /health (the OpenAPI schema too) needs it; "" is refused."""
    if api_key is not None and not api_key:
        raise ValueError("an empty API key would let anyone in; give a key, or None for no key")
    limits = limits or ServerLimits()
    served = ServedModel(llm, model_name, loop or AsyncEngine(llm.engine), limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.loop.start()
        try:
            yield
        finally:  # joining the engine blocks: not on the event loop
            await asyncio.to_thread(served.loop.shutdown)

    app = FastAPI(title="nanoserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.served = served
    app.add_middleware(BodyReader, limits=limits)
    if api_key is not None:  # added last: the outermost, so it runs before the body is read
        app.add_middleware(APIKeyGuard, api_key=api_key)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        ok = served.loop.is_running
        return JSONResponse({"status": "ok" if ok else "engine loop stopped"}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(served.metrics.render(served.loop.stats), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": "nanoserve",
            "max_model_len": llm.config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served.check(body)
        if isinstance(body.prompt, str):
            admission.check_prompt_chars(len(body.prompt), "prompt", limits)
            ids = await served.encode(body.prompt, "prompt")
        else:
            ids = body.prompt
        return await served.answer(served.generation(body, ids, 16), body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        served.check(body)
        ids = await served.encode(await served.chat_prompt(body), "messages")
        room = max(1, llm.config.max_model_len - len(ids))  # OpenAI's default: to the context end
        body.max_tokens = body.max_completion_tokens or body.max_tokens
        return await served.answer(served.generation(body, ids, room), body, request)

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: APIError, validation, unknown routes, bugs."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            return api_response(400, f"the body is not valid JSON: {first['msg']}")
        path = [str(part) for part in first["loc"] if part != "body"]
        param = ".".join(path) or None
        return api_response(400, f"{param or 'body'}: {first['msg']}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return api_response(err.status_code, str(err.detail), type=kind)

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> Response:
        # a bug of ours (no bad request ends here): an error object that says what it was
        return api_response(500, f"{type(err).__name__}: {err}", type="server_error")


def api_response(
    status: int, message: str, param: str | None = None, type: str = "invalid_request_error"
) -> Response:
    """An APIError as a JSON response."""
    return JSONResponse(APIError(status, message, param, type).body(), status)


async def off_loop_if_long(num_chars: int, function, *args, **kwargs):
    """function(*args, **kwargs), on a worker thread when its text is long (the tokenizer and
    the chat template release the event loop then; a short text is not worth the hop)."""
    if num_chars <= INLINE_TOKENIZE_CHARS:
        return function(*args, **kwargs)
    return await asyncio.to_thread(function, *args, **kwargs)


class Server(uvicorn.Server):
    """uvicorn's server, which ends every generation before it waits for the connections.

    uvicorn stops (SIGINT, SIGTERM, `should_exit`) by closing its sockets, then waiting up to
    its grace period for the responses in flight: a stream runs until its request finishes, so
    it waited out the whole period, and the stream ended without a finish reason. Here the engine
    loop is told to stop first: every request ends with "abort", every stream with its last
    chunk and [DONE], and the wait is over as soon as the bytes are out.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.served: ServedModel = app.state.served

    async def shutdown(self, sockets=None) -> None:
        self.served.loop.request_stop()  # no wait: the lifespan joins the loop at the end
        await super().shutdown(sockets)


def make_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> Server:
    """A Server for `app` with its limits on every socket (port 0: any free port)."""
    limits = app.state.served.limits
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return Server(config, app)


def run_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Serve `app` until SIGINT or SIGTERM: every stream ends with "abort", then it returns."""
    make_server(app, host, port, log_level).run()
