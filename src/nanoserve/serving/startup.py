"""What `nanoserve serve` settles before it listens: the API key, the limits, who can reach it.

Introduced with stage 10's server. A key on the command line is visible to every local user in
`ps`, so it may also come from $NANOSERVE_API_KEY or a file (`--api-key-file`, first line); an
empty key would silently mean "no key", so it is refused. A server bound beyond the loopback
without a key is anyone's GPU: it starts, with a warning nobody can miss. Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from nanoserve.serving.limits import LIMIT_FLAGS, ServerLimits

API_KEY_ENV = "NANOSERVE_API_KEY"


def api_key_from(flag: str | None, file: str | None, environ=os.environ) -> str | None:
    """The key from --api-key, --api-key-file or $NANOSERVE_API_KEY (at most one of them), or
    None; ValueError naming the source for an empty key, two sources or an unreadable file."""
    given = {"--api-key": flag, "--api-key-file": file, f"${API_KEY_ENV}": environ.get(API_KEY_ENV)}
    sources = [name for name, value in given.items() if value is not None]
    if len(sources) > 1:
        raise ValueError(f"the API key is given twice ({' and '.join(sources)}): give one")
    if not sources:
        return None
    (source,) = sources
    if source == "--api-key-file":
        assert file is not None  # it is the one source given
        try:
            lines = Path(file).read_text().splitlines()
        except OSError as err:
            raise ValueError(f"argument --api-key-file: cannot read {file!r}: {err}") from None
        key = lines[0].strip() if lines else ""
    else:
        key = given[source] or ""
    if not key:
        what = "argument " + source if source.startswith("--") else source
        raise ValueError(f"{what}: the API key is empty, which would let anyone in")
    return key


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server any machine on the network may use, or None."""
    if api_key is not None or is_loopback(host):
        return None
    bar = "!" * 78
    return (
        f"{bar}\nWARNING: nanoserve serve listens on {host} with no API key: anyone who can reach "
        f"this\nmachine can use the model. Set ${API_KEY_ENV} or --api-key-file, or bind to "
        f"127.0.0.1.\n{bar}"
    )


def limits_from(args) -> ServerLimits:
    """ServerLimits from the serve command's flags (ValueError names a bad one)."""
    return ServerLimits(**{field: getattr(args, field) for field in LIMIT_FLAGS})
