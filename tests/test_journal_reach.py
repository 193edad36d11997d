"""The journal's durable point, reach and identity (docs/FORMAT.md, "Frames", "The journal head").

* Open decides alone what a torn tail is: damage after the point known written durably (a
  power cut inside a group commit may keep a later unsynced frame and lose an earlier one)
  is set aside and the store opens; damage before it is refused and ``verify`` names it.
* The head file records which journal is the store's and how much of it is durable: a
  journal cut at a frame boundary, or replaced by another generation's, is refused.
* Frames are numbered: a journal cut short of the point its snapshot holds, then appended
  to because the journal switch failed (a full disk), keeps those appends.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from store_util import abandon

from reachy_memory import Config, CorruptionError, MemoryStore, StorageFullError
from reachy_memory.storage import backup as bk
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr
from reachy_memory.storage.files import JOURNAL_FILE, PREV_JOURNAL_FILE

pytestmark = pytest.mark.timeout(120)


def _ids(config: Config, ids: list[str]) -> list[str]:
    with MemoryStore(config=config, embedder=None) as store:
        return [i for i in ids if store.get(i) is not None]


def _group_commit(config: Config) -> tuple[list[str], list[str]]:
    """Facts acknowledged one by one, then three written by the daemon's way (deferred:
    one fsync would cover them, and none is acknowledged before it returns), then a crash
    before that fsync.  Returns (acknowledged ids, unacknowledged ids)."""
    with MemoryStore(config=config, embedder=None) as store:
        acked = [store.remember_fact(f"acknowledged fact {i}").id for i in range(5)]
        with store.deferred_durability():
            waiting = [store.remember_fact(f"waiting for the group fsync {i}").id for i in range(3)]
        store._storage.journal._fd, fd = None, store._storage.journal._fd  # a crash: no closing fsync
        abandon(store)
    import os
    os.close(fd)
    return acked, waiting


def test_a_power_cut_inside_a_group_commit_opens_by_itself(config: Config) -> None:
    """The disk kept the last unsynced frame and lost the first (FORMAT.md's disk model allows
    it between two fsyncs): open set that tail aside and opened, nothing acknowledged lost
    (it refused, "damaged bytes ... with valid frames after them", until verify --repair)."""
    acked, waiting = _group_commit(config)
    path = config.data_dir / JOURNAL_FILE
    offsets = jr.read_file(path, jr.JOURNAL).offsets
    data = bytearray(path.read_bytes())
    first_unsynced = offsets[-3]
    data[first_unsynced : offsets[-2]] = bytes(offsets[-2] - first_unsynced)  # lost: zeros
    path.write_bytes(bytes(data))
    report = bk.verify(config.data_dir)
    assert report.ok and any("torn" in n for n in report.notes), report.to_dict()
    assert _ids(config, acked + waiting) == acked
    torn = list(config.data_dir.glob("journal.rmj.torn-*"))
    assert len(torn) == 1 and len(torn[0].read_bytes()) == len(data) - first_unsynced  # set aside, not deleted
    assert bk.verify(config.data_dir).ok


def test_damage_before_the_durable_point_is_refused_and_named(config: Config) -> None:
    acked, _ = _group_commit(config)
    path = config.data_dir / JOURNAL_FILE
    offsets = jr.read_file(path, jr.JOURNAL).offsets
    data = bytearray(path.read_bytes())
    data[offsets[4] - 8] ^= 0x10  # a payload byte of an acknowledged fact (the third), past its id
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="damaged bytes"):
        MemoryStore(config=config, embedder=None)
    report = bk.verify(config.data_dir)
    assert not report.ok and acked[2] in report.affected
    bk.repair(config.data_dir, config)
    assert _ids(config, acked) == acked[:2] + acked[3:]


def _acked(config: Config, n: int = 10) -> list[str]:
    with MemoryStore(config=config, embedder=None) as store:
        ids = [store.remember_fact(f"fact number {i}").id for i in range(n)]
        abandon(store)
    return ids


def test_a_journal_cut_at_a_frame_boundary_is_refused_and_named(config: Config) -> None:
    ids = _acked(config)
    path = config.data_dir / JOURNAL_FILE
    cut = jr.read_file(path, jr.JOURNAL).offsets[-3]  # the last three acknowledged facts gone
    with open(path, "r+b") as handle:
        handle.truncate(cut)
    with pytest.raises(CorruptionError, match="promises"):  # it opened with 7 of 10, verify ok
        MemoryStore(config=config, embedder=None)
    report = bk.verify(config.data_dir)
    assert not report.ok and "promises" in " ".join(report.problems), report.to_dict()
    bk.repair(config.data_dir, config)  # going on with what is left is a decision, logged
    assert _ids(config, ids) == ids[:7] and bk.verify(config.data_dir).ok


def test_another_generations_journal_in_its_place_is_refused_and_named(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        ids = [store.remember_fact(f"fact number {i}").id for i in range(6)]
        store.compact()
        ids += [store.remember_fact(f"later fact {i}").id for i in range(6)]
        abandon(store)
    journal = config.data_dir / JOURNAL_FILE
    shutil.copy(config.data_dir / PREV_JOURNAL_FILE, journal)  # the older generation's journal
    with pytest.raises(CorruptionError, match="not the journal this store last wrote"):
        MemoryStore(config=config, embedder=None)  # it opened with 8 of 12, verify ok
    report = bk.verify(config.data_dir)
    assert not report.ok and "not the journal" in " ".join(report.problems), report.to_dict()


def test_a_journal_cut_short_of_its_snapshot_then_appended_to_keeps_those_writes(
        config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """A power cut under ``fsync: never`` leaves the old journal short of the offset the new
    snapshot follows (its last frames were in the snapshot, never on disk); the reopen cannot
    write the next journal (a full disk) and appends to the old one.  The next open applied
    frames from that offset on only: the appends below it were lost, the forgets undone."""
    config = config.replace("memory", fsync="never")
    with MemoryStore(config=config, embedder=None) as store:
        early = [store.remember_fact(f"early fact {i}").id for i in range(6)]
    path = config.data_dir / JOURNAL_FILE
    with MemoryStore(config=config, embedder=None) as store:
        durable = path.stat().st_size  # what the open synced: the rest is in the page cache only
        late = [store.remember_fact(f"fact written before the cut {i}").id for i in range(4)]

        def cut(directory: Path) -> None:
            raise SystemExit("power cut")  # the snapshot is durable, the journals not switched yet

        monkeypatch.setattr(files, "switch_journals", cut)
        with pytest.raises(SystemExit):
            store.compact()
        monkeypatch.undo()
        abandon(store)
    with open(path, "r+b") as handle:
        handle.truncate(durable)  # the cut: the unsynced frames are gone (they are in the snapshot)

    def full(*args: object, **kwargs: object) -> None:
        raise StorageFullError("the disk is full")

    monkeypatch.setattr(files, "write_next_journal", full)
    with MemoryStore(config=config, embedder=None) as store:
        assert all(store.get(i) for i in early + late)
        new = [store.remember_fact(f"written after the cut {i}").id for i in range(3)]
        assert store.forget(early[0]) and store.forget(late[0])
        abandon(store)
    monkeypatch.undo()
    expected = early[1:] + late[1:] + new
    assert _ids(config, early + late + new) == expected  # 2-3 of 3 new lost, the forgets undone
    assert bk.verify(config.data_dir).memories == len(expected)
