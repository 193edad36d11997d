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

import errno
import hmac
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from reachy_memory.errors import ConfigError

TOKEN_FILE = "mcp-http.token"  # in the private runtime directory, beside the daemon's socket
MIN_TOKEN_CHARS = 16

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def http_token(path: Path, *, what: str = "MCP HTTP", key: str = "mcp") -> str:
    """The token HTTP clients must send: read from ``path``, or a fresh random one written
    there (0600, fsynced) when the file does not exist.  Raises ConfigError for a file
    that is not a regular file, that another user owns or others can read, or that holds
    no token; ``what`` names the server in its message (``reachy-memory web`` says "web
    page"), ``key`` is its ConfigError's key."""
    token = _read_token(path, what, key)
    if token is not None:
        return token
    # Written whole under a scratch name, then linked into place (never replacing a file): a
    # second server starting meanwhile reads the first one's whole token, never an empty file.
    token = secrets.token_urlsafe(32)
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    try:
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(token + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.link(scratch, path)
        finally:
            scratch.unlink(missing_ok=True)
    except FileExistsError:
        token = _read_token(path, what, key)  # another server made it first
        if token is None:
            raise ConfigError(f"the {what} token file {path} came and went: start again", key=key) from None
        return token
    except OSError as exc:
        raise ConfigError(f"cannot create the {what} token file {path}: {exc.strerror}", key=key) from exc
    return token


MAX_TOKEN_FILE_BYTES = 4096


def _read_token(path: Path, what: str = "MCP HTTP", key: str = "mcp") -> str | None:
    """The token in ``path``, None if there is no such file; checked on the file actually
    opened (no symlink followed, a FIFO never waited on), not on the name."""
    not_regular = ConfigError(f"the {what} token file {path} is not a regular file", key=key)
    try:
        if not stat.S_ISREG(path.lstat().st_mode):  # never open a device, FIFO or symlink
            raise not_regular
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a symlink since
            raise not_regular from exc
        raise ConfigError(f"cannot read the {what} token file {path}: {exc}", key=key) from exc
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise not_regular
        if info.st_uid != os.geteuid():  # its owner chose the token (root reads any 0600 file)
            raise ConfigError(f"the {what} token file {path} belongs to another user (uid {info.st_uid}), who "
                              "knows the token: use a file of your own", key=key)
        if info.st_mode & 0o077:
            raise ConfigError(f"the {what} token file {path} can be read by other users (mode "
                              f"{stat.S_IMODE(info.st_mode):o}): chmod 600 it, or delete it for a new token",
                              key=key)
        try:
            data = fh.read(MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read the {what} token file {path}: {exc}", key=key) from exc
    text = data.decode("ascii", "replace").strip() if len(data) <= MAX_TOKEN_FILE_BYTES else ""
    if len(text) < MIN_TOKEN_CHARS or not text.isprintable() or any(c.isspace() for c in text) or "\ufffd" in text:
        raise ConfigError(f"the {what} token file {path} holds no token (one word of at least "
                          f"{MIN_TOKEN_CHARS} characters): delete it for a new one", key=key)
    return text


class BearerAuth:
    """ASGI middleware: an HTTP request without ``Authorization: Bearer <token>`` is answered
    401 and never reaches ``app``, a websocket is refused (403) whatever it carries; only
    the lifespan passes through untouched.  The scheme is case-insensitive (RFC 9110),
    the token compared in constant time."""

    def __init__(self, app: App, token: str) -> None:
        self._app = app
        self._token = token.encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (scope["type"] == "http" and self._allowed(scope)):
            await self._app(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body",
                        "body": b'{"error": "send Authorization: Bearer <the token in the server\'s token file>"}'})
        elif scope["type"] == "websocket":  # streamable HTTP has none; closing before accepting answers 403
            await send({"type": "websocket.close", "code": 1008})

    def _allowed(self, scope: Scope) -> bool:
        given = [value for name, value in scope.get("headers") or () if name.lower() == b"authorization"]
        if len(given) != 1:
            return False
        scheme, _, token = given[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(b" \t"), self._token)
