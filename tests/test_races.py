"""Races between threads (the daemon's I/O, embed and engine threads, the background
compaction thread, the bridge's worker), each found by a review and fixed.  Each test
forces or provokes one interleaving and checks what a caller sees; each is bounded to
a few seconds (``sys.setswitchinterval`` makes switches frequent)."""

from __future__ import annotations

import contextlib
import queue
import random
import string
import threading
import time
from typing import Any

import pytest

from reachy_memory import Config, MemoryStore, NotFoundError, ReachyMemoryError
from reachy_memory.engine.lexical_index import Tokenizer
from reachy_memory.integrations.reachy_mini import MemoryBridge
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr
from tests.conftest import HashEmbedder
from tests.store_util import abandon, frequent_switches


class WideEmbedder(HashEmbedder):
    """Random unit vectors of the real model's width (a vector block of realistic size)."""

    dim = 384


# -- 1. background snapshot: the vector block changes under its CRC ---------------------------


def test_a_background_snapshot_stays_readable_when_a_slot_freed_before_the_freeze_is_reused(
        config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """The frozen view's vector block is a view of the live matrix.  Slots freed *after*
    the freeze are quarantined, but a slot freed *before* it is still on the free list:
    the engine reuses it during the snapshot and writes its row inside the frozen block.
    The compaction thread has already computed the frame's CRC (RawBin.chunks), so the
    file gets other bytes than the CRC covers: a damaged snapshot, which the next open
    refuses.  Forced interleaving: the engine stores right after the CRC is taken."""
    emb = HashEmbedder()
    store = MemoryStore(config=config, embedder=emb)
    ids = [store.store(f"fact number {i}").id for i in range(10)]
    store.forget(ids[3])  # its slot goes back on the free list (no frozen view held yet)
    real_chunks = jr.RawBin.chunks
    crc_taken, resume = threading.Event(), threading.Event()

    def chunks(self: jr.RawBin, offset: int) -> list[Any]:
        out = real_chunks(self, offset)  # the frame header and its CRC over the frozen rows
        crc_taken.set()
        resume.wait(5)  # the compaction thread is preempted here (the GIL is released by crc32/write)
        return out

    monkeypatch.setattr(jr.RawBin, "chunks", chunks)
    with store._lock:
        store._storage.compact_in_background()
    try:
        assert crc_taken.wait(5)
        store.store("stored while the snapshot is being written")  # the engine thread, meanwhile
    finally:
        resume.set()
        store._storage.wait()
        monkeypatch.undo()
    abandon(store)  # a crash (power cut) before the next compaction
    with MemoryStore(config=config, embedder=emb) as again:  # CorruptionError: the vector frame fails its CRC
        assert len(again) == 10


def test_background_snapshots_stay_readable_while_stores_reuse_freed_slots(config: Config) -> None:
    """The same race, unforced: expired conversations free low slots, then stores keep
    arriving while background compactions write ~9 MB vector blocks."""
    cfg = config.replace("memory", fsync="never")
    store = MemoryStore(config=cfg, embedder=WideEmbedder())
    old = time.time() - 90 * 86400
    for start in range(0, 3000, 1000):
        store.store_batch([{"content": f"chat {start + i}", "memory_type": "conversation", "created_at": old + i}
                           for i in range(1000)])
    for start in range(0, 3000, 1000):
        store.store_batch([{"content": f"fact {start + i}"} for i in range(1000)])
    assert store.cleanup_expired() == 3000
    while store.maintain(budget=4096):  # bury: the 3000 slots become reusable
        pass
    bad = started = finished = n = 0
    deadline = time.monotonic() + 3.0
    try:
        while time.monotonic() < deadline and not bad:
            with store._lock:
                store._storage.compact_in_background()
                compaction = store._storage.compacting
            assert compaction is not None
            started += 1
            # Stores in a tight loop until this compaction is done: its final, locked step
            # must get the lock between them (Python's lock is not fair by contract).  Not
            # until `compacting` is None: on a fast host the loop's own writes fill the
            # journal's 32 MB within seconds and start the next compaction themselves.
            give_up = time.monotonic() + 60
            while compaction.is_alive() and time.monotonic() < give_up:
                store.store(f"late {n}")
                n += 1
            finished += not compaction.is_alive()
            store._storage.wait()
            try:
                files.read_snapshot(store.path / files.SNAPSHOT_FILE)
            except ReachyMemoryError:
                bad += 1
    finally:
        abandon(store)
    assert bad == 0, f"a background snapshot was written damaged ({n} stores during the compactions)"
    assert finished == started  # no compaction kept waiting a minute by the loop of stores


# -- 2. get_context (I/O thread, lock-free) during set_context ---------------------------------


def test_get_context_never_reads_none_while_the_key_is_being_replaced(config: Config) -> None:
    """set_context commits [del old, put new] as one frame, but the state applies them
    one after the other, swapping ``context_view`` after each: the I/O thread's lock-free
    get_context can run in between and answer None for a key that always had a value."""
    with MemoryStore(config=config.replace("memory", fsync="never"), embedder=None) as store:
        store.set_context("current_user", "v0")
        stop = threading.Event()
        errors: list[BaseException] = []

        def engine() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    store.set_context("current_user", f"v{i}")
                except BaseException as exc:
                    errors.append(exc)
                    return

        misses = reads = 0
        with frequent_switches():
            writer = threading.Thread(target=engine)
            writer.start()
            try:
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and not misses:
                    reads += 1
                    misses += store.get_context("current_user") is None
            finally:
                stop.set()
                writer.join(timeout=10)
        assert errors == []
        assert misses == 0, f"get_context answered None after {reads} reads"


# -- 3. prepare (embed thread) / commit (engine thread) of a retried id ------------------------


def test_a_retried_store_whose_memory_is_forgotten_before_its_commit_is_all_or_nothing(config: Config) -> None:
    """prepare leaves out an item whose id is already stored (an idempotent retry) and
    commit then reads ``records[id]`` for the reply.  A forget (engine lane) or an expiry
    sweep between the two makes that a KeyError, an 'internal' error to the client,
    after the batch's other items were made durable."""
    with MemoryStore(config=config, embedder=None) as store:
        store.store("the door code is 1234", id="X")
        prepared = store.prepare([{"content": "the door code is 1234", "id": "X"},  # embed thread: a retry
                                  {"content": "the wifi password is on the fridge", "id": "Y"}])
        store.forget("X")  # engine thread, queued before the commit
        with pytest.raises(NotFoundError) as info:
            store.commit(prepared)
        assert info.value.memory_id == "X" and store.get("Y") is None  # refused: nothing was written
        assert [m.id for m in store.store_batch([{"content": "the door code is 1234", "id": "X"}])] == ["X"]


# -- 4. one Tokenizer (stateful Snowball stemmer) used by two threads ---------------------------


def _novel_words(rng: random.Random, n: int) -> list[str]:
    suffixes = ["ational", "fulness", "izations", "iveness", "ically", "ousness", "ements", "ingly"]
    return ["".join(rng.choices(string.ascii_lowercase, k=6)) + rng.choice(suffixes) for _ in range(n)]


def test_one_tokenizer_shared_by_two_threads_stems_every_word_as_alone() -> None:
    """``Tokenizer._stem`` calls ``snowballstemmer``'s pure-Python stemmer (no PyStemmer
    here), whose ``stemWord`` keeps the word being stemmed in the stemmer object
    (``set_current``/``cursor``/``limit``): two threads stemming through one Tokenizer
    (the live index's, if the compaction thread's rebuild uses it) overwrite each
    other's word, and the wrong stem is cached.  The stem cache alone is safe."""
    rng = random.Random(7)
    lists = [_novel_words(rng, 20000), _novel_words(rng, 20000)]
    reference = Tokenizer()
    expected = [reference.terms(" ".join(words)) for words in lists]
    shared = Tokenizer()
    got: list[list[str]] = [[], []]
    errors: list[BaseException] = []

    def stem(k: int) -> None:
        try:
            for start in range(0, len(lists[k]), 50):
                got[k].extend(shared.terms(" ".join(lists[k][start : start + 50])))
        except BaseException as exc:
            errors.append(exc)

    with frequent_switches():
        threads = [threading.Thread(target=stem, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert errors == []
    wrong = sum(a != b for k in (0, 1) for a, b in zip(got[k], expected[k], strict=True))
    assert wrong == 0, f"{wrong} of 40000 words got another word's stem"


def test_a_background_snapshot_indexes_the_words_a_fresh_index_would(config: Config) -> None:
    """End to end: after an open (the live stem cache starts empty: the index is loaded
    from the snapshot) a background compaction re-tokenises every record while the
    engine stores memories with new words.  Every store must succeed, and the snapshot's
    terms must be exactly those of its records (a wrong stem in it makes the memory
    unfindable after a restart).  Up to three opens, a few seconds."""
    cfg = config.replace("memory", fsync="never")
    rng = random.Random(11)
    with MemoryStore(config=cfg, embedder=None) as first:
        for _ in range(2):
            first.store_batch([{"content": " ".join(_novel_words(rng, 6))} for _ in range(1000)])
    fresh = Tokenizer()
    deadline = time.monotonic() + 2.0
    for _ in range(3):
        store = MemoryStore(config=cfg, embedder=None)
        errors: list[BaseException] = []
        try:
            with frequent_switches():
                with store._lock:
                    store._storage.compact_in_background()
                    compaction = store._storage.compacting
                assert compaction is not None
                while compaction.is_alive() and not errors:  # this one: the writes may start the next
                    try:  # the engine thread: a batch of new words to stem
                        store.store_batch([{"content": " ".join(_novel_words(rng, 6))} for _ in range(20)])
                    except BaseException as exc:
                        errors.append(exc)
                store._storage.wait()
            snapshot = files.read_snapshot(store.path / files.SNAPSHOT_FILE)
        finally:
            abandon(store)
        assert errors == [], f"a store failed while the compaction thread stemmed: {errors[0]!r}"
        expected = {t for rec in snapshot["records"] for t in fresh.terms(rec["content"])}
        indexed = set(snapshot["lexical"]["terms_f32"])
        assert indexed == expected, (f"{len(indexed - expected)} wrong terms in the snapshot, "
                                     f"{len(expected - indexed)} missing")
        if time.monotonic() > deadline:
            break


# -- 5. MemoryBridge: a job queued while close() runs on another thread ------------------------


class _QuietClient:
    def get_context_window(self) -> list[dict[str, Any]]:
        return []

    def get_context(self, key: str) -> str | None:
        return None

    def store(self, content: str, memory_type: Any = "fact", metadata: Any = None) -> Any:
        return content

    def close(self) -> None:
        pass


def test_a_job_submitted_while_the_bridge_closes_on_another_thread_is_never_left_pending() -> None:
    """``_put`` checks ``_closed`` and then enqueues; ``close()`` on another thread sets
    ``_closed``, stops the worker and drains the queue in between.  The job lands in a
    queue nobody reads: its future never completes (a caller waiting without a timeout
    hangs) and ``record_turn`` reports True for a turn that is dropped.  Forced
    interleaving: the submitting thread is preempted between the check and the put."""
    bridge = MemoryBridge(client_factory=_QuietClient, refresh_interval=3600).start()
    real: queue.Queue[Any] = bridge._jobs
    about_to_put, go = threading.Event(), threading.Event()

    class Gate(queue.Queue):  # type: ignore[type-arg]
        def put_nowait(self, item: Any) -> None:
            if item is not None:  # the control thread's job (close() puts None)
                about_to_put.set()
                go.wait(5)
            real.put_nowait(item)

        def get(self, *args: Any, **kwargs: Any) -> Any:
            return real.get(*args, **kwargs)

        def get_nowait(self) -> Any:
            return real.get_nowait()

        def empty(self) -> bool:
            return real.empty()

        def qsize(self) -> int:
            return real.qsize()

    bridge._jobs = Gate()
    futures: list[Any] = []
    control = threading.Thread(target=lambda: futures.append(bridge.remember("the kettle is broken")))
    control.start()
    assert about_to_put.wait(5)
    # Another thread (the app's shutdown) closes meanwhile. close() now waits for the put
    # (the bridge's lock) and then drains the job; it ran in between before.
    closer = threading.Thread(target=bridge.close)
    closer.start()
    time.sleep(0.05)
    go.set()
    control.join(timeout=5)
    closer.join(timeout=10)
    assert not closer.is_alive()
    future = futures[0]
    try:
        future.exception(timeout=1.0)  # ClosedError or BusyError would do
    except TimeoutError:
        pytest.fail("the job's future was left pending forever after close()")


# -- 5b. close() on one thread while another thread writes ------------------------------------


@pytest.mark.parametrize("compact_bytes", [
    1 << 30,  # no compaction: close meets a write holding the lock
    4096,  # a background compaction every few writes: close meets one finishing too
])
def test_close_while_another_thread_writes_loses_no_acknowledged_memory(
        config: Config, compact_bytes: int) -> None:
    """The daemon closes the store after waiting a bounded time for its engine thread;
    a long operation can still be running then.  close() must wait for it, later
    writes must fail with ClosedError (never a foreign error from a closed journal),
    and every write that returned must be there after reopening."""
    config = config.replace("memory", compact_journal_bytes=compact_bytes)
    store = MemoryStore(config=config, embedder=HashEmbedder())
    acked: list[str] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def writer() -> None:
        try:
            for i in range(100_000):
                acked.extend(m.id for m in store.store_batch([{"content": f"note {i} {j}"} for j in range(5)]))
                started.set()
        except ReachyMemoryError:
            pass  # ClosedError once close() has run: the expected end
        except BaseException as exc:  # anything else escaped the store's contract
            errors.append(exc)

    with frequent_switches():
        thread = threading.Thread(target=writer)
        thread.start()
        assert started.wait(10)
        time.sleep(0.05)
        store.close()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert errors == []
    with MemoryStore(config=config, embedder=None) as reopened:
        assert len(reopened) == len(acked) and all(reopened.get(i) is not None for i in acked[-20:])


def test_two_threads_closing_at_once_both_return_and_release_the_lock_once(config: Config) -> None:
    """Both callers passed the closed check and both released the directory lock: the
    second ``os.close`` raised EBADF, or closed a descriptor another thread had just
    opened (43 of 100 tries before the close lock)."""
    for round_ in range(20):
        store = MemoryStore(config=config, embedder=None)
        store.store(f"fact {round_}")
        assert _close_twice_at_once(store) == [] and store.closed
        with MemoryStore(config=config, embedder=None) as again:  # the lock is free
            assert len(again) == round_ + 1


def test_close_returns_while_writers_keep_the_journal_over_the_compaction_threshold(config: Config) -> None:
    """With every write starting a background compaction, close() waited for one,
    found the next one started meanwhile, and so on for as long as the writers ran
    (still blocked after 10 s in 4 of 10 runs)."""
    config = config.replace("memory", compact_journal_bytes=1)
    store = MemoryStore(config=config, embedder=HashEmbedder())
    stop, started, acked = threading.Event(), threading.Event(), []

    def writer() -> None:
        with contextlib.suppress(ReachyMemoryError):
            while not stop.is_set():
                acked.append(store.store("a note that grows the journal").id)
                started.set()

    writers = [threading.Thread(target=writer) for _ in range(2)]
    for w in writers:
        w.start()
    assert started.wait(10)
    waits: list[str] = []
    real_wait = store._storage.wait

    def counted_wait() -> None:
        waits.append(threading.current_thread().name)
        real_wait()

    store._storage.wait = counted_wait  # type: ignore[method-assign]
    closer = threading.Thread(target=store.close, name="closer")
    closer.start()
    closer.join(timeout=20)
    stop.set()
    for w in writers:
        w.join(timeout=10)
    assert not closer.is_alive(), "close() never returned while writes went on"
    assert waits.count("closer") <= 2  # one compaction in flight at most, not one per write meanwhile
    with MemoryStore(config=config, embedder=None) as again:
        assert all(again.get(i) is not None for i in acked)


def test_reindex_while_another_thread_writes_raises_nothing_foreign(config: Config) -> None:
    """reindex listed the records without the lock: a write meanwhile made it raise
    "dictionary changed size during iteration" (2 of 40 and 6 of 30 tries)."""
    for round_ in range(4):
        path = config.data_dir.parent / f"r{round_}"
        cfg = config.replace("memory", path=str(path))
        with MemoryStore(config=cfg, embedder=None) as lexical:  # memories without vectors
            for start in range(0, 3000, 1000):
                lexical.store_batch([{"content": f"pre {start + i}"} for i in range(1000)])
        with MemoryStore(config=cfg, embedder=HashEmbedder()) as store:
            assert _reindex_beside_a_writer(store) == []


def _close_twice_at_once(store: MemoryStore) -> list[BaseException]:
    """Call ``store.close()`` from two threads released together; what they raised."""
    barrier, errors = threading.Barrier(2), []

    def close() -> None:
        barrier.wait()
        try:
            store.close()
        except BaseException as exc:  # any exception at all breaks idempotency
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    with frequent_switches():
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    return errors


def _reindex_beside_a_writer(store: MemoryStore) -> list[BaseException]:
    """Reindex ``store`` while another thread stores; what either raised."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            while not stop.is_set():
                store.store_batch([{"content": f"note {j}"} for j in range(5)])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=writer)
    with frequent_switches():
        thread.start()
        try:
            if store.reindex(batch=64) < 3000:
                errors.append(AssertionError("reindex skipped memories"))
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()
            thread.join(timeout=10)
    return errors


# -- 6. the daemon's per-op stats, recorded from three threads ---------------------------------


def test_the_daemon_counts_every_request_of_an_op_first_seen_on_two_threads() -> None:
    """``Stats.record`` runs on the I/O thread (inline ops, busy refusals), the embed
    thread (its failures) and the engine thread (every queued job).  ``stats.ops[op]``
    was a defaultdict whose factory (``OpStats()``) runs Python code: two threads that
    meet an op name for the first time can both build one, and one count is lost."""
    from reachy_memory.daemon.jobs import Stats

    stats = Stats()
    names = [f"op{i}" for i in range(3000)]
    barrier = threading.Barrier(2)

    def record() -> None:
        for name in names:
            barrier.wait(5)
            stats.record(name, 0.001, failed=False)

    with frequent_switches():
        threads = [threading.Thread(target=record) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    lost = sum(2 - stats.ops[n].count for n in names)
    assert lost == 0, f"{lost} of {2 * len(names)} requests not counted"
