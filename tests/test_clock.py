"""Steps of the wall clock (a robot without a real-time clock: a stale boot, then NTP;
a glitch years ahead and back): what the store and the daemon keep through them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import Config, MemoryStore, MemoryType
from reachy_memory import backup as bk
from reachy_memory._clock import STEP_SECONDS, ClockWatch

pytestmark = pytest.mark.timeout(60)

NOW = 1_795_000_000.0  # 2026-11-18 (a fixed "real" time: the tests move the wall clock around it)
DAY = 86_400.0
YEARS_14 = 14 * 365 * DAY


class WallClock:
    """``time.time`` for the test's process, set by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: float) -> None:
        self.at = at
        monkeypatch.setattr(time, "time", lambda: self.at)


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
    from reachy_memory.server import Daemon

    made: list[Daemon] = []
    maker = threading.Thread(target=lambda: made.append(Daemon(store._config, store=store,
                                                                endpoint=f"ipc://{tmp_path}/run/m.sock")))
    maker.start()
    maker.join(30)
    yield made[0]
    made[0]._endpoint_lock.release()
    made[0]._ctx.term()


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
    daemon._cleanup()  # the sweep of the daemon's start: the clock has not moved
    assert store.get(old, now=NOW - 2 * DAY) is None
    kept = store.set_context("task2", "today's chores").id
    wall.at = NOW + step
    daemon._cleanup()
    swept = first_sweep_runs and step >= DAY  # today's context is then past its day too
    assert daemon.last_cleanup["deleted"] == int(swept)
    assert len(store) == 1 - int(swept)
    assert ("deferred_s" in daemon.last_cleanup) is not first_sweep_runs
    daemon._cleanup()  # the next interval, the clock steady: swept whatever happened before
    assert "deferred_s" not in daemon.last_cleanup
    assert (store.get(kept, now=NOW) is None) is (step >= DAY)


def test_a_clock_glitch_years_ahead_and_back_deletes_nothing(
        store: MemoryStore, daemon: Any, wall: WallClock) -> None:
    """Before the deferral, the hourly sweep that met a glitch to 2040 deleted every
    conversation turn and context entry for good; the clock came back a minute later."""
    ids = [*_turns(store, 5), store.set_context("task", "reading").id]
    fact = store.remember_fact("Anna likes green tea").id
    daemon._cleanup()
    wall.at = NOW + YEARS_14
    daemon._cleanup()
    wall.at = NOW + 60
    daemon._cleanup()
    assert [i for i in [*ids, fact] if store.get(i) is None] == []
    assert daemon.last_cleanup["deleted"] == 0 and "deferred_s" not in daemon.last_cleanup


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
