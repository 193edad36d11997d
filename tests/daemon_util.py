"""Start and stop real daemon processes for the integration tests (loopback ipc only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
import zmq

from reachy_memory import MemoryClient, MemoryStore, load_config
from reachy_memory.errors import DaemonUnavailableError, ReachyMemoryError
from tests.conftest import model_cache

ROOT = Path(__file__).resolve().parents[1]


class DaemonProcess:
    """A ``reachy-memory serve`` child process on a private ipc endpoint."""

    def __init__(self, tmp: Path, **sections: dict) -> None:
        self.tmp = tmp
        self.data = tmp / "data"
        self.endpoint = f"ipc://{tmp}/run/memory.sock"
        settings = {"memory": {"path": str(self.data)}, "embedding": {"cache_dir": str(model_cache())},
                    "server": {"endpoint": self.endpoint}}
        for name, values in sections.items():
            settings.setdefault(name, {}).update(values)
        self.config_path = tmp / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(settings))
        self.config = load_config(self.config_path)
        self.endpoint = self.config.server.endpoint or self.endpoint
        self.proc: subprocess.Popen[str] | None = None
        self.log = tmp / "daemon.log"

    def start(self, env: dict[str, str] | None = None, wait: bool = True) -> DaemonProcess:
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        full_env.pop("REACHY_MEMORY_ENDPOINT", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reachy_memory.cli", "serve", "--config", str(self.config_path)],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "a"), env=full_env, text=True,  # noqa: SIM115
        )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self.client(timeout=0.5) as c:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
                try:
                    c.ping()
                    return
                except ReachyMemoryError:
                    time.sleep(0.05)
        raise RuntimeError(f"daemon not ready: {self.log.read_text()[-2000:]}")

    def __enter__(self) -> DaemonProcess:
        """Start the daemon (waiting until it answers); ``__exit__`` stops it."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self, timeout: float = 10.0, retries: int = 0) -> MemoryClient:
        return MemoryClient(self.endpoint, config=self.config, timeout=timeout, retries=retries)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


def restartable_daemon(tmp: Path) -> Iterator[DaemonProcess]:
    """For a fixture: a words-only daemon (no model to load: a restart takes about a
    second), thawed if a failed test left it frozen (SIGSTOP), stopped at the end."""
    d = DaemonProcess(tmp, embedding={"enabled": False}).start()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        os.kill(d.proc.pid, signal.SIGCONT)
    d.stop()


def stop_as_systemd(d: DaemonProcess, how: str) -> None:
    """Stop a (frozen or running) daemon as systemd would: SIGTERM ("term"), or SIGKILL ("kill")."""
    assert d.proc is not None
    if how == "kill":
        d.kill()
        return
    os.kill(d.proc.pid, signal.SIGTERM)
    os.kill(d.proc.pid, signal.SIGCONT)
    assert d.proc.wait(timeout=60) == 0, d.log.read_text()[-2000:]


class ReplyLost:
    """A client whose first ``method`` call reaches ``daemon`` (and is journaled there), then
    loses its reply with the daemon: killed (SIGKILL) and started again, the call raises
    DaemonUnavailableError. Every later call is ``real``'s; ``sent`` holds what each
    ``method`` call returned from the daemon."""

    def __init__(self, real: MemoryClient, daemon: DaemonProcess, method: str) -> None:
        self.sent: list[Any] = []
        self._real, self._daemon, self._method = real, daemon, method

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._real, name)
        return self._lost_once(call) if name == self._method else call

    def _lost_once(self, call: Any) -> Any:
        def lost(*args: Any, **kwargs: Any) -> Any:
            memory = call(*args, **kwargs)
            self.sent.append(memory)
            if len(self.sent) == 1:
                self._daemon.kill()
                self._daemon.start()
                raise DaemonUnavailableError("the daemon died before replying")
            return memory
        return lost


def words_only_daemon(tmp: Path, memories: int, **sections: dict) -> DaemonProcess:
    """A daemon (not started) over ``memories`` facts, without the model (no embedding
    to wait for): a store large enough that a backup of it takes about a second."""
    d = DaemonProcess(tmp, embedding={"enabled": False}, **sections)
    with MemoryStore(d.data, config=d.config, embedder=None) as store:
        for start in range(0, memories, 1000):
            store.store_batch([{"content": f"the fox number {i} ran along the river bank at dawn"}
                               for i in range(start, min(start + 1000, memories))])
    return d


def run_cli(daemon: DaemonProcess, *argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    """``reachy-memory ARGV --config <daemon's config>`` in a child process (bounded in
    time), ``stdin`` piped in (empty by default: a command never waits on the terminal)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REACHY_MEMORY_ENDPOINT", None)
    done = subprocess.run([sys.executable, "-m", "reachy_memory.cli", *argv, "--config", str(daemon.config_path)],
                          input=stdin, capture_output=True, timeout=120, env=env)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))


def never_reading_dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    """A raw DEALER with the smallest receive queue and buffer, for clients that send
    requests and never read the replies (the caller closes it)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.linger = 0
    sock.connect(endpoint)
    return sock
