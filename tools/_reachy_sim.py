"""Start and stop the reachy-mini daemon in mockup simulation (no MuJoCo, no
media, HTTP on 127.0.0.1) for the robot tests and tools/bench_control_loop.py.

The daemon normally advertises itself on the LAN over mDNS; tests and
benchmarks must stay on loopback, so the launcher turns that registration off
before running the daemon's own ``main()``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

SIM_ARGS = ["--mockup-sim", "--headless", "--no-media", "--no-wake-up-on-start", "--no-goto-sleep-on-stop",
            "--no-preload-datasets", "--dataset-update-interval", "0", "--fastapi-host", "127.0.0.1"]

_LAUNCH = (
    "import sys, runpy\n"
    "from reachy_mini.utils import discovery\n"
    "discovery.MdnsServiceRegistration.register = lambda self: None  # loopback only: no LAN advertisement\n"
    "sys.argv = ['reachy-mini-daemon', *sys.argv[1:]]\n"
    "runpy.run_module('reachy_mini.daemon.app.main', run_name='__main__')\n"
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimDaemon:
    """``python -m reachy_mini.daemon.app.main --mockup-sim ...`` as a child process; ``env`` is
    added to its environment (the dashboard gives it to the apps it starts)."""

    def __init__(self, log: Path, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.log = log
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> SimDaemon:
        """Start it and wait until its status says running; raises RuntimeError otherwise."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, *SIM_ARGS, "--fastapi-port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"reachy-mini daemon exited {self.proc.returncode}: {self.tail()}")
            if self.status().get("state") == "running":
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"reachy-mini daemon not running after {timeout} s: {self.tail()}")

    def status(self) -> dict[str, object]:
        """The daemon's /api/daemon/status, or {} if it does not answer."""
        try:
            found = self.api("GET", "/api/daemon/status", timeout=1)
        except (OSError, ValueError):
            return {}
        return dict(found) if isinstance(found, dict) else {}

    def api(self, method: str, path: str, timeout: float = 30.0) -> Any:
        """One call to the daemon's HTTP API (the dashboard's): its JSON reply; raises OSError
        (urllib's HTTPError for an error status) or ValueError."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> SimDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
