"""How much one server takes on: connections, slow clients, big requests, a long queue.

Introduced with stage 10's server. `ServerLimits` is the one frozen record of every limit, with
the defaults `nanoserve serve` uses and the flags that change them; connections.py enforces the
ones about sockets (connections, header and body timeouts, body size), server.py the ones about
requests (prompt characters, stop strings, queued requests). It imports nothing but the
standard library, so the command's parser can show the defaults without loading a web stack.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerLimits:
    """Every limit of one server; `None` turns a limit off."""

    max_body_bytes: int = 2**20  # 413 above: a 4096-token prompt as ids is about 30 kB of JSON
    max_connections: int | None = 1024  # open sockets; one more is answered 503 and closed
    header_timeout_s: float | None = 10.0  # from connecting (or the last response) to the headers
    body_timeout_s: float | None = 30.0  # from the headers to the body's last byte
    max_prompt_chars: int | None = 262_144  # text to tokenise, before it is tokenised
    max_stop_strings: int | None = 16  # OpenAI takes 4
    max_stop_chars: int | None = 256  # the length of one stop string
    max_queued_requests: int | None = 1024  # waiting for the engine; one more is 503 + Retry-After
    retry_after_s: int = 1  # what a 503 for a full queue or too many connections suggests

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None and not value > 0:  # also refuses nan
                raise ValueError(f"ServerLimits.{field.name} = {value!r} is invalid; expected > 0")


# field -> its flag's help; cli_parser adds one flag per field, spelt by `limit_flag`
LIMIT_FLAGS: dict[str, str] = {
    "max_body_bytes": "a request body over this many bytes is answered 413",
    "max_connections": "open connections at most; one more is answered 503 and closed",
    "header_timeout_s": "seconds a connection may take to send a request's headers (408)",
    "body_timeout_s": "seconds a request may take to send its body once its headers are in (408)",
    "max_prompt_chars": "characters of prompt text (or chat messages) at most, before tokenising",
    "max_stop_strings": "stop strings per request at most",
    "max_stop_chars": "characters of one stop string at most",
    "max_queued_requests": "requests waiting for the engine at most; one more is answered 503",
}


def limit_flag(field: str) -> str:
    """`header_timeout_s` -> `--header-timeout`, `max_stop_chars` -> `--max-stop-chars`."""
    return "--" + field.removesuffix("_s").replace("_", "-")
