"""Where the daemon listens and who may connect.

Default endpoint: ``ipc://<dir>/memory.sock`` where ``<dir>`` is systemd's
``$RUNTIME_DIRECTORY``, else ``$XDG_RUNTIME_DIR/reachy-memory``, else
``<data dir>/run``; the directory is made 0700 and the socket 0600, so only
the owning user can connect.  ``$REACHY_MEMORY_ENDPOINT`` or
``server.endpoint`` override it.  ``tcp://`` is accepted on loopback
addresses; any other address needs CURVE keys (``server.curve_secret_key`` and
``server.curve_authorized_dir``), since encryption without a list of allowed
client keys would let anyone in.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

from .config import Config
from .errors import AlreadyRunningError, ConfigError

ENV_ENDPOINT = "REACHY_MEMORY_ENDPOINT"


def default_endpoint(config: Config) -> str:
    """The endpoint daemon and clients use when none is given."""
    explicit = os.environ.get(ENV_ENDPOINT) or config.server.endpoint
    if explicit:
        return explicit
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        base = Path(runtime.split(":")[0])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        base = Path(os.environ["XDG_RUNTIME_DIR"]) / "reachy-memory"
    else:
        base = config.data_dir / "run"
    return f"ipc://{base}/memory.sock"


def ipc_path(endpoint: str) -> Path | None:
    """The filesystem path of an ipc:// endpoint, else None."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def check_endpoint(endpoint: str, config: Config) -> None:
    """Refuse endpoints that would expose the daemon; raises ConfigError."""
    if ipc_path(endpoint) is not None:
        return
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"endpoint {endpoint!r}: use ipc:///path or tcp://127.0.0.1:PORT", key="server.endpoint")
    host = urlsplit(endpoint).hostname or ""
    if _is_loopback(host):
        return
    if not (config.server.curve_secret_key and config.server.curve_authorized_dir):
        raise ConfigError(
            f"endpoint {endpoint!r} is reachable from other machines: set server.curve_secret_key and "
            "server.curve_authorized_dir (CURVE encryption plus a list of allowed client keys) or bind to loopback",
            key="server.endpoint",
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prepare_ipc_dir(path: Path) -> None:
    """Create the socket's directory private to this user (0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.parent.stat().st_uid == os.getuid():
        os.chmod(path.parent, 0o700)


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
