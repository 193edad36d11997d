"""Persistence of one open store: the journal, generations and compaction.

:class:`Storage` is the store's only way to the data directory's journal and
snapshots (the file rules are in :mod:`._persistence`; ``docs/FORMAT.md`` is
the contract).  It appends the ops of the mutation funnel
(``engine.core.Core.commit``), replays them at open, and compacts: synchronously
(``compact``: open --recover, explicit, close) or in the background, where a
thread writes the snapshot of a frozen view of the state (:mod:`._state`)
while writes go on (``compact_in_background``).

Threads: the holder of ``lock`` (the daemon's engine thread) owns
``journal``, ``generation`` and the state; the compaction thread owns its
frozen view and the snapshot file it writes, and takes ``lock`` for the
final switch.  At most one background compaction runs at a time.  A backup
works the same way on its caller's thread (the daemon's backup thread): the
lock only to freeze and to thaw, the file written from the frozen view.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reachy_memory._threads import gc_paused, short_switch_interval
from reachy_memory.config import Config
from reachy_memory.engine.records import RECORD_VERSION
from reachy_memory.engine.state import Frozen, MemoryState, checked, snapshot_sections, words_state
from reachy_memory.errors import ClosedError, CorruptionError, ReachyMemoryError, ReadOnlyError, StorageError
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr
from reachy_memory.storage import purge as pg
from reachy_memory.storage.files import GRAPH_FILE, JOURNAL_FILE

log = logging.getLogger(__name__)


@dataclass
class _Compaction:
    """One compaction in flight: the snapshot of ``frozen`` becomes ``generation``;
    it covers the current journal up to byte ``follows[1]``."""

    generation: int
    follows: tuple[int, int]  # (journal generation, offset): where the ops after the snapshot start
    frozen: Frozen
    head: dict[str, Any]
    lexical: dict[str, Any] | Callable[[], dict[str, Any]]  # the snapshot's lexical state, or what builds it
    seq: int = 0  # the snapshot holds the ops of every frame up to this seq (format-4 journals)
    after: bytes | None = None  # the id of the journal the next one replaces
    carried_to: int | None = None  # the journal offset up to which ops are already in the next journal
    number: int = 0  # the how-manyth compaction begun since the store opened (see storage.purge)
    switched: bool = False  # its journals switched: every generation file on disk is from its freeze on
    last_seq: int = 0  # the seq of the last frame carried into the next journal

    def numbered(self, frames: list[tuple[int | None, list[Any]]]) -> files.Carried:
        """``frames`` with a seq each (see :func:`_numbered`), counting on from the last carried."""
        out, self.last_seq = _numbered(frames, self.last_seq)
        return out


def _numbered(frames: Sequence[tuple[int | None, list[Any]]], last: int) -> tuple[files.Carried, int]:
    """``frames`` with a seq each: their own, or (frames of a journal of an earlier format)
    the next ones after ``last``; and the last seq given."""
    out: files.Carried = []
    for seq, ops in frames:
        last = seq if seq is not None else last + 1
        out.append((last, ops))
    return out, last


class Storage:
    """The journal, the generation and compaction of an open data directory."""

    def __init__(self, path: Path, config: Config, state: MemoryState, lock: threading.RLock,
                 snapshot: dict[str, Any] | None) -> None:
        self.path, self.config, self.state, self.lock = path, config, state, lock
        self.generation: int = snapshot["generation"] if snapshot else 0
        self.follows = files.follows_of(snapshot)  # (journal generation, offset) the snapshot covers
        self.seq = files.seq_of(snapshot)  # the snapshot holds every frame up to this seq (None: by offset)
        self.head = jr.Head(path / files.HEAD_FILE)
        self.dir_lock: jr.DirLock | None = None  # the store's lock, checked with the journal (check_files)
        self._checked = 0.0
        self.journal_generation = self.generation
        self.compacting: threading.Thread | None = None
        self.closed = False  # set under the lock by close(): no write reaches the files after it
        self.closing = False  # set by close() first: no background compaction or backup starts after it
        self._backups = _Tally()  # backups being written (any threads); close() waits for them
        self.journal: jr.Journal
        self.purge = pg.Purger(self)  # forgetting that reaches every file (storage/purge.py)

    def rebuilt_from(self, generation: int, seq: int | None) -> None:
        """The state was rebuilt from the previous generation (``verify --repair``), up to
        frame ``seq`` (format 4: the current journal's frames up to it are not applied again)."""
        self.generation, self.follows, self.seq = generation + 1, None, seq
        self._rebuilt_to = seq

    def open(self, *, rebuilding: bool = False) -> None:
        """Open the journal and replay it into the state.  Raises CorruptionError
        (nothing changed on disk) when the journal does not follow the snapshot, or is
        missing where a previous generation shows there was one (unless ``rebuilding``
        from that generation)."""
        files.complete_switch(self.path, self.generation)
        head = self.head.load()
        if not rebuilding:
            files.require_journal(self.path, head)
        self.journal = self._new_journal()
        try:
            self._replay(self.journal.open({"kind": "journal", "generation": self.generation},
                                           base_seq=self.seq or 0))
            self._settle_head()
        except BaseException:
            self.journal.close()
            raise

    def _new_journal(self) -> jr.Journal:
        mem = self.config.memory
        return jr.Journal(self.path / JOURNAL_FILE, mem.fsync, mem.fsync_batch_window_ms, head=self.head)

    def _settle_head(self) -> None:
        """Make the head file name the journal in use (a store from before it, a restored one,
        or a switch whose head update a crash cut off), durably.  Raises StorageError."""
        journal, state = self.journal, self.head.state
        if journal.id is not None and (state is None or state.journal_id != journal.id):
            if state is None:
                log.warning("%s: no journal head yet (a store from before it, or restored): written now",
                            self.head.path)
            self.head.write(self.journal_generation, journal.id, journal.synced, journal.seq)

    def opened(self, dir_lock: jr.DirLock) -> None:
        """The store is open: ``dir_lock`` is checked with the journal from now on
        (:meth:`check_files`), and a journal of a format before 4 (keyed frames) is compacted
        now, so that every later write goes into a format-4 journal.  A failure (a full disk)
        is logged: the old journal stays in use and the next compaction moves on."""
        self.dir_lock = dir_lock
        if self.journal.version >= jr.JOURNAL_VERSION or self.journal.failure is not None:
            return
        try:
            self.compact()
            log.warning("%s: the journal was of an earlier format; compacted to start one of format %s",
                        self.path, jr.JOURNAL_VERSION)
        except ReachyMemoryError as exc:
            log.warning("could not move the journal to format %s yet (%s); the next compaction does",
                        jr.JOURNAL_VERSION, exc)

    def check_files(self, *, every: float = 1.0, idle: bool = False) -> str | None:
        """At most once per ``every`` seconds: whether the data directory and the journal are
        still the ones opened.  When they are not (a directory removed or replaced, a journal
        deleted or swapped), the store refuses every later write (read-only, the reason in
        ``failure``, logged) and the reason is returned.  ``idle`` (maintain): also make the
        journal head's last reach durable (else the kernel writes it back in its time)."""
        now = time.monotonic()
        if now - self._checked < every or self.closed:
            return self.journal.failure
        self._checked = now
        reason = (self.dir_lock.lost() if self.dir_lock is not None else None) or self.journal.lost()
        if reason is not None:
            self.journal.fail(f"{reason}; writes now would be lost: restart the daemon once the data directory "
                              "is back")
        if idle:
            self.head.sync()
        return self.journal.failure

    def append(self, ops: list[list[Any]], *, durable: bool = False, defer: bool = False) -> None:
        """Journal one batch of ops (durable per policy when this returns, or synced
        whatever the policy with ``durable``; ``defer``: see :meth:`Journal.append`);
        the caller holds the lock.  Raises ClosedError after :meth:`close`."""
        self._require_open()
        self.check_files()
        self.journal.append(ops, durable=durable, defer=defer)

    def durability_mark(self) -> Callable[[], None] | None:
        """Under the lock: what makes every frame journaled so far durable (a call of
        :meth:`Journal.sync_through` on the journal of now: a compaction may switch
        journals before it runs), or None when they are durable already."""
        journal, end = self.journal, self.journal.size
        return None if journal.synced_through(end) else lambda: journal.sync_through(end)

    def apply(self, ops: list[list[Any]]) -> None:
        """Apply journaled ops to the state; a malformed op is CorruptionError naming the journal.
        What they remove (forgotten, expired) is purged from the disk (:mod:`.purge`)."""
        taken = pg.capture(self.state, ops)
        try:
            self.state.apply_all(ops)
        except CorruptionError as exc:
            where = self.journal.path if hasattr(self, "journal") else self.path
            raise CorruptionError(f"{where}: {exc.message}", path=str(where), offset=-1) from exc
        removal = taken.finish(self.state) if taken is not None else None
        if removal is not None:
            self.purge.note(removal)

    def maybe_compact(self) -> None:
        """Start a background compaction when the journal outgrew its threshold."""
        if self.journal.size > self.config.memory.compact_journal_bytes and self.compacting is None \
                and not self.closing:
            self.compact_in_background()

    @property
    def failure(self) -> str | None:
        """Why the journal refuses writes (an fsync failed), or None."""
        return self.journal.failure

    def close(self) -> None:
        """Wait for a background compaction, compact what the journal holds, save the
        graph cache, close the journal.  A failure is logged (the journal keeps everything).
        A purge pending is finished first (:meth:`Purger.finish`).
        Safe while another thread writes: it waits for that write, and later ones raise
        ClosedError; idempotent."""
        self.closing = True  # else writers could start compactions faster than close waits for them
        self.purge.stop()
        with self.quiesced():
            if self.closed:
                return
            try:
                self._finish_purge()
                if self.journal.holds_ops or self.journal.version < jr.JOURNAL_VERSION:
                    self.compact(full=True)
                elif self.state.vectors.pending or not (self.path / GRAPH_FILE).exists():
                    # an in-service compaction skipped the graph cache, or a purge removed it
                    self.state.vectors.save_graph(self.path / GRAPH_FILE, self.graph_tag(), force=True)
            except ReachyMemoryError as exc:
                log.warning("could not compact on close (the journal keeps every change): %s", exc)
            finally:
                self.journal.close()
                self.head.close()
                self.closed = True

    def _finish_purge(self) -> None:
        """Close: a purge pending is finished (a failure is logged: the register keeps it
        pending, and the next open resumes it)."""
        if self.journal.failure is not None:
            return
        try:
            self.purge.finish()
        except ReachyMemoryError as exc:
            log.warning("could not finish the purge on close (the next open does): %s", exc)

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """Hold the lock with no background compaction and no backup running (a finishing
        one needs the lock, so it is waited for first; one started meanwhile is waited for too)."""
        while True:
            self.wait()
            self._backups.wait_none()
            self.lock.acquire()
            if self.compacting is None and not self._backups.count:
                break
            self.lock.release()
        try:
            yield
        finally:
            self.lock.release()

    def backup(self, target: Path, progress: Callable[[int], None] | None = None) -> tuple[int, int]:
        """Write a consistent snapshot of the state now to ``target`` (fsynced); returns
        (bytes, memories).  The caller checked the target; ``progress`` is told the bytes
        written so far, as they are written.

        Any thread: the lock is held only to freeze the state and to thaw it (a few
        ms at 100k memories); writes and searches go on while the file is written,
        and stay out of it.  Raises ClosedError once the store is closing or closed,
        and abandons a backup being written when closing begins (:meth:`begin_closing`,
        :meth:`close`): at its next chunk, its temp file removed, ``target`` untouched.
        """
        with self.lock:
            self._require_open()
            if self.closing:
                raise ClosedError("the store is closing: no backup started (nothing written)")
            frozen, made = self.state.freeze(with_lexical=False), time.time()
            head = self._snapshot_head(self.generation)
            lexical = self._lexical_of(frozen, self._abandon_if_closing)
            self._backups.enter()
        try:
            with _short_gil_slices():
                sections = snapshot_sections(frozen, head, lexical, self._abandon_if_closing)
                size = jr.write_snapshot(target, sections, progress=self._ticking(progress))
            self.purge.backup_written(target, frozen, made)  # so that a forget can name it
            return size, len(frozen.records)
        finally:
            with self.lock:
                self.state.thaw()
            self._backups.leave()

    def _ticking(self, progress: Callable[[int], None] | None) -> Callable[[int], None]:
        """A backup's progress callback that also abandons it once closing begins (a
        backup of 100k memories on an SD card takes tens of seconds; a robot shutting
        down must not wait for it, nor be killed by systemd while closing)."""
        def tick(written: int) -> None:
            self._abandon_if_closing()
            if progress is not None:
                progress(written)
        return tick

    def _abandon_if_closing(self) -> None:
        """ClosedError once closing began: a backup's check at each chunk of its file, and
        every few hundred records while it packs them and builds their lexical state
        (seconds at 100k memories with no chunk written)."""
        if self.closing:
            raise ClosedError("the store is closing: the backup was abandoned (nothing written)")

    def begin_closing(self) -> None:
        """Stop background work ahead of :meth:`close`: no compaction or backup starts,
        and a backup being written is abandoned at its next chunk."""
        self.closing = True

    def graph_tag(self) -> str:
        return f"{self.generation}:{self.state.current_key}"

    def _replay(self, result: jr.ReadResult) -> None:
        """Apply the journal's ops, after checking that it follows the snapshot.

        Raises CorruptionError (nothing changed on disk) for a journal newer
        than the snapshot: the snapshot is missing or was replaced.
        """
        generation = files.journal_generation(result)
        if generation is not None and generation < self.generation:
            self._replay_older(result, generation)
            return
        if generation != self.generation:
            raise CorruptionError(
                f"{self.journal.path}: journal generation {generation} is newer than the snapshot's "
                f"{self.generation} (the snapshot is missing or was replaced); nothing was changed. "
                "Run 'reachy-memory verify --repair' to rebuild from the previous generation kept on disk",
                path=str(self.journal.path), offset=0)
        self.journal_generation = self.generation
        if result.version >= jr.JOURNAL_VERSION and self.seq is not None:
            self._check_chain(result)
            for _, ops in files.frames_not_in_snapshot(result, generation, None, self.seq):
                self.apply(ops)
            self.journal.floor(self.seq)
            return
        for ops in result.frames[1:]:
            self.apply(ops)

    def _check_chain(self, result: jr.ReadResult) -> None:
        """A rebuild from the previous generation must reach the frame the current journal
        starts after; raises CorruptionError (nothing changed) when frames between are gone."""
        rebuilt_to = getattr(self, "_rebuilt_to", None)
        if rebuilt_to is not None and result.seqs and result.seqs[0] > rebuilt_to:
            raise CorruptionError(
                f"{self.journal.path} starts after frame {result.seqs[0]}, but the previous generation on disk "
                f"reaches frame {rebuilt_to} only: the frames between are gone; nothing was changed",
                path=str(self.journal.path), offset=0)

    def _replay_older(self, result: jr.ReadResult, generation: int) -> None:
        """A compaction made the snapshot durable and died before switching journals.

        The snapshot covers this journal up to the offset it names (all of it for
        a snapshot that names none); the ops after that offset are applied and
        carried into the snapshot's journal, and this one is moved, never rewritten.
        """
        follows = self.follows if self.follows and self.follows[0] == generation else None
        tail = files.frames_not_in_snapshot(result, generation, follows, self.seq)
        for _, ops in tail:
            self.apply(ops)
        self.journal_generation = generation
        self.journal.floor(self.seq or 0)
        log.warning("journal generation %s is older than snapshot %s: %d ops after the snapshot applied",
                    generation, self.generation, len(tail))
        self._carry_over(follows or (generation, self.journal.size), tail)

    def _carry_over(self, follows: tuple[int, int], tail: Sequence[tuple[int | None, list[Any]]]) -> None:
        """Start the snapshot's own journal with ``tail`` (the frames it does not hold)
        and retire the current one (moved, never rewritten).

        When the disk is too full for that, the store goes on appending to the current
        journal: a format-4 one numbers its frames above the snapshot's seq, so the next
        open applies them wherever they land (an earlier format's, cut short of the offset
        the snapshot follows, would put them where that open skips them: the store refuses
        writes instead, until reopened).  Nothing is lost either way.
        """
        base = self.seq or 0
        try:
            files.write_next_journal(self.path, self.generation, follows, _numbered(tail, base)[0], base_seq=base,
                                     after=self.journal.id)
        except StorageError as exc:
            _log_kept(exc)
            if self.journal.version < jr.JOURNAL_VERSION and self.journal.size < follows[1]:
                self.journal.fail(f"{self.journal.path} ends before the offset its snapshot follows, and the "
                                  f"journal that replaces it cannot be written ({exc}); reopen the store once "
                                  "there is space")
            return
        self._switch_journals()

    def compact(self, full: bool = False) -> None:
        """:meth:`compact` without the open check (it also runs while opening).

        Steps and crash analysis: docs/FORMAT.md, "Generations and compaction".
        """
        with self.lock:
            self._require_open()
            job = self._begin_compaction(background=False)
            try:
                self._write_snapshot(job)
                self._finish_compaction(job)
            finally:
                self.state.thaw()
                self.purge.compacted(job.number, job.switched)
            self.state.vectors.save_graph(self.path / GRAPH_FILE, self.graph_tag(), force=full)
            files.tighten_files(self.path)

    def compact_in_background(self) -> None:
        """Auto-compaction: freeze the state (the only pause of the engine) and write
        the snapshot on a thread of its own.  A failure is logged, never raised: the
        write that triggered it is already durable in the journal (which keeps growing)."""
        with self.lock:  # held until compacting is set: the thread clears it under the lock
            try:
                job = self._begin_compaction(background=True)
            except ReachyMemoryError as exc:
                log.warning("compaction not started, the journal keeps every change: %s", exc)
                return
            thread = threading.Thread(target=self._compaction_thread, args=(job,),
                                      name="reachy-memory-compaction", daemon=True)
            thread.start()  # before it is published: wait() on another thread may join it at once
            self.compacting = thread

    def _compaction_thread(self, job: _Compaction) -> None:
        """The background compaction: touches only its frozen view until it takes the lock."""
        try:
            with _short_gil_slices():
                self._write_snapshot(job)
                self._carry_unlocked(job)
            with self.lock:
                self._finish_compaction(job)
        except ReachyMemoryError as exc:
            log.warning("compaction failed, the journal keeps every change: %s", exc)
        except Exception:  # a bug must not kill the store silently: logged, the journal keeps everything
            log.exception("compaction failed unexpectedly; the journal keeps every change")
        finally:
            with self.lock:
                self.state.thaw()
                self.compacting = None
                self.purge.compacted(job.number, job.switched)

    def wait(self) -> None:
        thread = self.compacting
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _begin_compaction(self, *, background: bool) -> _Compaction:
        """Under the lock: write the next journal's head (a disk-full failure stops here
        with nothing changed) and freeze the state.  The head is not fsynced: the engine
        waits for this step (two fsyncs, tens of ms on an SD card), and the file is written
        again durably, with the carried frames, before the journals switch
        (:meth:`_carry_unlocked`, :meth:`_finish_compaction`); until then no open reads it."""
        self._require_writable()
        generation, follows = self.generation + 1, (self.journal_generation, self.journal.size)
        seq, after = self._journal_seq(), self.journal.id
        files.write_next_journal(self.path, generation, follows, durable=False, base_seq=seq, after=after)
        number = self.purge.before_compaction()  # the ids a purge pending forgets are recorded first
        frozen = self.state.freeze(with_lexical=not background)
        head = self._snapshot_head(generation) | {"follows": list(follows)}
        lexical = frozen.lexical if frozen.lexical is not None else self._lexical_of(frozen)
        return _Compaction(generation, follows, frozen, head, lexical, seq=seq, after=after, last_seq=seq,
                           number=number)

    def _journal_seq(self) -> int:
        """The seq of the last frame journaled (0 in a journal of an earlier format: its
        frames are numbered when carried into the next one)."""
        return self.journal.seq if self.journal.version >= jr.JOURNAL_VERSION else 0

    def _write_snapshot(self, job: _Compaction) -> None:
        """Write the snapshot of the frozen view durably, keeping the previous one (any thread)."""
        files.write_snapshot_keeping_previous(self.path, snapshot_sections(job.frozen, job.head, job.lexical))

    def _lexical_of(self, frozen: Frozen, check: Callable[[], None] | None = None) -> Callable[[], dict[str, Any]]:
        """Under the lock: what builds the lexical state of ``frozen`` on any thread.
        The live index keeps changing while a snapshot is written in the background, so
        the snapshot's is built from the frozen records once they are written (sharing
        the live tokenizer, which is thread-safe, and its stem cache).  ``check`` is
        called every few hundred records (what it raises stops the build)."""
        weight, tokenizer = self.state.lexical.previous_weight, self.state.lexical.tokenizer
        records = frozen.records
        return lambda: words_state(records if check is None else checked(records, check), weight, tokenizer)

    def _carry_unlocked(self, job: _Compaction) -> None:
        """Compaction thread, no lock: copy the frames appended since the freeze so far
        into the next journal, so that the locked step only copies the last few.
        (``size`` moves only after a whole frame is written, so it is a frame boundary.)"""
        end = self.journal.size
        frames = job.numbered(jr.frames_from(self.journal.path, job.follows[1], self.journal.version, end))
        try:
            files.write_next_journal(self.path, job.generation, job.follows, frames, base_seq=job.seq,
                                     after=job.after)
        except StorageError as exc:
            job.last_seq = job.seq
            log.warning("could not pre-copy the ops written during compaction (%s); copying under the lock", exc)
            return
        job.carried_to = end

    def _finish_compaction(self, job: _Compaction) -> None:
        """Under the lock, the new snapshot being durable: carry the frames appended
        since the freeze into the next generation's journal and switch to it (not when
        the journal failed meanwhile: it stays the store's, read-only, until a reopen)."""
        self.generation, self.follows, self.seq = job.generation, job.follows, job.seq
        if self.journal.failure is not None:  # an fsync failed meanwhile: a fresh journal would take
            _log_kept(ReadOnlyError(self.journal.failure))  # writes again; the store stays read-only
            return
        start = job.carried_to if job.carried_to is not None else job.follows[1]
        frames = job.numbered(jr.frames_from(self.journal.path, start, self.journal.version))
        try:
            if job.carried_to is None:
                files.write_next_journal(self.path, job.generation, job.follows, frames, base_seq=job.seq,
                                         after=job.after)
            else:
                files.append_to_next_journal(self.path, frames)
        except StorageError as exc:
            _log_kept(exc)
            return
        self._switch_journals(known=job.last_seq)
        job.switched = True

    def _switch_journals(self, *, known: int | None = None) -> None:
        """Retire the current journal and open ``journal.next.rmj`` in its place
        (``known``: this process just wrote and synced it, up to that seq, so it is not
        read back), and make the head file name it.
        Raises ReadOnlyError, switching nothing, when closing fails to sync the current
        journal (it holds writes whose replies wait for that fsync): it stays the
        store's, read-only until a reopen, as after any failed fsync."""
        self.journal.close()
        if self.journal.failure is not None:
            raise self.journal.read_only()
        try:
            files.switch_journals(self.path)
            self._open_journal(known=known)
            self._settle_head()
        except ReachyMemoryError as exc:
            self.journal.failure = f"compaction could not switch journals ({exc}); reopen the store"
            raise

    def _open_journal(self, *, known: int | None = None) -> None:
        """Open ``journal.rmj`` (created for the current generation when absent; ``known``:
        see :meth:`_switch_journals`)."""
        self.journal = self._new_journal()
        if known is not None:
            self.journal.adopt(known)
        else:
            self.journal.open({"kind": "journal", "generation": self.generation}, base_seq=self.seq or 0)
            self.journal.floor(self.seq or 0)
        self.journal_generation = self.generation

    def _require_open(self) -> None:
        if self.closed:
            raise ClosedError("this MemoryStore is closed")

    def _require_writable(self) -> None:
        if self.journal.failure is not None:
            raise self.journal.read_only()

    def _snapshot_head(self, generation: int) -> dict[str, Any]:
        """A snapshot's head; ``seq``: it holds every journaled frame up to the last one (a
        compaction's job says the same; a backup's restored journal starts above it)."""
        state = self.state
        return {"kind": "snapshot", "generation": generation, "model": state.current_key or state.model_key,
                "dim": state.vectors.dim, "created": time.time(), "records": RECORD_VERSION,
                "seq": self._journal_seq()}


def _log_kept(exc: ReachyMemoryError) -> None:
    log.warning("journal kept in use after a compaction (%s); the next compaction retries", exc)


@contextlib.contextmanager
def _short_gil_slices() -> Iterator[None]:
    """Shorten the interpreter's thread switch interval while a CPU-bound background job
    runs: a thread that holds the store lock and waits for the GIL after a system call
    would otherwise wait up to the default 5 ms each time, and a commit makes several.
    The garbage collector waits too (the rows made here hold no cycles).  Jobs may
    overlap (a backup during a compaction): the last one out restores both."""
    # the snapshot's 100k short-lived rows would trigger full collections
    with short_switch_interval(), gc_paused():
        yield


class _Tally:
    """How many jobs of one kind are running, and a wait for none (any threads)."""

    def __init__(self) -> None:
        self._none = threading.Condition(threading.Lock())
        self.count = 0

    def enter(self) -> None:
        with self._none:
            self.count += 1

    def leave(self) -> None:
        with self._none:
            self.count -= 1
            if not self.count:
                self._none.notify_all()

    def wait_none(self) -> None:
        with self._none:
            self._none.wait_for(lambda: not self.count)
