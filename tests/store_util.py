"""Helpers shared by the storage fault tests."""

from __future__ import annotations

from reachy_memory import MemoryStore


def abandon(store: MemoryStore) -> None:
    """Leave a store as a crash would: no compaction, no final sync, lock released."""
    store._journal.close()
    store._closed = True
    store._dir_lock.release()
