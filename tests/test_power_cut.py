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

import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import Config, MemoryStore, MemoryType
from reachy_memory.storage import backup as bk
from reachy_memory.storage import journal as jr
from tests.conftest import HashEmbedder
from tests.store_util import Disk, abandon, cut_variants, files_by_inode


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
        for files, label in cut_variants(self._open_cut, lambda ino: self._synced.get(ino, b"")):
            self.disks.append(Disk(files, self.acked, label))
        self._open_cut = None

    def _listing(self) -> dict[str, int]:
        return files_by_inode(self.directory)


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


# -- restore --force: the old store or the backup, whole, wherever the power goes --------------


def _opened(where: Path, config: Config) -> MemoryStore:
    return MemoryStore(config=config.replace("memory", path=str(where)), embedder=HashEmbedder())


def _contents(where: Path, config: Config, store: MemoryStore | None = None) -> dict[str, str]:
    """Every memory of the store that opens in ``where`` (or of ``store``, opened there): id -> content."""
    with store if store is not None else _opened(where, config) as opened:
        page, _ = opened.export_page(limit=1000)
        assert len(page) == len(opened) < 1000
        return {m.id: m.content for m in page}


def _old_store_and_backup(cfg: Config, tmp_path: Path) -> tuple[dict[str, str], dict[str, str], Path]:
    """A store in ``cfg``'s data dir with two generations, a graph cache and journaled writes
    after them; a backup of another store holding other memories.  Returns both contents and
    the backup's path."""
    store = MemoryStore(config=cfg, embedder=HashEmbedder())
    for round_ in range(2):
        for i in range(12):
            store.store(f"old store fact {round_}-{i} about the garden")
        store.compact(full=True)
    store.store("old store fact written after the last compaction")
    abandon(store)  # the journal keeps its ops, as after a crash
    other = cfg.replace("memory", path=str(tmp_path / "other"))
    with MemoryStore(config=other, embedder=HashEmbedder()) as store:
        for i in range(9):
            store.store(f"backup fact {i} about the kitchen")
        store.compact()
        store.store("backup fact journaled before the backup")
        backup = Path(store.backup(tmp_path / "backup.rms")["path"])
    old, new = _contents(Path(cfg.memory.path), cfg), _contents(other.data_dir, cfg)
    assert old and new and not old.keys() & new.keys()
    return old, new, backup


def _opens_as_one(where: Path, cfg: Config, old: dict[str, str], new: dict[str, str], label: str) -> dict[str, str]:
    """Verify, then open ``where``: the old store or the backup, whole, and verify counts what opens."""
    report = bk.verify(where)
    found = _contents(where, cfg)
    assert found in (old, new), f"after a power cut at {label}: {len(found)} memories, a mix or neither"
    assert report.ok and report.memories == len(found), f"verify at {label}: {report.to_dict()}"
    return found


@pytest.mark.parametrize("into", ["store", "empty dir"])
def test_a_power_cut_during_restore_leaves_the_old_store_or_the_backup(config: Config, tmp_path: Path,
                                                                       into: str) -> None:
    """restore --force moved the old store aside, then wrote the backup's copy: a cut in
    between opened as a new, empty store (or refused to open), the old files set aside."""
    cfg = config.replace("search", exact_below=8, exact_threshold=4)  # graph caches to set aside too
    data = Path(cfg.memory.path)
    old, new, backup = _old_store_and_backup(cfg, tmp_path)
    if into == "empty dir":  # a plain restore (no --force) into a new data dir
        data, old = tmp_path / "new-data", {}
        data.mkdir(mode=0o700)
    with recording(data) as rec:
        bk.restore(backup, data, force=into == "store")
    assert len(rec.disks) >= (20 if into == "store" else 8)
    outcomes, recovered = [], 0
    for n, disk in enumerate(rec.disks):
        _write_disk(disk, tmp_path / f"cut-{n}-verified")
        found = _opens_as_one(tmp_path / f"cut-{n}-verified", cfg, old, new, disk.label)
        outcomes.append(found is new or found == new)
        where = tmp_path / f"cut-{n}"  # opened first (the recovery is the open's): a second cut at its fsyncs
        _write_disk(disk, where)
        with recording(where) as again:
            store = _opened(where, cfg)
        assert _contents(where, cfg, store) == found, f"open and verify disagree after {disk.label}"
        for m, second in enumerate(again.disks):
            _write_disk(second, tmp_path / f"cut-{n}-{m}")
            assert _contents(tmp_path / f"cut-{n}-{m}", cfg) == found, f"after {disk.label}, then {second.label}"
        recovered += len(again.disks)
    assert not outcomes[0] and outcomes[-1] and recovered > 10  # both ends were cut into
    assert _contents(data, cfg) == new
    original = tmp_path / "put-back-by-hand"  # the old store's files, set aside whole
    original.mkdir(mode=0o700)
    for path in data.glob("*.before-restore-*"):
        os.replace(path, original / path.name.partition(".before-restore-")[0])
    assert _contents(original, cfg) == old


def _counted(real: Callable[..., Any], calls: list[int], at: int) -> Callable[..., Any]:
    """``real``, with a SIGKILL of this process at the ``at``-th call counted in ``calls``."""
    def call(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)
    return call


def _killed_restore(backup: Path, where: Path, at: int) -> bool:
    """Restore ``backup`` into ``where`` in a forked child killed (SIGKILL) at its ``at``-th
    fsync or rename; True if it finished first.  Waits at most 20 s (a child wedged by the
    fork is killed, and the test fails); a child that raised fails it too."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        try:
            calls: list[int] = []
            os.fsync, os.replace = _counted(os.fsync, calls, at), _counted(os.replace, calls, at)
            bk.restore(backup, where, force=True)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            assert killed or status == 0, f"the restore killed at step {at} failed: {status}"
            return os.WIFEXITED(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the restore killed at step {at} did not end within 20 s")


def test_a_restore_killed_at_each_step_leaves_the_old_store_or_the_backup(config: Config, tmp_path: Path) -> None:
    """kill -9 keeps every write made (the page cache): what the open finds is the old store
    or the backup, whole, and no temp or staged file of the restore is left behind."""
    old, new, backup = _old_store_and_backup(config, tmp_path)
    seen = set()
    for at in range(1, 60):
        where = tmp_path / f"killed-{at}"
        shutil.copytree(config.data_dir, where)
        finished = _killed_restore(backup, where, at)
        found = _opens_as_one(where, config, old, new, f"kill at step {at}")
        seen.add(found == new)
        assert not [p.name for p in where.iterdir() if ".tmp-" in p.name or p.name.endswith(".restoring")
                    or p.name == "restore.intent"], f"kill at step {at}"
        if finished:
            assert found == new
            break
    else:
        raise AssertionError("the restore never finished")
    assert seen == {False, True}
