"""Helpers shared by the storage fault tests."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from reachy_memory import Config, MemoryStore


def abandon(store: MemoryStore) -> None:
    """Leave a store as a crash would: no compaction, no final sync, lock released.
    (A background compaction in flight finishes first: tests that crash inside one
    do it deterministically, on the calling thread.)"""
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
