"""A bearer token for ``reachy-memory mcp --http``.

Loopback is not private: every local user, and any page a browser on the robot
opens, can reach a port on 127.0.0.1 (the SDK's own Host/Origin check stops only
the browser's DNS-rebinding route).  The daemon's ipc socket is 0600 for that
reason; the HTTP endpoint gets the same reach with a token only its owner can
read: a file made 0600 in the private runtime directory, holding a random token
(:func:`http_token`), which :class:`BearerAuth` requires of every HTTP request
(``Authorization: Bearer <token>``; 401 otherwise, compared in constant time).
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from .errors import ConfigError

TOKEN_FILE = "mcp-http.token"  # in the private runtime directory, beside the daemon's socket
MIN_TOKEN_CHARS = 16

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def http_token(path: Path) -> str:
    """The token HTTP clients must send: read from ``path``, or a fresh random one written
    there (0600, fsynced) when the file does not exist.  Raises ConfigError for a file
    that is not a regular file, that other users can read, or that holds no token."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_token(path)
    except OSError as exc:
        raise ConfigError(f"cannot create the MCP HTTP token file {path}: {exc.strerror}", key="mcp") from exc
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(token + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return token


def _read_token(path: Path) -> str:
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read; a symlink could point anywhere
            raise ConfigError(f"the MCP HTTP token file {path} is not a regular file", key="mcp")
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the MCP HTTP token file {path}: {exc}", key="mcp") from exc
    if info.st_mode & 0o077:
        raise ConfigError(f"the MCP HTTP token file {path} can be read by other users (mode "
                          f"{stat.S_IMODE(info.st_mode):o}): chmod 600 it, or delete it for a new token", key="mcp")
    if len(text) < MIN_TOKEN_CHARS or not text.isprintable() or any(c.isspace() for c in text):
        raise ConfigError(f"the MCP HTTP token file {path} holds no token (one word of at least "
                          f"{MIN_TOKEN_CHARS} characters): delete it for a new one", key="mcp")
    return text


class BearerAuth:
    """ASGI middleware: an HTTP request without ``Authorization: Bearer <token>`` is answered
    401 and never reaches ``app``; other scopes (the lifespan) pass through."""

    def __init__(self, app: App, token: str) -> None:
        self._app = app
        self._expected = f"Bearer {token}".encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._allowed(scope):
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body",
                        "body": b'{"error": "send Authorization: Bearer <the token in the server\'s token file>"}'})
            return
        await self._app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = [value for name, value in scope.get("headers") or () if name.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected)
