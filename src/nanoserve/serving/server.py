"""The OpenAI-compatible HTTP server: FastAPI routes over one engine loop, run by uvicorn.

Introduced in stage 10. `create_app(llm, name)` builds the app; its lifespan starts the engine loop
(`AsyncEngine`) and stops it. Routes: GET /v1/models, POST /v1/completions and
/v1/chat/completions (whole or `stream: true`), GET /health, GET /metrics. Every error is
OpenAI's error object with a 4xx status that names the field: a bad request never reaches the
engine's step, and never takes another request down with it. What a request passes on its way in
(key, sockets, body) is connections.py's, what it must pass before it is queued admission.py's
and served_model.py's;
`run_server` stops like a production server: every stream ends with "abort" and [DONE], at once.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from nanoserve.llm import LLM
from nanoserve.serving import admission
from nanoserve.serving.async_engine import AsyncEngine
from nanoserve.serving.connections import APIKeyGuard, BodyReader, guarded_protocol
from nanoserve.serving.limits import ServerLimits
from nanoserve.serving.metrics import CONTENT_TYPE
from nanoserve.serving.openai_fields import client_param
from nanoserve.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanoserve.serving.served_model import ServedModel

SHUTDOWN_GRACE_S = 2  # after every generation is aborted: time for the last bytes to go out


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
        served.check(body, "/v1/completions", len(body.prompts) * body.n)
        prompts = await served.prompt_ids(body)
        completion = served.completion(body, prompts, body.max_tokens, "max_tokens")
        return await served.answer(completion, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        served.check(body, "/v1/chat/completions", body.n)
        ids = await served.encode(await served.chat_prompt(body), "messages")
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:  # None: OpenAI's default, to the context's end
            max_tokens, param = body.max_tokens, "max_tokens"
        completion = served.completion(body, [ids], max_tokens, param)
        return await served.answer(completion, body, request)

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: APIError, validation, unknown routes, bugs."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        errors = err.errors()
        if errors[0]["type"] == "json_invalid":
            return api_response(400, f"the body is not valid JSON: {errors[0]['msg']}")
        params = [client_param(e["loc"][1:], err.body, e["type"]) for e in errors]
        # a union tried several branches: the error deepest in the body is the one meant
        _, index = max((len(p or ""), -i) for i, p in enumerate(params))
        param, error = params[-index], errors[-index]
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "string_unicode":  # a lone surrogate, where a str is checked
            message = admission.NOT_UNICODE
        return api_response(400, f"{param or 'body'}: {message}", param)

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
