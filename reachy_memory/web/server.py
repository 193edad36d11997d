"""``reachy-memory web``: the household's page, on the standard library's HTTP server.

What it promises (``docs/WEB.md`` is the user's guide):

* It listens on 127.0.0.1 unless ``--host`` names another address (the LAN: plain
  HTTP, said at start).  On loopback a request whose ``Host`` is not this server's
  (127.0.0.1, localhost or [::1] with its port) is refused: a page on another site
  cannot reach it through a DNS name it rebinds to 127.0.0.1.
* Nothing of the memory is served without the login: the token (a 0600 file, made
  with a random token when missing; :func:`~reachy_memory.daemon.http_auth.http_token`)
  is given once, in the link printed at start (``/?token=...``).  Opening it sets a
  cookie (``HttpOnly``, ``SameSite=Strict``, derived from the token: deleting the token
  file logs every browser out) and sends the browser on to ``/``, the token gone from
  its address bar.  Without the cookie ``/`` shows how to log in, and ``/api/*`` answers 401.
* Every change is a ``POST`` of JSON carrying the page's CSRF token in the
  ``X-CSRF-Token`` header (derived from the token, put into the page), from the page's own
  origin (``Origin`` and ``Sec-Fetch-Site``, when the browser sends them, must say so),
  with the session cookie, which the browser sends from this site only.
* Limits: a request body of at most :data:`MAX_BODY` bytes (413 beyond), a search of
  at most :data:`MAX_QUERY_CHARS` characters, :data:`MAX_CONNECTIONS` requests at once
  (more are closed unanswered), :data:`SOCKET_TIMEOUT` seconds for a slow client.
  Bad input is answered 400 with ``{"error": "..."}`` naming what was wrong.
* Responses are never cached (``no-store``), never framed, never sent with a
  ``Referer`` to elsewhere; a strict Content-Security-Policy allows only this server's
  own script and style (the assets ship in the package: no CDN).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from datetime import datetime, tzinfo
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import parse_qs, urlsplit

from reachy_memory.config import Config
from reachy_memory.daemon.endpoint import prepare_ipc_dir, runtime_dir
from reachy_memory.daemon.http_auth import http_token
from reachy_memory.errors import (
    ConfigError,
    NotFoundError,
    ReachyMemoryError,
    ServiceError,
    StorageError,
    TooLargeError,
    ValidationError,
)
from reachy_memory.model import resolve_timezone
from reachy_memory.storage.export import person_entries
from reachy_memory.web import view
from reachy_memory.web.backend import WebBackend, now, open_backend

__all__ = ["DEFAULT_PORT", "MAX_BODY", "TOKEN_FILE", "HouseholdServer", "login_url", "make_server", "run"]

log = logging.getLogger("reachy_memory.web")

DEFAULT_PORT = 8767  # 8765: the MCP command and the conversation app; 8766: the MCP unit
TOKEN_FILE = "web.token"  # in the private runtime directory, unless --token-file
MAX_BODY = 16 * 1024  # bytes of a POST body
MAX_QUERY_CHARS = 500  # characters of a search
MAX_ID_CHARS = 256
MAX_PAUSE_MINUTES = 7 * 24 * 60
SEARCH_LIMIT = 30
MAX_CONNECTIONS = 16
SOCKET_TIMEOUT = 15.0
SESSION_SECONDS = 30 * 86400  # how long a browser stays logged in
ASSETS = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8",
          "icon.svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def _derive(token: str, purpose: str) -> str:
    return hmac.new(token.encode(), f"reachy-memory web {purpose}".encode(), hashlib.sha256).hexdigest()


class _Auth:
    """The login token and what is derived from it: the session cookie's value and the CSRF token."""

    def __init__(self, token: str, port: int) -> None:
        self._token = token.encode()
        self.session = _derive(token, "session")
        self.csrf = _derive(token, "csrf")
        self.cookie = f"reachy_memory_{port}"  # per port: two servers on one host keep their own

    def token_ok(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._token)

    def cookie_ok(self, header: str | None) -> bool:
        if not header:
            return False
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(header)
        except CookieError:
            return False
        morsel = jar.get(self.cookie)
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), self.session.encode())

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())


class _HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HouseholdServer(ThreadingHTTPServer):
    """The page's server: ``backend`` answers, ``token`` logs in; times shown in ``tz``.
    ``serve_forever`` serves until ``shutdown``; ``server_close`` releases the port
    (the backend is the caller's to close)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], backend: WebBackend, token: str, tz: tzinfo) -> None:
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__(address, _Handler)
        self.backend = backend
        self.tz = tz
        self.port = int(self.server_address[1])
        self.auth = _Auth(token, self.port)
        self.loopback = _is_loopback(host)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve on a thread of its own, unless :data:`MAX_CONNECTIONS` are being served:
        then the connection is closed unanswered (a flood cannot make threads without end)."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def allowed_hosts(self) -> set[str]:
        """The ``Host`` values a loopback server answers."""
        return {f"127.0.0.1:{self.port}", f"localhost:{self.port}", f"[::1]:{self.port}"}


class _Handler(BaseHTTPRequestHandler):
    server: HouseholdServer
    timeout = SOCKET_TIMEOUT

    def version_string(self) -> str:
        return "reachy-memory"  # no Python version for a visitor to read

    # -- plumbing ---------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        """To the logger at debug level, the query string left out (the login link holds the token)."""
        log.debug("%s %s", self.address_string(), (format % args).split("?", 1)[0])

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {**SECURITY_HEADERS, **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(data, ensure_ascii=False).encode(), "application/json; charset=utf-8")

    def _error(self, status: HTTPStatus, message: str) -> None:
        if self.path.startswith("/api/"):
            self._json({"error": message}, status)
        else:
            self._send(status, _page("Reachy's memory", message), "text/html; charset=utf-8")

    def _guarded(self, handle: Callable[[], None]) -> None:
        try:
            self._check_host()
            handle()
        except _HttpError as exc:
            self._error(exc.status, exc.message)
        except ReachyMemoryError as exc:
            self._error(_status_of(exc), exc.message)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception:
            log.exception("the household page failed on %s %s", self.command, self.path.split("?", 1)[0])
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the server's log)")

    def _check_host(self) -> None:
        if self.server.loopback and self.headers.get("Host", "") not in self.server.allowed_hosts():
            raise _HttpError(HTTPStatus.MISDIRECTED_REQUEST,
                             f"this server answers http://127.0.0.1:{self.server.port}/ only")

    def _logged_in(self) -> bool:
        return self.server.auth.cookie_ok(self.headers.get("Cookie"))

    def _require_login(self) -> None:
        if not self._logged_in():
            raise _HttpError(HTTPStatus.UNAUTHORIZED, "not logged in: open the link `reachy-memory web` printed")

    # -- GET --------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_HEAD(self) -> None:
        self._guarded(self._get)

    def _get(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True, max_num_fields=10)
        if url.path == "/":
            self._index(query)
        elif url.path.startswith("/static/"):
            self._asset(url.path.removeprefix("/static/"))
        elif url.path == "/favicon.ico":
            self._asset("icon.svg")
        elif url.path == "/api/overview":
            self._require_login()
            self._json(self._overview())
        elif url.path == "/api/search":
            self._require_login()
            self._json(self._search(_one(query, "q")))
        elif url.path == "/api/person":
            self._require_login()
            self._json(self._about(_one(query, "id")))
        elif url.path == "/api/export":
            self._require_login()
            self._export()
        else:
            raise _HttpError(HTTPStatus.NOT_FOUND, "no such page")

    def _index(self, query: dict[str, list[str]]) -> None:
        if "token" in query:
            self._login(_one(query, "token"))
        elif self._logged_in():
            html = _asset_text("index.html").replace("{{csrf}}", self.server.auth.csrf)
            self._send(HTTPStatus.OK, html.encode(), "text/html; charset=utf-8")
        else:
            self._send(HTTPStatus.UNAUTHORIZED, _page(
                "Reachy's memory", "Log in with the link <code>reachy-memory web</code> printed when it started "
                "(it ends with <code>?token=…</code>). Nothing of the memory is shown without it."),
                "text/html; charset=utf-8")

    def _login(self, token: str) -> None:
        """A valid token sets the session cookie and sends the browser on to ``/`` from a page of
        this site (a ``Refresh``, not a 303: a ``SameSite=Strict`` cookie is not sent on a redirect
        that a link on another site started), the token gone from the address bar."""
        auth = self.server.auth
        if not auth.token_ok(token):
            raise _HttpError(HTTPStatus.FORBIDDEN, "this login link is not valid (an old token?): use the link "
                             "`reachy-memory web` printed")
        cookie = f"{auth.cookie}={auth.session}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECONDS}"
        self._send(HTTPStatus.OK, _page("Reachy's memory", 'Logged in. <a href="/">Open the page</a>.'),
                   "text/html; charset=utf-8", {"Set-Cookie": cookie, "Refresh": "0; url=/"})

    def _asset(self, name: str) -> None:
        if name not in ASSETS:
            raise _HttpError(HTTPStatus.NOT_FOUND, "no such file")
        self._send(HTTPStatus.OK, _asset_text(name).encode(), ASSETS[name])

    def _overview(self) -> dict[str, Any]:
        backend = self.server.backend
        people = backend.people()
        return view.overview(people, backend.memories(), self.server.tz, now(), backend.remembering())

    def _search(self, text: str) -> dict[str, Any]:
        text = text.strip()
        if not text:
            raise _HttpError(HTTPStatus.BAD_REQUEST, "type something to search for")
        if len(text) > MAX_QUERY_CHARS:
            raise _HttpError(HTTPStatus.BAD_REQUEST, f"a search is at most {MAX_QUERY_CHARS} characters")
        backend = self.server.backend
        hits = backend.search(text, SEARCH_LIMIT)
        return {"query": text, "results": view.search_view(hits, self.server.tz, backend.people())}

    def _about(self, person_id: str) -> dict[str, Any]:
        return self.server.backend.about_person(_id(person_id))

    def _export(self) -> None:
        """Every person and memory as JSON Lines (the format of ``reachy-memory export``, which
        ``reachy-memory import`` reads), as a download."""
        backend = self.server.backend
        redirects = backend.person_redirects()
        lines = [json.dumps({"kind": "person", **p}, ensure_ascii=False)
                 for p in person_entries(backend.people(), redirects)]
        for page in backend.memories():
            lines += [json.dumps(m.to_dict(), ensure_ascii=False) for m in page]
        name = f"reachy-memory-{datetime.now(self.server.tz):%Y-%m-%d}.jsonl"
        self._send(HTTPStatus.OK, "".join(line + "\n" for line in lines).encode(), "application/x-ndjson",
                   {"Content-Disposition": f'attachment; filename="{name}"'})

    # -- POST -------------------------------------------------------------------------

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _post(self) -> None:
        url = urlsplit(self.path)
        actions: dict[str, Callable[[dict[str, Any]], Any]] = {
            "/api/forget": self._forget, "/api/forget-person": self._forget_person,
            "/api/pause": self._pause, "/api/resume": lambda _: self.server.backend.resume()}
        action = actions.get(url.path)
        if action is None:
            raise _HttpError(HTTPStatus.NOT_FOUND, "no such action")
        self._check_same_origin()
        self._require_login()
        if not self.server.auth.csrf_ok(self.headers.get("X-CSRF-Token")):
            raise _HttpError(HTTPStatus.FORBIDDEN, "missing or wrong X-CSRF-Token: reload the page")
        self._json(action(self._body()))

    def _check_same_origin(self) -> None:
        """A change comes from this page: ``Sec-Fetch-Site`` (when sent) says same-origin,
        ``Origin`` (when sent) is this server's."""
        site = self.headers.get("Sec-Fetch-Site")
        if site is not None and site != "same-origin":
            raise _HttpError(HTTPStatus.FORBIDDEN, f"cross-site request refused (Sec-Fetch-Site: {site[:40]})")
        origin = self.headers.get("Origin")
        if origin is not None and origin != f"http://{self.headers.get('Host', '')}":
            raise _HttpError(HTTPStatus.FORBIDDEN, "cross-origin request refused")

    def _body(self) -> dict[str, Any]:
        if not self.headers.get("Content-Type", "").lower().startswith("application/json"):
            raise _HttpError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "send the action as application/json")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise _HttpError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is needed") from None
        if length > MAX_BODY or length < 0:
            self.close_connection = True  # the body is not read
            raise _HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a request is at most {MAX_BODY} bytes")
        raw = self.rfile.read(length)
        try:
            data = json.loads(raw.decode("utf-8")) if raw else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _HttpError(HTTPStatus.BAD_REQUEST, f"the request is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise _HttpError(HTTPStatus.BAD_REQUEST, "the request must be a JSON object")
        return data

    def _forget(self, data: dict[str, Any]) -> dict[str, Any]:
        memory_id = _id(data.get("id"))
        if not self.server.backend.forget(memory_id):
            raise _HttpError(HTTPStatus.NOT_FOUND, "that memory is gone already (forgotten or expired)")
        return {"forgotten": memory_id}

    def _forget_person(self, data: dict[str, Any]) -> dict[str, Any]:
        dry_run = data.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise _HttpError(HTTPStatus.BAD_REQUEST, "dry_run must be true or false")
        return self.server.backend.forget_person(_id(data.get("id")), dry_run)

    def _pause(self, data: dict[str, Any]) -> dict[str, Any]:
        minutes = data.get("minutes")
        if isinstance(minutes, bool) or not isinstance(minutes, int | float) or not 0 < minutes <= MAX_PAUSE_MINUTES:
            raise _HttpError(HTTPStatus.BAD_REQUEST, f"minutes must be a number from 1 to {MAX_PAUSE_MINUTES}")
        return self.server.backend.pause(float(minutes))


def _one(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name)
    if not values or len(values) != 1:
        raise _HttpError(HTTPStatus.BAD_REQUEST, f"give {name} once")
    return values[0]


def _id(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_ID_CHARS:
        raise _HttpError(HTTPStatus.BAD_REQUEST, f"id must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return value


def _status_of(exc: ReachyMemoryError) -> HTTPStatus:
    if isinstance(exc, TooLargeError):
        return HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    if isinstance(exc, ValidationError):
        return HTTPStatus.BAD_REQUEST
    if isinstance(exc, NotFoundError):
        return HTTPStatus.NOT_FOUND
    if isinstance(exc, ServiceError | StorageError) or exc.code in ("unavailable", "busy", "timeout"):
        return HTTPStatus.SERVICE_UNAVAILABLE
    return HTTPStatus.INTERNAL_SERVER_ERROR


def _asset_text(name: str) -> str:
    return (resources.files("reachy_memory.web") / "assets" / name).read_text(encoding="utf-8")


def _page(title: str, message_html: str) -> bytes:
    """A small page of this site (the login screen, an error) with only static text."""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{title}</title>'
            f'<link rel="stylesheet" href="/static/app.css"></head><body><main class="notice"><h1>{title}</h1>'
            f"<p>{message_html}</p></main></body></html>").encode()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def login_url(host: str, port: int, token: str) -> str:
    """The link that logs a browser in."""
    shown = host
    if host in ("0.0.0.0", "::", ""):
        shown = socket.gethostname()
    elif ":" in host:
        shown = f"[{host}]"
    return f"http://{shown}:{port}/?token={token}"


def token_path(config: Config, given: str | os.PathLike[str] | None) -> Path:
    """Where the login token lives: ``given``, else :data:`TOKEN_FILE` in the private runtime
    directory (made 0700 if missing). Raises ConfigError."""
    if given is not None:
        return Path(given).expanduser()
    path = runtime_dir(config) / TOKEN_FILE
    prepare_ipc_dir(path)
    return path


def make_server(backend: WebBackend, token: str, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                tz: tzinfo | None = None) -> HouseholdServer:
    """The page's server bound to ``host:port`` (0: a free port), not serving yet.
    Raises ConfigError when it cannot bind."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535, not {port}", key="web")
    try:
        return HouseholdServer((host, port), backend, token, tz or resolve_timezone("local"))
    except OSError as exc:
        raise ConfigError(f"cannot serve the page on {host}:{port}: {exc.strerror or exc}; choose another "
                          "--port or --host", key="web") from exc


def run(config: Config, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
        token_file: str | os.PathLike[str] | None = None, in_process: bool = False, endpoint: str | None = None,
        timeout: float = 10.0, out: TextIO | None = None) -> int:
    """Serve the page until SIGINT or SIGTERM; returns the exit code.

    ``in_process`` opens ``config.data_dir`` here (StoreLockedError while a daemon holds
    it), else the page talks to the daemon at ``endpoint`` (else the configured one).
    The login link goes to ``out`` (stdout), the rest to stderr."""
    out = out or sys.stdout
    token = http_token(token_path(config, token_file), what="web page", key="web")
    backend = open_backend(config, in_process=in_process, endpoint=endpoint, timeout=timeout)
    try:
        server = make_server(backend, token, host=host, port=port,
                             tz=resolve_timezone(config.memory.timezone))
    except BaseException:
        backend.close()
        raise
    try:
        where = f"the store {config.data_dir}" if in_process else "the daemon"
        print(f"reachy-memory web: the household's page of {where} on http://{host}:{server.port}/", file=sys.stderr)
        if not server.loopback:
            print("reachy-memory web: WARNING: served to the network as plain HTTP: anyone on it who can read the "
                  "traffic can read the session cookie and the memory; keep --host for a network you trust",
                  file=sys.stderr)
        print(f"Open this link to log in (it logs that browser in; keep it private):\n  "
              f"{login_url(host, server.port, token)}", file=out, flush=True)
        _serve_until_signal(server)
    finally:
        server.server_close()
        backend.close()
    return 0


def _serve_until_signal(server: HouseholdServer) -> None:
    """``serve_forever`` until SIGTERM or SIGINT (from the main thread: handlers installed)."""
    stop = threading.Event()

    def on_signal(*_: Any) -> None:
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()  # not from this thread: it would wait

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        for sig, handler in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
