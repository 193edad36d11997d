"""Helpers shared by the storage fault tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from reachy_memory import Config, MemoryStore


@dataclass(frozen=True)
class Disk:
    """One possible disk after a power cut: names -> content, and the acknowledged ops before it."""

    files: dict[str, bytes]
    acked: int
    label: str


def files_by_inode(directory: Path) -> dict[str, int]:
    """The regular files of ``directory`` (name -> inode); a file another thread removes
    meanwhile (a background compaction's temp file) is skipped."""
    listing: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.is_file(follow_symlinks=False):
                    listing[entry.name] = entry.inode()
    return listing


def cut_variants(open_cut: tuple[dict[str, int], dict[str, int], str],
                 content_of: Callable[[int], bytes]) -> list[tuple[dict[str, bytes], str]]:
    """The two disks a power cut may leave at the end of a cut point ``open_cut`` (the
    directory's names as last synced, its names as they stand, a label): each name with
    ``content_of(its inode)``, the file as of its last fsync."""
    entries, current, label = open_cut
    return [({n: content_of(ino) for n, ino in names.items()}, f"{label}, {variant}")
            for names, variant in ((entries, "synced names"), (current, "names as they stand"))]


def abandon(store: MemoryStore) -> None:
    """Leave a store as a crash would: no compaction, no final sync, lock released.
    (A background compaction in flight finishes first: tests that crash inside one
    do it deterministically, on the calling thread.)"""
    store._storage.purge.stop()  # a purge thread must not write into a directory another store opens
    store._storage.wait()
    store._storage.journal.close()
    store._closed = True
    store._dir_lock.release()


def present_after_crash(store: MemoryStore, config: Config, ids: list[str]) -> list[str]:
    """Crash ``store`` (see :func:`abandon`), reopen it, and return which of ``ids`` are there."""
    abandon(store)
    with MemoryStore(config=config, embedder=None) as reopened:
        return [i for i in ids if reopened.get(i) is not None]


@contextmanager
def frequent_switches(interval: float = 1e-5) -> Iterator[None]:
    """Make the interpreter switch threads every ``interval`` seconds (races show up
    within a second instead of by luck)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class WallClock:
    """``time.time`` for the test's process, set by hand (``at``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: float) -> None:
        self.at = at
        monkeypatch.setattr(time, "time", lambda: self.at)


@contextmanager
def unwritable_dir(where: Path) -> Iterator[Path]:
    """An existing folder ``where`` this process may not write: mode 0500 for a user;
    for root (whom modes do not stop) a read-only tmpfs mounted there, or the test is
    skipped when none can be mounted."""
    where.mkdir()
    if os.geteuid() != 0:
        where.chmod(0o500)
        try:
            yield where
        finally:
            where.chmod(0o700)
        return
    mounted = shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)], capture_output=True, timeout=10,
    ).returncode == 0
    if not mounted:
        pytest.skip("root needs a mountable read-only tmpfs for a folder it cannot write")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)


# Data directories a store cannot use, and what the error says (ConfigError, key memory.path).
BAD_DATA_DIRS = [
    ("a regular file", "is a file, not a directory"),  # was StorageError "File exists", exit 1
    ("under a regular file", "is a file, not a directory"),  # was StorageError "Not a directory", exit 1
    ("an unwritable folder", "permission denied|read-only file system"),  # was a PermissionError on LOCK (exit 1),
    # or for root StorageError on the chmod
    ("in an unwritable folder", "permission denied|read-only file system"),  # was StorageError, exit 1
]


@contextmanager
def bad_data_dir(kind: str, tmp: Path) -> Iterator[Path]:
    """The data directory path of ``kind`` (a :data:`BAD_DATA_DIRS` row), made in ``tmp``."""
    if kind in ("a regular file", "under a regular file"):
        (tmp / "file").write_text("not a folder")
        yield tmp / "file" if kind == "a regular file" else tmp / "file" / "data"
        return
    with unwritable_dir(tmp / "locked") as locked:
        yield locked if kind == "an unwritable folder" else locked / "data"
