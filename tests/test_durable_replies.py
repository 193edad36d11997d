"""The daemon's sync thread: a write's reply waits for its fsync, nothing else does.

A daemon serves in this process (a thread, loopback ipc in a temp dir) so that the
journal's fsync (``journal._os.fdatasync``, the syscall seam) can be held: an SD
card's fsync takes milliseconds to tens of them, and a search queued behind a write
used to wait for all of it on the engine thread.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import MemoryClient, MemoryStore
from reachy_memory.config import Config
from reachy_memory.daemon.server import Daemon
from reachy_memory.errors import BusyError, NotFoundError, ReadOnlyError, StorageError
from reachy_memory.storage import journal as jr

pytestmark = pytest.mark.timeout(120)
WAIT = 10.0  # seconds: bounds a broken run only


class HeldDisk:
    """``fdatasync`` that, once ``hold()`` is called, blocks until ``release()`` (or
    fails with EIO when ``failing``); counts the calls made while held or after."""

    def __init__(self) -> None:
        self.real = os.fdatasync
        self.held = False
        self.failing = False
        self.entered = threading.Event()
        self.released = threading.Event()
        self.calls = 0

    def fdatasync(self, fd: int) -> None:
        if self.held:
            self.calls += 1
            self.entered.set()
            assert self.released.wait(WAIT), "the test never released the disk"
            if self.failing:
                raise OSError(errno.EIO, "Input/output error")
        self.real(fd)

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> HeldDisk:
    held = HeldDisk()
    monkeypatch.setattr(jr._os, "fdatasync", held.fdatasync)
    return held


@pytest.fixture
def served(config: Config, tmp_path: Path, disk: HeldDisk) -> Iterator[Daemon]:
    """A words-only daemon serving on a thread of this process; stopped after the test."""
    store = MemoryStore(config=config, embedder=None)
    daemon = Daemon(config, store=store, endpoint=f"ipc://{tmp_path}/run/m.sock", clock_sync=lambda: None)
    thread = threading.Thread(target=daemon.serve, daemon=True)
    thread.start()
    try:
        with client(daemon, timeout=WAIT) as c:
            c.ping()
        yield daemon
    finally:
        disk.release()
        daemon.stop()
        thread.join(WAIT)
        assert not thread.is_alive()


def client(daemon: Daemon, timeout: float = WAIT) -> MemoryClient:
    return MemoryClient(daemon.endpoint, config=daemon.config, timeout=timeout)


def in_background(call: Callable[[MemoryClient], Any], daemon: Daemon, pool: ThreadPoolExecutor) -> Future[Any]:
    """``call`` with a client of its own, on a pool thread."""
    def run() -> Any:
        with client(daemon) as c:
            return call(c)
    return pool.submit(run)


def test_reads_are_answered_while_a_write_waits_for_its_fsync(served: Daemon, disk: HeldDisk) -> None:
    """Before: the engine thread ran the fsync, and the search queued behind it waited for
    the disk (here: forever, so it timed out)."""
    with ThreadPoolExecutor(2) as pool, client(served, timeout=3.0) as c:
        c.store("the kettle is in the kitchen")
        disk.hold()
        write = in_background(lambda w: w.store("the garden gate is green", id="gate"), served, pool)
        assert disk.entered.wait(WAIT)
        hits = c.search("garden gate", mode="lexical")  # not held by the fsync in flight
        assert [h.memory.id for h in hits] == ["gate"]  # (it shows a write not yet durable)
        assert c.get("gate") is not None and c.people() == []
        time.sleep(0.2)
        assert not write.done()  # its reply waits for the disk
        disk.release()
        assert write.result(WAIT).id == "gate"


def test_a_retry_of_a_write_not_yet_durable_waits_for_it_too(served: Daemon, disk: HeldDisk) -> None:
    """A retry finds its memory written: it must not say so before the first copy is durable."""
    with ThreadPoolExecutor(2) as pool:
        disk.hold()
        first = in_background(lambda w: w.store("the spare key is under the pot", id="key"), served, pool)
        assert disk.entered.wait(WAIT)
        retry = in_background(lambda w: w.store("the spare key is under the pot", id="key"), served, pool)
        time.sleep(0.3)
        assert not first.done() and not retry.done()
        disk.release()
        assert first.result(WAIT).id == retry.result(WAIT).id == "key"


def test_writes_made_during_one_fsync_share_the_next(served: Daemon, disk: HeldDisk) -> None:
    """Group commit: before, each write had an fsync of its own (6 here)."""
    with ThreadPoolExecutor(6) as pool:
        disk.hold()
        first = in_background(lambda w: w.store("first"), served, pool)
        assert disk.entered.wait(WAIT)
        rest = [in_background(lambda w, i=i: w.store(f"note {i}"), served, pool) for i in range(5)]
        deadline = time.monotonic() + WAIT
        while served.store.stats()["memories"] < 6:  # all five applied while the first fsync is held
            assert time.monotonic() < deadline
            time.sleep(0.01)
        disk.release()
        assert first.result(WAIT) and all(f.result(WAIT) for f in rest)
    assert disk.calls == 2


def test_a_failed_fsync_fails_the_write_and_the_store_refuses_writes(served: Daemon, disk: HeldDisk) -> None:
    with ThreadPoolExecutor(1) as pool, client(served) as c:
        disk.hold()
        disk.failing = True
        write = in_background(lambda w: w.store("maybe never on disk"), served, pool)
        assert disk.entered.wait(WAIT)
        disk.release()
        with pytest.raises(ReadOnlyError, match="may not be durable"):
            write.result(WAIT)
        with pytest.raises(ReadOnlyError):
            c.store("refused")
        assert c.health()["status"] == "read_only" and c.ping()["pong"]


def test_a_stop_during_a_held_fsync_answers_the_write_and_closes_clean(served: Daemon, disk: HeldDisk,
                                                                        config: Config) -> None:
    with ThreadPoolExecutor(1) as pool:
        disk.hold()
        write = in_background(lambda w: w.store("said just before the stop", id="last"), served, pool)
        assert disk.entered.wait(WAIT)
        # the held fsync may be the store's own upkeep (the journal head's): stop only once the
        # daemon holds the write, else the stop ends intake before the write arrives
        deadline = time.monotonic() + WAIT
        while served.store.get("last") is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        served.stop()
        time.sleep(0.2)
        disk.release()
        assert write.result(WAIT).id == "last"
    served.store.close()  # (idempotent: the daemon closed it) then it reopens with the write
    with MemoryStore(config=config, embedder=None) as again:
        assert again.get("last") is not None


@contextmanager
def serving(config: Config, tmp_path: Path) -> Iterator[Daemon]:
    """A words-only daemon of ``config`` serving on a thread of this process until the block ends."""
    store = MemoryStore(config=config, embedder=None)
    daemon = Daemon(config, store=store, endpoint=f"ipc://{tmp_path}/run/m.sock", clock_sync=lambda: None)
    thread = threading.Thread(target=daemon.serve, daemon=True)
    thread.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        thread.join(WAIT)
        assert not thread.is_alive()


@pytest.mark.parametrize("policy", ["batch", "never"])
def test_a_write_under_a_lighter_fsync_policy_never_waits_for_an_fsync(config: Config, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        policy: str) -> None:
    """``batch`` answers before its group fsync (a power cut may lose the last window),
    ``never`` leaves write-back to the OS. Before: every reply waited for an fdatasync of
    the sync thread, whatever the policy said."""
    synced: list[int] = []
    monkeypatch.setattr(jr._os, "fdatasync", lambda fd: synced.append(fd))
    cfg = config.replace("memory", fsync=policy, fsync_batch_window_ms=10_000.0)
    with serving(cfg, tmp_path) as daemon, client(daemon) as c:
        for i in range(5):
            c.store(f"fact {i}", id=f"f{i}")
        c.forget("f0")
        assert synced == []
        assert c.get("f4") is not None


def test_the_sync_thread_outlives_an_unexpected_error(served: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """No descriptor left to duplicate (EMFILE) for the fsync: the write waiting for it is
    answered with the error, and the next one is made durable.  Before: the OSError ended
    the sync thread, and every later write waited for good (here: timed out)."""
    real_dup = os.dup
    failed: list[int] = []

    def dup(fd: int) -> int:
        if not failed:
            failed.append(fd)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_dup(fd)

    monkeypatch.setattr(os, "dup", dup)
    with client(served, timeout=5.0) as c:
        with pytest.raises(StorageError, match="cannot make the last writes"):
            c.store("the first write: its fsync could not start", id="first")
        assert failed
        assert c.store("the second write", id="second").id == "second"
        assert c.store("the first write: its fsync could not start", id="first").id == "first"  # the retry


def test_a_write_that_failed_keeps_its_own_error_when_the_fsync_fails_too(served: Daemon,
                                                                          disk: HeldDisk) -> None:
    """A failed request queued behind a write whose fsync then fails: its own error, counted
    once.  Before: the fsync's ReadOnlyError replaced it and it was counted twice."""
    with ThreadPoolExecutor(2) as pool, client(served) as c:
        disk.hold()
        disk.failing = True
        write = in_background(lambda w: w.store("maybe never on disk"), served, pool)
        assert disk.entered.wait(WAIT)
        wrong = in_background(lambda w: w.confirm("no-such-memory"), served, pool)
        deadline = time.monotonic() + WAIT
        while c.stats()["queues"]["sync"] < 1:  # the confirm waits behind the held fsync
            assert time.monotonic() < deadline
            time.sleep(0.01)
        disk.release()
        with pytest.raises(ReadOnlyError):
            write.result(WAIT)
        with pytest.raises(NotFoundError):
            wrong.result(WAIT)
        assert c.stats()["ops"]["confirm"]["errors"] == 1


def test_a_journal_whose_fsync_failed_never_says_its_frames_are_durable(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed after its last fsync failed (a compaction's switch closes the journal; a
    switch that fails then leaves it the store's journal): before, a closed journal
    counted as synced, and the write was answered as durable."""
    journal = jr.Journal(tmp_path / "journal.rmj")
    journal.open({"kind": "journal", "generation": 0})
    journal.append([["op", 1]], defer=True)
    end = journal.size
    assert not journal.synced_through(end)

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(jr._os, "fdatasync", failing)
    journal.close()  # its fsync fails (logged): the journal is read-only, and closed
    assert journal.failure is not None
    assert not journal.synced_through(end)
    with pytest.raises(ReadOnlyError):
        journal.sync_through(end)


def test_an_fsync_that_succeeds_after_another_failed_does_not_count(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel reports a write-back error to one fsync of a file description: the sync
    thread's fsync (of a duplicate) may return 0 while the one a closing compaction made
    failed.  Before: the write was answered as durable."""
    journal = jr.Journal(tmp_path / "journal.rmj")
    journal.open({"kind": "journal", "generation": 0})
    journal.append([["op", 1]], defer=True)
    end = journal.size
    real = os.fdatasync

    def the_other_fsync_fails_meanwhile(fd: int) -> None:
        real(fd)
        with journal._lock:
            journal._fail("fsync of the journal failed (Input/output error)")

    monkeypatch.setattr(jr._os, "fdatasync", the_other_fsync_fails_meanwhile)
    with pytest.raises(ReadOnlyError):
        journal.sync_through(end)
    assert not journal.synced_through(end)
    journal.close()


def test_a_search_is_answered_while_the_scheduled_sweep_waits_for_its_fsync(served: Daemon,
                                                                             disk: HeldDisk) -> None:
    """The expiry sweep (like the decay clock refreshes and late vectors of idle upkeep) is
    the engine's own write: its fsync goes to the sync thread too.  Before: the engine
    thread ran it, and a search arriving then waited for the disk (here: timed out)."""
    with client(served, timeout=3.0) as c:
        c.store("the kettle is in the kitchen", id="kettle")
        c.store_batch([{"content": "an old chat about the garden", "memory_type": "conversation",
                        "created_at": time.time() - 400 * 86400, "id": "old"}])
        assert served.store.stats()["expired_unswept"] == 1
        disk.hold()
        served.lanes.schedule(served.upkeep.cleanup)
        assert disk.entered.wait(WAIT)
        assert [h.memory.id for h in c.search("kettle kitchen", mode="lexical")] == ["kettle"]
        disk.release()
        deadline = time.monotonic() + WAIT
        while served.store.stats()["expired_unswept"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_full_sync_queue_holds_the_engine_back_and_everything_is_answered(config: Config, tmp_path: Path,
                                                                            disk: HeldDisk) -> None:
    """A write flood while the disk stalls: the sync queue (4 x queue_size) fills, the engine
    waits for room (backpressure), later requests are refused busy; once the disk answers,
    every write accepted is answered, and then a stop finds it durable."""
    cfg = config.replace("server", queue_size=2)
    with serving(cfg, tmp_path) as daemon, ThreadPoolExecutor(24) as pool:
        with client(daemon) as c:
            c.ping()
        disk.hold()
        writes = [in_background(lambda w, i=i: w.store(f"fact {i}", id=f"f{i}"), daemon, pool) for i in range(24)]
        assert disk.entered.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while daemon.lanes.sync_q.qsize() < 8:  # the queue fills (the engine then waits for room)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(1.5)  # the embed thread's 1-s wait for the engine queue runs out: busy
        disk.release()
        answered, busy = [], 0
        for i, write in enumerate(writes):
            try:
                answered.append(write.result(WAIT).id)
            except BusyError:
                busy += 1
            else:
                assert answered[-1] == f"f{i}"
        assert answered and busy and len(answered) + busy == 24
    with MemoryStore(config=cfg, embedder=None) as again:
        assert all(again.get(i) is not None for i in answered)


def test_a_stop_while_writes_wait_for_a_stalled_fsync_answers_them_all(served: Daemon, disk: HeldDisk,
                                                                       config: Config) -> None:
    with ThreadPoolExecutor(6) as pool:
        disk.hold()
        writes = [in_background(lambda w, i=i: w.store(f"said before the stop {i}", id=f"s{i}"), served, pool)
                  for i in range(6)]
        assert disk.entered.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while served.store.stats()["memories"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        served.stop()
        time.sleep(0.3)
        assert not any(w.done() for w in writes)
        disk.release()
        assert sorted(w.result(WAIT).id for w in writes) == [f"s{i}" for i in range(6)]
    served.store.close()
    with MemoryStore(config=config, embedder=None) as again:
        assert all(again.get(f"s{i}") is not None for i in range(6))


def test_a_store_whose_fsync_failed_stays_read_only_when_a_compaction_in_flight_ends(
        config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background compaction is writing its snapshot when a journal fsync fails (the
    sync thread's, or any): its switch used to open a fresh journal, and the store took
    writes again (``health`` ok) after its journal had said that recent writes may be lost."""
    from reachy_memory.storage import files

    cfg = config.replace("memory", compact_journal_bytes=2000)
    writing, go_on = threading.Event(), threading.Event()
    real_write = files.write_snapshot_keeping_previous

    def slow_snapshot(directory: Path, frames: Any) -> None:
        writing.set()
        assert go_on.wait(WAIT)
        real_write(directory, frames)

    monkeypatch.setattr(files, "write_snapshot_keeping_previous", slow_snapshot)
    with MemoryStore(config=cfg, embedder=None) as store:
        i = 0
        while not writing.is_set():  # until the journal outgrows the threshold
            store.store(f"fact {i} about the garden gate")
            i += 1
        with store.deferred_durability():
            store.store("its fsync is about to fail", id="doomed")
        mark = store.durability_mark()
        assert mark is not None
        monkeypatch.setattr(jr._os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
        with pytest.raises(ReadOnlyError):
            mark()
        monkeypatch.setattr(jr._os, "fdatasync", os.fdatasync)
        go_on.set()
        store._storage.wait()  # the compaction ends
        assert store.read_only
        with pytest.raises(ReadOnlyError):
            store.store("refused: the store is read-only until reopened")
    with MemoryStore(config=cfg, embedder=None) as again:  # the snapshot and the journal it follows
        assert len(again) == i + 1 and not again.read_only


def test_a_store_stays_read_only_when_the_fsync_closing_its_journal_at_a_switch_fails(
        config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch closes (and syncs) the retired journal, which holds writes not yet synced
    (their replies wait for the sync thread): that fsync failing was logged, and the store
    went on writing into the fresh journal as if nothing had happened."""
    from reachy_memory.storage import files

    cfg = config.replace("memory", compact_journal_bytes=2000)
    real_write = files.write_snapshot_keeping_previous
    failing = threading.Event()

    def then_fsyncs_fail(directory: Path, frames: Any) -> None:
        real_write(directory, frames)
        failing.set()

    def fdatasync(fd: int) -> None:
        if failing.is_set():
            raise OSError(errno.EIO, "Input/output error")
        os.fdatasync(fd)

    monkeypatch.setattr(files, "write_snapshot_keeping_previous", then_fsyncs_fail)
    monkeypatch.setattr(jr._os, "fdatasync", fdatasync)
    with MemoryStore(config=cfg, embedder=None) as store:
        with store.deferred_durability():  # as the daemon's engine writes (the sync thread syncs)
            while store._storage.compacting is None:
                store.store("a fact about the garden gate, written until a compaction starts")
        mark = store.durability_mark()
        store._storage.wait()
        assert failing.is_set()
        assert store.read_only
        with pytest.raises(ReadOnlyError):
            store.store("refused: the store is read-only until reopened")
        assert mark is not None
        with pytest.raises(ReadOnlyError):
            mark()
        failing.clear()


# -- an LLM tool's write whose daemon kept it and then failed: never "not stored" --------------


def _tool(daemon: Daemon, name: str, args: dict[str, Any]) -> Any:
    """The LLM tool ``name`` run once on ``daemon`` (sent again for 0.3 s after a "not now" failure)."""
    import asyncio

    from reachy_memory import AsyncMemoryClient
    from reachy_memory.integrations.tools import TOOLS_BY_NAME, DaemonBackend

    async def call() -> Any:
        backend = DaemonBackend(AsyncMemoryClient(daemon.endpoint, config=daemon.config, timeout=3.0),
                                retry_for=0.3)
        try:
            return await TOOLS_BY_NAME[name].run(backend, args)
        finally:
            await backend.aclose()

    return asyncio.run(call())


def _lexical(daemon: Daemon, query: str) -> list[str]:
    with client(daemon) as c:
        return sorted(h.memory.content for h in c.search(query, limit=10, mode="lexical"))


@pytest.mark.parametrize(("name", "args"), [
    ("store_memory", {"content": "the boat is moored at pier nine", "memory_type": "conversation"}),
    ("remember", {"content": "the boat is moored at pier nine"}),
])
def test_a_tool_write_the_daemon_applied_before_its_fsync_failed_is_not_said_unstored(
        served: Daemon, disk: HeldDisk, name: str, args: dict[str, Any]) -> None:
    # The daemon applied the write (searches find it), then its fsync failed: ReadOnlyError, a
    # "not now" code. The tool sent it again, refused each time, and told the model "the memory
    # was not stored": a model storing it again made a second copy of what the daemon holds.
    disk.hold()
    disk.failing = True
    disk.release()  # every fsync from here on fails at once
    with pytest.raises(ReadOnlyError) as raised:
        _tool(served, name, args)
    assert "not stored" not in raised.value.message
    assert "may have been kept: search for it before storing it again" in raised.value.message
    assert _lexical(served, "boat pier nine") == [args["content"]]  # the daemon holds it


def test_a_tool_remember_whose_disk_filled_is_said_unstored_and_stores_nothing(
        served: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each fact of a remember was its own journal frame: the disk filling at the second left the
    # first stored (and the tool said it may have been kept). A remember is one frame now: a
    # full disk stores none of its facts, and the model is told so.
    real = jr._os.write

    def write(fd: int, data: memoryview) -> int:
        if b"the kayak is blue" in bytes(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(jr._os, "write", write)
    facts = {"facts": [{"content": "the canoe is red"}, {"content": "the kayak is blue"}]}
    with pytest.raises(StorageError) as raised:
        _tool(served, "remember", facts)
    assert "not stored" in raised.value.message and "may have been kept" not in raised.value.message
    assert _lexical(served, "canoe") == [] and _lexical(served, "kayak") == []
    monkeypatch.setattr(jr._os, "write", real)  # space again: writes work
    assert _tool(served, "remember", {"content": "the kayak is blue"})["count"] == 1
