"""Steps of the wall clock, seen against a steady clock (no I/O, clocks injectable).

A robot without a real-time-clock battery boots with the time of its last
shutdown, and NTP then steps the clock forward by hours or days; a glitch can
step it years ahead and back.  A memory's expiry is a wall-clock time, so an
expiry sweep run just after a forward step deletes what the step made look
expired, for good, even when the step is undone a minute later.  The daemon
asks :class:`ClockWatch` before each sweep and defers a sweep that follows a
forward step of more than :data:`STEP_SECONDS` by one ``cleanup_interval``
(reads hide expired memories meanwhile, as always).
"""

from __future__ import annotations

import time
from collections.abc import Callable

STEP_SECONDS = 300.0  # a forward step larger than this defers the next sweep (NTP slews smaller errors)


def steady_clock() -> float:
    """Seconds of a clock no one sets: since boot, suspend included (CLOCK_BOOTTIME),
    or ``time.monotonic`` where the system has no such clock."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


class ClockWatch:
    """How far the wall clock moved against the steady one between two calls of :meth:`step`."""

    def __init__(self, wall: Callable[[], float] | None = None, steady: Callable[[], float] = steady_clock) -> None:
        self._wall = wall or (lambda: time.time())  # looked up per call: tests move time
        self._steady = steady
        self._offset = self._offset_now()

    def _offset_now(self) -> float:
        return self._wall() - self._steady()

    def step(self) -> float:
        """Seconds the wall clock jumped since the last call (or creation): positive
        forward, negative back, ~0 when nobody set it.  Counts from now on."""
        offset = self._offset_now()
        moved, self._offset = offset - self._offset, offset
        return moved
