"""The data directory's files and the generation rules between them.

Owned by the thread that holds the store's lock (the daemon's engine thread);
these functions only touch files, never in-memory state.  ``docs/FORMAT.md``
("Generations and compaction") is the contract and the crash analysis.

Files::

    LOCK              pid of the process that has the store open (the lock: a flock on the directory)
    head.rmh          the journal head: which journal is the store's, how much of it is durable
    snapshot.rms      generation g: every memory as of the last compaction
    journal.rmj       generation g: ops since that snapshot
    snapshot.prev.rms generation g-1 (absent before the first compaction)
    journal.prev.rmj  generation g-1: ops between the two snapshots
    vectors.hnsw      graph cache (+ .meta), rebuilt when missing or stale

Rules: a journal is set aside only when its generation is provably older than
the snapshot's, and it is moved (renamed), never rewritten.  A journal newer
than the snapshot (the snapshot is missing or was replaced) stops the open
with :class:`CorruptionError`; ``verify --repair`` rebuilds the state from the
previous generation (``snapshot.prev.rms`` + ``journal.prev.rmj`` +
``journal.rmj``) without deleting anything.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reachy_memory.engine.records import RECORD_VERSION
from reachy_memory.engine.vector_index import ITEM_BYTES, VECTOR_FORMAT
from reachy_memory.errors import (
    ConfigError,
    CorruptionError,
    FormatVersionError,
    ReachyMemoryError,
    StorageError,
    ValidationError,
)
from reachy_memory.storage import journal as jr

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "snapshot.rms"
JOURNAL_FILE = "journal.rmj"
PREV_SNAPSHOT_FILE = "snapshot.prev.rms"
PREV_JOURNAL_FILE = "journal.prev.rmj"
NEXT_JOURNAL_FILE = "journal.next.rmj"  # the next generation's empty journal, during a compaction
GRAPH_FILE = "vectors.hnsw"
RESTORE_INTENT_FILE = "restore.intent"  # a restore's decided swap, only while it runs (see _restore)
HEAD_FILE = "head.rmh"  # which journal is the store's, and how much of it is durable (journal.Head)
STORE_FILES = ("LOCK", SNAPSHOT_FILE, JOURNAL_FILE, PREV_SNAPSHOT_FILE, PREV_JOURNAL_FILE, GRAPH_FILE, HEAD_FILE)
# A temp file of journal.write_atomic (.<name>.tmp-<pid>-<thread>) or of a graph cache save (.<name>.tmp-<pid>)
_TEMP_NAME = re.compile(r"\.(.+)\.tmp-\d+(?:-\d+)?")


def secure_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or tighten an existing one we own to 0700.

    Raises ConfigError (``key="memory.path"``) when ``path``, or a folder it would be
    made in, is a file, or when this process may not create or write it (permissions,
    a read-only file system): the configured path is wrong, nothing was created.
    Raises StorageError for any other failure.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
            os.chmod(path, 0o700)
            log.warning("data directory %s was readable by others (mode %o); tightened to 0700",
                        path, stat.S_IMODE(info.st_mode))
        if not os.access(path, os.W_OK | os.X_OK):  # an existing folder of another user, or read-only
            code = errno.EROFS if os.statvfs(path).f_flag & os.ST_RDONLY else errno.EACCES
            raise OSError(code, os.strerror(code))
    except OSError as exc:
        raise _unusable_dir(path, exc) from exc


def _unusable_dir(path: Path, exc: OSError) -> ReachyMemoryError:
    """The error for a data directory ``path`` that ``exc`` stopped: ConfigError when the
    configured path is wrong (a file in the way, no permission, a read-only file system)."""
    why = f"data directory {path} cannot be used"
    blocking = next((p for p in (path, *path.parents) if _not_a_dir(p)), None)
    if blocking is not None or exc.errno in (errno.EEXIST, errno.ENOTDIR):
        what = "it" if blocking in (None, path) else str(blocking)
        return ConfigError(f"{why}: {what} is a file, not a directory (memory.path, or --data-dir, must name a "
                           "directory)", key="memory.path", path=str(path))
    if exc.errno == errno.EROFS:
        return ConfigError(f"{why}: it is on a read-only file system (memory.path, or --data-dir, must name a "
                           "directory on a writable one)", key="memory.path", path=str(path))
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConfigError(f"{why}: permission denied to uid {os.getuid()} (give memory.path, or --data-dir, a "
                           "directory this user may write, or change its owner)", key="memory.path", path=str(path))
    return StorageError(f"cannot create data directory {path}: {exc.strerror}", path=str(path))


def _not_a_dir(path: Path) -> bool:
    """Whether ``path`` exists and is not a directory (what cannot be looked at: False)."""
    try:
        return not stat.S_ISDIR(path.stat().st_mode)
    except OSError:
        return False


def tighten_files(path: Path) -> None:
    """Make the store's own files 0600 (files written before this rule, graph caches)."""
    for name in STORE_FILES:
        for file in (path / name, path / f"{name}.meta"):
            try:
                if file.exists() and stat.S_IMODE(file.stat().st_mode) & 0o077:
                    os.chmod(file, 0o600)
            except OSError as exc:
                log.warning("cannot tighten the mode of %s: %s", file, exc.strerror)


def remove_unfinished_writes(path: Path) -> None:
    """Remove the temp files of the store's own writes that never finished: a crash
    or a power cut in the middle of a snapshot, a journal switch, a repair, a restore
    or a graph cache save leaves one (as large as the file it was replacing: tens of MB at 100k
    memories), named after a pid that never writes again.  Only for the holder of the
    store's lock, before it writes: no one else writes these names.  What cannot be
    removed is logged, never raised: the store opens without it."""
    owned = {*STORE_FILES, NEXT_JOURNAL_FILE, RESTORE_INTENT_FILE}  # a restore's staged files: <name>.restoring
    for tmp in path.glob(".*.tmp-*"):
        named = _TEMP_NAME.fullmatch(tmp.name)
        if named is None or not any(named[1] == n or named[1].startswith(f"{n}.") for n in owned):
            continue
        try:
            tmp.unlink()
        except OSError as exc:
            log.warning("cannot remove %s, left by a write that never finished: %s", tmp, exc.strerror)


def read_snapshot(path: Path) -> dict[str, Any]:
    """A snapshot or backup file as one dict: the header's keys plus ``records``,
    ``vectors`` (a view), ``lexical`` and ``window``.

    Raises CorruptionError for an incomplete or damaged file,
    FormatVersionError for a foreign one.
    """
    frames = jr.read_file(path, jr.SNAPSHOT, raw=frozenset({2})).frames
    sections = [frames[i] for i in (0, 1, 3, 4, 5)] if len(frames) == 6 else []
    if not sections or not all(isinstance(f, dict) for f in sections):
        raise CorruptionError(f"{path}: incomplete snapshot ({len(frames)} of 6 sections)", path=str(path), offset=0)
    head, recs, lexical, window, end = sections
    records = recs.get("records", [])
    if end.get("end") != len(records):
        raise CorruptionError(f"{path}: end marker counts {end.get('end')} memories, found {len(records)}",
                              path=str(path), offset=0)
    try:
        vectors = jr.raw_bin(frames[2])
    except ValueError as exc:
        raise CorruptionError(f"{path}: bad vector block", path=str(path), offset=0) from exc
    _check_vector_format(path, head)
    _check_head(path, head)
    return {**head, "records": records, "people": recs.get("people", []), "vectors": vectors,
            "lexical": lexical.get("lexical", {}),
            "window": window.get("window", [])}


def _check_vector_format(path: Path, head: dict[str, Any]) -> None:
    """FormatVersionError unless the head names a vector block format this version
    reads (none: float32, written before bf16): a block read in the wrong format
    would be silently wrong vectors, and one not read at all would lose them."""
    fmt = head.get("vector_format", "f32")
    if not (isinstance(fmt, str) and fmt in ITEM_BYTES):
        raise FormatVersionError(f"{path}: vector block in format {fmt!r}; this reachy-memory reads "
                                 f"{sorted(ITEM_BYTES)}", path=str(path), found=repr(fmt), expected=VECTOR_FORMAT)


MAX_DIM = 1 << 16  # a vector's components: far above any sentence model's (384 here)
MAX_GENERATION = 1 << 62  # a generation number stays one msgpack can write after many more compactions


def _check_head(path: Path, head: dict[str, Any]) -> None:
    """Refuse a snapshot head this version cannot use: a record format newer than
    :data:`RECORD_VERSION` (FormatVersionError: a newer writer), a generation, dimension
    or model that is not what this store writes (CorruptionError).  A backup with a
    generation of 1.5 or "1" was restored and then refused at open; a dimension "8"
    dropped every vector at open; "records": 3 was read as format 2."""
    fmt = head.get("records", RECORD_VERSION)
    if type(fmt) is not int or not 1 <= fmt <= RECORD_VERSION:
        raise FormatVersionError(f"{path}: records in format {fmt!r}; this reachy-memory reads 1..{RECORD_VERSION}",
                                 path=str(path), found=repr(fmt), expected=RECORD_VERSION)
    generation, dim, model = head.get("generation", 0), head.get("dim"), head.get("model")
    if type(generation) is not int or not 0 <= generation < MAX_GENERATION:
        raise CorruptionError(f"{path}: generation {generation!r} is not a generation number", path=str(path), offset=0)
    if dim is not None and (type(dim) is not int or not 0 < dim <= MAX_DIM):
        raise CorruptionError(f"{path}: vector dimension {dim!r} is not one", path=str(path), offset=0)
    if model is not None and type(model) is not str:
        raise CorruptionError(f"{path}: model {model!r} is not a model name", path=str(path), offset=0)


def journal_generation(result: jr.ReadResult) -> int | None:
    """The generation a journal's first frame names (None if it names none)."""
    head = result.frames[0] if result.frames else {}
    gen = head.get("generation") if isinstance(head, dict) else None
    return gen if isinstance(gen, int) else None


def set_aside(path: Path, suffix: str) -> Path:
    """Rename ``path`` to ``<name>.<suffix>-<epoch>`` (durably); returns the new path."""
    target = jr.side_path(path, suffix)
    try:
        os.replace(path, target)
        jr.fsync_dir(path.parent)
    except OSError as exc:
        raise StorageError(f"cannot move {path} aside: {exc.strerror}", path=str(path)) from exc
    return target


def write_snapshot_keeping_previous(directory: Path, frames: Any) -> None:
    """Replace ``snapshot.rms`` durably; the one it replaces becomes ``snapshot.prev.rms``.

    The old snapshot is hard-linked first and the link installed only after the
    new snapshot is durable, so a failure (StorageFullError, StorageError)
    leaves every file as it was.
    """
    current, held = directory / SNAPSHOT_FILE, directory / f".{PREV_SNAPSHOT_FILE}.tmp"
    try:
        held.unlink(missing_ok=True)
        if current.exists():
            os.link(current, held)
        jr.write_snapshot(current, frames)
        if held.exists():
            os.replace(held, directory / PREV_SNAPSHOT_FILE)
            jr.fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot keep the previous snapshot: {exc.strerror}", path=str(current)) from exc
    finally:
        held.unlink(missing_ok=True)


Carried = list[tuple[int, list[Any]]]  # (seq, ops) of frames carried into a next journal


def write_next_journal(directory: Path, generation: int, follows: tuple[int, int] | None = None,
                       frames: Carried | None = None, *, durable: bool = True, base_seq: int = 0,
                       after: bytes | None = None) -> None:
    """Write the next generation's journal as ``journal.next.rmj`` (format 4, a key of its
    own; fsynced, its rename too, unless not ``durable``: a compaction's first write of it,
    which only checks that the disk takes it, is always written again durably before the
    switch).

    ``follows`` = (generation, offset): the snapshot of ``generation`` covers the journal it
    follows up to that byte offset, and every frame up to ``base_seq`` (the head frame's
    seq); ``frames`` ((seq, ops), one frame each, as they were journaled) are the ones
    appended after it; ``after``: the id of the journal this one replaces (the head file's).
    Raises StorageFullError / StorageError; nothing else is touched then.
    """
    head: dict[str, Any] = {"kind": "journal", "generation": generation}
    if follows is not None:
        head["follows"] = list(follows)
    if after is not None:
        head["after"] = after
    jr.write_atomic(directory / NEXT_JOURNAL_FILE, jr.journal_chunks(head, base_seq, frames or ()), durable=durable)


def append_to_next_journal(directory: Path, frames: Carried) -> None:
    """Append ``frames`` ((seq, ops)) to ``journal.next.rmj`` and fsync it.

    Raises StorageFullError / StorageError (the file may then hold part of a
    frame: it is only ever used after this returned).
    """
    path = directory / NEXT_JOURNAL_FILE
    try:
        with open(path, "r+b") as handle:
            key = jr.read_file(path, jr.JOURNAL).key
            assert key is not None
            offset = handle.seek(0, os.SEEK_END)
            for seq, ops in frames:
                frame = jr.encode_keyed(ops, key, seq, offset)
                handle.write(frame)
                offset += len(frame)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise jr.storage_error(f"cannot append to {path}", path, exc) from exc


def follows_of(head: Any) -> tuple[int, int] | None:
    """The (generation, offset) a snapshot or journal head says it follows, if any."""
    value = head.get("follows") if isinstance(head, dict) else None
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value[0], value[1]
    return None


def seq_of(snapshot: Any) -> int | None:
    """The seq up to which a snapshot holds every frame's ops (None: a snapshot from
    before format-4 journals, which says where it stops by byte offset only)."""
    value = snapshot.get("seq") if isinstance(snapshot, dict) else None
    return value if type(value) is int and value >= 0 else None


def frames_not_in_snapshot(result: jr.ReadResult, generation: int, follows: tuple[int, int] | None,
                           seq: int | None = None) -> list[tuple[int | None, list[Any]]]:
    """The frames ((seq, ops); seq None before format 4) of a journal (of ``generation``)
    that a snapshot does not hold.  Format 4: those numbered above the snapshot's ``seq``,
    wherever they are (a journal cut short of the snapshot's point and appended to since
    keeps them).  Earlier formats: those from the byte offset ``follows`` names on (none
    when it names no offset in this journal: then the snapshot holds all of it)."""
    seqs: list[int | None] = list(result.seqs[1:]) or [None] * (len(result.frames) - 1)
    pairs = list(zip(seqs, result.frames[1:], strict=True))
    if result.version >= 4 and seq is not None:
        return [(s, frame) for s, frame in pairs if s is not None and s > seq]
    if follows is None or follows[0] != generation:
        return []
    return [(s, frame) for (s, frame), offset in zip(pairs, result.offsets[1:], strict=True) if offset >= follows[1]]


def next_journal_in_place_of(directory: Path, generation: int) -> Path | None:
    """``journal.next.rmj`` when it stands for the missing ``journal.rmj`` (a compaction
    died between its two journal renames; see :func:`complete_switch`), else None."""
    current, nxt = directory / JOURNAL_FILE, directory / NEXT_JOURNAL_FILE
    if current.exists() or not nxt.exists():
        return None
    return nxt if journal_generation(jr.read_file(nxt, jr.JOURNAL)) == generation else None


def complete_switch(directory: Path, generation: int) -> bool:
    """Finish a compaction that died between its two journal renames.

    When ``journal.rmj`` is missing and ``journal.next.rmj`` is the journal of
    the snapshot's ``generation``, rename it into place; returns True if it did.
    """
    nxt = next_journal_in_place_of(directory, generation)
    if nxt is None:
        return False
    try:
        os.replace(nxt, directory / JOURNAL_FILE)
        jr.fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot finish the journal switch: {exc.strerror}", path=str(nxt)) from exc
    log.warning("finished a compaction interrupted between its journal renames (%s)", directory)
    return True


def switch_journals(directory: Path) -> None:
    """``journal.rmj`` -> ``journal.prev.rmj``, ``journal.next.rmj`` -> ``journal.rmj`` (durably).

    Two renames: a crash between them leaves no ``journal.rmj``, and open then
    starts an empty one for the snapshot's generation (nothing is lost: every
    op of the retired journal is in the snapshot).
    """
    try:
        if (directory / JOURNAL_FILE).exists():
            os.replace(directory / JOURNAL_FILE, directory / PREV_JOURNAL_FILE)
        os.replace(directory / NEXT_JOURNAL_FILE, directory / JOURNAL_FILE)
        jr.fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot switch journals in {directory}: {exc.strerror}", path=str(directory)) from exc


def retire_journal(directory: Path) -> None:
    """A journal found older than the snapshot (already folded in) becomes ``journal.prev.rmj``."""
    current = directory / JOURNAL_FILE
    try:
        os.replace(current, directory / PREV_JOURNAL_FILE)
        jr.fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot retire the journal: {exc.strerror}", path=str(current)) from exc


@dataclass
class RecoveryBase:
    """Where a recovery starts: the previous snapshot (or nothing) and the ops after it."""

    snapshot: dict[str, Any] | None
    generation: int
    ops: list[list[Any]] = field(default_factory=list)
    moved_aside: list[str] = field(default_factory=list)
    seq: int | None = None  # format 4: the last frame whose ops are in ``ops``


def recovery_base(directory: Path) -> RecoveryBase:
    """The previous generation, for rebuilding a store whose snapshot is missing or damaged.

    Moves an unreadable ``snapshot.rms`` aside (never deletes it).  Raises
    CorruptionError, changing nothing else, when the previous generation on
    disk does not chain up to the current journal.
    """
    base = _previous_snapshot(directory)
    generation = int(base["generation"]) if base else 0
    prev = directory / PREV_JOURNAL_FILE
    if not prev.exists():
        raise CorruptionError(f"{directory}: no previous journal to rebuild from; the snapshot cannot be "
                              "recovered automatically (nothing was changed)", path=str(directory), offset=0)
    result = jr.read_file(prev, jr.JOURNAL)
    start = _chain_start(prev, journal_generation(result), generation, follows_of(base))
    if result.version >= 4:  # by seq: the frames carried into the current journal are skipped there
        floor = seq_of(base) if base is not None else None
        kept = [(s, f) for s, f in zip(result.seqs[1:], result.frames[1:], strict=True) if floor is None or s > floor]
        ops = [op for _, frame in kept for op in frame]
        last: int | None = kept[-1][0] if kept else (floor if floor is not None else result.seqs[0])
    else:
        end = _covered_offset(directory, journal_generation(result))
        ops = [op for frame, offset in zip(result.frames[1:], result.offsets[1:], strict=True)
               if start <= offset < end for op in frame]
        last = None
    moved = [str(set_aside(directory / SNAPSHOT_FILE, "damaged"))] if (directory / SNAPSHOT_FILE).exists() else []
    return RecoveryBase(base, generation, ops, moved, last)


def _chain_start(prev: Path, journal_gen: int | None, generation: int, follows: tuple[int, int] | None) -> int:
    """Where the previous journal's ops after the previous snapshot begin; raises
    CorruptionError when that journal does not follow that snapshot."""
    if journal_gen == generation:
        return 0
    if follows is not None and journal_gen == follows[0]:
        return follows[1]  # a journal kept in use after a compaction (disk full at the switch)
    raise CorruptionError(f"{prev}: generation {journal_gen} does not follow the previous snapshot's "
                          f"{generation}; nothing was changed", path=str(prev), offset=0)


def _covered_offset(directory: Path, generation: int | None) -> float:
    """How much of journal ``generation`` the next snapshot covers: the offset the
    current journal's head names (the rest was carried into the current journal)."""
    try:
        head = jr.read_file(directory / JOURNAL_FILE, jr.JOURNAL).frames[0]
    except (StorageError, OSError, IndexError):  # damaged or missing: all of the previous journal
        return math.inf
    follows = follows_of(head)
    return follows[1] if follows is not None and follows[0] == generation else math.inf


def _previous_snapshot(directory: Path) -> dict[str, Any] | None:
    path = directory / PREV_SNAPSHOT_FILE
    return read_snapshot(path) if path.exists() else None


def previous_generation_kept(directory: Path) -> list[str]:
    """The previous generation's files on disk (present once a compaction has run)."""
    return [name for name in (PREV_SNAPSHOT_FILE, PREV_JOURNAL_FILE) if (directory / name).exists()]


def require_journal(directory: Path, head: jr.HeadState | None = None) -> None:
    """Refuse to start a fresh journal in a store that had one: with ``journal.rmj``
    gone (deleted, or lost with its directory entry), opening would silently drop
    every write since the last compaction (or, for a store never compacted, every write:
    the head file shows it had a journal).  Raises CorruptionError (nothing changed)."""
    if (directory / JOURNAL_FILE).exists():
        return
    kept = previous_generation_kept(directory) + ([HEAD_FILE] if head is not None else [])
    if kept:
        raise CorruptionError(f"{directory}: {JOURNAL_FILE} is missing although {' and '.join(kept)} show "
                              "this store has one; the writes since the last compaction are in it. "
                              "Nothing was changed. Put the file back, or run 'reachy-memory verify --repair' "
                              "to go on without them", path=str(directory / JOURNAL_FILE), offset=0)


def snapshot_usable(directory: Path) -> bool:
    """True when ``snapshot.rms`` is absent-by-design or reads cleanly.

    False when it is damaged, or missing while the journal says a compaction
    happened (generation >= 1).
    """
    snapshot, journal = directory / SNAPSHOT_FILE, directory / JOURNAL_FILE
    if snapshot.exists():
        try:
            read_snapshot(snapshot)
        except CorruptionError:
            return False
        return True
    if not journal.exists():
        return not previous_generation_kept(directory)  # both current files gone: rebuild from the previous
    try:
        return (journal_generation(jr.read_file(journal, jr.JOURNAL)) or 0) == 0
    except CorruptionError:
        return True  # the journal's own damage is repaired frame by frame, not here


# What decoding a well-checksummed but malformed file raises from Python and numpy:
# a frame rewritten with a valid CRC (a bug elsewhere, or tampering) reaches the state.
DAMAGE = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, ZeroDivisionError)


@contextlib.contextmanager
def damage_is_corruption(where: Path) -> Iterator[None]:
    """Turn a foreign exception raised while reading the files of ``where`` into
    CorruptionError (its type and text kept in the message and as the cause)."""
    try:
        yield
    except DAMAGE as exc:
        raise CorruptionError(f"{where}: a file holds content this version cannot read, though its checksum "
                              f"matches ({type(exc).__name__}: {str(exc)[:200]}). Run 'reachy-memory verify'",
                              path=str(where), offset=-1) from exc


def backup_target(dest: str | Path, data_dir: Path, *, force: bool = False) -> Path:
    """The file a backup to ``dest`` writes: ``dest`` itself, or a timestamped
    ``memory-<UTC>.rms`` inside it when it is a directory.

    Raises ValidationError (nothing written) for a target inside the data
    directory, a symlink, a missing parent directory, or an existing file that
    is not a backup (unless ``force``), a NUL byte or a name the file system refuses.
    """
    if "\x00" in str(dest):
        raise ValidationError("backup path contains a NUL byte", field="path")
    try:
        return _backup_target(dest, data_dir, force)
    except OSError as exc:  # a name too long, a component that is a file, no permission
        raise ValidationError(f"backup path {str(dest)[:200]!r}: {exc.strerror}", field="path") from exc


def _backup_target(dest: str | Path, data_dir: Path, force: bool) -> Path:
    wants_dir = str(dest).endswith(os.sep)
    dest = Path(dest).expanduser()
    if wants_dir and not dest.is_dir():
        raise ValidationError(f"backup directory {dest} does not exist", field="path")
    if dest.is_symlink():
        raise ValidationError(f"backup target {dest} is a symlink; name the real file", field="path")
    if dest.is_dir():
        dest = dest / time.strftime("memory-%Y%m%dT%H%M%SZ.rms", time.gmtime())
    parent = dest.parent.resolve()
    if not parent.is_dir():
        raise ValidationError(f"backup directory {dest.parent} does not exist", field="path")
    target = parent / dest.name
    home = data_dir.resolve()
    if target == home or home in target.parents:
        raise ValidationError(f"backup target {target} is inside the data directory {home}; "
                              "choose a place outside it", field="path")
    if target.exists() and not force and not is_snapshot(target):
        raise ValidationError(f"{target} exists and is not a reachy-memory backup; "
                              "choose another name (or --force to replace it)", field="path")
    return target


def is_snapshot(path: Path) -> bool:
    """True when ``path`` is a regular file that starts with a snapshot's (or a backup's)
    magic bytes.  Opened without blocking: reading a FIFO named as the target waited
    for a writer forever (the CLI, or the daemon's engine thread)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = fh.read(jr.HEADER_SIZE)
    return head[:5] == jr.MAGIC + jr.SNAPSHOT
