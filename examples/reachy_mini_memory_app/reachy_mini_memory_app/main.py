"""``MemoryGreeter``: a Reachy Mini app that uses reachy-memory from its control loop.

It greets the person in front of it (``REACHY_MEMORY_DEMO_PERSON``, default
"friend") with the facts it remembers about them, records the greeting as a
conversation turn, sways its head gently at 50 Hz, and nods whenever a new fact
about that person appears in memory (stored by an LLM's ``remember`` tool, the
CLI or another app).  Every memory call goes through
:class:`~reachy_memory.integrations.reachy_mini.MemoryBridge`: the loop only
reads the bridge's last snapshot and queues jobs, so memory never makes a tick
late.  It stops within one tick of ``stop_event`` (the app manager's SIGINT).

Install beside reachy-memory (``pip install -e examples/reachy_mini_memory_app``);
the robot's dashboard lists it through the ``reachy_mini_apps`` entry point.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

from reachy_mini import ReachyMini
from reachy_mini.apps.app import ReachyMiniApp
from reachy_mini.utils import create_head_pose

from reachy_memory.config import Config
from reachy_memory.integrations.reachy_mini import MemoryBridge

TICK = 0.02  # 50 Hz
NOD_TICKS = 25  # half a second of nodding per new fact


class MemoryGreeter(ReachyMiniApp):
    """Greets with memories; nods when it learns something new."""

    dont_start_webserver = True
    request_media_backend = "no_media"

    def __init__(self, endpoint: str | None = None, config: Config | None = None, person: str | None = None) -> None:
        super().__init__()
        self.endpoint, self.config = endpoint, config
        self.person = person or os.environ.get("REACHY_MEMORY_DEMO_PERSON", "friend")
        self.ticks = 0
        self.nods = 0

    def run(self, reachy_mini: ReachyMini, stop_event: threading.Event) -> None:
        """The app's loop: 50 Hz head motion, memory through the bridge only."""
        with MemoryBridge(self.endpoint, config=self.config, refresh_interval=0.2) as bridge:
            bridge.set_current_person(self.person)
            greeted = False
            known: tuple[str, ...] | None = None
            nod_left = 0
            while not stop_event.is_set():
                snapshot = bridge.latest()  # an attribute read: no I/O on the loop
                if snapshot.person == self.person and known is None:
                    known = snapshot.person_facts
                if not greeted and known is not None:
                    bridge.record_turn("assistant", _greeting(self.person, known), person=self.person)
                    greeted = True
                if known is not None and snapshot.person == self.person and set(snapshot.person_facts) - set(known):
                    known, nod_left = snapshot.person_facts, NOD_TICKS
                    self.nods += 1
                reachy_mini.set_target(head=_pose(self.ticks, nod_left > 0))
                nod_left = max(nod_left - 1, 0)
                self.ticks += 1
                stop_event.wait(TICK)


def _greeting(person: str, facts: tuple[str, ...]) -> str:
    if not facts:
        return f"Hello {person}! Tell me about yourself."
    return f"Hello {person}! I remember: {facts[0]}"


def _pose(tick: int, nodding: bool) -> Any:
    if nodding:
        return create_head_pose(pitch=12 * math.sin(tick * 0.6), degrees=True)
    return create_head_pose(yaw=8 * math.sin(tick * TICK * 2 * math.pi / 4), degrees=True)
