"""What reaches the routes: the key is checked, sockets are counted and timed, bodies are capped.

Introduced with stage 10's server. Three guards, outermost first, each cheap and each before any
work a stranger could make the server do:

    socket  --> GuardedH11Protocol: over max_connections -> 503, closed;
                headers not in within header_timeout_s -> 408, closed
    headers --> APIKeyGuard: wrong or missing key -> 401, the body never read
    body    --> BodyReader: over max_body_bytes -> 413; not in within body_timeout_s -> 408
    routes  (the body replayed to them whole)

uvicorn has no header or body timeout (a socket that never sends a byte stays open) and counts
its concurrency limit per request, not per socket; GuardedH11Protocol adds both to uvicorn's h11
protocol. It does not parse JSON or look at what a request asks for: server.py does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math

from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve.serving.limits import ServerLimits

OPEN_PATHS = ("/health",)  # what a load balancer probes: no key needed


def error_body(status: int, message: str, type: str = "invalid_request_error", code=None) -> bytes:
    """OpenAI's error object as bytes (protocol.APIError's shape, without pydantic)."""
    error = {"message": message, "type": type, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


async def send_error(send, status: int, body: bytes, headers=()) -> None:
    """An error response that also closes the connection (a body may be left unread)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class APIKeyGuard:
    """ASGI middleware: 401 unless `Authorization: Bearer <key>`, on every path but /health.

    It looks at the headers only, so a request without the key costs the server no body read,
    no JSON parse and no validation; /openapi.json is behind the key like every route.
    """

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("an empty API key would let anyone in; give a key or none")
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):  # constant time: no timing oracle
            return await self.app(scope, receive, send)
        message = "missing or incorrect API key (Authorization: Bearer <key>)"
        body = error_body(401, message, code="invalid_api_key")
        await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])


class BodyReader:
    """ASGI middleware: read the body whole first; 413 over max_body_bytes, 408 when it takes
    longer than body_timeout_s. The body is replayed to the app afterwards, and later `receive`
    calls (the disconnect a handler waits for) go to the server as usual."""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.timeout_s = app, limits.body_timeout_s
        self.max_bytes = limits.max_body_bytes or math.inf  # None: no limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.too_large(send)
        try:
            body = await asyncio.wait_for(self.read(receive), self.timeout_s)
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout_s:g} s"
            return await send_error(send, 408, error_body(408, message))
        if body is None:  # the client left before sending it all
            return None
        if len(body) > self.max_bytes:
            return await self.too_large(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def read(self, receive) -> bytes | None:
        """The whole body, or None if the client left; stops one chunk past max_bytes."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes or not message.get("more_body", False):
                return b"".join(chunks)

    async def too_large(self, send):
        message = f"the request body is over the server's limit of {self.max_bytes} bytes"
        await send_error(send, 413, error_body(413, message))


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the socket limits of `limits`, as a class for `http=`."""

    class Guarded(GuardedH11Protocol):
        max_connections, header_timeout_s = limits.max_connections, limits.header_timeout_s
        retry_after_s = limits.retry_after_s

    return Guarded


class GuardedH11Protocol(H11Protocol):
    """One connection: refused when there are too many, closed when its headers are too slow.

    The header clock starts when the socket opens and again after every response (unless a
    request pipelined behind it has started), and stops when a request's headers are complete
    (uvicorn then starts a request cycle); the body's clock is BodyReader's. A request that is
    running is never timed out here.
    """

    max_connections: int | None = None
    header_timeout_s: float | None = None
    retry_after_s: int = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            message = f"the server has {self.max_connections} connections open; try again later"
            self.refuse(503, message, f"retry-after: {self.retry_after_s}\r\n")
            return
        self.start_header_clock()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are in: its cycle started
            self.stop_header_clock()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # starts a request pipelined behind this one, if any
        if self.cycle is cycle and not self.transport.is_closing():
            self.start_header_clock()  # the next request's headers, on a kept-alive socket

    def connection_lost(self, exc) -> None:
        self.stop_header_clock()
        super().connection_lost(exc)

    def start_header_clock(self) -> None:
        self.stop_header_clock()
        if self.header_timeout_s is not None:
            self.header_timer = self.loop.call_later(self.header_timeout_s, self.headers_too_slow)

    def stop_header_clock(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def headers_too_slow(self) -> None:
        self.header_timer = None
        message = f"no complete request headers within {self.header_timeout_s:g} s"
        self.refuse(408, message)

    def refuse(self, status: int, message: str, extra_headers: str = "") -> None:
        """Answer outside any request cycle (h11 has none yet), then close the socket."""
        if self.transport.is_closing():
            return
        body = error_body(status, message, "server_error" if status == 503 else "timeout")
        reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{extra_headers}\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()
