"""What the daemon's engine thread does besides answering requests: index upkeep in
its idle time, the scheduled expiry sweep, the redate after NTP's first sync, and
heap trims.

Everything here runs on the engine thread (the one thread that changes the store),
so the state below has one writer: the engine thread.  The I/O thread reads
``last_cleanup`` and ``last_redate`` (``health``; each replaced whole) and sets
``trim_due``; the handlers of ``cleanup_expired`` and ``apply_retention`` (engine
thread too) report their sweeps through :meth:`Upkeep.swept`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from reachy_memory._threads import release_free_heap
from reachy_memory.config import Config
from reachy_memory.daemon.clock import STEP_SECONDS, ClockWatch, Redate, SyncWatch, clock_synchronized
from reachy_memory.errors import ReachyMemoryError

log = logging.getLogger(__name__)

__all__ = ["IDLE_SLICE", "IDLE_STEP", "Upkeep"]

IDLE_STEP = 8  # vectors (or buried records) per upkeep step: 2-4 ms of graph insertion on this VM
IDLE_SLICE = 0.04  # seconds of upkeep per idle tick (the engine then checks its queue again)
UPKEEP_PAUSE_SECONDS = 60.0  # after an unexpected fault in idle upkeep (not retried every 50 ms)


class Upkeep:
    """The engine thread's work between requests and on schedule.

    ``quiet()`` says whether nothing waits for the engine (idle work may run) and
    ``last_request()`` when the latest request arrived (monotonic): both are the
    lanes', read here.
    """

    def __init__(self, store: Any, config: Config, *, quiet: Callable[[], bool], last_request: Callable[[], float],
                 clock_sync: Callable[[], bool | None] = clock_synchronized) -> None:
        self.store, self.config = store, config
        self._quiet, self._last_request = quiet, last_request
        self.clock_watch = ClockWatch()  # a forward step of the wall clock defers a sweep
        # NTP's first sync redates the stale period (after what the store held at start)
        self.sync_watch = SyncWatch(synced=clock_sync, after=store.latest_time())
        self.last_redate: dict[str, Any] | None = None
        self.last_cleanup: dict[str, Any] | None = None
        self.trim_due = threading.Event()  # the I/O loop sets it every server.heap_trim_seconds
        self.trims: list[float] = []  # durations (ms) of the last heap trims
        self.paused_until = 0.0  # idle upkeep stays off until then (monotonic) after a fault
        self.left = False  # the last idle slice ended with index work left

    # -- idle time -----------------------------------------------------------------------

    def idle(self) -> bool:
        """Index upkeep in small steps (``IDLE_STEP`` vectors, 2-4 ms) for up to
        ``IDLE_SLICE`` seconds, stopping as soon as a request is in flight: one step
        of 256 vectors held the engine ~50 ms, and a search arriving then waited for
        it (p99 43.5 ms, max 76 ms while 3,000 new vectors went into the graphs).
        A heap trim that is due goes first (:meth:`trim_heap`).
        Returns True when work is left (the engine then comes back sooner)."""
        if time.monotonic() < self.paused_until:
            return False
        if self.trim_due.is_set() and self._quiet():
            self.trim_due.clear()
            self.trim_heap()
        until = time.monotonic() + IDLE_SLICE
        try:
            while self._quiet() and time.monotonic() < until:
                if not self.store.maintain(budget=IDLE_STEP, save_cache=self._quiet_for_a_while()):
                    return False  # nothing left, or nothing doable yet (graphs still loading)
        except ReachyMemoryError as exc:
            log.warning("index maintenance failed: %s", exc)
            return False
        except Exception:  # a fault in upkeep must not end the engine thread: no request would be answered
            log.exception("index maintenance failed; idle upkeep pauses for %.0f s", UPKEEP_PAUSE_SECONDS)
            self.paused_until = time.monotonic() + UPKEEP_PAUSE_SECONDS
            return False
        return True

    def _quiet_for_a_while(self) -> bool:
        """No request for ``server.graph_cache_quiet_seconds``: a graph cache save (tens of
        milliseconds at 100k memories, holding the GIL) may run without meeting one."""
        return time.monotonic() - self._last_request() >= self.config.server.graph_cache_quiet_seconds

    def trim_heap(self) -> None:
        """Give the C heap's free pages back (``malloc_trim``, 1-6 ms at 10k memories),
        on the engine thread when no request is in flight.  A request arriving
        during it may wait: the trim holds each malloc arena while it walks it, so
        even the I/O thread's inline answers can block on ``malloc`` that long.
        Embedding frees its activations every call and the freed space stays
        scattered through the heap: 30 s after a 2-minute mixed load
        (``tools/bench_daemon.py``) RSS was 180 MB without trims and 173-177 MB
        with them.  Under a continuous load it gains nothing lasting (the heap
        fills again within seconds: peak 186 MB either way), so it waits for idle time."""
        started = time.monotonic()
        if release_free_heap():
            self.trims = [*self.trims[-99:], (time.monotonic() - started) * 1000]

    def trim_summary(self) -> dict[str, float | None]:
        """Count, median and max (ms; None before the first) of the last heap trims."""
        trims = self.trims
        if not trims:
            return {"recent": 0, "p50_ms": None, "max_ms": None}
        return {"recent": len(trims), "p50_ms": round(float(np.median(trims)), 3), "max_ms": round(max(trims), 3)}

    # -- the wall clock ----------------------------------------------------------------------

    def check_sync(self) -> None:
        """Redate the memories written since boot when NTP's first sync has just stepped
        the wall clock (``clock.SyncWatch``); two clock reads otherwise.  Never raises:
        a failure is logged and the memories keep their times."""
        try:
            redate = self.sync_watch.check()
            if redate is not None:
                self._redate(redate)
        except Exception:  # the engine thread must go on answering
            log.exception("redating the memories written before the clock's first sync failed")

    def _redate(self, redate: Redate) -> None:
        """Journal and apply ``redate`` (``MemoryStore.redate``), log it, show it in ``health``."""
        moved = self.store.redate(redate.since, redate.until, redate.delta)
        self.last_redate = {"time": time.time(), "memories": moved, "delta_s": round(redate.delta, 3),
                            "since": redate.since, "until": redate.until}
        log.warning("NTP's first sync stepped the wall clock by %+.0f s: %d memories written since boot by the "
                    "stale clock redated by that much", redate.delta, moved)

    # -- the expiry sweep --------------------------------------------------------------------

    def cleanup(self) -> None:
        """The scheduled expiry sweep, deferred by one interval when the wall clock just
        stepped forward (see ``clock``): a step undone meanwhile deletes nothing then.
        NTP's first sync, seen first, redates what the stale clock dated (:meth:`check_sync`)."""
        self.check_sync()
        step = self.clock_watch.step()
        if step > STEP_SECONDS:
            self.last_cleanup = {"time": time.time(), "deleted": 0, "duration_ms": None, "deferred_s": round(step, 3)}
            log.warning("the wall clock stepped forward by %.0f s since the last expiry sweep: sweep deferred by "
                        "one cleanup_interval (a clock glitch would otherwise delete memories for good)", step)
            return
        started = time.monotonic()
        deleted = self.store.cleanup_expired()
        took = (time.monotonic() - started) * 1000
        self.swept(deleted, round(took, 3))
        log.info("cleanup_expired: deleted %d expired memories in %.1f ms (%d remain)", deleted, took, len(self.store))

    def swept(self, deleted: int, duration_ms: float | None = None) -> None:
        """Show a sweep in ``health`` (``last_cleanup``): the scheduled one, or one a client asked for."""
        self.last_cleanup = {"time": time.time(), "deleted": deleted, "duration_ms": duration_ms}
