"""Forgetting that reaches the disk: the purge of an open store.

A ``del`` (forget), an expiry sweep (``expire``, ``ttl``), a window cleared or a
person deleted removes text from the state at once; on disk the text stays in
the journal, and in the previous generation, until two compactions have run.
The :class:`Purger` of an open store makes that happen within seconds
(``docs/FORMAT.md``, "Purge"):

1. :meth:`Purger.note` (the store's funnel, under its lock, while the ops are
   applied, at open too when the journal is replayed) collects what went: the
   memory ids forgotten, their texts (in memory only), whether a vector went.
   A purge is then due; removals within ``PURGE_DELAY`` of each other (at most
   ``PURGE_MAX_DELAY`` after the first) are purged together.
2. The purge thread records the forgotten ids (never a text) and "a purge is
   pending" in ``forgotten.rmf`` (atomic, fsynced), then rewrites every set-aside
   file of the data directory (torn tails, damaged copies, the old store of a
   restore: ``*.torn-*``, ``*.damaged-*``, ``*.before-restore-*``, any file the
   store does not own) with each forgotten text's bytes zeroed.
3. It runs background compactions (:meth:`Storage.compact_in_background`, the
   engine pauses only for the freeze and the switch) until the last two
   compactions both froze the state after the last removal and both switched
   journals: then ``snapshot.rms``, ``journal.rmj``, ``snapshot.prev.rms`` and
   ``journal.prev.rmj`` hold nothing the state no longer holds.
4. Under the store lock: the temp files of the data directory are removed, the
   graph cache is removed when a forgotten memory had a vector (it is saved again,
   scrubbed, in idle time or at close); then ``forgotten.rmf`` says no purge is pending.

A crash at any point: the open replays the journal (a removal still in it is
noted again) and reads ``forgotten.rmf`` (a purge pending is resumed), so the purge
finishes after the restart; the compactions are the store's own, crash-safe ones.

Backups: :class:`BackupRegister` (``backups.rmb``) lists the backups this store
wrote, with a 32-bit hash of each memory id they hold; :meth:`Purger.backups_holding`
says which still hold a forgotten memory, and :func:`purge_backup` rewrites one
without them (and without what expired).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from reachy_memory.errors import CorruptionError, ReachyMemoryError, StorageError, ValidationError
from reachy_memory.storage import journal as jr
from reachy_memory.storage.files import (
    GRAPH_FILE,
    JOURNAL_FILE,
    NEXT_JOURNAL_FILE,
    PREV_JOURNAL_FILE,
    PREV_SNAPSHOT_FILE,
    RESTORE_INTENT_FILE,
    SNAPSHOT_FILE,
    is_snapshot,
)

if TYPE_CHECKING:
    from reachy_memory.config import Config
    from reachy_memory.engine.state import Frozen, MemoryState
    from reachy_memory.storage.generations import Storage

log = logging.getLogger(__name__)

FORGOTTEN_FILE = "forgotten.rmf"  # forgotten memory and person ids, and whether a purge is pending
BACKUPS_FILE = "backups.rmb"  # the backups this store wrote, with the hashes of the ids they hold
PURGE_DELAY = 1.0  # seconds after the last removal before a purge starts (a burst costs one purge)
PURGE_MAX_DELAY = 2.0  # ...but never later than this after the first removal of a burst
RETRY_SECONDS = 10.0  # a purge that failed (a full disk) is tried again after this
MIN_TEXT = 4  # bytes: shorter texts are not searched for in set-aside files (they would match anywhere)
_PROBE = 8  # bytes of a text's start searched for in set-aside files, then extended
_MAGIC = b"RMEMP\x01\x00\x00"
_HEAD = struct.Struct("<II")  # payload length, CRC-32 of the payload
# Files of the live store (never rewritten by the side-file pass; the generations are
# purged by compaction).  head.rmh: the journal reach file of later versions (ids only).
_OWNED = frozenset({"LOCK", SNAPSHOT_FILE, JOURNAL_FILE, PREV_SNAPSHOT_FILE, PREV_JOURNAL_FILE, NEXT_JOURNAL_FILE,
                    RESTORE_INTENT_FILE, FORGOTTEN_FILE, BACKUPS_FILE, "head.rmh"})
_GRAPH = re.compile(re.escape(GRAPH_FILE) + r"(\.meta|\.\d+)?")
_TEMP = re.compile(r"\..+\.tmp(-\d+(-\d+)?)?")


# -- what a frame removes ------------------------------------------------------------------


@dataclass
class Removal:
    """What one frame of ops removed from the state: forgotten memory ids (a ``del``),
    every text that left (those of expired memories too), person ids deleted."""

    forgotten: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    persons: list[str] = field(default_factory=list)
    vectors: bool = False  # a memory that went had a vector (the graph cache holds it)
    rows: list[bytes] = field(default_factory=list)  # forgotten vectors as snapshots and graph caches hold them


class Capture:
    """Taken under the store lock before a frame is applied (:func:`capture`);
    :meth:`removal` after it says what went."""

    def __init__(self, state: MemoryState, ops: list[Any]) -> None:
        self.removal = Removal()
        self._before: dict[str, Any] | None = None
        for op in ops:
            if isinstance(op, dict):
                if op.get("op") == "person_delete" and isinstance(op.get("id"), str):
                    self.removal.persons.append(op["id"])
                continue
            kind = op[0] if isinstance(op, list | tuple) and op else None
            if kind == "del" and len(op) == 2 and isinstance(op[1], str):
                rec = state.records.get(op[1])
                if rec is not None:
                    self.removal.forgotten.append(rec.id)
                    self._went(rec)
                    self.removal.rows += _vector_forms(state, rec.slot)
            elif kind in ("expire", "ttl") and self._before is None:
                self._before = dict(state.records)  # refs only: ~1 ms at 100k, once a sweep
            elif kind == "put" and len(op) >= 2 and isinstance(op[1], dict):
                old = state.records.get(str(op[1].get("id")))  # a memory rewritten in place: its old text went
                if old is not None and old.content != op[1].get("content"):
                    self.removal.texts.append(old.content)
            elif kind == "winclr":
                self._cleared = True  # a window cleared: a purge, no id

    _cleared = False

    def _went(self, rec: Any) -> None:
        self.removal.texts.append(rec.content)
        self.removal.vectors = self.removal.vectors or rec.vkey is not None

    def finish(self, state: MemoryState) -> Removal | None:
        """After the frame was applied: what it removed, or None when nothing went."""
        if self._before is not None:
            for memory_id in self._before.keys() - state.records.keys():
                self._went(self._before[memory_id])
            self._before = None
        r = self.removal
        return r if r.forgotten or r.texts or r.persons or self._cleared else None


_REMOVING = frozenset({"del", "expire", "ttl", "put", "winclr"})


def _vector_forms(state: MemoryState, slot: int) -> list[bytes]:
    """A live slot's vector as a snapshot holds it (bf16) and as a graph cache does (float32
    widened from it); none for a slot without one."""
    vectors = state.vectors
    if slot >= len(vectors.alive) or not vectors.alive[slot]:
        return []
    bf16 = vectors.matrix[slot].copy()
    return [bf16.astype("<u2").tobytes(), (bf16.astype(np.uint32) << 16).astype("<u4").tobytes()]


def capture(state: MemoryState, ops: list[Any]) -> Capture | None:
    """A :class:`Capture` when ``ops`` may remove something (a ``del``, a sweep, a
    rewrite, a window cleared, a person deleted), else None (most frames: a glance)."""
    return Capture(state, ops) if any(map(_may_remove, ops, [state] * len(ops))) else None


def _may_remove(op: Any, state: MemoryState) -> bool:
    if isinstance(op, dict):
        return op.get("op") == "person_delete"
    if not (isinstance(op, list | tuple) and op and op[0] in _REMOVING):
        return False
    return op[0] != "put" or (len(op) >= 2 and isinstance(op[1], dict) and op[1].get("id") in state.records)


# -- the registers ---------------------------------------------------------------------------


def _write_register(path: Path, obj: dict[str, Any]) -> None:
    payload = jr.pack(obj)
    jr.write_atomic(path, [_MAGIC, _HEAD.pack(len(payload), zlib.crc32(payload)), payload])


def _read_register(path: Path) -> dict[str, Any] | None:
    """The register's content; None when there is none.  Raises CorruptionError."""
    data = jr.read_if_present(path)
    if data is None:
        return None
    size = len(_MAGIC) + _HEAD.size
    if len(data) < size or data[: len(_MAGIC)] != _MAGIC:
        raise CorruptionError(f"{path}: not a reachy-memory purge register", path=str(path), offset=0)
    length, crc = _HEAD.unpack_from(data, len(_MAGIC))
    payload = data[size : size + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise CorruptionError(f"{path}: damaged (checksum)", path=str(path), offset=size)
    try:
        obj = jr.unpack(payload)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptionError(f"{path}: undecodable", path=str(path), offset=size) from exc
    if not isinstance(obj, dict):
        raise CorruptionError(f"{path}: not a map", path=str(path), offset=size)
    return obj


def _read_or_set_aside(path: Path) -> tuple[dict[str, Any], bool]:
    """(the register, whether it was readable); a damaged one is renamed aside (it holds
    ids only) and logged: the purge then runs again, and backups are checked again."""
    try:
        return _read_register(path) or {}, True
    except CorruptionError as exc:
        log.warning("%s; set aside, a purge runs again", exc)
        with contextlib.suppress(OSError):
            os.replace(path, jr.side_path(path, "damaged"))
        return {}, False


def id_hash(memory_id: str) -> int:
    """The 32-bit hash a backup entry keeps of each id (CRC-32 of its UTF-8 bytes)."""
    return zlib.crc32(memory_id.encode("utf-8", "surrogatepass"))


def _hashes(ids: Iterable[str]) -> np.ndarray:
    return np.unique(np.fromiter(map(id_hash, ids), np.uint32))


class ForgottenRegister:
    """``forgotten.rmf``: every memory and person id forgotten (with when), and whether a
    purge is pending.  Ids only, never a text: what backups made before are checked with."""

    def __init__(self, path: Path) -> None:
        self.path = path / FORGOTTEN_FILE
        obj, readable = _read_or_set_aside(self.path)
        self.memories: dict[str, float] = _id_times(obj.get("memories"))
        self.persons: dict[str, float] = _id_times(obj.get("persons"))
        self.pending = bool(obj.get("pending", False)) or not readable

    def save(self, pending: bool, memories: dict[str, float], persons: dict[str, float]) -> None:
        """Write it with ``memories`` and ``persons`` (copies of its own: another thread adds
        to those meanwhile) (atomic, fsynced).  Raises StorageError."""
        _write_register(self.path, {"version": 1, "pending": pending, "memories": memories, "persons": persons})
        self.pending = pending


def _id_times(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {k: float(v) for k, v in value.items() if isinstance(k, str) and isinstance(v, int | float)}


@dataclass
class BackupEntry:
    """A backup this store wrote, as it was written (a file changed since is not it)."""

    path: str
    made: float
    ino: int
    size: int
    mtime_ns: int
    ids: np.ndarray  # sorted uint32 hashes of its memory ids
    persons: np.ndarray  # sorted uint32 hashes of its person ids
    next_expiry: float  # the earliest expiry of a memory in it (inf: none expires)

    def current(self) -> bool:
        """Whether the file is still the one written (not deleted, rotated or replaced)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return False
        return (info.st_ino, info.st_size, info.st_mtime_ns) == (self.ino, self.size, self.mtime_ns)

    def holds(self, hashes: np.ndarray, of: np.ndarray) -> int:
        """How many of ``hashes`` are in ``of`` (this entry's ids or persons)."""
        return int(np.count_nonzero(np.isin(hashes, of, assume_unique=False))) if len(hashes) else 0

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "made": self.made, "ino": self.ino, "size": self.size, "mtime_ns": self.mtime_ns,
                "ids": self.ids.astype("<u4").tobytes(), "persons": self.persons.astype("<u4").tobytes(),
                "next_expiry": None if math.isinf(self.next_expiry) else self.next_expiry}


def _entry(obj: Any) -> BackupEntry | None:
    try:
        expiry = obj.get("next_expiry")
        return BackupEntry(str(obj["path"]), float(obj["made"]), int(obj["ino"]), int(obj["size"]),
                           int(obj["mtime_ns"]), np.frombuffer(obj["ids"], "<u4").astype(np.uint32),
                           np.frombuffer(obj.get("persons", b""), "<u4").astype(np.uint32),
                           math.inf if expiry is None else float(expiry))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def entry_for(target: Path, made: float, ids: Iterable[str], persons: Iterable[str],
              next_expiry: float) -> BackupEntry:
    """The register entry of the backup file ``target`` just written.  Raises OSError."""
    info = os.stat(target)
    return BackupEntry(str(target), made, info.st_ino, info.st_size, info.st_mtime_ns, _hashes(ids),
                       _hashes(persons), next_expiry)


class BackupRegister:
    """``backups.rmb``: the backups this store wrote that are still as written."""

    def __init__(self, path: Path) -> None:
        self.path = path / BACKUPS_FILE
        obj, _ = _read_or_set_aside(self.path)
        listed: list[Any] = obj["backups"] if isinstance(obj.get("backups"), list) else []
        self.entries: dict[str, BackupEntry] = {e.path: e for e in map(_entry, listed) if e is not None}

    def current(self) -> list[BackupEntry]:
        """The entries whose files are still as written (the others are dropped)."""
        self.entries = {p: e for p, e in self.entries.items() if e.current()}
        return sorted(self.entries.values(), key=lambda e: e.made)

    def put(self, entry: BackupEntry) -> None:
        """Add (or replace) an entry and save the register.  Raises StorageError."""
        self.entries[entry.path] = entry
        self.current()
        _write_register(self.path, {"version": 1, "backups": [e.to_wire() for e in self.entries.values()]})


# -- set-aside files and temp files ----------------------------------------------------------


def side_files(directory: Path) -> list[Path]:
    """Every regular file under ``directory`` the store does not keep in use: torn tails,
    damaged copies, the old store of a restore, anything else put there (graph caches,
    temp files and the live generations excluded: they are purged otherwise)."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        top = Path(root) == directory
        for name in names:
            path = Path(root) / name
            if top and (name in _OWNED or _GRAPH.fullmatch(name) or _TEMP.fullmatch(name)):
                continue
            if not path.is_symlink() and path.is_file():
                found.append(path)
    return found


def temp_files(directory: Path) -> list[Path]:
    """The temp files of unfinished writes in ``directory`` (``.<name>.tmp[-pid[-thread]]``)."""
    with contextlib.suppress(OSError):
        return [p for p in directory.iterdir() if _TEMP.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    return []


def text_spans(data: bytes | memoryview, texts: Iterable[str]) -> list[tuple[int, int]]:
    """The byte ranges of ``data`` that hold one of ``texts`` (UTF-8), whole or a prefix of
    at least ``_PROBE`` bytes (a previous turn's copy, a write cut short), or at its very end
    a prefix of at least ``MIN_TEXT`` bytes (a torn tail).  Texts under ``MIN_TEXT`` bytes
    are not searched for."""
    encoded = [b for b in {t.encode("utf-8", "surrogatepass") for t in texts} if len(b) >= MIN_TEXT]
    if not encoded or not len(data):
        return []
    blob = bytes(data)
    spans = _probe_spans(blob, [b for b in encoded if len(b) >= _PROBE])
    for b in (b for b in encoded if len(b) < _PROBE):
        at = blob.find(b)
        while at != -1:
            spans.append((at, at + len(b)))
            at = blob.find(b, at + 1)
    for b in encoded:  # a text cut short by the end of the file, under _PROBE bytes of it left
        for k in range(min(len(b), _PROBE) - 1, MIN_TEXT - 1, -1):
            if blob.endswith(b[:k]):
                spans.append((len(blob) - k, len(blob)))
                break
    return spans


def _probe_spans(blob: bytes, texts: list[bytes]) -> list[tuple[int, int]]:
    """Spans of ``texts`` (each at least ``_PROBE`` bytes) in ``blob``: every offset whose
    next 8 bytes start a text is found with numpy (8 aligned passes over the file), then
    the match is extended as far as it goes."""
    if not texts or len(blob) < _PROBE:
        return []
    starts: dict[int, list[bytes]] = {}
    for b in texts:
        starts.setdefault(int.from_bytes(b[:_PROBE], "little"), []).append(b)
    probes = np.fromiter(starts, np.uint64, len(starts))
    spans = []
    for align in range(_PROBE):
        usable = (len(blob) - align) // _PROBE * _PROBE
        words = np.frombuffer(blob, "<u8", usable // _PROBE, align)
        for index in np.flatnonzero(np.isin(words, probes)).tolist():
            at = align + index * _PROBE
            for b in starts[int(words[index])]:
                spans.append((at, at + _common_prefix(blob, at, b)))
    return spans


def _common_prefix(blob: bytes, at: int, text: bytes) -> int:
    """How many bytes of ``text`` ``blob`` holds from ``at`` on (at least ``_PROBE``)."""
    n = min(len(text), len(blob) - at)
    if blob[at : at + n] == text[:n]:
        return n
    lo, hi = _PROBE, n  # blob[at:at+lo] matches, blob[at:at+hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if blob[at : at + mid] == text[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Traces:
    """What a set-aside file may hold of removed memories: their texts, their vectors
    (bf16 and widened float32 rows), and the ids whose journaled vectors (float32, as the
    model gave them) are found by reading the file's frames."""

    texts: set[str] = field(default_factory=set)
    rows: set[bytes] = field(default_factory=set)
    ids: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.texts or self.rows or self.ids)

    def __sub__(self, other: Traces) -> Traces:
        return Traces(self.texts - other.texts, self.rows - other.rows, self.ids - other.ids)

    def update(self, other: Traces) -> None:
        self.texts |= other.texts
        self.rows |= other.rows
        self.ids |= other.ids


def journal_vectors(path: Path, data: memoryview, ids: set[str]) -> list[bytes]:
    """The vectors that the valid frames of the journal-format file ``data`` ``put`` for
    ``ids`` (float32, as the model gave them: a set-aside journal, a damaged copy); none
    for another kind of file."""
    if not ids or bytes(data[: len(jr.MAGIC) + 1]) != jr.MAGIC + jr.JOURNAL:
        return []
    try:
        found = jr.scan(path, data, jr.JOURNAL)
    except ReachyMemoryError:
        return []
    vectors = []
    for _, payload in found.frames:
        try:
            ops = jr.unpack(payload)
        except Exception:  # damage that kept its checksum: not ours to read
            continue
        for op in ops if isinstance(ops, list) else ():
            if isinstance(op, list) and len(op) == 3 and op[0] == "put" and isinstance(op[1], dict) \
                    and op[1].get("id") in ids and isinstance(op[2], bytes) and op[2]:
                vectors.append(op[2])
    return vectors


def redact(path: Path, traces: Traces) -> int:
    """Rewrite ``path`` (atomically, fsynced, same name) with every trace of removed memories
    in it zeroed (:func:`text_spans`, their vector rows, their journaled vectors); returns
    the bytes zeroed (0: the file is left as it was).  The frames holding them no longer
    pass their checksums (``verify`` reports them as damage): such a file holds nothing
    acknowledged that the store does not hold.  Raises StorageError."""
    data = jr.read_bytes(path)
    spans = text_spans(data, traces.texts)
    needles = {*traces.rows, *journal_vectors(path, data, traces.ids)}
    blob = bytes(data) if needles else b""
    for needle in needles:
        at = blob.find(needle)
        while at != -1:
            spans.append((at, at + len(needle)))
            at = blob.find(needle, at + 1)
    if not spans:
        return 0
    out = bytearray(data)
    zeroed = 0
    for start, end in spans:
        zeroed += end - start
        out[start:end] = bytes(end - start)
    jr.write_atomic(path, [bytes(out)])
    return zeroed


# -- the purge of an open store ---------------------------------------------------------------


class _Stopped(Exception):
    """The store is closing: the purge thread stops (close finishes the purge)."""


@dataclass
class _Batch:
    """The removals not yet purged from disk."""

    traces: Traces = field(default_factory=Traces)
    redacted: Traces = field(default_factory=Traces)  # already zeroed in set-aside files
    forgotten: int = 0  # memory ids forgotten in this batch (recorded in the register)
    vectors: bool = False
    after: int = -1  # compactions begun before its last removal (-1: none yet: nothing pending)
    first: float = 0.0  # monotonic time of its first and last removal
    last: float = 0.0
    version: int = 0  # bumped by every removal noted
    recorded: int = -1  # the version last recorded in the register

    @property
    def due(self) -> bool:
        return self.after >= 0


class Purger:
    """The purge of one open store (:class:`Storage`); see the module docstring.

    Threads: :meth:`note`, :meth:`before_compaction` and :meth:`compacted` run under the
    store lock (the engine thread, a compaction); the purge thread runs the purge,
    taking the store lock only to start a compaction and for the last step; the
    registers have a lock of their own (a backup thread registers its backup)."""

    def __init__(self, storage: Storage) -> None:
        self.storage, self.path = storage, storage.path
        self._cond = threading.Condition(threading.Lock())
        self._registers = threading.RLock()
        self.forgotten = ForgottenRegister(self.path)
        self.backups = BackupRegister(self.path)
        self._batch = _Batch()
        if self.forgotten.pending:  # a purge cut short by a crash: resumed once the store is open
            self._mark(self._batch, 0)
        self._begun = 0  # compactions begun (under the store lock)
        self._streak: list[int] = []  # numbers of the last compactions that switched, none failed since
        self._last_result: tuple[int, bool] | None = None
        self._ready = False
        self._stopping = False
        self._halted = False  # the store refuses writes: no purge until it is reopened
        self._thread: threading.Thread | None = None
        self.purges = 0
        self.last: dict[str, Any] | None = None

    # -- hooks of the store (under its lock) -------------------------------------------------------

    def note(self, removal: Removal) -> None:
        """The funnel applied a frame that removed ``removal`` (live, or replayed at open)."""
        now = time.time()
        with self._cond:
            for memory_id in removal.forgotten:
                self.forgotten.memories[memory_id] = now
            for person_id in removal.persons:
                self.forgotten.persons[person_id] = now
            batch = self._batch
            batch.traces.update(Traces(set(removal.texts), set(removal.rows), set(removal.forgotten)))
            batch.forgotten += len(removal.forgotten)
            batch.vectors = batch.vectors or removal.vectors
            self._mark(batch, self._begun)
            self._wake()

    def _mark(self, batch: _Batch, begun: int) -> None:
        now = time.monotonic()
        if not batch.due:
            batch.first = now
        batch.after, batch.last, batch.version = max(batch.after, begun), now, batch.version + 1

    def before_compaction(self) -> int:
        """A compaction begins (under the store lock): removals not yet recorded are (their
        ``del`` ops leave the journal with it); returns the compaction's number."""
        with self._cond:
            unrecorded = self._batch.due and self._batch.recorded != self._batch.version
        if unrecorded:
            self._record()
        self._begun += 1
        return self._begun

    def compacted(self, number: int, switched: bool) -> None:
        """Compaction ``number`` ended: its journals switched, or it failed."""
        with self._cond:
            self._streak = [*self._streak[-1:], number] if switched else []
            self._last_result = (number, switched)
            self._cond.notify_all()

    def opened(self) -> None:
        """The store is open: a purge due (a crash cut one short, or the replay removed
        something) starts now."""
        with self._cond:
            self._ready = True
            self._wake()

    # -- the purge thread --------------------------------------------------------------------------

    def _wake(self) -> None:
        """(Under ``_cond``.)  Start the purge thread, or wake it."""
        if not self._ready or self._stopping or self._halted or not self._batch.due:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="reachy-memory-purge", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _run(self) -> None:
        try:
            while self._wait_until_due():
                try:
                    self._purge()
                except _Stopped:
                    return
                except ReachyMemoryError as exc:
                    if self.storage.failure is not None:  # read-only until reopened: the next open resumes it
                        log.warning("purge stopped, the store refuses writes (the next open purges): %s", exc)
                        self._halted = True
                        return
                    log.warning("purge failed (tried again in %.0f s): %s", RETRY_SECONDS, exc)
                    self._pause(RETRY_SECONDS)
                except Exception:  # a bug must not end the thread silently
                    log.exception("purge failed unexpectedly (tried again in %.0f s)", RETRY_SECONDS)
                    self._pause(RETRY_SECONDS)
        finally:
            with self._cond:
                self._thread = None
                self._wake()  # a removal noted while it was stopping for lack of work

    def _wait_until_due(self) -> bool:
        """Wait for a batch whose coalescing window passed; False once stopping or idle."""
        with self._cond:
            while not self._stopping:
                batch = self._batch
                if not batch.due:
                    return False  # the thread ends; the next removal starts another
                wake = min(batch.last + PURGE_DELAY, batch.first + PURGE_MAX_DELAY)
                left = wake - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
            return False

    def _pause(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._stopping, seconds)

    def _purge(self, *, closing: bool = False) -> None:
        """Purge the batch pending until nothing is: record, set-aside files, compactions,
        the last step.  ``closing``: on the closing thread, with synchronous compactions."""
        started, compactions, sides = time.monotonic(), 0, 0
        while True:
            with self._cond:
                batch = self._batch
                version, after, traces = batch.version, batch.after, batch.traces - batch.redacted
            if not batch.due:
                return
            if batch.recorded != version:
                self._record()
            if traces:
                sides += self._redact_side_files(traces)
                with self._cond:
                    batch.redacted.update(traces)
            if not self._clean_after(after):
                self._compact(closing=closing)
                compactions += 1
                continue
            self._last_step(batch, closing=closing)
            with self._cond:
                if batch.version != version:
                    continue  # removed meanwhile: the same batch goes on
                self._batch = _Batch()
                self.purges += 1
                self.last = {"at": time.time(), "seconds": round(time.monotonic() - started, 3),
                             "compactions": compactions, "files_rewritten": sides}
            self._record()
            log.info("purge: %d forgotten, every copy gone from %s in %.2f s (%d compactions)",
                     batch.forgotten, self.path, time.monotonic() - started, compactions)
            return

    def _record(self) -> None:
        """Save the register with what is pending now (ids only).  Raises StorageError."""
        with self._registers:
            with self._cond:
                batch = self._batch
                version, pending = batch.version, batch.due
                memories, persons = dict(self.forgotten.memories), dict(self.forgotten.persons)
            self.forgotten.save(pending, memories, persons)
            with self._cond:
                batch.recorded = version

    def _redact_side_files(self, traces: Traces) -> int:
        """Zero ``traces`` in every set-aside file; returns how many files were rewritten."""
        rewritten = 0
        for path in side_files(self.path):
            try:
                if redact(path, traces):
                    rewritten += 1
                    log.warning("purge: forgotten text zeroed in %s", path)
            except FileNotFoundError:
                continue
        return rewritten

    def _clean_after(self, after: int) -> bool:
        """Whether the last two compactions began after compaction ``after`` and switched."""
        with self._cond:
            return len(self._streak) == 2 and self._streak[0] > after

    def _compact(self, *, closing: bool) -> None:
        """One compaction that begins now (after one in flight ends); raises StorageError
        when it fails (the store's journal keeps every change: tried again later)."""
        st = self.storage
        if closing:
            st.compact()
            return
        st.wait()
        with st.lock:
            if st.closing or st.closed:
                raise _Stopped
            if st.compacting is None:
                before = self._begun
                st.compact_in_background()
                if self._begun == before:  # it could not begin (logged): a full disk, a read-only store
                    raise StorageError("a purge's compaction could not begin", path=str(self.path))
        st.wait()
        with self._cond:
            result = self._last_result
        if result is not None and not result[1]:
            raise StorageError("a purge's compaction did not switch journals", path=str(self.path))

    def _last_step(self, batch: _Batch, *, closing: bool) -> None:
        """Under the store lock, no compaction running: remove the temp files of writes
        that never finished, and the graph cache when a forgotten memory had a vector."""
        st = self.storage
        with st.lock:
            if not closing and (st.closing or st.closed):
                raise _Stopped
            if st.compacting is not None:
                return  # another compaction began: the next round (clean_after) waits for it
            with self._registers:
                for tmp in temp_files(self.path):
                    with contextlib.suppress(FileNotFoundError):
                        tmp.unlink()
            if batch.vectors:
                from reachy_memory.engine.vector_index import forget_cache  # late: the engine imports storage

                forget_cache(st.state.vectors, self.path / GRAPH_FILE)

    # -- closing -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the purge thread (closing begins) and wait for it."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def finish(self) -> None:
        """On close (quiesced, under the lock): finish a pending purge with synchronous
        compactions.  Raises ReachyMemoryError (the register keeps it pending: the next
        open resumes it)."""
        self._purge(closing=True)

    # -- backups -----------------------------------------------------------------------------------

    def backup_written(self, target: Path, frozen: Frozen, made: float) -> None:
        """A backup of ``frozen`` was written to ``target``: register it (a failure is logged)."""
        try:
            expiry = float(np.min(frozen.expires, initial=math.inf))
            persons = [op["id"] for op in frozen.people if op.get("op") == "person_put" and "id" in op]
            entry = entry_for(target, made, (r.id for r in frozen.records), persons, expiry)
            with self._registers:
                self.backups.put(entry)
        except (OSError, ReachyMemoryError) as exc:
            log.warning("backup %s written but not registered (forget cannot name it): %s", target, exc)

    def backups_holding(self, ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The backups this store wrote that still hold a forgotten memory (of ``ids``, or
        any), a forgotten person or an expired memory: path, when made, how many."""
        with self._cond:
            memories, forgotten_persons = dict(self.forgotten.memories), list(self.forgotten.persons)
        with self._registers:
            wanted = memories if ids is None else [i for i in ids if i in memories]
            hashes, persons = _hashes(wanted), _hashes(forgotten_persons if ids is None else ())
            now, out = time.time(), []
            for entry in self.backups.current():
                held, people = entry.holds(hashes, entry.ids), entry.holds(persons, entry.persons)
                expired = ids is None and entry.next_expiry <= now
                if held or people or expired:
                    out.append({"path": entry.path, "made": entry.made, "forgotten": held,
                                "persons": people, "expired": expired})
            return out

    def purge_backups(self, paths: Iterable[str | Path] | None = None) -> list[dict[str, Any]]:
        """Rewrite the backups this store wrote, and ``paths`` (backup files, or directories of
        timestamped backups), without the memories and persons forgotten and what expired;
        returns one ``{"path", "removed", "persons", "bytes"}`` per backup (``bytes`` 0:
        it held none).  Any thread (the daemon's background thread): the store lock is not
        taken.  Raises ValidationError for a path inside the data directory or that is no
        backup, StorageError when one cannot be written (those before it are done)."""
        targets = self._backup_targets(paths)
        with self._cond:
            forgotten, persons = list(self.forgotten.memories), list(self.forgotten.persons)
        done = []
        for target in targets:
            with self._registers:
                known = self.backups.entries.get(str(target))
            made = known.made if known is not None else time.time()
            result, kept = purge_backup(target, self.storage.config, forgotten, persons)
            try:
                entry = entry_for(target, made, kept.ids, kept.persons, kept.next_expiry)
                with self._registers:
                    self.backups.put(entry)
            except (OSError, ReachyMemoryError) as exc:
                log.warning("backup %s purged but not registered: %s", target, exc)
            if result["bytes"]:
                log.warning("purged %d forgotten or expired memories and %d persons from the backup %s",
                            result["removed"], result["persons"], target)
            done.append(result)
        return done

    def _backup_targets(self, paths: Iterable[str | Path] | None) -> list[Path]:
        """The registered backups still as written, and the backups ``paths`` name."""
        from reachy_memory.storage.backup import _backups_in as backups_in  # late: backup imports the engine

        with self._registers:
            found = [Path(e.path) for e in self.backups.current()]
        home = self.path.resolve()
        for given in paths or ():
            path = Path(given).expanduser().resolve()
            if path == home or home in path.parents:
                raise ValidationError(f"{path} is inside the data directory {home}", field="paths")
            listed = backups_in(path) if path.is_dir() else [path]
            if not path.is_dir() and not is_snapshot(path):
                raise ValidationError(f"{path} is not a reachy-memory backup", field="paths")
            found += [p.resolve() for p in listed]
        return list(dict.fromkeys(found))

    def status(self) -> dict[str, Any]:
        """For stats: a purge pending, purges done, the last one, ids recorded."""
        with self._cond:
            pending = self._batch.due
        return {"pending": pending, "purges": self.purges, "last": self.last,
                "forgotten_ids": len(self.forgotten.memories)}


# -- purging a backup ----------------------------------------------------------------------------


def _forget_person_ops(state: MemoryState, config: Config, person_id: str, at: float) -> list[Any]:
    """The ops that forget a person in a backup's state as ``forget_person`` does in the store
    (``engine/household.py``): their memories and turns deleted, their names removed from
    the others' (rewritten without a vector: a restored store embeds them in idle time)."""
    from reachy_memory.engine.household import plan_forget, sort_records
    from reachy_memory.engine.records import encode

    person = state.people.get(person_id)
    assert person is not None  # (a person the state lists as forgotten-about is one it knows)
    merged = [old for old, kept in state.people.redirects().items() if kept == person_id]
    found = sort_records(person, merged, list(state.records.values()), state.people.people(None),
                         config.search.entity_fields)
    plan = plan_forget(found, state.records, state.window_view, [])
    ops: list[Any] = [["del", rec.id] for rec in plan.deleted]
    ops += [["put", encode(rec.replace(vkey=None)), None] for rec in plan.rewritten]
    ops.append({"op": "person_delete", "id": person_id, "at": at})
    if plan.window is not None:
        ops += [["winclr"], *(["win", role, text, when] for role, text, when in plan.window)]
    return ops


@dataclass
class Kept:
    """What a backup holds after :func:`purge_backup` (for its register entry)."""

    ids: list[str]
    persons: list[str]
    next_expiry: float


def purge_backup(path: Path, config: Config, forgotten: Iterable[str], persons: Iterable[str],
                 now: float | None = None) -> tuple[dict[str, Any], Kept]:
    """Rewrite the backup file ``path`` (atomically, fsynced) without the memories
    ``forgotten``, the persons ``persons`` (their memories unlinked from them), and every
    memory expired at ``now``; returns ``{"path", "removed", "persons", "bytes"}``
    (``bytes`` 0: nothing to remove, the file is left as it was) and what it keeps.
    Raises CorruptionError / FormatVersionError for a file that is no backup,
    StorageError when it cannot be written."""
    from reachy_memory.engine.records import RECORD_VERSION  # late: the engine imports storage
    from reachy_memory.engine.state import MemoryState, snapshot_sections
    from reachy_memory.storage.files import damage_is_corruption, read_snapshot

    at = time.time() if now is None else now
    with damage_is_corruption(path):
        snap = read_snapshot(path)
        model = snap.get("model")
        state = MemoryState(config, int(snap.get("dim") or 384), model, model)
        state.load(snap)
        before, people_before = len(state.records), len(state.people)
        state.apply_all([*(["del", i] for i in forgotten if i in state.records), ["expire", at]])
        for person_id in (p for p in persons if state.people.is_live(p)):
            state.apply_all(_forget_person_ops(state, config, person_id, at))
    removed, gone = before - len(state.records), people_before - len(state.people)
    expiries = [r.expires for r in state.records.values() if r.expires is not None]
    kept = Kept(list(state.records), [p.id for p in state.people.people()], min(expiries, default=math.inf))
    if not removed and not gone:
        return {"path": str(path), "removed": 0, "persons": 0, "bytes": 0}, kept
    # read_snapshot's "records" are the rows, not the head's record format: the state writes its own
    kept_keys = ("kind", "generation", "model", "dim", "created", "follows")
    head: dict[str, Any] = {k: snap[k] for k in kept_keys if k in snap}
    head["records"] = RECORD_VERSION
    frozen = state.freeze(with_lexical=True)
    size = jr.write_snapshot(path, snapshot_sections(frozen, head | {"purged": at}, frozen.lexical or {}))
    return {"path": str(path), "removed": removed, "persons": gone, "bytes": size}, kept
