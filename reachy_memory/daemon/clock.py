"""Steps of the wall clock, seen against a steady clock (no I/O, clocks injectable).

A robot without a real-time-clock battery boots with the time of its last
shutdown, and NTP then steps the clock forward by hours or days; a glitch can
step it years ahead and back.  A memory's expiry is a wall-clock time, so an
expiry sweep run just after a forward step deletes what the step made look
expired, for good, even when the step is undone a minute later.  The daemon
asks :class:`ClockWatch` before each sweep and defers a sweep that follows a
forward step of more than :data:`STEP_SECONDS` by one ``cleanup_interval``
(reads hide expired memories meanwhile, as always).

Memories written before that first sync carry the stale time.  :class:`SyncWatch`
tells NTP's first sync from any other step by the kernel's own flag
(:func:`clock_synchronized`, what ``timedatectl`` shows as "System clock
synchronized"): a step of more than :data:`STEP_SECONDS` seen while the flag went
from unsynchronised to synchronised yields a :class:`Redate` of the memories written
since boot, which the daemon journals (``MemoryStore.redate``).  A step without that
transition (a glitch, a hand-set date, a system without the flag) yields nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STEP_SECONDS = 300.0  # a forward step larger than this defers the next sweep (NTP slews smaller errors)


SYNC_GRACE_SECONDS = 60.0  # a step waits this long for the kernel's flag to say synchronised
FLAG_EVERY_SECONDS = 1.0  # the flag is read at most this often while the clock does not step
_TIME_ERROR = 5  # adjtimex's return: the clock is not synchronised
_STA_UNSYNC = 0x0040  # struct timex status bit: the clock is not synchronised


class _Timex(ctypes.Structure):
    """The head of Linux's ``struct timex`` (``long`` fields, as the C library's
    ``adjtimex`` takes it), then room for the rest, which is never read."""

    _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
                ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                ("rest", ctypes.c_char * 256)]


def clock_synchronized() -> bool | None:
    """The kernel's view of the wall clock: True once an NTP daemon (systemd-timesyncd,
    chrony) has synchronised it, False before, None when it cannot be read (not Linux,
    no C library, the call failed).  Reads only (``adjtimex`` with modes 0); never raises."""
    adjtimex = _adjtimex()
    if adjtimex is None:
        return None
    timex = _Timex()  # modes 0: read, change nothing
    state = adjtimex(ctypes.byref(timex))
    if state < 0:
        return None
    return state != _TIME_ERROR and not timex.status & _STA_UNSYNC


@functools.cache
def _adjtimex() -> Any:
    """The C library's ``adjtimex``, or None (not Linux, no such library or symbol)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").adjtimex
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.POINTER(_Timex)], ctypes.c_int
    return function


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
        self.at = steady()  # steady time of the last reading
        self.offset = self._wall() - self.at  # wall minus steady at that reading

    def step(self) -> float:
        """Seconds the wall clock jumped since the last call (or creation): positive
        forward, negative back, ~0 when nobody set it.  Counts from now on."""
        self.at = self._steady()
        offset = self._wall() - self.at
        moved, self.offset = offset - self.offset, offset
        return moved


@dataclass(frozen=True)
class Redate:
    """Memories created in ``[since, until)`` by the stale clock move by ``delta`` seconds."""

    since: float
    until: float
    delta: float


class SyncWatch:
    """Tells NTP's first sync (a step of the wall clock while the kernel's flag goes from
    unsynchronised to synchronised) from other steps.  Owned by one thread (the daemon's
    engine thread): :meth:`check` is cheap enough for every idle tick (two clock reads;
    the flag only when a step is seen or a second has passed)."""

    def __init__(self, wall: Callable[[], float] | None = None, steady: Callable[[], float] = steady_clock,
                 synced: Callable[[], bool | None] = clock_synchronized, *, after: float = 0.0) -> None:
        """``after``: the latest time the store held when the daemon started.  A stale period
        starts after it: a clock restored at boot from a time saved before the last boot's
        end (a power cut) starts below that boot's last memories, which were dated right."""
        self._clock = ClockWatch(wall, steady)
        self._synced = synced
        self._after = math.nextafter(after, math.inf)
        self._flag, self._flag_at = synced(), self._clock.at
        self._pending: Redate | None = None  # a step seen while unsynchronised, waiting for the flag
        self._pending_until = 0.0  # steady time: the pending step is dropped after this

    def check(self) -> Redate | None:
        """A :class:`Redate` when NTP's first sync stepped the clock since the last call
        (or within :data:`SYNC_GRACE_SECONDS` of a step seen unsynchronised), else None."""
        old, last_at = self._clock.offset, self._clock.at
        step = self._clock.step()
        now, since_last = self._clock.at, self._clock.at - last_at
        if abs(step) > STEP_SECONDS:
            self._step_seen(old, step, now, attributable=abs(step) > since_last)
        elif now - self._flag_at >= FLAG_EVERY_SECONDS:
            self._read_flag(now)
        return self._take_pending(now)

    def _step_seen(self, old: float, step: float, now: float, *, attributable: bool) -> None:
        """A step of ``step`` seconds from offset ``old``: pending when the flag read
        unsynchronised before it.  The stale period runs from boot (steady 0), or from
        just after the store's latest time at the daemon's start if later, to now, both by
        the old clock.  Not ``attributable`` (the step is smaller than the time
        since the last reading): times written after it could fall in that period."""
        before = self._flag
        self._read_flag(now)
        since, until = max(old, self._after, 0.0), max(old + now, 0.0)
        stale = before is False and attributable and since < until
        self._pending = Redate(since, until, step) if stale else None
        self._pending_until = now + SYNC_GRACE_SECONDS

    def _read_flag(self, now: float) -> None:
        self._flag, self._flag_at = self._synced(), now

    def _take_pending(self, now: float) -> Redate | None:
        """The pending redate once the flag reads synchronised; dropped after the grace."""
        pending = self._pending
        if pending is not None and now > self._pending_until:
            self._pending = pending = None  # the flag came too late to be this step's
        if pending is None or self._flag is not True:
            return None
        self._pending = None
        return pending
