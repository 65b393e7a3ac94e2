"""The OpenAI-compatible HTTP server: FastAPI routes over one engine loop, run by uvicorn.

Introduced in stage 10. `create_app(llm, name)` builds the app; its lifespan starts the engine loop
(`AsyncEngine`) and stops it. Routes: GET /v1/models, POST /v1/completions and
/v1/chat/completions (whole or `stream: true`), GET /health, GET /metrics. Every error is
OpenAI's error object with a 4xx status that names the field: a bad request never reaches the
engine's step, and never takes another request down with it.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanoserve.llm import LLM
from nanoserve.serving.async_engine import AsyncEngine
from nanoserve.serving.generation import Generation, response_unless_disconnected
from nanoserve.serving.metrics import Metrics
from nanoserve.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanoserve.serving.text import TextStream

MAX_BODY_BYTES = 2**20  # 1 MiB: a 4096-token prompt as ids is about 30 kB of JSON


class ServedModel:
    """The LLM behind the routes: its name, its tokenizer and its engine loop."""

    def __init__(self, llm: LLM, name: str, loop: AsyncEngine):
        self.llm, self.name, self.loop = llm, name, loop
        self.metrics = Metrics()

    def check_model(self, model: str) -> None:
        """404 unless the request names the model this server serves."""
        if model != self.name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, param: str) -> list[int]:
        """Token ids of a prompt text, as `LLM.generate` makes them (no special tokens added)."""
        if self.llm.tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer; send the prompt as token ids", param=param
            )
        return self.llm.tokenizer.encode(text, add_special_tokens=False)

    def generation(self, body, prompt_token_ids: list[int], default_max_tokens: int) -> Generation:
        """A Generation of this request, its fields checked and mapped to SamplingParams."""
        self.check_model(body.model)
        params = body.sampling_params(default_max_tokens)
        text = TextStream(self.llm.tokenizer, body.stop_strings)
        chat = isinstance(body, ChatCompletionRequest)
        return Generation(self.loop, self.metrics, self.name, prompt_token_ids, params, text, chat)

    async def answer(self, generation: Generation, body, request: Request) -> Response:
        """Start the generation (a rejection is a 400), then stream it or send it whole."""
        await generation.start()
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
    max_body_bytes: int = MAX_BODY_BYTES,
    loop: AsyncEngine | None = None,
) -> FastAPI:
    """The app serving `llm` as `model_name`; `loop` defaults to an AsyncEngine over its engine."""
    served = ServedModel(llm, model_name, loop or AsyncEngine(llm.engine))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.loop.start()
        try:
            yield
        finally:
            served.loop.shutdown()

    app = FastAPI(title="nanoserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.served = served
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    add_error_handlers(app)
    guarded = [Depends(api_key_check(api_key))] if api_key else []

    @app.get("/health")
    async def health() -> Response:
        ok = served.loop.is_running
        return JSONResponse({"status": "ok" if ok else "engine loop stopped"}, 200 if ok else 503)

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return PlainTextResponse(
            served.metrics.render(served.loop.stats), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        card = {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": "nanoserve",
            "max_model_len": llm.config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served.check_model(body.model)
        ids = served.encode(body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
        return await served.answer(served.generation(body, ids, 16), body, request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        served.check_model(body.model)
        try:
            prompt = llm.apply_chat_template(body.conversation)
        except Exception as err:  # no tokenizer, no template, or a template that refuses
            raise APIError(400, f"the chat template failed: {err}", param="messages") from None
        ids = served.encode(prompt, "messages")
        room = max(1, llm.config.max_model_len - len(ids))  # OpenAI's default: to the context end
        body.max_tokens = body.max_completion_tokens or body.max_tokens
        return await served.answer(served.generation(body, ids, room), body, request)

    return app


def api_key_check(api_key: str):
    """A dependency: 401 unless `Authorization: Bearer <api_key>` (compared in constant time)."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(
                401,
                "missing or incorrect API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )

    return check


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: APIError, validation, unknown routes, bugs."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return JSONResponse(err.body(), err.status)

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


class BodyLimit:
    """ASGI middleware: read the body whole first, and answer 413 when it is over max_bytes.

    The body is replayed to the app afterwards, and later `receive` calls (the disconnect a
    handler waits for) go to the server as usual.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self.too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await self.app(scope, replay, send)

    async def too_large(self, scope, receive, send):
        message = f"the request body is over the server's limit of {self.max_bytes} bytes"
        await api_response(413, message)(scope, receive, send)


def run_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Serve `app` with uvicorn until interrupted (Ctrl-C stops it cleanly)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
