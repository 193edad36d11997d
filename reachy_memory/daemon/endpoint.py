"""Where the daemon listens and who may connect.

Default endpoint: ``ipc://<dir>/memory.sock`` where ``<dir>`` is systemd's
``$RUNTIME_DIRECTORY``, else ``$XDG_RUNTIME_DIR/reachy-memory``, else
``<data dir>/run``; a directory the daemon creates is made 0700 and the socket
0600, so only the owning user can connect.  A directory that already exists is
never chmodded: it is refused when other users can write to it (they could
replace the socket).  Precedence, for the daemon and the clients alike: an
explicit endpoint (``--endpoint``) > ``$REACHY_MEMORY_ENDPOINT`` >
``server.endpoint`` in the config file > the default above.

An ``ipc://`` socket path given in any of those ways is expanded as ``memory.path``
is: ``$VAR`` / ``${VAR}`` first, then a leading ``~``; daemon and clients resolve it
through :func:`resolve_endpoint` alike.  A path that only becomes a path through
``~`` or a variable must expand to an absolute one (see :func:`expand_endpoint`).

``tcp://`` needs CURVE keys (``server.curve_secret_key`` and
``server.curve_authorized_dir``): without them any local user could read and
erase every memory.  ``--insecure-tcp`` allows plain tcp on loopback only, with
a warning in the log.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import re
import socket
import stat
from pathlib import Path
from urllib.parse import urlsplit

from reachy_memory.config import Config
from reachy_memory.errors import AlreadyRunningError, ConfigError

log = logging.getLogger(__name__)

ENV_ENDPOINT = "REACHY_MEMORY_ENDPOINT"


def resolve_endpoint(explicit: str | None, config: Config) -> str:
    """The endpoint to use: ``explicit`` (a flag) > ``$REACHY_MEMORY_ENDPOINT`` >
    ``server.endpoint`` > the private default, its ipc path expanded
    (:func:`expand_endpoint`, whose ConfigError it raises)."""
    return expand_endpoint(explicit) if explicit else default_endpoint(config)


def default_endpoint(config: Config) -> str:
    """The endpoint daemon and clients use when none is given explicitly (expanded as
    :func:`resolve_endpoint` says; raises its ConfigError)."""
    configured = os.environ.get(ENV_ENDPOINT) or config.server.endpoint
    if configured:
        return expand_endpoint(configured)
    # built from directories that are already expanded: a '$' in them is a real character
    return f"ipc://{runtime_dir(config)}/memory.sock"


_IPC = "ipc://"
_VARIABLE = re.compile(r"\$(?:(\w+)|\{([^}]*)\})", re.ASCII)  # what os.path.expandvars replaces


def expand_endpoint(endpoint: str) -> str:
    """``endpoint`` with its ipc socket path expanded like ``memory.path``: environment
    variables (``$VAR``, ``${VAR}``), then a leading ``~`` or ``~user``.  tcp:// endpoints
    and Linux abstract sockets (``ipc://@name``) are returned unchanged, and so is a path
    with neither.

    Raises ConfigError (key ``server.endpoint``) when the path names a variable that is
    unset or empty (``ipc://$XDG_RUNTIME_DIR/m.sock`` would be ``/m.sock``, or a file
    named ``$XDG_RUNTIME_DIR``), and when a path that starts with ``~`` or ``$`` still is
    relative after expansion (``~`` of an unknown user, ``REL=run``): the daemon under
    systemd works in ``/`` and a client in its shell's folder, so that socket would be two
    different files, each side waiting for the other.  A path written relative
    (``ipc://run/m.sock``) keeps its meaning: from the config file's folder, or for a flag
    or ``$REACHY_MEMORY_ENDPOINT`` from the working directory.
    """
    if not endpoint.startswith(_IPC) or endpoint.startswith(_IPC + "@"):
        return endpoint
    written = endpoint[len(_IPC):]
    unset = [name for name in _variables(written) if not os.environ.get(name)]
    if unset:
        raise ConfigError(f"endpoint {endpoint!r}: ${unset[0]} is not set (or is empty) in this environment; "
                          "set it for the daemon and its clients alike, or write the socket's absolute path",
                          key="server.endpoint")
    path = os.path.expanduser(os.path.expandvars(written))
    if written.startswith(("~", "$")) and not os.path.isabs(path):
        raise ConfigError(f"endpoint {endpoint!r} expands to the relative path {path!r}: the daemon and its "
                          "clients work in different folders, so write a path that expands to an absolute one",
                          key="server.endpoint")
    return _IPC + path


def _variables(text: str) -> list[str]:
    """The names of the environment variables ``text`` refers to ($NAME or ${NAME})."""
    return [m[1] if m[1] is not None else m[2] for m in _VARIABLE.finditer(text)]


def runtime_dir(config: Config) -> Path:
    """The private runtime directory: systemd's ``$RUNTIME_DIRECTORY``, else
    ``$XDG_RUNTIME_DIR/reachy-memory``, else ``<data dir>/run`` (not created here)."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "reachy-memory"
    return config.data_dir / "run"


def ipc_path(endpoint: str) -> Path | None:
    """The filesystem path of an ipc:// endpoint, else None."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def load_certificate(path: str, key: str) -> tuple[bytes, bytes | None]:
    """The (public, secret) keys of a CURVE certificate file (``~`` expanded); ConfigError
    naming ``key`` for a file that is missing or is not a certificate (OSError, ValueError
    from zmq.auth)."""
    from zmq import auth

    try:
        return auth.load_certificate(os.path.expanduser(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"CURVE certificate {path} ({key}) cannot be loaded: {exc}", key=key) from exc


def ipc_listener_gone(endpoint: str) -> str | None:
    """For an ipc:// endpoint, why no daemon can be listening there (no socket file, or
    a socket nobody accepts on: a daemon that was killed), found at once instead of
    after a request's timeout; None when one may be (or for tcp://). One stat and one
    non-blocking connect: it never waits."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    if not path.exists():
        return "no socket there"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Never waits (an event loop calls this before each MCP or app tool call): a frozen daemon's
    # full listen queue refuses at once (BlockingIOError), and the request and its timeout say.
    probe.setblocking(False)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        return "a socket left by a daemon that stopped"
    except OSError:  # BlockingIOError (a full queue) too
        return None  # permissions, a path too long, a frozen daemon...: let the request say
    finally:
        probe.close()
    return None


def check_endpoint(endpoint: str, config: Config, *, insecure_tcp: bool = False) -> None:
    """Refuse endpoints that would expose the daemon; raises ConfigError."""
    path = ipc_path(endpoint)
    if path is not None and not path.name:
        raise ConfigError(f"endpoint {endpoint!r}: an ipc endpoint needs a socket path (ipc:///path/memory.sock)",
                          key="server.endpoint")
    if path is not None:
        return
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"endpoint {endpoint!r}: use ipc:///path or tcp://127.0.0.1:PORT", key="server.endpoint")
    check_tcp_port(endpoint)
    if config.server.curve_secret_key and config.server.curve_authorized_dir:
        return
    host = urlsplit(endpoint).hostname or ""
    if insecure_tcp and _is_loopback(host):
        log.warning("INSECURE: serving %s without CURVE: any local user can read, change and erase every "
                    "memory; use the default ipc socket or CURVE keys", endpoint)
        return
    raise ConfigError(
        f"endpoint {endpoint!r} has no CURVE keys: any local user could read and erase every memory. Set "
        "server.curve_secret_key and server.curve_authorized_dir, use the private ipc socket, or (loopback "
        "only, at your own risk) pass --insecure-tcp", key="server.endpoint")


def check_tcp_port(endpoint: str) -> None:
    """Refuse a tcp:// endpoint whose port is not one number from 1 to 65535; raises
    ConfigError.  libzmq takes the port modulo 65536 (``:99999`` bound port 34463) and
    ``:0`` or ``:*`` bind a port chosen at random, which no client could find."""
    if not endpoint.startswith("tcp://"):
        return
    port = endpoint.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"endpoint {endpoint!r}: a tcp endpoint needs a port from 1 to 65535 "
                          "(tcp://127.0.0.1:PORT)", key="server.endpoint")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prepare_ipc_dir(path: Path) -> None:
    """Create the socket's directory private to this user (0700), or check an existing one.

    An existing directory is never chmodded (it may be the working directory or
    a shared temp dir); ConfigError when users other than its owner can write to
    it and it is not sticky (they could swap the socket).
    """
    parent = path.parent
    if not parent.exists():
        _make_private_dirs(parent)
        return
    mode = parent.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise ConfigError(f"socket directory {parent} is writable by other users (mode {stat.S_IMODE(mode):o}); "
                          "use a private directory for the ipc socket", key="server.endpoint")


def _make_private_dirs(folder: Path) -> None:
    """Create ``folder`` and every missing folder above it, each 0700 whatever the umask
    (the default socket folder is ``<data dir>/run``: made with the umask's mode, the data
    directory was 0755 until the store tightened it, with a warning, on the first start).
    A folder another process made meanwhile is left as it is."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        try:
            made.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(made, 0o700)


class EndpointLock:
    """flock on ``<socket>.lock``: a second daemon would silently steal an ipc path."""

    def __init__(self, endpoint: str) -> None:
        path = ipc_path(endpoint)
        self.path = path.with_name(path.name + ".lock") if path else None
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; AlreadyRunningError if another daemon has it."""
        if self.path is None:
            return
        prepare_ipc_dir(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise AlreadyRunningError(f"another reachy-memory daemon already serves {self.path.with_suffix('')}",
                                      where=str(self.path)) from exc
        self._fd = fd

    def release(self) -> None:
        """Release; idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
