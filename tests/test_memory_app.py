"""The memory app (``reachy_memory.main``) as the robot's dashboard runs it: found through
reachy-memory's own ``reachy_mini_apps`` entry point, started and stopped through the
reachy-mini daemon's HTTP API (the dashboard's) on a mockup-sim daemon (loopback only),
talking to a real reachy-memory daemon.

Needs reachy-memory installed (``pip install -e .``: the entry point is in its metadata)
and the robot extra; skipped without them, except in CI (``tools/test.sh`` installs both)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any

import pytest

if os.environ.get("CI") != "true":
    pytest.importorskip("reachy_mini", reason="the robot extra is not installed (pip install '.[robot]')")
    if not entry_points(group="reachy_mini_apps", name="reachy_memory"):
        pytest.skip("reachy-memory's entry points are not installed (pip install -e .)", allow_module_level=True)

import psutil

from tests.daemon_util import DaemonProcess
from tools._reachy_sim import SimDaemon, free_port

pytestmark = pytest.mark.timeout(300)
APP = "reachy_memory"


@pytest.fixture(scope="module")
def memory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A memory daemon, not started: the first test runs the app without it."""
    d = DaemonProcess(tmp_path_factory.mktemp("memory"))
    yield d
    if d.proc is not None and d.proc.poll() is None:
        assert d.stop() == 0, d.log.read_text()[-2000:]


@pytest.fixture(scope="module")
def app_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory, memory: DaemonProcess, app_port: int) -> Iterator[SimDaemon]:
    daemon = SimDaemon(tmp_path_factory.mktemp("sim") / "sim.log")
    daemon.env = {
        "REACHY_MEMORY_ENDPOINT": memory.endpoint,
        "REACHY_MEMORY_CONFIG": str(memory.config_path),
        "REACHY_MEMORY_APP_URL": f"http://127.0.0.1:{app_port}",  # loopback only in tests
        "REACHY_MEMORY_APP_ROBOT": f"127.0.0.1:{daemon.port}",
        "REACHY_MEMORY_APP_PERSON": "Nora",
        "REACHY_MEMORY_APP_WAIT": "3",
    }
    with daemon:
        yield daemon


def _status(sim: SimDaemon) -> dict[str, Any] | None:
    return sim.api("GET", "/api/apps/current-app-status")  # type: ignore[return-value]


def _page(port: int, path: str, data: dict[str, Any] | None = None) -> Any:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="GET" if body is None
                                     else "POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as r:
        return json.loads(r.read())


def _wait(predicate: Any, timeout: float = 60.0, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = predicate()
        except (OSError, ValueError):
            found = None
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"not reached within {timeout} s")


def _app_process(sim: SimDaemon) -> psutil.Process:
    assert sim.proc is not None
    return _wait(lambda: next((p for p in psutil.Process(sim.proc.pid).children()
                               if "reachy_memory.main" in " ".join(p.cmdline())), None), timeout=20)


def _window(memory: DaemonProcess) -> list[str]:
    with memory.client() as c:
        return [t["content"] for t in c.get_context_window()]


def test_the_dashboard_lists_the_app_with_its_settings_page(sim: SimDaemon, app_port: int) -> None:
    apps = sim.api("GET", "/api/apps/list-available/installed")
    assert isinstance(apps, list)
    ours = [a for a in apps if a["name"] == APP]
    assert len(ours) == 1 and ours[0]["extra"]["custom_app_url"] == f"http://127.0.0.1:{app_port}"


def test_without_the_memory_daemon_the_app_ends_in_error_saying_so(sim: SimDaemon, memory: DaemonProcess) -> None:
    assert memory.proc is None  # not started yet
    sim.api("POST", f"/api/apps/start-app/{APP}")
    status = _wait(lambda: (s := _status(sim)) and s["state"] == "error" and s, timeout=60)
    assert "reachy-memory daemon is not running" in status["error"]
    assert "systemctl start reachy-memory" in status["error"] and "Traceback" not in status["error"]
    sim.api("POST", "/api/apps/stop-current-app")  # frees the slot (the manager keeps an app in error)


def test_the_dashboard_starts_the_app_which_remembers_and_stops_within_a_second(
        sim: SimDaemon, memory: DaemonProcess, app_port: int) -> None:
    memory.start()
    with memory.client() as c:
        c.remember_fact("Nora likes jazz", {"person": "Nora"})
    started = sim.api("POST", f"/api/apps/start-app/{APP}")
    assert isinstance(started, dict) and started["state"] in ("starting", "running")
    process = _app_process(sim)
    _wait(lambda: _page(app_port, "/status")["memory_daemon"] == "running")
    running_since = time.monotonic()
    # what it says: the greeting, with what it remembers of the person in front of it
    _wait(lambda: "Hello Nora! I remember: Nora likes jazz" in _window(memory), timeout=20)
    # what it hears (its settings page), and its answers
    _page(app_port, "/heard", {"text": "My name is Sam, I just came back from Lyon"})
    _wait(lambda: {"My name is Sam, I just came back from Lyon", "Hello Sam! Tell me about yourself."}
          <= set(_window(memory)), timeout=20)
    _page(app_port, "/heard", {"text": "remember that Sam plays chess"})
    _wait(lambda: "I will remember that." in _window(memory), timeout=20)
    with memory.client() as c:
        assert c.get_context("current_person") == "Sam"
        hits = c.search("chess", "fact", where={"person": "Sam"}, min_score=0.0)
        assert [h.memory.content for h in hits] == ["Sam plays chess"]
    _wait(lambda: _page(app_port, "/status")["nods"] >= 1, timeout=20)  # it nodded at the new fact
    while time.monotonic() - running_since < 5.0:  # running for several seconds, no error
        status = _status(sim)
        assert status is not None and status["state"] == "running" and status["error"] is None, status
        time.sleep(0.25)
    assert process.is_running()
    family = [process, *process.children(recursive=True)]  # the app and its bridge's helper
    assert len(family) == 2

    exits: list[float] = []
    stopper = threading.Thread(target=sim.api, args=("POST", "/api/apps/stop-current-app"))
    asked = time.monotonic()
    stopper.start()  # SIGINT to the app; the call returns after the robot's 1 s move back to zero
    _, alive = psutil.wait_procs(family, timeout=5, callback=lambda _: exits.append(time.monotonic()))
    stopper.join(30)
    assert not alive and len(exits) == 2 and not stopper.is_alive()
    assert max(exits) - asked < 1.0  # the app and its helper ended within a second of the request
    assert _status(sim) is None  # stopped, not in error
    log = sim.tail(200_000)
    assert "App stopped successfully" in log and "forcing termination" not in log
    assert "Traceback" not in log.split(f"Starting app {APP}")[-1]
