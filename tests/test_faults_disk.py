"""Write failures at the syscall seam (short writes, ENOSPC, fsync errors) and on a
real full disk: a write is acknowledged only when it is whole and durable, and
no acknowledged write is lost (docs/FORMAT.md, "Write and fsync errors")."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from store_util import abandon, present_after_crash

from reachy_memory import Config, MemoryStore, ReadOnlyError, StorageError, StorageFullError
from reachy_memory.engine.store import GRAPH_FILE
from reachy_memory.engine.vector_index import VectorIndex
from reachy_memory.storage import journal as jr


class Faults:
    """Replaces the journal's system calls; each fault fires once by default."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._mp = monkeypatch

    def write(self, fail: Callable[[int, memoryview], int]) -> None:
        self._mp.setattr(jr._os, "write", fail)

    def fdatasync(self, fail: Callable[[int], None]) -> None:
        self._mp.setattr(jr._os, "fdatasync", fail)

    def ftruncate(self, fail: Callable[[int, int], None]) -> None:
        self._mp.setattr(jr._os, "ftruncate", fail)

    def clear(self) -> None:
        self._mp.undo()


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Faults]:
    yield Faults(monkeypatch)


def _half_then_enospc() -> Callable[[int, memoryview], int]:
    calls = {"n": 0}

    def write(fd: int, data: memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return os.write(fd, data[: len(data) // 2])  # the disk takes half...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...then is full

    return write


def _eio(*_: object) -> None:
    raise OSError(errno.EIO, "Input/output error")


def test_disk_full_mid_frame_rolls_back_and_later_writes_succeed(config: Config, faults: Faults) -> None:
    store = MemoryStore(config=config, embedder=None)
    acked = [store.store(f"before {i}").id for i in range(3)]
    size = os.path.getsize(config.data_dir / "journal.rmj")
    faults.write(_half_then_enospc())
    with pytest.raises(StorageFullError):
        store.store("refused")
    faults.clear()
    assert os.path.getsize(config.data_dir / "journal.rmj") == size  # the half frame is gone
    assert len(store) == 3  # not applied
    acked += [store.store(f"after {i}").id for i in range(3)]  # usable again once space returns
    abandon(store)
    with MemoryStore(config=config, embedder=None) as reopened:  # opens cleanly: no checksum error
        assert all(reopened.get(i) for i in acked) and len(reopened) == 6


def test_short_writes_are_completed(config: Config, faults: Faults) -> None:
    def trickle(fd: int, data: memoryview) -> int:
        return os.write(fd, data[:7])  # the kernel may accept fewer bytes than asked

    store = MemoryStore(config=config, embedder=None)
    faults.write(trickle)
    memory = store.store("written seven bytes at a time")
    faults.clear()
    assert present_after_crash(store, config, [memory.id]) == [memory.id]


def test_failed_fsync_makes_the_store_read_only_until_reopened(config: Config, faults: Faults) -> None:
    store = MemoryStore(config=config, embedder=None)
    kept = store.store("durable").id
    faults.fdatasync(_eio)
    with pytest.raises(ReadOnlyError):
        store.store("not acknowledged")
    faults.clear()
    assert len(store) == 1  # the unacknowledged op is not applied in memory
    assert store.read_only and store.stats()["read_only"]
    with pytest.raises(ReadOnlyError):
        store.store("refused even though fsync works again")  # the kernel may have dropped pages
    store.close()
    with MemoryStore(config=config, embedder=None) as reopened:
        assert reopened.read_only is None and reopened.get(kept) is not None
        reopened.store("writes work after reopening")


def test_batch_fsync_failure_surfaces_on_the_next_write(config: Config, faults: Faults) -> None:
    cfg = config.replace("memory", fsync="batch", fsync_batch_window_ms=1.0)
    store = MemoryStore(config=cfg, embedder=None)
    faults.fdatasync(_eio)
    store.store("reaches the OS; its group fsync fails on the timer thread")
    store._storage.journal._timer.join(timeout=5)  # type: ignore[union-attr]
    faults.clear()
    with pytest.raises(ReadOnlyError):
        store.store("the next write is told")
    store.close()


def test_failed_rollback_makes_the_store_read_only(config: Config, faults: Faults) -> None:
    store = MemoryStore(config=config, embedder=None)
    faults.write(_half_then_enospc())
    faults.ftruncate(_eio)
    with pytest.raises(StorageFullError):
        store.store("half written, cannot be cut")
    faults.clear()
    with pytest.raises(ReadOnlyError):
        store.store("refused: the file may hold a partial frame")
    store.close()


def test_disk_full_during_auto_compaction_does_not_fail_the_acknowledged_write(
        config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.replace("memory", compact_journal_bytes=1)
    store = MemoryStore(config=cfg, embedder=None)

    def full(*_: object, **__: object) -> None:
        raise StorageFullError("disk full", path="x")

    monkeypatch.setattr("reachy_memory.storage.files.write_snapshot_keeping_previous", full)
    memory = store.store("durable in the journal even though the snapshot could not be written")
    monkeypatch.undo()
    assert present_after_crash(store, cfg, [memory.id]) == [memory.id]


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, timeout=10)
    return done.returncode == 0


def test_real_full_disk_loses_no_acknowledged_write(tmp_path: Path, base_config: Config) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("needs root and a mountable tmpfs for a real full disk")
    try:
        cfg = base_config.replace("memory", path=str(disk / "data"), compact_journal_bytes=256 * 1024)
        store = MemoryStore(config=cfg, embedder=None)
        acked, refused = [], 0
        for i in range(3000):
            try:
                acked.append(store.store(f"memory {i} " + "x" * 400).id)
            except StorageError:
                refused += 1
                if refused > 20:
                    break
        assert refused > 0, "the disk never filled"
        abandon(store)
        for filler in (disk / "data").glob("snapshot.prev.rms"):
            filler.unlink()  # space comes back
        with MemoryStore(config=cfg, embedder=None) as reopened:
            missing = [i for i in acked if reopened.get(i) is None]
            assert missing == [] and len(acked) > 100
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=10)


def test_real_full_disk_during_an_idle_graph_save_leaves_no_file_behind(tmp_path: Path) -> None:
    """hnswlib's save of a graph larger than the free space returned without an error:
    the short file was renamed in as the group's cached graph and kept the disk full."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "64k"):
        pytest.skip("needs root and a mountable tmpfs for a real full disk")
    try:
        vi = VectorIndex(8, exact_below=40, exact_threshold=10)
        rows = np.random.default_rng(3).standard_normal((2000, 8)).astype(np.float32)
        for slot, row in enumerate(rows):
            vi.add(slot, row / np.linalg.norm(row))
        vi.flush()  # a graph of ~350 KB
        assert vi.cache_step(disk / GRAPH_FILE, "t", 0.0) == 0
        assert list(disk.iterdir()) == [] and vi._changed[0] == 2000  # nothing left; still due
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=10)


def test_disk_full_during_an_expiry_sweep_deletes_nothing_and_a_retry_does_it_all(
        config: Config, faults: Faults) -> None:
    store = MemoryStore(config=config, embedder=None)
    chats = store.store_batch([{"content": f"chat {i}", "memory_type": "conversation"} for i in range(300)])
    fact = store.store("a fact that never expires")
    later = chats[0].created_at.timestamp() + 31 * 86400
    faults.write(_half_then_enospc())  # the sweep's one frame is cut halfway by a full disk
    with pytest.raises(StorageFullError):
        store.cleanup_expired(now=later)
    faults.clear()
    assert len(store) == 301 and not store._state._ghosts  # all or nothing: nothing applied
    assert store.cleanup_expired(now=later) == 300  # space is back: the retry deletes them all
    abandon(store)
    with MemoryStore(config=config, embedder=None) as reopened:  # the replay agrees
        assert len(reopened) == 1 and reopened.get(fact.id) is not None
