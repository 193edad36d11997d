"""The ``redate`` op (docs/FORMAT.md, "Journal ops"): the memories and window turns a
stale clock dated (a robot without a real-time clock, before NTP's first sync) move by
the step, exactly those of ``[since, until)``; live, after a crash, after a compaction
and beside a background one, the state is the same.  The daemon's side (when it
journals one) is in ``tests/test_clock.py``."""

from __future__ import annotations

from typing import Any

import pytest
from store_util import WallClock, abandon

from reachy_memory import Config, CorruptionError, MemoryStore, ValidationError
from reachy_memory.engine.records import RECORD_FIELDS, Record, encode
from reachy_memory.engine.state import MemoryState
from reachy_memory.storage import backup as bk
from reachy_memory.storage.files import read_snapshot

pytestmark = pytest.mark.timeout(60)

NOW = 1_795_000_000.0  # 2026-11-18 11:06:40 UTC: the real time once NTP has synced
DAY = 86_400.0
STALE = NOW - 3 * DAY  # what a robot's clock read after a boot without an RTC battery
SINCE, UNTIL = STALE - 600.0, STALE + 3600.0  # boot and the sync's moment, by the stale clock


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> WallClock:
    return WallClock(monkeypatch, STALE)


@pytest.fixture
def cfg(config: Config) -> Config:
    return config.replace("memory", timezone="UTC")


def _open(cfg: Config) -> MemoryStore:
    return MemoryStore(config=cfg, embedder=None)


def _snapshot(store: MemoryStore) -> tuple[Any, ...]:
    """Everything a redate may touch, field by field: records, window, the newest turn."""
    st = store._state
    rows = {r.id: tuple(getattr(r, name) for name in RECORD_FIELDS if name != "slot")
            for r in st.records.values()}
    last = st.last_turn
    return rows, st.window_view, last.id if last is not None else None, sorted(st.context_view)


def _stale_session(store: MemoryStore, wall: WallClock) -> dict[str, str]:
    """A session under the stale clock, after memories of an earlier boot, outside the
    stale period: a turn of yesterday (its clock was right: newer than the stale turns
    until they are set right), a fact dated just before the boot.  The session: a context,
    three turns (in the window too), a fact."""
    earlier = store.store_batch([
        {"content": "turn of an earlier boot about kites", "memory_type": "conversation",
         "created_at": NOW - DAY},
        {"content": "fact of an earlier boot", "created_at": SINCE - 1.0}])
    ids = {"earlier_turn": earlier[0].id, "earlier_fact": earlier[1].id}
    wall.at = STALE
    ids["context"] = store.set_context("task", "water the garden").id
    for i in range(3):  # the last ones before the sync
        wall.at = UNTIL - 30.0 + 10.0 * i
        ids[f"turn{i}"] = store.record_turn("user", f"stale turn {i} about the garden").id
    ids["fact"] = store.remember_fact("Anna likes green tea").id
    wall.at = NOW + 3600.0  # NTP stepped the clock by 3 days (plus the hour the session took)
    return ids


# -- the op on the state -------------------------------------------------------------------------

def _state() -> MemoryState:
    return MemoryState(Config().replace("memory", context_window_size=4), 8, None, None)


@pytest.mark.parametrize(("created", "moved"), [
    (SINCE - 0.001, False),  # just before boot: written by an earlier boot, dated right
    (SINCE, True),  # at boot: the period's first instant is in it
    (STALE, True),  # inside the stale period
    (UNTIL - 0.001, True),  # the last instant before the sync was seen
    (UNTIL, False),  # the sync's moment itself is not in [since, until)
    (UNTIL + 3 * DAY, False),  # written after the sync, by the right clock
])
@pytest.mark.parametrize(("mtype", "expires"), [
    ("conversation", 30 * DAY),  # a turn: 30 days from its creation
    ("context", 7 * 3600.0),  # a context: the rest of its day
    ("fact", None),  # a fact never expires, and still does not
])
def test_the_op_moves_exactly_the_memories_and_window_turns_of_its_period(
        created: float, moved: bool, mtype: str, expires: float | None) -> None:
    state = _state()
    metadata = {"context_key": "task"} if mtype == "context" else {}
    rec = Record("m", "words", mtype, created, None if expires is None else created + expires, metadata)
    state.apply_all([["put", encode(rec), None], ["win", "user", "words", created]])
    placed = state.records["m"]
    state.apply_all([["redate", SINCE, UNTIL, 3 * DAY]])
    shift = 3 * DAY if moved else 0.0
    after = state.records["m"]
    assert after.created == created + shift
    assert after.expires == (None if expires is None else created + expires + shift)
    assert state.window_view == (("user", "words", created + shift),)
    assert float(state._expires[after.slot]) == (float("inf") if expires is None else created + expires + shift)
    assert [r.id for r in state.context_view.get("task", ())] == (["m"] if mtype == "context" else [])
    assert (after is not placed) is moved  # a moved memory is a new record: a frozen view keeps the old one


@pytest.mark.parametrize("op", [
    ["redate", SINCE, UNTIL],  # no delta
    ["redate", UNTIL, SINCE, DAY],  # since after until
    ["redate", SINCE, UNTIL, float("nan")],  # not a number
    ["redate", SINCE, float("inf"), DAY],  # an open period
    ["redate", True, UNTIL, DAY],  # a bool is not a time
    ["redate", "0", UNTIL, DAY],  # nor is a string
    ["redate", SINCE, UNTIL, 1e12],  # times moved past 2200
    ["redate", -1.0, UNTIL, DAY],  # a period starting before 1970
])
def test_malformed_redate_ops_are_corruption_and_the_store_refuses_them_unwritten(
        op: list[Any], cfg: Config) -> None:
    with pytest.raises(CorruptionError):
        _state().apply(op)
    if len(op) == 4:
        with _open(cfg) as store:
            store.remember_fact("a fact")
            size = (cfg.data_dir / "journal.rmj").stat().st_size
            with pytest.raises(ValidationError):
                store.redate(*op[1:])
            assert (cfg.data_dir / "journal.rmj").stat().st_size == size
        with _open(cfg) as store:  # nothing the open would stop at
            assert len(store) == 1


# -- the stale session, set right ----------------------------------------------------------------

def test_a_stale_session_is_set_right_context_window_turns_and_the_newest_turn(
        cfg: Config, wall: WallClock) -> None:
    with _open(cfg) as store:
        ids = _stale_session(store, wall)
        assert store.get_context("task") is None  # the stale day's end passed at the sync: hidden
        assert store.get_context_window() == []  # three days old by the new clock
        assert store._state.last_turn.id == ids["earlier_turn"]  # the stale turns looked older
        stale_score = _score(store, "what did we say about the garden today", ids["turn0"])
        assert store.redate(SINCE, UNTIL, 3 * DAY) == 5
        assert _score(store, "what did we say about the garden today", ids["turn0"]) > stale_score  # "today" again
        assert store.get_context("task") == "water the garden"
        assert [t["content"] for t in store.get_context_window()] == [f"stale turn {i} about the garden"
                                                                       for i in range(3)]
        context = store.get(ids["context"])
        assert context.expires_at.timestamp() == NOW - NOW % DAY + DAY  # the end of its (corrected) day
        turn = store.get(ids["turn2"])
        assert turn.created_at.timestamp() == UNTIL - 10 + 3 * DAY
        assert turn.expires_at.timestamp() == turn.created_at.timestamp() + 30 * DAY
        # an earlier boot's memories keep their times
        assert store.get(ids["earlier_turn"]).created_at.timestamp() == NOW - DAY
        assert store.get(ids["earlier_fact"]).created_at.timestamp() == SINCE - 1.0
        assert store._state.last_turn.id == ids["turn2"]  # the newest turn again, as a reload finds it
        assert store.record_turn("user", "and the roses").id in {  # 10 s after it, by the right clock
            r.id for r in store._state.records.values() if r.follows == ids["turn2"]}
        assert store.cleanup_expired() == 0  # nothing of the session looks expired now
        assert store.cleanup_expired(now=NOW - NOW % DAY + DAY) == 1  # the context, at its day's end
        assert store.get_context("task") is None


def _score(store: MemoryStore, query: str, memory_id: str) -> float:
    hits = store.search(query, min_score=0.0, limit=50)  # hybrid: the time prior (lexical-only here)
    return next(h.score for h in hits if h.memory.id == memory_id)


def _with_redate(cfg: Config, wall: WallClock, *, compact_before: bool, compact_after: bool) -> tuple[Any, ...]:
    store = _open(cfg)
    _stale_session(store, wall)
    if compact_before:
        store.compact()
    store.redate(SINCE, UNTIL, 3 * DAY)
    store.record_turn("user", "a turn after the sync")
    if compact_after:
        store.compact()
    live = _snapshot(store)
    abandon(store)  # a crash: what the journal (and snapshot) hold is all there is
    return live


@pytest.mark.parametrize(("compact_before", "compact_after"), [
    (False, False),  # the op replayed from the journal alone
    (True, False),  # over a snapshot of the stale state
    (False, True),  # folded into a snapshot
])
def test_replay_after_a_crash_gives_the_live_state_field_by_field(
        cfg: Config, wall: WallClock, compact_before: bool, compact_after: bool) -> None:
    live = _with_redate(cfg, wall, compact_before=compact_before, compact_after=compact_after)
    with _open(cfg) as again:
        assert _snapshot(again) == live
    report = bk.verify(cfg.data_dir)
    assert report.problems == [] and report.memories == len(live[0])


def test_a_background_compaction_racing_the_op_writes_a_consistent_snapshot(cfg: Config, wall: WallClock) -> None:
    """The redate lands after the freeze: the snapshot holds the whole stale state (no
    memory half moved), and the op, in the next journal, moves it again on replay."""
    store = _open(cfg)
    ids = _stale_session(store, wall)
    stale = _snapshot(store)
    original = store._storage._write_snapshot

    def write(job: Any) -> None:
        store.redate(SINCE, UNTIL, 3 * DAY)
        original(job)

    store._storage._write_snapshot = write  # type: ignore[method-assign]
    with store._lock:
        store._storage.compact_in_background()
    store._storage.wait()
    live = _snapshot(store)
    assert live != stale
    written = read_snapshot(cfg.data_dir / "snapshot.rms")
    rows = {row["id"]: row for row in written["records"]}
    for name, memory_id in ids.items():
        assert (rows[memory_id]["created"], rows[memory_id]["expires"]) == stale[0][memory_id][3:5], name
    assert [turn[2] for turn in written["window"]] == [turn[2] for turn in stale[1]]
    abandon(store)
    with _open(cfg) as again:
        assert _snapshot(again) == live
    assert bk.verify(cfg.data_dir).problems == []


def test_a_redate_of_nothing_writes_nothing(cfg: Config, wall: WallClock) -> None:
    with _open(cfg) as store:
        store.remember_fact("a fact")
        journal = cfg.data_dir / "journal.rmj"
        size = journal.stat().st_size
        assert store.redate(NOW + DAY, NOW + 2 * DAY, DAY) == 0
        assert journal.stat().st_size == size
