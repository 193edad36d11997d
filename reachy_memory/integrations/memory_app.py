"""The memory app: reachy-memory as a Reachy Mini app that the dashboard lists, starts and stops.

reachy-memory registers it under the ``reachy_mini_apps`` entry point as ``reachy_memory``
(:mod:`reachy_memory.main`, Pollen's layout: ``<package>.main:<Class>``), so installing
reachy-memory into the robot's apps venv is all it takes. The dashboard starts it as
``python -u -m reachy_memory.main`` and stops it with SIGINT; :func:`main` runs it as
Pollen's app template does (``wrapped_run()``), until told to stop.

What it does, every 20 ms tick of its control loop:

* checks the memory daemon through :class:`~reachy_memory.integrations.reachy_mini.MemoryBridge`
  (its worker in a helper process: the loop only reads the last snapshot and queues
  calls). At start it waits up to ``REACHY_MEMORY_APP_WAIT`` seconds (30) for the daemon's
  first answer; none: it exits with status 1 and one line saying the daemon is not
  running and how to start it, which the dashboard shows as the app's error. Later
  outages are logged once (and once more when the daemon is back) and shown on the
  settings page; the bridge keeps the writes until the daemon answers again;
* records what the robot hears and says as conversation turns: what it hears comes from
  its settings page (``POST /heard``: what a person said, typed or from a speech
  recogniser), what it says are its replies (a greeting with what it remembers of the
  person in front of it, a welcome when someone says their name, an acknowledgement when
  told "remember that ..."), printed to its output (the dashboard's log) as ``Reachy says:``;
* moves the head gently (a slow sway) and nods when a new fact about the current person
  appears in memory (stored by an LLM's ``remember`` tool, the CLI or another app);
* stops within one tick of the stop request, then gives the bridge ``CLOSE_TIMEOUT`` seconds
  to deliver the last turns: well within a second in all.

Its settings page (``custom_app_url``, http://0.0.0.0:8042 like Pollen's template; the
dashboard links to it) shows the daemon's state, who is in front of the robot and the
counters, and takes what a person said. Like the dashboard itself it has no login and is
reachable from the robot's network: it shows no memory's content.

Environment (the dashboard gives an app the reachy-mini daemon's environment, so set them
where that daemon starts, e.g. ``Environment=`` in its systemd unit):
``REACHY_MEMORY_ENDPOINT`` / ``REACHY_MEMORY_CONFIG`` (which memory daemon; with neither, the
systemd unit's socket ``/run/reachy-memory/memory.sock`` when it is there, else the default),
``REACHY_MEMORY_APP_PERSON`` (who is in front of the robot at start; nobody by default),
``REACHY_MEMORY_APP_WAIT`` (seconds to wait for the memory daemon at start),
``REACHY_MEMORY_APP_URL`` (the settings page's address; empty: no page),
``REACHY_MEMORY_APP_ROBOT`` (``host:port`` of a reachy-mini daemon that is not on
localhost:8000).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reachy_mini import ReachyMini
from reachy_mini.apps.app import ReachyMiniApp
from reachy_mini.utils import create_head_pose

from reachy_memory.config import Config
from reachy_memory.errors import DaemonUnavailableError
from reachy_memory.integrations.reachy_mini import MemoryBridge, MemorySnapshot

log = logging.getLogger("reachy_memory.app")

TICK = 0.02  # 50 Hz
NOD_TICKS = 25  # half a second of nodding per new fact
CLOSE_TIMEOUT = 0.3  # seconds the bridge gets to deliver the last turns once the app is told to stop
DEFAULT_WAIT = 30.0  # seconds to wait for the memory daemon's first answer (at boot it may start after the app)
#: The socket of the systemd unit (systemd/reachy-memory.service): the app's default when neither
#: $REACHY_MEMORY_ENDPOINT nor $REACHY_MEMORY_CONFIG says otherwise (the dashboard passes neither)
ROBOT_SOCKET = Path("/run/reachy-memory/memory.sock")
MAX_HEARD = 2000  # characters of one thing heard
URL_ENV, WAIT_ENV, PERSON_ENV, ROBOT_ENV = ("REACHY_MEMORY_APP_URL", "REACHY_MEMORY_APP_WAIT",
                                           "REACHY_MEMORY_APP_PERSON", "REACHY_MEMORY_APP_ROBOT")
_NAME = re.compile(r"\b(?:my name is|i am|i'm|call me)\s+([A-Z][\w'-]{0,40})", re.IGNORECASE)
_REMEMBER = re.compile(r"^\s*(?:please\s+)?remember(?:\s+that)?\s+(.{3,})$", re.IGNORECASE)


class MemoryApp(ReachyMiniApp):
    """A Reachy Mini app that remembers: records what the robot hears and says, greets
    people with what it remembers of them, nods when it learns something (module docstring)."""

    custom_app_url: str | None = "http://0.0.0.0:8042"
    request_media_backend: str | None = "no_media"

    def __init__(self, endpoint: str | None = None, config: Config | None = None, person: str | None = None,
                 startup_wait: float | None = None) -> None:
        """``endpoint``/``config``: the memory daemon (default: as every client finds it);
        ``person``: who is in front of the robot at start (default ``$REACHY_MEMORY_APP_PERSON``);
        ``startup_wait``: seconds to wait for the daemon (default ``$REACHY_MEMORY_APP_WAIT`` or 30)."""
        if URL_ENV in os.environ:  # before the base class: it serves the page at this address
            self.custom_app_url = os.environ[URL_ENV] or None
        super().__init__()
        self.endpoint, self.config = endpoint or _robot_endpoint(config), config
        self.person = (person or os.environ.get(PERSON_ENV) or "").strip() or None
        self.startup_wait = DEFAULT_WAIT if startup_wait is None else startup_wait
        if startup_wait is None and os.environ.get(WAIT_ENV):
            self.startup_wait = float(os.environ[WAIT_ENV])
        self.ticks = 0
        self.nods = 0
        self.said: list[str] = []
        self.heard = 0
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()  # from the settings page
        self._status: dict[str, Any] = {"memory_daemon": "starting", "person": self.person}
        if self.settings_app is not None:
            from reachy_memory.integrations.memory_app_page import add_routes  # fastapi: only with a page

            add_routes(self.settings_app, self)

    # -- what the settings page (another thread) may call -----------------------------------

    def hear(self, text: str, person: str | None = None) -> None:
        """Someone said ``text`` (to be recorded and answered by the loop, at its next tick)."""
        self._inbox.put(("heard", (text[:MAX_HEARD], person)))

    def set_person(self, name: str | None) -> None:
        """``name`` is in front of the robot (None: nobody), from the loop's next tick."""
        self._inbox.put(("person", name))

    def status(self) -> dict[str, Any]:
        """The app's state for the settings page: the daemon's, the person's, the counters."""
        return dict(self._status)

    # -- the app -------------------------------------------------------------------------------

    def run(self, reachy_mini: ReachyMini, stop_event: threading.Event) -> None:
        """Wait for the memory daemon, then the 50 Hz loop until ``stop_event``; raises
        DaemonUnavailableError when the daemon did not answer within ``startup_wait``."""
        bridge = MemoryBridge(self.endpoint, config=self.config).start()
        try:
            if not self._wait_for_daemon(bridge, stop_event):
                return
            _Loop(self, bridge, reachy_mini).run(stop_event)
        finally:
            bridge.close(CLOSE_TIMEOUT)

    def _wait_for_daemon(self, bridge: MemoryBridge, stop_event: threading.Event) -> bool:
        """True once the daemon answered the bridge's first fetch; False when told to stop
        first; DaemonUnavailableError after ``startup_wait`` seconds without an answer."""
        deadline = time.monotonic() + self.startup_wait
        while True:
            snapshot = bridge.latest()
            if snapshot.fetched_at and snapshot.error is None:
                log.info("memory daemon answers; remembering what is heard and said")
                return True
            if time.monotonic() >= deadline:
                why = snapshot.error or f"no answer within {self.startup_wait:g} s"
                self._status["memory_daemon"] = f"not running: {why}"
                raise DaemonUnavailableError(
                    f"the reachy-memory daemon is not running or not answering ({why}); start it "
                    "(`sudo systemctl start reachy-memory`, or `reachy-memory serve`), then start this app again")
            if stop_event.wait(0.05):
                return False


class _Loop:
    """The app's control loop: one tick every 20 ms, memory through the bridge only."""

    def __init__(self, app: MemoryApp, bridge: MemoryBridge, mini: ReachyMini) -> None:
        self.app, self.bridge, self.mini = app, bridge, mini
        self.person: str | None = None
        self.greeted: str | None = None  # the person greeted last
        self.known: tuple[str, ...] | None = None  # the facts about ``person`` seen so far
        self.nod_left = 0
        self.daemon_error: str | None = None

    def run(self, stop_event: threading.Event) -> None:
        if self.app.person:
            self._set_person(self.app.person)
        next_tick = time.monotonic()
        while not stop_event.is_set():
            self.tick()
            next_tick += TICK
            delay = next_tick - time.monotonic()
            if delay < -TICK:  # late by more than a tick (the process was stopped): start afresh
                next_tick, delay = time.monotonic(), 0.0
            stop_event.wait(max(delay, 0.0))

    def tick(self) -> None:
        app = self.app
        snapshot = self.bridge.latest()  # an attribute read and a non-blocking pipe read
        self._watch_daemon(snapshot)
        while True:
            try:
                kind, value = app._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "heard":
                self._hear(*value)
            else:
                self._set_person(value)
        if self.person and snapshot.person == self.person and snapshot.fetched_at:
            if self.known is None:
                self.known = snapshot.person_facts
            if self.greeted != self.person:
                self._say(_greeting(self.person, self.known))
                self.greeted = self.person
            elif set(snapshot.person_facts) - set(self.known):
                self.known, self.nod_left = snapshot.person_facts, NOD_TICKS
                app.nods += 1
        self.mini.set_target(head=_pose(app.ticks, self.nod_left > 0))
        self.nod_left = max(self.nod_left - 1, 0)
        app.ticks += 1
        if app.ticks % 25 == 0:
            self._publish(snapshot)

    def _watch_daemon(self, snapshot: MemorySnapshot) -> None:
        if snapshot.error != self.daemon_error:
            if snapshot.error:
                log.warning("memory daemon not answering (%s); writes wait for it", snapshot.error)
            else:
                log.info("memory daemon answers again")
            self.daemon_error = snapshot.error
            self._publish(snapshot)

    def _hear(self, text: str, person: str | None) -> None:
        self.app.heard += 1
        if person and person != self.person:
            self._set_person(person)
        named = _NAME.search(text)
        if named and named.group(1).capitalize() != self.person:
            self._set_person(named.group(1).capitalize())
        self.bridge.record_turn("user", text, person=self.person)
        told = _REMEMBER.match(text)
        if told:
            fact = told.group(1).strip().rstrip(".")
            self.bridge.remember(fact[:1].upper() + fact[1:], "fact", {"person": self.person} if self.person else None)
            self._say("I will remember that.")

    def _set_person(self, name: str | None) -> None:
        name = (name or "").strip() or None
        if name == self.person:
            return
        self.person, self.known, self.greeted = name, None, None
        self.bridge.set_current_person(name)
        self.app._status["person"] = name

    def _say(self, text: str) -> None:
        """What the robot says: printed (the dashboard's log) and recorded as its turn."""
        print(f"Reachy says: {text}", flush=True)
        self.app.said.append(text)
        del self.app.said[:-20]
        self.bridge.record_turn("assistant", text, person=self.person)

    def _publish(self, snapshot: MemorySnapshot) -> None:
        stats = self.bridge.stats
        self.app._status = {
            "memory_daemon": "running" if snapshot.error is None else f"not answering: {snapshot.error}",
            "person": self.person,
            "heard": self.app.heard,
            "said": len(self.app.said),
            "nods": self.app.nods,
            "ticks": self.app.ticks,
            "bridge": {"pending": self.bridge.pending, "dropped": stats.dropped, "errors": stats.errors,
                       "turns_lost": stats.turns_lost},
        }


def _robot_endpoint(config: Config | None) -> str | None:
    """The systemd unit's socket when nothing names another daemon and it is there, else None."""
    named = config is not None or any(os.environ.get(v) for v in ("REACHY_MEMORY_ENDPOINT", "REACHY_MEMORY_CONFIG"))
    return f"ipc://{ROBOT_SOCKET}" if not named and ROBOT_SOCKET.exists() else None


def _greeting(person: str, facts: tuple[str, ...]) -> str:
    if not facts:
        return f"Hello {person}! Tell me about yourself."
    return f"Hello {person}! I remember: {facts[0]}"


def _pose(tick: int, nodding: bool) -> Any:
    if nodding:
        return create_head_pose(pitch=12 * math.sin(tick * 0.6), degrees=True)
    return create_head_pose(yaw=8 * math.sin(tick * TICK * 2 * math.pi / 4), degrees=True)


def main(app_class: Callable[[], MemoryApp] = MemoryApp) -> int:
    """Run the app as the dashboard does (``python -u -m reachy_memory.main``) until SIGINT or
    SIGTERM; 0 once stopped, 1 (and one line on stderr) when the memory daemon is not running."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    app = app_class()

    def stop(signum: int, frame: Any) -> None:
        app.stop_event.set()

    signal.signal(signal.SIGINT, stop)  # the dashboard's stop: end the loop, not a KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    robot = os.environ.get(ROBOT_ENV)
    kwargs: dict[str, Any] = {}
    if robot:
        host, _, port = robot.rpartition(":")
        kwargs = {"host": host or "localhost", "port": int(port)}
    try:
        app.wrapped_run(**kwargs)
    except DaemonUnavailableError as exc:
        print(f"reachy-memory app: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


__all__ = ["CLOSE_TIMEOUT", "MemoryApp", "main"]

if __name__ == "__main__":  # the dashboard starts reachy_memory.main; this module works too
    sys.exit(main())
