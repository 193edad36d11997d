"""systemd integration without libsystemd: sd_notify datagrams and journald-friendly logs."""

from __future__ import annotations

import logging
import os
import socket
import sys

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to $NOTIFY_SOCKET; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


class _JournalFormatter(logging.Formatter):
    """One line per record; a <priority> prefix when journald reads stderr."""

    def __init__(self, journald: bool) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s" if journald
                         else "%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._journald = journald

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\n", " | ")
        if self._journald:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{text}"
        return text


def setup_logging(level: str = "INFO") -> None:
    """Log to stderr, one line per record, journald priorities under systemd."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JournalFormatter(bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
