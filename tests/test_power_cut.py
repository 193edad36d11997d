"""Power cuts: what the disk holds when the power goes, not what the page cache held.

A process crash (``kill -9``, tests/test_crash.py) keeps every write the process
made: the kernel still has it.  A power cut keeps only what was made durable.
:class:`DiskAtPowerCut` records, at every fsync the store makes, what a power cut
right after it would leave behind: each file's content as of its own last fsync
(never fsynced: empty, as ext4's delayed allocation leaves a new file), and the
directory's entries as of its last fsync, or, in the other variant, as they stand
(renames may reach the disk before the directory's fsync, never the content).

Each such disk is written to a fresh directory and opened: every write the store
had acknowledged before the next fsync must be there, and nothing forgotten back.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reachy_memory import Config, MemoryStore, MemoryType
from reachy_memory import journal as jr
from tests.conftest import HashEmbedder


@dataclass(frozen=True)
class Disk:
    """One possible disk after a power cut: names -> content, and the acknowledged ops before it."""

    files: dict[str, bytes]
    acked: int
    label: str


@dataclass
class DiskAtPowerCut:
    """Records the disks a power cut could leave in ``directory`` (flat: the store's files)."""

    directory: Path
    acked: int = 0
    disks: list[Disk] = field(default_factory=list)
    _synced: dict[int, bytes] = field(default_factory=dict)  # inode -> content at its last fsync
    _entries: dict[str, int] = field(default_factory=dict)  # name -> inode at the directory's last fsync
    _open_cut: tuple[dict[str, int], dict[str, int], str] | None = None  # since the last fsync
    _events: int = 0
    _finished: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def synced(self, fd: int) -> None:
        """An fsync of ``fd`` returned: record it, then open a new cut point."""
        info = os.fstat(fd)
        with self._lock:
            if self._finished:
                return
            self._close_cut()
            self._events += 1
            if stat.S_ISDIR(info.st_mode):
                if info.st_ino == self.directory.stat().st_ino:
                    self._entries = self._listing()
            else:
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    self._synced[info.st_ino] = f.read()
            self._open_cut = (dict(self._entries), self._listing(), f"fsync #{self._events}")

    def seed(self) -> None:
        """Take what ``directory`` holds now as on disk (the start of a recovery's recording)."""
        self._entries = self._listing()
        for name, ino in self._entries.items():
            self._synced[ino] = (self.directory / name).read_bytes()

    def ack(self) -> None:
        """One more operation was acknowledged to its caller."""
        with self._lock:
            self.acked += 1

    def finish(self) -> list[Disk]:
        """The disks of every cut point (two variants each)."""
        with self._lock:
            self._close_cut()
            self._finished = True
        return list(self.disks)

    def _close_cut(self) -> None:
        # A cut point lasts until the next fsync: the acknowledgements given in
        # between are all owed by a power cut at its end.
        if self._open_cut is None:
            return
        entries, current, label = self._open_cut
        for names, variant in ((entries, "synced names"), (current, "names as they stand")):
            files = {n: self._synced.get(ino, b"") for n, ino in names.items()}
            self.disks.append(Disk(files, self.acked, f"{label}, {variant}"))
        self._open_cut = None

    def _listing(self) -> dict[str, int]:
        # Another thread (a background compaction) may remove a temp file meanwhile: skipped.
        listing: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file(follow_symlinks=False):
                        listing[entry.name] = entry.inode()
        return listing


@contextmanager
def recording(directory: Path) -> Iterator[DiskAtPowerCut]:
    """Every fsync and fdatasync of the process, while inside, goes through a recorder of ``directory``."""
    rec = DiskAtPowerCut(directory)
    rec.seed()
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        rec.synced(fd)

    def fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        rec.synced(fd)

    with pytest.MonkeyPatch.context() as mp:
        for seam in (os, jr._os):
            mp.setattr(seam, "fsync", fsync)
            mp.setattr(seam, "fdatasync", fdatasync)
        yield rec
    rec.finish()


@dataclass
class Expected:
    """What the acknowledged operations promise, in order."""

    ops: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, id, content)

    def live(self, acked: int) -> tuple[dict[str, str], set[str], set[str]]:
        """Memories present (id -> content), forgotten, and persons, after the first ``acked``
        ops; the op in flight then (the next one: durable or not, it was not acknowledged)
        may have happened or not, so what it touches is left out of both."""
        present: dict[str, str] = {}
        gone: set[str] = set()
        people: set[str] = set()
        for kind, memory_id, content in self.ops[:acked]:
            if kind == "put":
                present[memory_id] = content
            elif kind == "person":
                people.add(memory_id)
            else:
                present.pop(memory_id, None)
                gone.add(memory_id)
        for _, in_flight, _ in self.ops[acked : acked + 1]:
            present.pop(in_flight, None)
        return present, gone, people


def _workload(store: MemoryStore, rec: DiskAtPowerCut, expected: Expected, rounds: int) -> None:
    """Writes, forgets, persons, contexts, and compactions both explicit and in the background."""
    for i in range(rounds):
        m = store.store(f"fact number {i} about the garden", MemoryType.FACT)
        expected.ops.append(("put", m.id, m.content))
        rec.ack()
        t = store.record_turn("user", f"turn {i}: what a day in the kitchen")
        expected.ops.append(("put", t.id, t.content))
        rec.ack()
        if i % 3 == 2:
            victim = expected.ops[-4][1]
            store.forget(victim)
            expected.ops.append(("del", victim, ""))
            rec.ack()
        while store.maintain():  # the graph cache is saved too (not fsynced: a cache)
            pass
        if i % 5 == 4:
            store.compact()
        if i == rounds // 2:
            p = store.add_person("Sarah", relation="wife")
            expected.ops.append(("person", p.id, p.name))
            rec.ack()


def _write_disk(disk: Disk, where: Path) -> None:
    where.mkdir(mode=0o700)
    for name, content in disk.files.items():
        (where / name).write_bytes(content)
        (where / name).chmod(0o600)


def _check(where: Path, config: Config, expected: Expected, acked: int, label: str) -> None:
    """Open the store in ``where``: it serves (a search walks the vectors) and holds what was acknowledged."""
    present, gone, people = expected.live(acked)
    with MemoryStore(config=config.replace("memory", path=str(where)), embedder=HashEmbedder()) as store:
        store.search("garden kitchen", limit=50)
        missing = [i for i, text in present.items() if (m := store.get(i)) is None or m.content != text]
        back = [i for i in gone if store.get(i) is not None]
        lost_people = [i for i in people if i not in {p.id for p in store.people()}]
    assert (missing, back, lost_people) == ([], [], []), f"after a power cut at {label}"


def test_every_acknowledged_write_survives_a_power_cut_at_every_fsync(config: Config, tmp_path: Path) -> None:
    cfg = config.replace("memory", compact_journal_bytes=2048).replace(  # background compactions too
        "search", exact_below=8, exact_threshold=4)  # graphs, and their cache saves
    expected = Expected()
    with recording(Path(cfg.memory.path)) as rec, MemoryStore(config=cfg, embedder=HashEmbedder()) as store:
        _workload(store, rec, expected, rounds=15)
    assert len(rec.disks) > 100  # the workload made many fsyncs: a cut at each of them
    assert any(name.startswith("vectors.hnsw") for disk in rec.disks for name in disk.files)  # caches cut too
    for n, disk in enumerate(rec.disks):
        _write_disk(disk, tmp_path / f"cut-{n}")
        _check(tmp_path / f"cut-{n}", cfg, expected, disk.acked, disk.label)


def test_a_power_cut_during_recovery_loses_nothing_either(config: Config, tmp_path: Path) -> None:
    """The open after a cut repairs (carries a journal over, switches journals, sets a torn
    tail aside); a second cut at each of its fsyncs must still find everything."""
    cfg = config.replace("memory", compact_journal_bytes=2048)
    expected = Expected()
    with recording(Path(cfg.memory.path)) as rec, MemoryStore(config=cfg, embedder=HashEmbedder()) as store:
        _workload(store, rec, expected, rounds=8)
    recovered = 0
    for n, disk in enumerate(rec.disks[::3]):
        where = tmp_path / f"cut-{n}"
        _write_disk(disk, where)
        with recording(where) as again:
            MemoryStore(config=cfg.replace("memory", path=str(where)), embedder=HashEmbedder()).close()
        for m, second in enumerate(again.disks):
            _write_disk(second, tmp_path / f"cut-{n}-{m}")
            _check(tmp_path / f"cut-{n}-{m}", cfg, expected, disk.acked, f"{disk.label}, then {second.label}")
        recovered += len(again.disks)
    assert recovered > 50
