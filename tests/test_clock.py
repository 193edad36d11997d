"""Steps of the wall clock (a robot without a real-time clock: a stale boot, then NTP;
a glitch years ahead and back): what the store and the daemon keep through them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_util import WallClock

from reachy_memory import Config, MemoryStore, MemoryType
from reachy_memory.daemon.clock import STEP_SECONDS, SYNC_GRACE_SECONDS, ClockWatch, SyncWatch, clock_synchronized
from reachy_memory.storage import backup as bk

pytestmark = pytest.mark.timeout(60)

NOW = 1_795_000_000.0  # 2026-11-18 (a fixed "real" time: the tests move the wall clock around it)
DAY = 86_400.0
YEARS_14 = 14 * 365 * DAY


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> WallClock:
    return WallClock(monkeypatch, NOW)


@pytest.fixture
def store(config: Config) -> Iterator[MemoryStore]:
    with MemoryStore(config=config.replace("memory", timezone="UTC"), embedder=None) as s:
        yield s


@pytest.fixture
def daemon(store: MemoryStore, tmp_path: Path, wall: WallClock) -> Iterator[Any]:
    """A daemon over ``store``, made but not serving (built on another thread: it installs
    no signal handlers there); the test calls its engine-thread methods itself."""
    from reachy_memory.daemon.server import Daemon

    made: list[Daemon] = []
    maker = threading.Thread(target=lambda: made.append(Daemon(  # no sync flag: the host's own is not the test's
        store._config, store=store, endpoint=f"ipc://{tmp_path}/run/m.sock", clock_sync=lambda: None)))
    maker.start()
    maker.join(30)
    yield made[0]
    made[0]._endpoint_lock.release()
    made[0]._ctx.term()


class SyncedClock:
    """The steady clock (seconds since boot) and the kernel's sync flag, set by hand."""

    def __init__(self) -> None:
        self.steady = 1000.0
        self.synced: bool | None = False


@pytest.fixture
def kernel() -> SyncedClock:
    return SyncedClock()


def _watch(daemon: Any, wall: WallClock, kernel: SyncedClock) -> None:
    """The daemon's clock watches on the test's clocks."""
    daemon.upkeep.sync_watch = SyncWatch(lambda: wall.at, lambda: kernel.steady, lambda: kernel.synced)
    daemon.upkeep.clock_watch = ClockWatch(lambda: wall.at, lambda: kernel.steady)


def _later(wall: WallClock, kernel: SyncedClock, seconds: float) -> None:
    wall.at += seconds
    kernel.steady += seconds


def _turns(store: MemoryStore, n: int) -> list[str]:
    return [store.record_turn("user", f"turn {i} about the garden").id for i in range(n)]


# -- the sweep after a step of the clock -------------------------------------------------------

@pytest.mark.parametrize(("step", "first_sweep_runs"), [
    (0.0, True),  # nobody set the clock: the sweep deletes what expired
    (60.0, True),  # NTP correcting a small error: below STEP_SECONDS, an ordinary sweep
    (-DAY, True),  # a step back makes nothing look expired that was not: no reason to wait
    (3 * DAY, False),  # the first NTP sync after a stale boot: deferred once, then swept
    (YEARS_14, False),  # a glitch years ahead: deferred (undone meanwhile, it deletes nothing)
])
def test_a_sweep_right_after_a_forward_step_of_the_clock_waits_one_interval(
        store: MemoryStore, daemon: Any, wall: WallClock, step: float, first_sweep_runs: bool) -> None:
    wall.at = NOW - 2 * DAY
    old = store.set_context("task", "yesterday's chores").id  # expired at NOW (end of its day)
    wall.at = NOW
    daemon.upkeep.cleanup()  # the sweep of the daemon's start: the clock has not moved
    assert store.get(old, now=NOW - 2 * DAY) is None
    kept = store.set_context("task2", "today's chores").id
    wall.at = NOW + step
    daemon.upkeep.cleanup()
    swept = first_sweep_runs and step >= DAY  # today's context is then past its day too
    assert daemon.upkeep.last_cleanup["deleted"] == int(swept)
    held = store.stats()
    assert held["memories"] + held["expired_unswept"] == 1 - int(swept)  # a deferred sweep deleted nothing
    assert ("deferred_s" in daemon.upkeep.last_cleanup) is not first_sweep_runs
    daemon.upkeep.cleanup()  # the next interval, the clock steady: swept whatever happened before
    assert "deferred_s" not in daemon.upkeep.last_cleanup
    assert (store.get(kept, now=NOW) is None) is (step >= DAY)


def test_a_clock_glitch_years_ahead_and_back_deletes_nothing(
        store: MemoryStore, daemon: Any, wall: WallClock) -> None:
    """Before the deferral, the hourly sweep that met a glitch to 2040 deleted every
    conversation turn and context entry for good; the clock came back a minute later."""
    ids = [*_turns(store, 5), store.set_context("task", "reading").id]
    fact = store.remember_fact("Anna likes green tea").id
    daemon.upkeep.cleanup()
    wall.at = NOW + YEARS_14
    daemon.upkeep.cleanup()
    wall.at = NOW + 60
    daemon.upkeep.cleanup()
    assert [i for i in [*ids, fact] if store.get(i) is None] == []
    assert daemon.upkeep.last_cleanup["deleted"] == 0 and "deferred_s" not in daemon.upkeep.last_cleanup


def test_uptime_follows_a_steady_clock_not_the_wall_clock(daemon: Any, wall: WallClock) -> None:
    """``uptime_s`` was wall-clock time since start: a step back gave a negative uptime, NTP's
    first sync days of uptime."""
    for at in (NOW - DAY, NOW + 3 * DAY):
        wall.at = at
        assert 0 <= daemon.health()["uptime_s"] < 60
        assert 0 <= daemon.stats()["uptime_s"] < 60


@pytest.mark.parametrize(("wall_moves", "steady_moves", "step"), [
    (10.0, 10.0, 0.0),  # time passing: both clocks move alike
    (3 * DAY + 10, 10.0, 3 * DAY),  # NTP stepped the wall clock 3 days ahead meanwhile
    (10.0 - DAY, 10.0, -DAY),  # a step back
])
def test_clock_watch_reports_a_step_once(wall_moves: float, steady_moves: float, step: float) -> None:
    clocks = {"wall": NOW, "steady": 100.0}
    watch = ClockWatch(lambda: clocks["wall"], lambda: clocks["steady"])
    clocks["wall"] += wall_moves
    clocks["steady"] += steady_moves
    assert watch.step() == pytest.approx(step)
    assert watch.step() == 0.0  # counted from the last call on
    assert STEP_SECONDS < DAY


# -- what a step leaves consistent in the store --------------------------------------------------

def _state(store: MemoryStore) -> tuple[Any, ...]:
    st = store._state
    last = st.last_turn
    rows = sorted((r.id, r.created, r.expires, r.follows, r.previous_text) for r in st.records.values())
    return rows, last.id if last is not None else None, st.window_view


@pytest.mark.parametrize("steps", [
    [-2 * 3600.0],  # NTP correcting a clock that ran 2 h ahead
    [3 * DAY],  # a stale boot's first NTP sync
    [YEARS_14, -YEARS_14 + 60],  # a glitch years ahead, and back
    [-40 * DAY, 40 * DAY],  # a hand-set date in the past, then corrected
])
def test_a_store_written_across_clock_steps_replays_to_the_same_state_and_verifies(
        config: Config, wall: WallClock, steps: list[float]) -> None:
    cfg = config.replace("memory", timezone="UTC")
    with MemoryStore(config=cfg, embedder=None) as s:
        _turns(s, 3)
        for step in steps:
            wall.at += step
            _turns(s, 2)
            s.set_context("task", f"at {wall.at}")
            s.remember_fact(f"a fact told at {wall.at}")
            s.cleanup_expired()
        live = _state(s)
    with MemoryStore(config=cfg, embedder=None) as s:
        assert _state(s) == live
        assert s.get_context("task") == f"at {wall.at}"
        assert len([m for m in s.export_page()[0] if m.memory_type is MemoryType.FACT]) == len(steps)
    assert bk.verify(cfg.memory.path).problems == []


# -- NTP's first sync: the stale period redated --------------------------------------------------

def _stale_boot(store: MemoryStore, daemon: Any, wall: WallClock, kernel: SyncedClock, step: float,
                synced: bool | None) -> dict[str, str]:
    """A boot 1000 s ago with the clock ``step`` behind, the flag reading ``synced``; a fact
    of an earlier boot (dated before this boot by the stale clock), then a context and
    two turns written by the stale clock."""
    wall.at, kernel.steady, kernel.synced = NOW - step, 1000.0, synced
    _watch(daemon, wall, kernel)
    earlier = store.store_batch([{"content": "a fact of an earlier boot", "created_at": NOW - step - 1005.0}])
    _later(wall, kernel, 10.0)
    ids = {"earlier": earlier[0].id, "context": store.set_context("task", "water the garden").id}
    ids.update({f"turn{i}": t for i, t in enumerate(_turns(store, 2))})
    _later(wall, kernel, 10.0)
    daemon.upkeep.check_sync()  # an idle tick: no step yet
    return ids


def _times(store: MemoryStore) -> dict[str, tuple[float, float | None]]:
    return {r.id: (r.created, r.expires) for r in store._state.records.values()}


@pytest.mark.parametrize(("step", "before", "after", "redated"), [
    (3 * DAY, False, True, True),  # NTP's first sync after a stale boot: the stale period set right
    (-DAY, False, True, True),  # the first sync sets a clock that ran a day ahead back
    (3 * DAY, True, True, False),  # a step while synchronised: a glitch, or a date set by hand
    (YEARS_14, True, True, False),  # a glitch years ahead while synchronised
    (3 * DAY, False, False, False),  # a date set by hand before any sync: the flag stays unsynchronised
    (3 * DAY, None, None, False),  # no flag to read (not Linux): never redated
    (60.0, False, True, False),  # the first sync without a large step: NTP slews, nothing to set right
])
def test_only_a_large_step_at_the_flags_first_sync_redates_the_stale_period(
        store: MemoryStore, daemon: Any, wall: WallClock, kernel: SyncedClock, step: float,
        before: bool | None, after: bool | None, redated: bool) -> None:
    ids = _stale_boot(store, daemon, wall, kernel, step, before)
    stale = _times(store)
    wall.at += step
    kernel.synced = after
    _later(wall, kernel, 0.05)  # the next idle tick, 50 ms on
    daemon.upkeep.check_sync()
    moved = {i for i, times in _times(store).items() if times != stale[i]}
    assert moved == ({ids["context"], ids["turn0"], ids["turn1"]} if redated else set())
    for memory_id in moved:
        created, expires = stale[memory_id]
        assert _times(store)[memory_id] == (created + step, expires + step)
    assert (daemon.upkeep.last_redate is not None) is redated
    assert (daemon.health()["last_redate"] or {}).get("memories") == (3 if redated else None)
    assert daemon.upkeep.check_sync() is None and _times(store) == (_times(store) if redated else stale)


def test_a_context_set_before_the_sync_outlives_it_and_ends_with_its_corrected_day(
        store: MemoryStore, daemon: Any, wall: WallClock, kernel: SyncedClock) -> None:
    """Before the redate, the sync hid the context at once (its stale day had ended) and
    the sweep one interval later deleted it; turns were three days old (out of the window)."""
    ids = _stale_boot(store, daemon, wall, kernel, 3 * DAY, False)
    daemon.upkeep.cleanup()  # the start-up sweep, by the stale clock
    wall.at += 3 * DAY
    kernel.synced = True
    daemon.upkeep.cleanup()  # the sweep after the sync: the sync seen first, then the sweep deferred
    assert "deferred_s" in daemon.upkeep.last_cleanup and daemon.upkeep.last_redate["delta_s"] == 3 * DAY
    assert store.get_context("task") == "water the garden"
    assert len(store.get_context_window()) == 2
    _later(wall, kernel, 3600.0)
    daemon.upkeep.cleanup()  # the next interval: swept, the context still in its day
    assert daemon.upkeep.last_cleanup["deleted"] == 0 and store.get_context("task") == "water the garden"
    end_of_day = NOW - NOW % DAY + DAY
    assert store.get(ids["context"]).expires_at.timestamp() == end_of_day
    _later(wall, kernel, end_of_day - wall.at)
    daemon.upkeep.cleanup()
    assert daemon.upkeep.last_cleanup["deleted"] == 1 and store.get_context("task") is None
    assert bk.verify(store.path).problems == []


@pytest.mark.parametrize(("flag_after", "redated"), [
    (0.0, True),  # systemd-timesyncd: the step and the flag in one call
    (5.0, True),  # chrony may set the flag after its step: the step waits for it
    (SYNC_GRACE_SECONDS + 1.0, False),  # too late to tie the flag to this step
])
def test_a_step_waits_a_while_for_the_flag(store: MemoryStore, daemon: Any, wall: WallClock,
                                           kernel: SyncedClock, flag_after: float, redated: bool) -> None:
    _stale_boot(store, daemon, wall, kernel, 3 * DAY, False)
    wall.at += 3 * DAY
    daemon.upkeep.check_sync()  # the step seen, the flag still unsynchronised
    assert daemon.upkeep.last_redate is None or flag_after == 0.0
    _later(wall, kernel, flag_after)
    kernel.synced = True
    _later(wall, kernel, 1.0)  # the flag is read at most once a second
    daemon.upkeep.check_sync()
    assert (daemon.upkeep.last_redate is not None) is redated


@pytest.mark.parametrize(("since_last_check", "step", "pending"), [
    (0.05, 3 * DAY, True),  # an idle tick later: only the stale clock dated what came before
    (400.0, 350.0, False),  # a step smaller than the time since the last reading: times written
                            # after it could fall in the stale period, so it is not attributed
    (400.0, 3 * DAY, True),  # a long job between the readings, but a step far larger than it
])
def test_sync_watch_attributes_a_step_only_when_the_periods_cannot_mix(
        since_last_check: float, step: float, pending: bool) -> None:
    clocks: dict[str, Any] = {"wall": NOW, "steady": 500.0, "synced": False}
    watch = SyncWatch(lambda: clocks["wall"], lambda: clocks["steady"], lambda: clocks["synced"])
    clocks["wall"] += since_last_check + step
    clocks["steady"] += since_last_check
    clocks["synced"] = True
    redate = watch.check()
    assert (redate is not None) is pending
    if redate is not None:  # boot and the reading's moment, by the old clock
        assert (redate.since, redate.until, redate.delta) == pytest.approx(
            (NOW - 500.0, NOW + since_last_check, step))


def test_the_engine_thread_redates_at_an_idle_tick(
        store: MemoryStore, daemon: Any, wall: WallClock, kernel: SyncedClock) -> None:
    _stale_boot(store, daemon, wall, kernel, 3 * DAY, False)
    wall.at += 3 * DAY
    kernel.synced = True
    engine = threading.Thread(target=daemon.lanes.engine_loop)
    engine.start()
    try:
        deadline = time.monotonic() + 10
        while daemon.upkeep.last_redate is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        daemon.lanes.engine_q.put(None)
        engine.join(10)
    assert daemon.upkeep.last_redate is not None and daemon.upkeep.last_redate["memories"] == 3


def test_a_previous_boots_memories_inside_the_stale_period_keep_their_times(
        store: MemoryStore, daemon: Any, wall: WallClock, kernel: SyncedClock) -> None:
    """After a power cut the clock is restored from a time saved before the last boot
    ended: this boot's stale period then starts below that boot's last memories, which
    were dated right.  The period starts after what the store held at the daemon's start."""
    wall.at, kernel.steady, kernel.synced = NOW - 3 * DAY, 30.0, False  # restored 10 min behind the last boot's end
    last_boot = store.store_batch([{"content": "said just before the power cut", "created_at": wall.at + 600.0}])
    daemon.upkeep.sync_watch = SyncWatch(lambda: wall.at, lambda: kernel.steady, lambda: kernel.synced,
                             after=store.latest_time())  # as the daemon makes it at its start
    _later(wall, kernel, 300.0)
    early = _turns(store, 1)[0]  # this boot's, but dated among the last boot's: left as it is
    _later(wall, kernel, 600.0)
    late = _turns(store, 1)[0]  # dated after everything of the last boot: this boot's
    stale = _times(store)
    wall.at += 3 * DAY
    kernel.synced = True
    _later(wall, kernel, 0.05)
    daemon.upkeep.check_sync()
    moved = {i for i, times in _times(store).items() if times != stale[i]}
    assert moved == {late} and last_boot[0].id not in moved and early not in moved
    assert daemon.upkeep.last_redate["since"] > stale[last_boot[0].id][0]


def test_the_kernel_flag_reads_as_a_bool_or_none() -> None:
    assert clock_synchronized() in (True, False, None)
