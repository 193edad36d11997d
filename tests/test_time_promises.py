"""The time promises over weeks of simulated robot life: random sequences of writes,
clock advances (to expiry boundaries too), sweeps, compactions, reopens (clean or after a crash,
with another zone or TTL), retention changes, checked against a small model.

The model: a CONVERSATION turn lives ``conversation_ttl_days`` from its creation, a
FACT forever, a CONTEXT until the first second of the next local day in the zone the
store had when it was written; a memory is gone for every reader (get, get_context,
search, export, ``len`` and ``stats``' counts) from its expiry on, swept or not; a
sweep, and only a sweep (or a retention change), takes the expired ones out of the
store (``stats``' ``expired_unswept``, ``verify``'s count); a reopen, a crash and
``verify`` see what the live store held; the window shows the last turns not older
than ``context_window_max_age_minutes``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_util import abandon

from reachy_memory import Config, MemoryStore, NotFoundError
from reachy_memory.storage import backup as bk

pytestmark = pytest.mark.timeout(120)

DAY = 86_400.0
ZONES = ("Europe/Paris", "America/Santiago", "Australia/Lord_Howe", "UTC")
# starts a few days before a change of offset in one of the zones (Paris 03-29 and 10-25;
# Santiago 04-05 at midnight back to 23:00, 09-06 at midnight to 01:00; Lord Howe 04-05
# and 10-04, half an hour)
STARTS = tuple(datetime(2026, *md, tzinfo=UTC).timestamp() for md in ((3, 26), (4, 2), (9, 3), (10, 1), (10, 22)))
WINDOW_TURNS = 3
MAX_AGE_MIN = 240.0


def end_of_local_day(created: float, zone: str) -> float:
    """The first whole second whose local date is after ``created``'s, found by bisection
    (no wall-time arithmetic: the oracle must not share the code's way)."""
    tz = ZoneInfo(zone)

    def day(t: float) -> date:
        return datetime.fromtimestamp(t, tz).date()

    start = day(created)
    lo, hi = int(created), int(created) + 3600
    while day(hi) == start:
        lo, hi = hi, hi + 3600
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if day(mid) == start else (lo, mid)
    return float(hi)


@dataclass
class Kept:
    kind: str
    token: str
    created: float
    expires: float | None
    key: str | None = None

    def alive(self, at: float) -> bool:
        return self.expires is None or at < self.expires


@dataclass
class Model:
    zone: str
    ttl_days: float
    memories: dict[str, Kept] = field(default_factory=dict)  # in the store (swept or forgotten: out)
    window: list[tuple[str, float]] = field(default_factory=list)

    def next_expiry(self, at: float) -> float | None:
        return min((m.expires for m in self.memories.values() if m.expires is not None and m.expires > at),
                   default=None)


class Clock:
    def __init__(self, at: float) -> None:
        self.at = at


@contextmanager
def wall_clock(at: float) -> Iterator[Clock]:
    clock = Clock(at)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "time", lambda: clock.at)
        yield clock


@contextmanager
def system_zone(zone: str) -> Iterator[None]:
    """The process's zone (``TZ``) set to ``zone``, for stores opened with ``local``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TZ", zone)
        time.tzset()
        try:
            yield
        finally:
            mp.undo()
            time.tzset()


ops = st.one_of(
    st.tuples(st.just("advance"), st.sampled_from([1.0, 59.0, 1800.0, 3 * 3600.0, 11 * 3600.0, DAY, 3 * DAY,
                                                    9 * DAY]) | st.floats(0.001, 2 * DAY)),
    st.tuples(st.just("boundary"), st.sampled_from([-1.0, -0.001, 0.0, 0.001])),
    st.tuples(st.just("turn")), st.tuples(st.just("turn")),
    st.tuples(st.just("context"), st.sampled_from(["task", "topic"])),
    st.tuples(st.just("fact")),
    st.tuples(st.just("sweep")),
    st.tuples(st.just("compact"), st.booleans()),
    st.tuples(st.just("reopen"), st.booleans(), st.sampled_from([None, *ZONES]),
              st.sampled_from([None, 1.0, 30.0, 45.0])),
    st.tuples(st.just("retention")),
)


def open_store(base: Config, path: Path, model: Model, local: bool) -> MemoryStore:
    cfg = base.replace("memory", path=str(path), timezone="local" if local else model.zone,
                       conversation_ttl_days=model.ttl_days, context_window_size=WINDOW_TURNS,
                       context_window_max_age_minutes=MAX_AGE_MIN)
    return MemoryStore(config=cfg, embedder=None)


def check(store: MemoryStore, model: Model, at: float) -> None:
    live = {i for i, m in model.memories.items() if m.alive(at)}
    assert len(store) == len(live)
    stats = store.stats()
    assert stats["memories"] == len(live) and stats["expired_unswept"] == len(model.memories) - len(live)
    assert sum(stats["by_type"].values()) == len(live)
    for memory_id, kept in model.memories.items():
        got = store.get(memory_id)
        assert (got is not None) == (memory_id in live), (kept, at)
    exported = {m.id for m in store.export_page(limit=1000)[0]}
    assert exported == live
    for key in ("task", "topic"):
        values = [m for m in model.memories.values() if m.key == key and m.alive(at)]
        want = max(values, key=lambda m: m.created).token if values else None
        assert store.get_context(key) == want
    # a search for the words of the memories nearest their expiry finds exactly the live ones
    near = sorted(model.memories.items(), key=lambda kv: abs((kv[1].expires or 1e12) - at))[:3]
    for memory_id, kept in near:
        hits = {r.memory.id for r in store.search(kept.token, limit=50, min_score=0.0, mode="lexical")}
        assert (memory_id in hits) == (memory_id in live), (kept, at)
    shown = [(t["content"], datetime.fromisoformat(t["timestamp"]).timestamp()) for t in store.get_context_window()]
    want_window = [(c, t) for c, t in model.window[-2 * WINDOW_TURNS:] if t >= at - MAX_AGE_MIN * 60]
    assert [c for c, _ in shown] == [c for c, _ in want_window]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(zone=st.sampled_from(ZONES), start=st.sampled_from(STARTS), offset=st.floats(0, 3 * DAY),
       local=st.booleans(), steps=st.lists(ops, min_size=5, max_size=40))
def test_time_promises_hold_over_weeks_of_robot_life(base_config: Config, zone: str, start: float, offset: float,
                                                      local: bool, steps: list[tuple[Any, ...]]) -> None:
    model = Model(zone, 30.0)
    counter = 0
    with tempfile.TemporaryDirectory() as tmp, system_zone(zone if local else "UTC"), \
            wall_clock(start + offset) as clock:
        path = Path(tmp) / "data"
        store = open_store(base_config, path, model, local)
        try:
            for step in steps:
                op, at = step[0], clock.at
                if op == "advance":
                    clock.at += step[1]
                elif op == "boundary":
                    upcoming = model.next_expiry(at)
                    if upcoming is not None and upcoming + step[1] > at:
                        clock.at = upcoming + step[1]
                elif op in ("turn", "context", "fact"):
                    counter += 1
                    token = f"tok{counter}x"
                    if op == "turn":
                        mem = store.record_turn("user", token)
                        model.window.append((token, at))
                        expires: float | None = at + model.ttl_days * DAY
                    elif op == "context":
                        mem = store.set_context(step[1], token)
                        for old in [i for i, m in model.memories.items() if m.key == step[1]]:
                            del model.memories[old]
                        expires = end_of_local_day(at, model.zone)
                    else:
                        mem = store.remember_fact(token)
                        expires = None
                    assert abs(mem.created_at.timestamp() - at) < 1e-5  # a datetime holds microseconds
                    got = mem.expires_at.timestamp() if mem.expires_at else None
                    assert got == expires if got is None or expires is None else abs(got - expires) < 1e-5, \
                        (op, datetime.fromtimestamp(at, ZoneInfo(model.zone)), got, expires)
                    model.memories[mem.id] = Kept(op, token, at, expires, step[1] if op == "context" else None)
                elif op == "sweep":
                    gone = sum(not m.alive(at) for m in model.memories.values())
                    assert store.cleanup_expired() == gone
                    model.memories = {i: m for i, m in model.memories.items() if m.alive(at)}
                elif op == "compact":  # a snapshot: what follows is replayed over it at the next open
                    store.compact(full=step[1])
                elif op == "retention":
                    store.apply_retention()
                    ttl = model.ttl_days * DAY
                    for m in model.memories.values():  # alive turns get the configured lifetime; a sweep
                        if m.kind == "turn" and m.alive(at):
                            m.expires = m.created + ttl
                    model.memories = {i: m for i, m in model.memories.items() if m.alive(at)}
                elif op == "reopen":
                    crash, new_zone, new_ttl = step[1:]
                    if crash:
                        abandon(store)
                    else:
                        store.close()
                    report = bk.verify(path)
                    assert report.ok and report.memories == len(model.memories), report.problems
                    if new_zone is not None:  # applies to new memories only
                        model.zone = new_zone
                    if new_ttl is not None:
                        model.ttl_days = new_ttl
                    with system_zone(model.zone if local else "UTC"):
                        store = open_store(base_config, path, model, local)
                        check(store, model, clock.at)
                    continue
                check(store, model, clock.at)
        finally:
            store.close()


def test_an_expired_note_is_gone_before_the_sweep(base_config: Config, tmp_path: Path) -> None:
    cfg = base_config.replace("memory", path=str(tmp_path / "data"), timezone="UTC")
    with wall_clock(STARTS[0]) as clock, MemoryStore(config=cfg, embedder=None) as store:
        [note] = store.remember("the wifi password is hunter2", name="wifi", expires_in_days=1, subjects=[])
        clock.at += 2 * DAY  # expired, the hourly sweep not run yet
        assert store.get(note.id) is None
        assert store.note("wifi") is None  # it returned the expired note
        store.remember("the wifi password is swordfish", name="wifi", subjects=[])  # "already used by" it


def test_history_leaves_out_what_expired_before_the_sweep(base_config: Config, tmp_path: Path) -> None:
    """``get`` of an expired, unswept memory is None; ``history`` gave its whole chain."""
    cfg = base_config.replace("memory", path=str(tmp_path / "data"), timezone="UTC")
    with wall_clock(STARTS[0]) as clock, MemoryStore(config=cfg, embedder=None) as store:
        [old] = store.remember("the gate code is 1234", expires_in_days=1, subjects=[])
        new = store.correct(old.id, "the gate code is 5678")
        assert [m.id for m in store.history(new.id)] == [old.id, new.id]
        clock.at += 2 * DAY
        for memory in (old, new):
            if store.get(memory.id) is None:
                with pytest.raises(NotFoundError, match="expired"):
                    store.history(memory.id)
            else:
                assert old.id not in [m.id for m in store.history(memory.id)]
        assert store.get(old.id) is None  # the case this test is about


@pytest.mark.parametrize("reopen", ["crash", "compacted"])  # the journal replayed; a snapshot loaded
def test_a_note_name_taken_over_from_an_expired_note_survives_a_reopen(base_config: Config, tmp_path: Path,
                                                                        reopen: str) -> None:
    """Both records hold the name until the sweep; the names index must answer the live
    one whatever order a reopen indexes them in (a freed slot put the new note first)."""
    cfg = base_config.replace("memory", path=str(tmp_path / "data"), timezone="UTC")
    with wall_clock(STARTS[0]) as clock:
        store = MemoryStore(config=cfg, embedder=None)
        gone = store.store("filler, deleted to free its slot").id
        store.remember("the wifi password is hunter2", name="wifi", expires_in_days=1, subjects=[])
        store.forget(gone)
        clock.at += 2 * DAY
        [new] = store.remember("the wifi password is swordfish", name="wifi", subjects=[])
        if reopen == "compacted":
            store.compact()
        abandon(store)
        with MemoryStore(config=cfg, embedder=None) as reopened:
            assert (note := reopened.note("wifi")) is not None and note.id == new.id


def test_prompt_context_dates_memories_in_the_configured_zone(base_config: Config, tmp_path: Path) -> None:
    cfg = base_config.replace("memory", path=str(tmp_path / "data"), timezone="Asia/Tokyo")
    at = datetime(2026, 11, 2, 8, 0, tzinfo=ZoneInfo("Asia/Tokyo")).timestamp()  # 2026-11-01 23:00 UTC
    with wall_clock(at), MemoryStore(config=cfg, embedder=None) as store:
        store.remember_fact("Sarah likes Italian food")
        assert "[fact, 2026-11-02] Sarah likes Italian food" in store.context_for("Italian food").text


def test_a_change_to_an_expired_note_does_not_take_its_name_back(base_config: Config, tmp_path: Path) -> None:
    """An ``update`` of the expired note (its person forgotten: subjects relinked) placed it
    again, and the names index gave it back the name the live note had taken over:
    ``note`` answered None and ``remove_note`` deleted the expired one, keeping the live."""
    cfg = base_config.replace("memory", path=str(tmp_path / "data"), timezone="UTC")
    with wall_clock(STARTS[0]) as clock, MemoryStore(config=cfg, embedder=None) as store:
        dave = store.add_person("Dave")
        store.remember("the wifi password is hunter2", name="wifi", expires_in_days=1, subjects=[dave.id])
        clock.at += 2 * DAY
        [new] = store.remember("the wifi password is swordfish", name="wifi", subjects=[])
        store.delete_person(dave.id)
        assert (note := store.note("wifi")) is not None and note.id == new.id
        assert store.remove_note("wifi") and store.get(new.id) is None


def test_a_backup_holding_an_expired_notes_name_twice_verifies_and_restores(base_config: Config,
                                                                            tmp_path: Path) -> None:
    """The unswept expired note and the live one that took its name over are both in a
    backup written before the sweep: verify refused it ("given to memories ... and ..."),
    so a backup of a sound store could not be restored."""
    cfg = base_config.replace("memory", path=str(tmp_path / "data"), timezone="UTC")
    with wall_clock(STARTS[0]) as clock:
        with MemoryStore(config=cfg, embedder=None) as store:
            store.remember("the wifi password is hunter2", name="wifi", expires_in_days=1, subjects=[])
            clock.at += 2 * DAY
            [new] = store.remember("the wifi password is swordfish", name="wifi", subjects=[])
            store.backup(tmp_path / "b.rms")
        assert bk.verify(tmp_path / "b.rms").ok, bk.verify(tmp_path / "b.rms").problems
        bk.restore(tmp_path / "b.rms", tmp_path / "restored")
        with MemoryStore(config=cfg.replace("memory", path=str(tmp_path / "restored")), embedder=None) as store:
            assert (note := store.note("wifi")) is not None and note.id == new.id


def test_counts_are_what_a_reader_sees_before_the_sweep(base_config: Config, tmp_path: Path) -> None:
    """``len`` and ``stats`` counted expired, unswept memories (hidden from every reader
    until the hourly sweep); ``expired_unswept`` now says how many the sweep will delete."""
    cfg = base_config.replace("memory", path=str(tmp_path / "data"), timezone="UTC", conversation_ttl_days=1.0)
    with wall_clock(STARTS[0]) as clock, MemoryStore(config=cfg, embedder=None) as store:
        store.remember_fact("the robot's name is Reachy")
        for i in range(3):
            store.record_turn("user", f"turn {i}")
        store.set_context("task", "tidying up")  # until the end of the day
        assert len(store) == store.stats()["memories"] == 5
        clock.at += 1.5 * DAY  # the turns and the context expired; the sweep has not run
        counts = store.stats()
        assert len(store) == counts["memories"] == 1 == len(store.export_page()[0])
        assert counts["by_type"] == {"conversation": 0, "fact": 1, "context": 0}
        assert counts["expired_unswept"] == 4
        store.record_turn("user", "a new turn")  # a write since the last count
        assert len(store) == 2 and store.stats()["by_type"]["conversation"] == 1
        clock.at += 1.5 * DAY  # and that one expires too, with no write in between
        assert len(store) == 1 and store.stats()["expired_unswept"] == 5
        clock.at -= 1.5 * DAY  # a clock stepped back: it is alive again for every reader
        assert len(store) == 2
        clock.at += 1.5 * DAY
        assert store.cleanup_expired() == 5
        counts = store.stats()
        assert len(store) == counts["memories"] == 1 and counts["expired_unswept"] == 0
