"""The data directory's lock and the files a running store holds (docs/FORMAT.md, "Files").

The lock is a flock on the directory itself: deleting ``LOCK`` (a "stale lock" clean-up)
does not let a second store in.  A store whose directory or journal is taken away while
it runs notices (``maintain``, the daemon's idle step, and every write check it at most
once a second) and refuses writes from then on, the reason in ``read_only`` (the daemon's
``health`` says ``read_only``) and the log, instead of acknowledging writes into unlinked
files.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from reachy_memory import Config, MemoryStore, ReadOnlyError, StoreLockedError
from reachy_memory.storage import journal as jr

pytestmark = pytest.mark.timeout(60)


def test_deleting_lock_does_not_let_a_second_store_in(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("written by the first store")
        (config.data_dir / "LOCK").unlink()  # a "stale lock" clean-up under a running daemon
        with pytest.raises(StoreLockedError):
            MemoryStore(config=config, embedder=None)
        assert jr.is_locked(config.data_dir)
        store._storage._checked = 0.0
        store.maintain()
        assert (config.data_dir / "LOCK").read_text().strip() == str(os.getpid())  # made again, informative
        assert store.read_only is None


def _taken_away(store: MemoryStore) -> str:
    store._storage._checked = 0.0  # the check runs at most once a second
    store.maintain()
    reason = store.read_only
    assert reason is not None
    with pytest.raises(ReadOnlyError):
        store.remember_fact("acknowledged into a file nobody will read again")
    assert store.stats()["read_only"] == reason
    return reason


def test_a_removed_data_directory_makes_the_store_read_only(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("before")
        shutil.rmtree(config.data_dir)
        assert "removed" in _taken_away(store)


def test_a_data_directory_replaced_by_another_makes_the_store_read_only(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("before")
        os.rename(config.data_dir, config.data_dir.with_name("moved"))
        config.data_dir.mkdir()
        assert "replaced" in _taken_away(store)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_journal_taken_away_makes_the_store_read_only(config: Config, how: str) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("before")
        journal = config.data_dir / "journal.rmj"
        if how == "deleted":
            journal.unlink()
        else:
            copy = journal.with_name("copy")
            shutil.copy(journal, copy)
            os.replace(copy, journal)  # a copy in its place: the store's file is unlinked
        assert "journal.rmj" in _taken_away(store)


def test_writes_check_too_without_idle_time(config: Config) -> None:
    """A daemon busy with writes calls maintain rarely: the write itself checks (the journal's
    link count every time, the directory's identity once a second)."""
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("before")
        shutil.rmtree(config.data_dir)
        with pytest.raises(ReadOnlyError, match="deleted"):
            store.remember_fact("after")
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("before")
        os.rename(config.data_dir, config.data_dir.with_name("elsewhere"))
        time.sleep(1.05)
        with pytest.raises(ReadOnlyError, match="removed"):
            store.remember_fact("after")
