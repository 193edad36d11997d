"""Offline checks and copies: verify a data directory or backup file, restore
a backup into a data directory, repair damaged files.

A backup is a snapshot file (the same format as ``snapshot.rms``) written by
the daemon while it runs (``MemoryStore.backup``), so it is consistent and can
be copied off the robot as one file.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reachy_memory.config import Config
from reachy_memory.engine.records import Record, decode, first_dim, first_vkey
from reachy_memory.engine.vector_index import BF16_TOLERANCE, ITEM_BYTES, widen
from reachy_memory.errors import CorruptionError, ReachyMemoryError, StorageError, StoreLockedError, ValidationError
from reachy_memory.people.importer import check_note_names, check_supersession
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr
from reachy_memory.storage import restore as swap
from reachy_memory.storage.files import (
    HEAD_FILE,
    JOURNAL_FILE,
    PREV_JOURNAL_FILE,
    PREV_SNAPSHOT_FILE,
    SNAPSHOT_FILE,
    damage_is_corruption,
    read_snapshot,
)

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``ok`` is False when ``problems`` is not empty."""

    path: str
    memories: int = 0
    vectors: int = 0
    journal_frames: int = 0
    generation: int = 0
    seq: int = 0  # a backup's: its restored journal numbers its frames above it
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    affected: list[str] = field(default_factory=list)  # ids readable in damaged bytes

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "memories": self.memories, "vectors": self.vectors,
                "journal_frames": self.journal_frames, "problems": self.problems, "notes": self.notes,
                "affected_ids": self.affected}


LIVE_TRIES = 5  # checks of a live store whose compactions keep replacing its files, before giving up


def verify(path: str | Path, progress: Progress | None = None) -> VerifyReport:
    """Check a data directory or a backup file: checksums, counts, index consistency.

    A restore cut short in a data directory is settled first, as the next open
    would (:func:`_settle_restore`); nothing else is written.  A store open in a
    daemon is checked as one generation: when a compaction replaced its files while
    they were read, the check runs again (up to :data:`LIVE_TRIES` times; then it says
    so in notes, and counts nothing seen in files replaced meanwhile as a problem).
    Never raises for damage: every finding goes into the report.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        return _verify_once(path, progress)
    for attempt in range(LIVE_TRIES):
        time.sleep(0.05 * attempt)  # let a compaction that replaced files under the last check finish
        before = _generation_files(path)
        try:
            report = _verify_once(path, progress)
        except StorageError as exc:  # a file renamed away while it was read
            if not jr.is_locked(path):
                raise
            report = VerifyReport(str(path), problems=[exc.message])
            continue
        if _generation_files(path) == before or not jr.is_locked(path):
            return report
    report.notes += [f"the store is live and compactions replaced its files during each of {LIVE_TRIES} checks: "
                     "the counts are those of the last check; run verify again to check one generation whole",
                     *(f"seen in a file replaced while it was read (not a problem): {p}" for p in report.problems)]
    report.problems = []
    return report


def _generation_files(path: Path) -> dict[str, tuple[int, ...]]:
    """Each generation file's identity (inode; for snapshots, which are never written in
    place, its change time too): a compaction changes some of them."""
    found: dict[str, tuple[int, ...]] = {}
    for name in (SNAPSHOT_FILE, PREV_SNAPSHOT_FILE, JOURNAL_FILE, PREV_JOURNAL_FILE, HEAD_FILE):
        try:
            info = (path / name).stat()
        except OSError:
            continue
        found[name] = (info.st_ino, info.st_ctime_ns) if name.endswith(".rms") else (info.st_ino,)
    return found


def _verify_once(path: Path, progress: Progress | None) -> VerifyReport:
    report = VerifyReport(str(path))
    try:
        with damage_is_corruption(path):
            if path.is_dir():
                _verify_dir(path, report, progress)
            elif path.is_file():
                _verify_backup(path, report, progress)
            else:
                report.problems.append(f"{path} does not exist")
    except CorruptionError as exc:  # malformed content behind a valid checksum
        report.problems.append(str(exc))
    return report


def _verify_dir(path: Path, report: VerifyReport, progress: Progress | None) -> None:
    _settle_restore(path, report)
    head = _read_head(path, report)  # first: the journal read after it holds at least what it promises
    snapshot_path = path / SNAPSHOT_FILE
    snapshot = _verify_snapshot(snapshot_path, report, progress) if snapshot_path.exists() else None
    generation = int(snapshot.get("generation", 0)) if snapshot else (-1 if snapshot_path.exists() else 0)
    journal, frames = _journal_of(path, generation, report), None
    if journal.exists():
        frames = _verify_journal(journal, generation, snapshot, report, head)
    elif files.previous_generation_kept(path) or head is not None:
        report.problems.append(f"{journal} is missing although the previous generation or the journal head is on "
                               "disk: the writes since the last compaction are in it (put it back, or --repair to "
                               "go on without)")
    if (path / PREV_JOURNAL_FILE).exists():
        _verify_frames(path / PREV_JOURNAL_FILE, report)
    if report.ok and generation >= 0:
        _count_replayed(snapshot, frames or [], journal, report)
    if not snapshot_path.exists() and report.ok:
        report.notes.append("no snapshot yet (a new store, or one never compacted): counted from the journal")
    if jr.is_locked(path):
        report.notes.append("the store is open in a running daemon; files were checked read-only")


def _settle_restore(path: Path, report: VerifyReport) -> None:
    """A restore cut short in ``path``: finish it (or drop its staged files) as the next
    open would, so that what is verified is what opens.  Left as it is, with a note,
    while a restore holds the lock; a failure becomes a problem."""
    if not swap.pending(path):
        return  # the usual case: no lock taken, nothing written (verify is read-only then)
    lock = jr.DirLock(path)
    try:
        lock.acquire()
    except StoreLockedError:
        report.notes.append("a restore into this directory is running; its files were checked as they stand")
        return
    except StorageError as exc:
        report.problems.append(f"a restore was cut short here and cannot be finished: {exc.message}")
        return
    try:
        swap.settle(path)
        report.notes.append("a restore cut short by a crash was settled (as the next open would)")
    except StorageError as exc:
        report.problems.append(exc.message)
    finally:
        lock.release()


def _journal_of(path: Path, generation: int, report: VerifyReport) -> Path:
    """The journal an open would replay: ``journal.rmj``, or ``journal.next.rmj`` standing
    in for it after a compaction that died between its renames (the open finishes it)."""
    nxt = files.next_journal_in_place_of(path, generation) if generation >= 0 else None
    if nxt is None:
        return path / JOURNAL_FILE
    report.notes.append(f"a compaction stopped between its journal renames: {nxt.name} is the journal "
                        f"(the next open renames it to {JOURNAL_FILE})")
    return nxt


def _count_replayed(snapshot: dict[str, Any] | None, frames: list[Any], journal: Path, report: VerifyReport) -> None:
    """Memories and vectors as the store opens them: the snapshot, then the journal's
    frames applied by the store's own state (an op the store would refuse to replay is
    a problem here too; before, a store never compacted verified as 0 memories)."""
    from reachy_memory.engine.state import (
        MemoryState,  # late: the state pulls in the indexes, which only this check needs
    )

    ops = [op for frame in frames for op in frame]
    head = snapshot or {}
    key = head.get("model") or first_vkey(ops)
    # A snapshot written without a model records the default dimension, not the vectors' one.
    dim = (head.get("dim") if head.get("model") else None) or first_dim(ops) or head.get("dim") or 384
    state = MemoryState(Config(), int(dim), key, key)
    try:
        if snapshot is not None:
            state.load(snapshot)
        for frame in frames:
            state.apply_all(frame)
    except CorruptionError as exc:
        report.problems.append(f"{journal}: {exc.message}; the store would refuse to open")
        return
    report.memories = len(state.records)
    report.vectors = sum(1 for rec in state.records.values() if rec.vkey is not None)


def _verify_backup(path: Path, report: VerifyReport, progress: Progress | None) -> None:
    """Check a backup file as a snapshot, then as the store that opens from it: loaded
    into a state as an open loads it (a backup whose window, persons, lexical state or
    records an open refuses verified, was restored, and left a store that would not
    open), with the links no store holds (superseded_by loops, a note name on two
    memories) and lexical postings outside its slots refused.  Problems go in ``report``."""
    snapshot = _verify_snapshot(path, report, progress)
    if snapshot is None or not report.ok:
        return
    _check_links(path, snapshot["records"], report)
    _check_postings(snapshot["lexical"], report)
    memories, vectors = report.memories, report.vectors
    _count_replayed(snapshot, [], path, report)
    if report.ok and (report.memories, report.vectors) != (memories, vectors):
        report.problems.append(f"{memories} memories and {vectors} vectors in the file, {report.memories} and "
                               f"{report.vectors} once loaded")


def _check_links(path: Path, records: list[Any], report: VerifyReport) -> None:
    """Links a store no longer makes (an import refuses them), noted, not refused: earlier
    versions made them (``supersede`` closed loops, an import gave a stored note's name to
    another), such a store opens and verifies, and its backups must restore as it is.
    An expired note holds no name (``_note_holder``): until the sweep, it and the live
    note that took its name over are both in a sound store's backups."""
    now = time.time()
    try:
        check_supersession(str(path), records)
        check_note_names(str(path), [r for r in records if not _expired_row(r, now)])
    except ValidationError as exc:
        report.notes.append(f"{exc.message} (made by an earlier version: restored as it is)")


def _expired_row(row: Any, now: float) -> bool:
    """Whether a snapshot's record ``row`` (a map; a v1 list holds no name) expired by ``now``."""
    expires = row.get("expires") if isinstance(row, dict) else None
    return isinstance(expires, int | float) and expires <= now


def _check_postings(lexical: dict[str, Any], report: VerifyReport) -> None:
    """Every lexical posting inside the state's slots, with one frequency per slot: a slot
    past ``doc_len`` opened and made each search that matched it fail (IndexError)."""
    terms = lexical.get("terms_f32", lexical.get("terms", {}))
    slots = len(lexical.get("doc_len", b"")) // 4
    tf_bytes = 4 if "terms_f32" in lexical else 2
    for term, (where, tfs) in terms.items():
        found = np.frombuffer(where, np.int32)
        if len(tfs) != len(found) * tf_bytes or (len(found) and not 0 <= found.min() <= found.max() < slots):
            report.problems.append(f"lexical posting of {str(term)[:64]!r} names slots outside 0..{slots - 1} "
                                   "or does not give one frequency a slot")
            return


def _verify_snapshot(path: Path, report: VerifyReport, progress: Progress | None) -> dict[str, Any] | None:
    """Check a snapshot file; returns its content (None, the problem noted, when unreadable)."""
    try:
        snapshot = read_snapshot(path)
    except ReachyMemoryError as exc:
        report.problems.append(str(exc))
        return None
    records = snapshot["records"]
    report.memories = len(records)
    report.generation = int(snapshot.get("generation", 0))
    report.seq = files.seq_of(snapshot) or 0
    matrix = _vector_matrix(snapshot, report)
    if matrix is not None:
        tolerance = NORM_TOLERANCE[snapshot.get("vector_format", "f32")]
        _check_records(records, matrix, tolerance, report, progress)
    lexical_n = snapshot["lexical"].get("n")
    if lexical_n != len(records):
        report.problems.append(f"lexical index holds {lexical_n} documents for {len(records)} memories")
    return snapshot


# How far a stored unit vector's norm may be from 1: a float32 row's rounding, or
# bf16's (each component within 2^-8, relatively; ~1e-4 in practice)
NORM_TOLERANCE = {"f32": 1e-3, "bf16": BF16_TOLERANCE}


def _vector_matrix(snapshot: dict[str, Any], report: VerifyReport) -> np.ndarray | None:
    """The snapshot's vector block as float32 rows (None, with the problem noted, when
    it is not a whole number of vectors)."""
    vectors, dim = snapshot["vectors"], int(snapshot.get("dim") or 384)
    fmt = snapshot.get("vector_format", "f32")  # read_snapshot refused any other
    if len(vectors) % (ITEM_BYTES[fmt] * dim):
        report.problems.append(f"vector block of {len(vectors)} bytes is not a whole number of {dim}-d vectors")
        return None
    if fmt == "bf16":
        return widen(np.frombuffer(vectors, np.uint16)).reshape(-1, dim)
    return np.frombuffer(vectors, np.float32).reshape(-1, dim)


def _check_records(records: list[Any], matrix: np.ndarray, tolerance: float, report: VerifyReport,
                   progress: Progress | None) -> None:
    ids, slots = set(), set()
    for n, obj in enumerate(records):
        try:
            rec = decode(obj)
        except ValidationError as exc:
            report.problems.append(f"record {n}: {exc.message}")
            continue
        if rec.id in ids:
            report.problems.append(f"duplicate memory id {rec.id!r}")
        ids.add(rec.id)
        if rec.slot in slots:
            report.problems.append(f"slot {rec.slot} used twice")
        slots.add(rec.slot)
        if rec.vkey is not None:
            _check_vector(rec, matrix, tolerance, report)
        if progress and (n % 1000 == 0 or n == len(records) - 1):
            progress(n + 1, len(records))


def _check_vector(rec: Record, matrix: np.ndarray, tolerance: float, report: VerifyReport) -> None:
    if rec.slot >= len(matrix):
        report.problems.append(f"memory {rec.id!r} has a vector slot {rec.slot} beyond the vector block")
        return
    norm = float(np.linalg.norm(matrix[rec.slot]))
    if not abs(norm - 1.0) <= tolerance:  # a NaN norm fails too
        report.problems.append(f"memory {rec.id!r}: vector norm {norm:.4f}, expected 1")
    else:
        report.vectors += 1


def _read_head(path: Path, report: VerifyReport) -> jr.HeadState | None:
    """The journal head (None when there is none, or when it is damaged: a problem)."""
    try:
        return jr.Head.read(path / HEAD_FILE)
    except ReachyMemoryError as exc:
        report.problems.append(str(exc))
        return None


def _reach_of(path: Path, head: jr.HeadState | None) -> int:
    """What ``head`` promises of the journal ``path`` (0 when it names another one)."""
    return head.reach if head is not None and jr.file_journal_id(path) == head.journal_id else 0


def _verify_journal(path: Path, generation: int, snapshot: dict[str, Any] | None, report: VerifyReport,
                    head: jr.HeadState | None) -> list[Any] | None:
    """Check the journal, against the head file too; returns the frames an open replays
    after ``snapshot`` (of ``generation``), or None when the journal does not follow it."""
    if not _verify_frames(path, report, _reach_of(path, head)):
        return None
    try:
        result = jr.read_journal(path, head)
    except CorruptionError as exc:  # shorter than the head promises, or not the journal it names
        report.problems.append(exc.message)
        return None
    if head is None and result.version >= jr.JOURNAL_VERSION:
        report.notes.append(f"no journal head ({HEAD_FILE}); the next open writes it")
    report.journal_frames = max(0, len(result.frames) - 1)
    found, seq = files.journal_generation(result), files.seq_of(snapshot)
    if generation < 0 or found is None:
        return None
    if found == generation:
        if result.version >= jr.JOURNAL_VERSION and seq is not None:
            return [ops for _, ops in files.frames_not_in_snapshot(result, found, None, seq)]
        return result.frames[1:]
    if found < generation:
        tail = [ops for _, ops in files.frames_not_in_snapshot(result, found, files.follows_of(snapshot), seq)]
        report.notes.append(f"journal generation {found} predates snapshot {generation} (a compaction stopped "
                            f"before its journal switch): {len(tail)} frames after the snapshot are counted, "
                            f"and the next open carries them into a new journal")
        return tail
    else:
        report.problems.append(f"journal generation {found} is newer than the snapshot's {generation}: the snapshot "
                               "is missing or was replaced; 'verify --repair' rebuilds from the previous generation")
    return None


def _verify_frames(path: Path, report: VerifyReport, reach: int = 0) -> bool:
    """Check every frame of a journal (``reach``: bytes the head promises); damage becomes a
    problem naming the memories it touches."""
    try:
        found = jr.scan(path, jr.read_bytes(path), jr.JOURNAL, reach)
    except ReachyMemoryError as exc:
        report.problems.append(str(exc))
        return False
    if found.torn_at is not None:
        report.notes.append(f"{path}: torn end at offset {found.torn_at} (a write cut short by a crash, and "
                            "anything after it; never acknowledged; set aside on the next open)")
    for start, end in found.damaged:
        ids = jr.ids_in(jr.read_bytes(path)[start:end])
        report.affected.extend(ids)
        report.problems.append(f"{path}: damaged bytes {start}..{end} (valid frames follow, or they were written "
                               f"durably); memories named in "
                               f"them: {', '.join(ids) or 'none readable'}; 'verify --repair' keeps every valid frame")
    return not found.damaged


def backup_target(dest: str | Path, data_dir: str | Path, *, force: bool = False) -> Path:
    """Where a backup to ``dest`` goes (see :func:`reachy_memory.storage.files.backup_target`):
    ValidationError for a target inside ``data_dir``, a symlink, a missing
    directory, or an existing file that is not a backup (unless ``force``)."""
    return files.backup_target(dest, Path(data_dir).expanduser(), force=force)


# The names backup_target gives in a directory (UTC to the second): prune touches no other file.
BACKUP_NAME = re.compile(r"memory-\d{8}T\d{6}Z\.rms")


def prune(directory: str | Path, keep: int, *, written: str | Path | None = None) -> list[str]:
    """Delete all but the newest ``keep`` timestamped backups in ``directory``, and the temp
    files of backups whose writer died; returns what it deleted.

    Only files named as :func:`backup_target` names them *and* holding a snapshot's
    header count (a user's ``memory-notes.rms`` is not ours).  ``written``, the
    backup just taken, is always one of those kept: its name comes from the clock,
    and a robot without a real-time clock that boots in the past named it older than
    the ones it took before, so ordering by name deleted the backup just written.
    Raises ValidationError for ``keep`` < 1, StorageError when a file cannot be deleted.
    """
    if keep < 1:
        raise ValidationError("--keep must be at least 1", field="keep")
    newest = Path(written).expanduser().resolve() if written is not None else None
    listed = _backups_in(Path(directory).expanduser())
    backups = sorted(p for p in listed if p.resolve() != newest)
    # ``written`` takes one of the ``keep`` places only when it is there: a daemon on another
    # machine or mount namespace wrote it where this listing cannot see it, and "keep 1"
    # then deleted every backup this side has.
    kept = keep - 1 if len(backups) < len(listed) else keep
    old = backups[:max(0, len(backups) - kept)]
    old += _abandoned_temps(Path(directory).expanduser())
    for path in old:
        try:
            path.unlink(missing_ok=True)  # a concurrent prune may have deleted it first
        except OSError as exc:
            raise StorageError(f"cannot delete the old backup {path}: {exc.strerror}", path=str(path)) from exc
    return [str(p) for p in old]


# write_atomic's temp file for a backup: ".<name>.tmp-<pid>-<thread>"
BACKUP_TEMP = jr.temp_pattern(BACKUP_NAME.pattern)


def _abandoned_temps(directory: Path) -> list[Path]:
    """Temp files of backups whose writer is gone (a daemon killed mid-backup, by the
    watchdog or kill -9, leaves one, as large as a backup, that nothing else removes).
    A writer that may be alive keeps its file: only "no such process" counts as gone."""
    found = []
    for path in directory.glob(".memory-*.rms.tmp-*"):
        match = BACKUP_TEMP.fullmatch(path.name)
        if match and not path.is_symlink() and path.is_file() and not _alive(int(match.group(1))):
            found.append(path)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: someone else's process; an absurd pid: not ours to judge
        return True
    return True


def _backups_in(directory: Path) -> list[Path]:
    """The regular files in ``directory`` named and headed as our timestamped backups.
    Raises StorageError when the directory cannot be listed."""
    try:
        names = [p for p in directory.iterdir() if BACKUP_NAME.fullmatch(p.name)]
    except OSError as exc:
        raise StorageError(f"cannot list the backups in {directory}: {exc.strerror}", path=str(directory)) from exc
    return [p for p in names if not p.is_symlink() and p.is_file() and files.is_snapshot(p)]


def repair(path: str | Path, config: Config | None = None) -> list[jr.RepairReport]:
    """Repair a data directory; never deletes anything.  Refuses a live store.

    Journals keep every valid frame (before and after any damage; the damaged
    originals are moved aside).  A missing or damaged snapshot is rebuilt from
    the previous generation kept on disk (``snapshot.prev.rms`` +
    ``journal.prev.rmj`` + ``journal.rmj``); the damaged snapshot is moved aside.
    Raises CorruptionError when that chain is not on disk (nothing is changed then).
    """
    path = Path(path).expanduser()
    lock = jr.DirLock(path)
    lock.acquire()
    try:
        swap.settle(path)  # a restore cut short: the store it leaves is the one repaired
        reports = _finish_switch(path)
        head = _head_or_none(path)
        reports += [jr.repair_file(path / name, jr.JOURNAL, _reach_of(path / name, head) if head else 0)
                    for name in (JOURNAL_FILE, PREV_JOURNAL_FILE) if (path / name).exists()]
        usable = files.snapshot_usable(path)
        if usable and not (path / JOURNAL_FILE).exists() and (files.previous_generation_kept(path) or head):
            reports.append(_start_empty_journal(path, head))
        reports += _accept_journal(path)
    finally:
        lock.release()
    if not usable:
        reports.append(_rebuild_snapshot(path, config or Config()))
    return reports


def _finish_switch(path: Path) -> list[jr.RepairReport]:
    """A compaction that died between its journal renames left its journal as
    ``journal.next.rmj``: put it in place first, as an open would (else the empty
    journal started for a missing ``journal.rmj`` was written over it, and the
    writes acknowledged during that compaction were lost).  Damage in it is repaired
    first, frame by frame (reading it to switch raised the CorruptionError that told
    the user to run this repair).  Raises StorageError."""
    nxt = path / files.NEXT_JOURNAL_FILE
    if not (files.snapshot_usable(path) and (path / SNAPSHOT_FILE).exists()):
        return []
    reports = [jr.repair_file(nxt, jr.JOURNAL)] if nxt.exists() and not (path / JOURNAL_FILE).exists() else []
    files.complete_switch(path, int(read_snapshot(path / SNAPSHOT_FILE).get("generation", 0)))
    return reports


def _head_or_none(path: Path) -> jr.HeadState | None:
    """The journal head, or None when there is none or it is damaged (written anew)."""
    try:
        return jr.Head.read(path / HEAD_FILE)
    except ReachyMemoryError:
        return None


def _accept_journal(path: Path) -> list[jr.RepairReport]:
    """The journal is not what the head file promises (cut short, another copy or
    generation put in its place) or the head is damaged: go on with the journal as it is,
    writing the head anew (the lost writes accepted, logged)."""
    journal = path / JOURNAL_FILE
    if not journal.exists() or jr.file_journal_id(journal) is None:
        return []
    try:
        jr.read_journal(journal, jr.Head.read(path / HEAD_FILE))
        return []
    except CorruptionError as exc:
        why = exc.message
    result = jr.read_file(journal, jr.JOURNAL)
    jid = result.journal_id
    assert jid is not None
    aside = jr.side_path(path / HEAD_FILE, "damaged")
    if (path / HEAD_FILE).exists():
        os.replace(path / HEAD_FILE, aside)
    jr.Head(path / HEAD_FILE).write(files.journal_generation(result) or 0, jid, 0, result.last_seq or 0)
    log.warning("%s: going on with the journal as it is (%s); the head it did not match was moved to %s",
                path, why, aside)
    return [jr.RepairReport(str(path / HEAD_FILE), len(result.frames), 0, str(aside))]


def _start_empty_journal(path: Path, head: jr.HeadState | None) -> jr.RepairReport:
    """The current journal is gone: accept the loss of the writes it held and start the
    snapshot's generation afresh (the store refuses to open until this is asked for), its
    frames numbered above any the snapshot or the head knew."""
    snapshot = read_snapshot(path / SNAPSHOT_FILE) if (path / SNAPSHOT_FILE).exists() else {}
    generation = int(snapshot.get("generation", 0))
    base = max(files.seq_of(snapshot) or 0, head.seq if head else 0)
    files.write_next_journal(path, generation, base_seq=base, after=head.journal_id if head else None)
    files.complete_switch(path, generation)
    log.warning("%s was missing: started an empty journal; the writes since the last compaction are lost",
                path / JOURNAL_FILE)
    return jr.RepairReport(str(path / JOURNAL_FILE), 0, None, None)


def _rebuild_snapshot(path: Path, config: Config) -> jr.RepairReport:
    from reachy_memory.engine.store import MemoryStore  # late: the store is only needed for a rebuild

    config = config.replace("memory", path=str(path))
    with MemoryStore(config=config, embedder=None, recover=True) as store:
        stats = store.stats()
        count = stats["memories"] + stats["expired_unswept"]  # what the snapshot holds, the unswept too
    log.warning("rebuilt %s from the previous generation: %d memories", path / SNAPSHOT_FILE, count)
    return jr.RepairReport(str(path / SNAPSHOT_FILE), count, 0, None)


def restore(backup_file: str | Path, data_dir: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Rebuild ``data_dir`` from a backup file, whole or not at all: a crash or a power
    cut at any point leaves the old store or the restored one (see :mod:`._restore`).

    Refuses a data directory in use by a running daemon (StoreLockedError), and
    one holding data unless ``force`` (ValidationError; with it, its files are moved
    aside, not deleted), and one it cannot make or write as a store would
    (ConfigError: a file in the way, no permission, a read-only file system).
    Raises StorageError when the backup does not verify, or when writing its copy
    fails (the old store is then untouched).
    """
    backup_file, data_dir = Path(backup_file).expanduser(), Path(data_dir).expanduser()
    if data_dir.resolve() in backup_file.resolve().parents:
        raise ValidationError(f"the backup {backup_file} is inside the data directory it would replace; "
                              "copy it elsewhere first", field="backup")
    report = verify(backup_file)
    if not report.ok:
        raise StorageError(f"backup {backup_file} does not verify: {'; '.join(report.problems)}",
                           path=str(backup_file))
    files.secure_dir(data_dir)
    lock = jr.DirLock(data_dir)
    lock.acquire()  # StoreLockedError for a live store
    try:
        swap.settle(data_dir)  # a restore cut short before this one: finished (or undone) first
        files.remove_unfinished_writes(data_dir)
        moves = swap.plan(data_dir)
        if moves and not force:
            # Bad usage (exit 2), not a store in use (exit 4): nothing holds it, --force is missing.
            raise ValidationError(f"{data_dir} already holds a store; pass --force to move it aside and restore",
                                  field="force")
        swap.stage(data_dir, _chunks(backup_file), report.generation, report.seq)
        swap.swap(data_dir, moves)
    finally:
        lock.release()
    return {"data_dir": str(data_dir), "memories": report.memories,
            "moved_aside": [str(data_dir / aside) for _, aside in moves]}


def _chunks(path: Path) -> Iterator[bytes]:
    """A file in 1 MiB pieces (a backup can be larger than we want in memory twice)."""
    with open(path, "rb") as fh:
        yield from iter(lambda: fh.read(1 << 20), b"")
