"""Background compaction (docs/FORMAT.md, "Generations and compaction"): writes
acknowledged while a snapshot is being written are never lost, whatever step a
crash or a full disk interrupts, and the previous generation still rebuilds a
damaged snapshot."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HashEmbedder
from store_util import abandon

from reachy_memory import Config, MemoryStore, StorageFullError
from reachy_memory.engine.lexical_index import LexicalIndex
from reachy_memory.storage import backup as bk
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr


class Crash(BaseException):
    """Stands for a power cut."""


def _writes_during_compaction(store: MemoryStore, ids: list[str], tag: str) -> None:
    """Make the next compaction see writes arrive while its snapshot is written."""
    original = store._storage._write_snapshot

    def write(job: Any) -> None:
        ids.extend(store.store(f"{tag} during {i}").id for i in range(5))
        store.add_to_context_window("user", f"{tag} turn")
        original(job)

    store._storage._write_snapshot = write  # type: ignore[method-assign]


def _reopened(config: Config) -> MemoryStore:
    return MemoryStore(config=config, embedder=None)


def _check(config: Config, ids: list[str], window: list[str]) -> None:
    with _reopened(config) as store:
        assert [i for i in ids if store.get(i) is None] == []
        assert [t["content"] for t in store.get_context_window()] == window  # no turn lost or doubled
        assert len(store) == len(ids)


def _verified(config: Config, ids: list[str]) -> None:
    """verify, before an open finishes anything, counts what the open will find (it
    counted 10 of 20 with the journal still in use, and failed the store between renames)."""
    report = bk.verify(config.data_dir)
    assert report.ok and report.memories == len(ids), report.to_dict()


def _crash_on_call(n: int, real: Any) -> Any:
    calls = {"n": 0}

    def fn(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            raise Crash
        return real(*args, **kwargs)

    return fn


def _half_switch(directory: Path) -> None:
    os.replace(directory / files.JOURNAL_FILE, directory / files.PREV_JOURNAL_FILE)
    raise Crash


@pytest.mark.parametrize("step", [
    "snapshot",  # the new snapshot never became durable: the old generation is in force
    "carry_over",  # the snapshot is durable, the ops written meanwhile are only in the old journal
    "between_renames",  # the old journal is retired, the new one not yet in place
    "none",  # the compaction finished; the crash comes after it
])
@pytest.mark.parametrize("repair", [
    False,  # the next open finishes what the crash interrupted
    True,  # 'verify --repair' runs first (between the renames it started an empty journal over the carried writes)
])
def test_writes_during_a_compaction_survive_a_crash_at_each_step(config: Config, monkeypatch: pytest.MonkeyPatch,
                                                                  step: str, repair: bool) -> None:
    store = _reopened(config)
    ids = [store.store(f"before {i}").id for i in range(20)]
    store.add_to_context_window("user", "first turn")
    _writes_during_compaction(store, ids, "a")
    if step == "snapshot":
        monkeypatch.setattr(files, "write_snapshot_keeping_previous", _crash_on_call(1, None))
    elif step == "carry_over":  # the first call writes the next journal's head, the second the carried ops
        monkeypatch.setattr(files, "write_next_journal", _crash_on_call(2, files.write_next_journal))
    elif step == "between_renames":
        monkeypatch.setattr(files, "switch_journals", _half_switch)
    if step == "none":
        store.compact()
    else:
        with pytest.raises(Crash):
            store.compact()
    monkeypatch.undo()
    abandon(store)
    _verified(config, ids)
    if repair:
        bk.repair(config.data_dir, config)
        _verified(config, ids)
    _check(config, ids, ["first turn", "a turn"])


def test_starting_a_compaction_makes_no_fsync_under_the_lock(config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine waits for the start (the store lock): its two fsyncs (the next journal's
    # head and its rename) cost tens of ms on an SD card, and the head is written again
    # durably before the switch anyway. The compaction as a whole still fsyncs.
    store = _reopened(config)
    ids = [store.store(f"before {i}").id for i in range(20)]
    fsyncs: list[bool] = []
    starting = threading.Event()
    real_fsync, real_begin = os.fsync, store._storage._begin_compaction

    def begin(**kwargs: Any) -> Any:
        starting.set()
        try:
            return real_begin(**kwargs)
        finally:
            starting.clear()

    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(starting.is_set()), real_fsync(fd))[1])
    monkeypatch.setattr(store._storage, "_begin_compaction", begin)
    store._storage.compact_in_background()
    ids += [store.store(f"during {i}").id for i in range(5)]
    store._storage.wait()
    monkeypatch.undo()
    assert fsyncs and not any(fsyncs)  # fsyncs made, none while starting
    abandon(store)
    _check(config, ids, [])


def test_repair_between_the_renames_keeps_the_valid_frames_of_a_damaged_next_journal(
        config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _reopened(config)
    ids = [store.store(f"before {i}").id for i in range(20)]
    _writes_during_compaction(store, ids, "a")
    monkeypatch.setattr(files, "switch_journals", _half_switch)
    with pytest.raises(Crash):
        store.compact()
    monkeypatch.undo()
    abandon(store)
    nxt = config.data_dir / files.NEXT_JOURNAL_FILE
    offsets = jr.read_file(nxt, jr.JOURNAL).offsets  # the head, then the 5 carried writes and the turn
    data = bytearray(nxt.read_bytes())
    data[offsets[2] + 20] ^= 0xFF  # bit rot in the second carried write: valid frames follow it
    nxt.write_bytes(bytes(data))
    assert not bk.verify(config.data_dir).ok  # it says 'verify --repair' keeps every valid frame
    bk.repair(config.data_dir, config)  # raised the same CorruptionError, over and over
    assert bk.verify(config.data_dir).ok
    lost = ids[21]
    with _reopened(config) as reopened:
        assert [i for i in ids if reopened.get(i) is None] == [lost]
    assert list(config.data_dir.glob(f"{files.NEXT_JOURNAL_FILE}.damaged-*"))  # the original, set aside


def test_a_full_disk_at_the_journal_switch_keeps_the_journal_in_use(config: Config,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = _reopened(config)
    ids = [store.store(f"before {i}").id for i in range(10)]
    _writes_during_compaction(store, ids, "a")
    real = files.write_next_journal

    def full_on_carry(directory: Path, generation: int, follows: Any = None, ops: Any = None, **kw: Any) -> None:
        if ops:
            raise StorageFullError("disk full", path=str(directory))
        real(directory, generation, follows, ops, **kw)

    monkeypatch.setattr(files, "write_next_journal", full_on_carry)
    store.compact()  # not an error: the snapshot is durable and the journal goes on
    monkeypatch.undo()
    assert store.read_only is None
    ids += [store.store(f"after {i}").id for i in range(5)]
    abandon(store)
    _verified(config, ids)
    _check(config, ids, ["a turn"])
    with _reopened(config) as again:  # the next compaction switches journals normally
        ids.append(again.store("later").id)
        again.compact()
    assert not (config.data_dir / files.NEXT_JOURNAL_FILE).exists()
    _check(config, ids, ["a turn"])


def test_a_damaged_snapshot_after_carried_writes_is_rebuilt_without_doubles(config: Config) -> None:
    store = _reopened(config)
    ids = [store.store(f"first {i}").id for i in range(10)]
    store.compact()
    ids += [store.store(f"second {i}").id for i in range(10)]
    store.add_to_context_window("user", "second turn")
    _writes_during_compaction(store, ids, "b")
    store.compact()  # generation 2 follows journal 1 at an offset; its journal starts with the carried ops
    abandon(store)
    path = config.data_dir / files.SNAPSHOT_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    bk.repair(config.data_dir, config)
    _check(config, ids, ["second turn", "b turn"])


def test_background_compactions_under_concurrent_writes_lose_nothing(config: Config) -> None:
    cfg = config.replace("memory", compact_journal_bytes=4096, context_window_size=3)
    store = MemoryStore(config=cfg, embedder=None)
    acked: list[str] = []
    turns: list[str] = []

    def write(worker: int) -> None:
        for i in range(150):
            acked.append(store.store(f"worker {worker} memory {i} " + "x" * 50).id)
            if i % 10 == 0:
                store.add_to_context_window("user", f"w{worker} turn {i}")
                turns.append(f"w{worker} turn {i}")

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    generation = store.stats()["generation"]
    window = [t["content"] for t in store.get_context_window()]
    abandon(store)
    assert generation >= 3  # several compactions ran while the writers wrote
    _check(cfg, acked, window)
    assert len(window) == 6 and set(window) <= set(turns)


@pytest.mark.parametrize("disk_full", [
    False,  # the bulk is copied without the lock, the last frames under it; the new journal is adopted
    True,  # the last copy fails: the store keeps appending to the old journal
])
def test_background_compaction_copies_late_writes_in_two_steps(config: Config, monkeypatch: pytest.MonkeyPatch,
                                                               disk_full: bool) -> None:
    store = _reopened(config)
    ids = [store.store(f"before {i}").id for i in range(10)]
    _writes_during_compaction(store, ids, "a")
    unlocked = store._storage._carry_unlocked

    def carry(job: Any) -> None:
        unlocked(job)
        ids.extend(store.store(f"late {i}").id for i in range(3))  # after the unlocked copy

    store._storage._carry_unlocked = carry  # type: ignore[method-assign]
    if disk_full:
        monkeypatch.setattr(files, "append_to_next_journal", _raise_full)
    with store._lock:
        store._storage.compact_in_background()
    store._storage.wait()
    monkeypatch.undo()
    assert store.read_only is None and store.stats()["generation"] == 1
    ids.append(store.store("after").id)
    abandon(store)
    _check(config, ids, ["a turn"])


def _raise_full(directory: Path, frames: Any) -> None:
    raise StorageFullError("disk full", path=str(directory))


def test_an_expiry_sweep_during_a_background_compaction_is_buried_after_the_thaw(config: Config) -> None:
    """The sweep's slots are buried into quarantine while the frozen view is held, reused
    only after the thaw; a crash then replays the sweep and loses none of the rest."""
    later = time.time() + 40 * 86400
    store = _reopened(config)
    store.store_batch([{"content": f"chat {i} about tea", "memory_type": "conversation"} for i in range(300)])
    kept = [m.id for m in store.store_batch([{"content": f"fact {i} about tea"} for i in range(20)])]
    original = store._storage._write_snapshot
    seen: dict[str, int] = {}

    def write(job: Any) -> None:
        seen["swept"] = store.cleanup_expired(now=later)
        while store.maintain() or store._state.bury(0):
            pass
        kept.extend(m.id for m in store.store_batch([{"content": f"during {i} about tea"} for i in range(10)]))
        seen["quarantined"], seen["free"] = len(store._state._quarantine or []), len(store._state._free)
        original(job)

    store._storage._write_snapshot = write  # type: ignore[method-assign]
    with store._lock:
        store._storage.compact_in_background()
    store._storage.wait()
    assert seen == {"swept": 300, "quarantined": 300, "free": 0}  # nothing the frozen view names was reused
    assert len(store._state._free) == 300
    kept.extend(m.id for m in store.store_batch([{"content": f"after {i} about tea"} for i in range(10)]))
    assert max(store._state.records[i].slot for i in kept[-10:]) < 300  # the thawed slots are reused
    abandon(store)
    with _reopened(config) as again:
        assert sorted(again._state.records) == sorted(kept)
        assert {h.memory.id for h in again.search("chat tea", limit=100, min_score=0)} <= set(kept)


def test_the_vector_matrix_grows_during_a_background_snapshot_and_both_stay_right(config: Config) -> None:
    """A growth while the compaction thread writes the frozen rows copies the matrix
    (the snapshot's view keeps the old mapping); after the thaw it grows in place
    again; the snapshot file and the reopened store hold the right vectors."""
    emb = HashEmbedder()
    store = MemoryStore(config=config, embedder=emb)
    store.store_batch([{"content": f"fact {i}"} for i in range(1000)])
    vectors = store._state.vectors
    first = vectors._map
    original = store._storage._write_snapshot
    moved: list[bool] = []

    def write(job: Any) -> None:
        store.store_batch([{"content": f"late {i}"} for i in range(100)])  # past 1024 rows: growth
        moved.append(vectors._map is not first)
        original(job)

    store._storage._write_snapshot = write  # type: ignore[method-assign]
    with store._lock:
        store._storage.compact_in_background()
    store._storage.wait()
    rows = {mid: vectors.matrix[rec.slot].copy() for mid, rec in store._state.records.items()}
    snapshot = files.read_snapshot(store.path / files.SNAPSHOT_FILE)
    assert snapshot["vector_format"] == "bf16"
    matrix = np.frombuffer(snapshot["vectors"], np.uint16).reshape(-1, emb.dim)
    assert moved == [True] and len(snapshot["records"]) == 1000
    assert all(np.array_equal(matrix[obj["slot"]], rows[obj["id"]]) for obj in snapshot["records"])
    grown = vectors._map
    store.store_batch([{"content": f"more {i}"} for i in range(1000)])
    assert vectors._map is grown  # no view held any more: in place
    rows = {mid: vectors.matrix[rec.slot].copy() for mid, rec in store._state.records.items()}
    query = emb.embed(["late 7"])[0]
    found = [store._state.by_slot[int(s)].id for s in vectors.search(query, 10)[0]]
    abandon(store)
    with MemoryStore(config=config, embedder=emb) as again:
        assert len(again) == len(rows) == 2100
        got = again._state.vectors
        assert all(np.array_equal(got.matrix[again._state.records[m].slot], v) for m, v in rows.items())
        assert [again._state.by_slot[int(s)].id for s in got.search(query, 10)[0]] == found


def test_a_background_snapshot_indexes_the_previous_turn_field_at_the_configured_weight(config: Config) -> None:
    """The compaction thread rebuilds the lexical index from the frozen records: with
    the store's weight, so the next open loads it as is instead of re-indexing."""
    config = config.replace("search", previous_turn_weight=0.25)
    store = _reopened(config)
    store.store_batch([{"content": "What did you paint?", "memory_type": "conversation"},
                       {"content": "A sunrise", "memory_type": "conversation"}])
    with store._lock:
        store._storage.compact_in_background()
    store._storage.wait()
    snapshot = files.read_snapshot(store.path / files.SNAPSHOT_FILE)
    abandon(store)
    index = LexicalIndex(previous_weight=0.25)
    assert index.load_state(snapshot["lexical"])
    reply = next(r["slot"] for r in snapshot["records"] if r["content"] == "A sunrise")
    assert reply in index.scores("paint")[0].tolist()


def test_a_retention_change_during_a_background_snapshot_is_replayed_after_a_crash(config: Config) -> None:
    """The ttl op sets expiries in place, the one change to placed records: the frozen
    view the snapshot is written from sees the new ones, and the op (after the
    snapshot's point in the journal) gives the same again on replay."""
    now = time.time()
    with _reopened(config) as store:
        old, recent = store.store_batch([
            {"content": "chat about kites", "memory_type": "conversation", "created_at": now - 20 * 86400},
            {"content": "chat about trains", "memory_type": "conversation", "created_at": now - 2 * 86400}])
    store = MemoryStore(config=config.replace("memory", conversation_ttl_days=7), embedder=None)
    original = store._storage._write_snapshot
    seen: dict[str, Any] = {}

    def write(job: Any) -> None:
        seen.update(store.apply_retention())
        original(job)

    store._storage._write_snapshot = write  # type: ignore[method-assign]
    with store._lock:
        store._storage.compact_in_background()
    store._storage.wait()
    assert (seen["applied"], seen["deleted"]) == (True, 1)
    abandon(store)
    with _reopened(config) as again:  # 30 days in the config: the stored expiries stand
        assert again.get(old.id) is None
        assert again.get(recent.id).expires_at == recent.created_at + timedelta(days=7)
