"""What `nanoserve serve` settles before it listens: the API key, the limits, who can reach it.

Introduced with stage 10's server. A key on the command line is visible to every local user in
`ps`, so it may also come from $NANOSERVE_API_KEY or a file (`--api-key-file`, first line); an
empty key would silently mean "no key", so it is refused. A server bound beyond the loopback
without a key is anyone's GPU: it starts, with a warning nobody can miss. Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
import resource
from pathlib import Path

from nanoserve.serving.limits import LIMIT_FLAGS, ServerLimits

API_KEY_ENV = "NANOSERVE_API_KEY"
SPARE_FILES = 64  # files a server keeps open besides its sockets: pipes, logs, the model


def api_key_from(flag: str | None, file: str | None, environ=os.environ) -> str | None:
    """The key from --api-key or --api-key-file (not both), else $NANOSERVE_API_KEY, else None;
    ValueError naming the source for an empty key, both flags or an unreadable file."""
    if flag is not None and file is not None:
        raise ValueError("argument --api-key-file: the API key is given twice (and --api-key)")
    given = {"--api-key": flag, "--api-key-file": file, f"${API_KEY_ENV}": environ.get(API_KEY_ENV)}
    sources = [name for name, value in given.items() if value is not None]
    if not sources:
        return None
    source = sources[0]  # a flag before the environment, as a command line overrides it
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


def open_files_for(limits: ServerLimits) -> str | None:
    """Raise this process's open-file limit to fit max_connections sockets (a shell's default
    soft limit is often 1024, which would fail accept() before the connection limit is reached);
    a warning if the hard limit does not allow it, else None."""
    if limits.max_connections is None:
        return None
    needed = limits.max_connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    if hard != resource.RLIM_INFINITY and hard < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return (
            f"warning: --max-connections {limits.max_connections} needs {needed} open files; "
            f"this process may open {hard} (ulimit -n)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return None
