"""Durable msgpack files: checksummed frames, an append-only journal, atomic
snapshots and the data directory lock.  ``docs/FORMAT.md`` is the contract.

File layout (all integers little-endian)::

    header    b"RMEM" kind:u8 version:u8 0x00 0x00     kind: b"J" journal, b"S" snapshot
    frame v2  b"\xa7RMF" length:u32 crc32(payload):u32 crc32(first 12 bytes):u32 payload
    frame v1  length:u32 crc32(payload):u32 payload      (read only; written into v1 journals)

Snapshot files are written at version 3: v2 frames, and a bf16 vector block
(``docs/FORMAT.md``).  The version moved so that a reachy-memory reading only
1 and 2 refuses such a file instead of reading bf16 rows as float32.

Recovery rules, shared by every reader (:func:`scan`):

* a frame is valid when its header checksum (v2), its length bound
  (``MAX_FRAME``, inside the file) and its payload checksum all hold;
* unusable bytes with **no valid frame after them** are a torn tail: a write
  cut short by a crash.  The journal copies them to a side file
  (``journal.rmj.torn-<epoch>``) before cutting them away on open;
* unusable bytes **followed by a valid frame** are damage, wherever they are:
  :func:`read_file` raises :class:`CorruptionError` (open refuses, nothing is
  changed on disk) and :func:`repair_file` keeps every valid frame, before and
  after the damage, moving the original aside (``<name>.damaged-<epoch>``).

Writes: :meth:`Journal.append` writes the whole frame or rolls the file back
to the last frame boundary (:class:`StorageFullError` on ENOSPC); a failed
fsync makes the journal refuse every later write (:class:`ReadOnlyError`)
until it is reopened, because the kernel may have dropped the dirty pages.
System calls go through :data:`_os`, the seam the fault-injection tests use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import msgpack

from reachy_memory._threads import big_buffer
from reachy_memory.errors import (
    CorruptionError,
    FormatVersionError,
    ReadOnlyError,
    StorageError,
    StorageFullError,
    StoreLockedError,
    TooLargeError,
    ValidationError,
)

log = logging.getLogger(__name__)

MAGIC = b"RMEM"
VERSION = 2  # journals (and every frame) are written at 2
SNAPSHOT_VERSION = 3  # snapshot files: v2 frames, bf16 vectors (see the module doc)
READABLE_VERSIONS = (1, 2, 3)
JOURNAL = b"J"
SNAPSHOT = b"S"
HEADER_SIZE = 8
FRAME_MARK = b"\xa7RMF"
_V1 = struct.Struct("<II")
_V2 = struct.Struct("<4sIII")
_V2_HEAD = struct.Struct("<4sII")
MAX_FRAME = (1 << 31) - 1  # a frame's payload; the vector block of a very large snapshot stays below
FRAME_OVERHEAD = {1: _V1.size, 2: _V2.size, 3: _V2.size}  # a file's version -> its frames' header size

FsyncPolicy = Literal["always", "batch", "never"]

# The system calls behind every journal write: tests replace these to inject
# short writes, ENOSPC and fsync failures (the "syscall seam").
_os = SimpleNamespace(write=os.write, fdatasync=os.fdatasync, ftruncate=os.ftruncate, fsync=os.fsync)


def header(kind: bytes, version: int = VERSION) -> bytes:
    """The 8-byte file header for ``kind``."""
    return MAGIC + kind + bytes([version, 0, 0])


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` (bin type for bytes, no pickle-like extensions).
    Raises ValidationError for text that is not valid Unicode (a lone surrogate):
    the last check before anything is written, whatever field it came in."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except UnicodeEncodeError as exc:
        raise ValidationError("a text to store is not valid Unicode (a lone surrogate); this write was not stored",
                              field="text") from exc


def unpack(data: bytes | memoryview) -> Any:
    """Decode msgpack; raises ValueError-family errors on bad data."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def frame_header(length: int, crc: int, version: int = VERSION) -> bytes:
    """The header of a frame whose payload has ``length`` bytes and CRC32 ``crc``."""
    if version == 1:
        return _V1.pack(length, crc)
    head = _V2_HEAD.pack(FRAME_MARK, length, crc)
    return head + struct.pack("<I", zlib.crc32(head))


def encode_frame(obj: Any, version: int = VERSION) -> bytes:
    """One frame: header (length and checksums) and the msgpack payload.

    Raises TooLargeError when the payload would exceed ``MAX_FRAME``.
    """
    return _payload_frame(pack(obj), version)


def _payload_frame(payload: bytes, version: int = VERSION) -> bytes:
    return _payload_header(payload, version) + payload


def _payload_header(payload: bytes | memoryview, version: int = VERSION) -> bytes:
    """The frame header of ``payload``; raises TooLargeError past :data:`MAX_FRAME`."""
    if len(payload) > MAX_FRAME:
        raise TooLargeError(f"a frame of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit",
                            field="frame", size=len(payload), limit=MAX_FRAME)
    return frame_header(len(payload), zlib.crc32(payload), version)


def pack_gently(obj: Any) -> memoryview:
    """msgpack-encode ``obj`` like :func:`pack`, piece by piece inside big containers.

    One ``packb`` of a 100k-record list holds the GIL for tens of milliseconds;
    packing item by item lets a snapshot be written by a background thread
    while the engine thread keeps serving (the interpreter can switch threads
    between items).  The pieces go straight into one buffer (no list of
    small bytes objects, no joined copy), and a :class:`Stream` is packed as it
    is produced: a compaction's transient objects were interleaved with the
    engine's long-lived ones, and the heap they fragmented stayed resident.
    The bytes decode to the same value.
    """
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    _pack_into(obj, packer, 0)
    return packer.getbuffer()


class Stream:
    """A list for :func:`pack_gently` whose ``length`` items are produced while it
    is packed (each is garbage once packed)."""

    def __init__(self, length: int, items: Iterable[Any]) -> None:
        self.length, self.items = length, items


def _pack_into(obj: Any, packer: msgpack.Packer, depth: int) -> None:
    if isinstance(obj, Stream):
        packer.pack_array_header(obj.length)
        packed = 0
        for value in obj.items:
            _pack_into(value, packer, depth + 1)
            packed += 1
        if packed != obj.length:
            raise ValueError(f"a stream of {obj.length} items produced {packed}")
        return
    big = depth < 2 or len(obj) > 64 if isinstance(obj, dict | list | tuple) else False
    if not big:
        packer.pack(obj)
    elif isinstance(obj, dict):
        packer.pack_map_header(len(obj))
        for key, value in obj.items():
            packer.pack(key)
            _pack_into(value, packer, depth + 1)
    else:
        packer.pack_array_header(len(obj))
        for value in obj:
            _pack_into(value, packer, depth + 1)


class Packed:
    """A frame whose msgpack payload is already encoded (see :func:`pack_gently`)."""

    def __init__(self, payload: bytes | memoryview) -> None:
        self.payload = payload


def frames_from(path: Path, offset: int, version: int, end: int | None = None) -> list[Any]:
    """The decoded frames of ``path`` from byte ``offset`` to ``end`` (frame boundaries;
    default the end of the file).

    Used to carry the ops appended during a background compaction into the
    next journal.  Raises CorruptionError when a frame there is not valid.
    """
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = memoryview(handle.read(-1 if end is None else end - offset))
    except OSError as exc:
        raise storage_error(f"cannot read {path}", path, exc) from exc
    frames, at = [], 0
    while at < len(data):
        payload = _frame_at(data, at, version)
        if payload is None:
            raise CorruptionError(f"{path}: no valid frame at offset {offset + at}", path=str(path),
                                  offset=offset + at)
        frames.append(_decode(path, offset + at, payload))
        at += FRAME_OVERHEAD[version] + len(payload)
    return frames


ALIGN = 64


RAW_PIECE = 4 << 20  # bytes of a RawBin's data written at a time


class RawBin:
    """A large binary frame written without copying, its data 64-byte aligned
    in the file so it can be used in place.  On disk it is the msgpack array
    ``[pad: bin8, data: bin32]``."""

    def __init__(self, data: memoryview | bytes) -> None:
        self.data = memoryview(data)

    def chunks(self, offset: int) -> list[bytes | memoryview]:
        """The frame's bytes when it starts at file ``offset`` (always a v2 frame), the
        data in ``RAW_PIECE`` views: a backup's progress moves, and a daemon stopping can
        abandon it, while its vector block (77 MB at 100k memories) is written."""
        fixed = _V2.size + 1 + 2 + 5  # frame header, array, bin8 header, bin32 header
        pad = -(offset + fixed) % ALIGN
        head = b"\x92\xc4" + bytes([pad]) + bytes(pad) + b"\xc6" + struct.pack(">I", len(self.data))
        crc = zlib.crc32(self.data, zlib.crc32(head))
        pieces = [self.data[i : i + RAW_PIECE] for i in range(0, len(self.data), RAW_PIECE)]
        return [frame_header(len(head) + len(self.data), crc) + head, *pieces]


def raw_bin(payload: memoryview) -> memoryview:
    """The data of a frame written by :class:`RawBin` (a view, no copy)."""
    if len(payload) < 8 or payload[0] != 0x92 or payload[1] != 0xC4:
        raise ValueError("not a raw binary frame")
    start = 3 + payload[2]
    if payload[start] != 0xC6:
        raise ValueError("not a raw binary frame")
    (length,) = struct.unpack_from(">I", payload, start + 1)
    return payload[start + 5 : start + 5 + length]


@dataclass
class Scan:
    """Every valid frame of a file and every unusable byte range in it.

    ``damaged`` lists ``(start, end)`` ranges that are followed by a valid
    frame (real damage); ``torn_at`` is where a torn tail starts (unusable bytes
    that reach the end of the file with no valid frame after them).
    """

    version: int
    size: int
    frames: list[tuple[int, memoryview]] = field(default_factory=list)
    damaged: list[tuple[int, int]] = field(default_factory=list)
    torn_at: int | None = None


@dataclass
class ReadResult:
    """What a file held: the decoded frames and where a torn tail began."""

    frames: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    end: int = HEADER_SIZE  # offset just past the last good frame
    torn_at: int | None = None
    version: int = VERSION


def read_file(path: Path, kind: bytes, raw: frozenset[int] = frozenset()) -> ReadResult:
    """Read and check every frame of ``path``.

    Frames whose index is in ``raw`` are returned undecoded, as writable views
    into one buffer (so a large vector block is never copied).
    Raises :class:`FormatVersionError` for a foreign header and
    :class:`CorruptionError` for damage that is not a torn tail.
    """
    data = read_bytes(path)
    found = scan(path, data, kind)
    if found.damaged:
        start, end = found.damaged[0]
        raise CorruptionError(
            f"{path}: damaged bytes {start}..{end} with valid frames after them; nothing was changed. "
            "Run 'reachy-memory verify' to see what is affected and 'reachy-memory verify --repair' "
            "to keep every valid frame", path=str(path), offset=start, end=end,
        )
    result = ReadResult(torn_at=found.torn_at, version=found.version)
    for offset, payload in found.frames:
        index = len(result.frames)
        result.frames.append(payload if index in raw else _decode(path, offset, payload))
        result.offsets.append(offset)
        result.end = offset + FRAME_OVERHEAD[found.version] + len(payload)
    return result


def read_bytes(path: Path) -> memoryview:
    """The whole file in one writable buffer, page-aligned (so data frames stay
    aligned as in the file), in a :func:`big_buffer`: a reader done with a large
    part of it gives that part back with :func:`release_pages`."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            buf = memoryview(big_buffer(size))[:size]
            fh.readinto(buf)
        return buf
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror}", path=str(path)) from exc


def _check_header(path: Path, data: memoryview, kind: bytes) -> int:
    """The file's format version; FormatVersionError for a foreign or future file."""
    if len(data) < HEADER_SIZE or data[:4] != MAGIC or data[4:5] != kind:
        raise FormatVersionError(
            f"{path} is not a reachy-memory {'journal' if kind == JOURNAL else 'snapshot'} file",
            path=str(path), found=bytes(data[:6]), expected=header(kind)[:6],
        )
    if data[5] not in READABLE_VERSIONS:
        raise FormatVersionError(
            f"{path} has format version {data[5]}; this reachy-memory reads versions {READABLE_VERSIONS}",
            path=str(path), found=data[5], expected=VERSION,
        )
    return int(data[5])


def scan(path: Path, data: memoryview, kind: bytes) -> Scan:
    """Every valid frame of ``data`` and every unusable range (see :class:`Scan`)."""
    version = _check_header(path, data, kind)
    result = Scan(version, len(data))
    offset = HEADER_SIZE
    while offset < len(data):
        payload = _frame_at(data, offset, version)
        if payload is not None:
            result.frames.append((offset, payload))
            offset += FRAME_OVERHEAD[version] + len(payload)
            continue
        resume = _next_frame(data, offset + 1, version)
        if resume is None:
            result.torn_at = offset
            break
        result.damaged.append((offset, resume))
        offset = resume
    return result


def _frame_at(data: memoryview, offset: int, version: int) -> memoryview | None:
    """The payload of a valid frame starting at ``offset``, or None."""
    overhead = FRAME_OVERHEAD[version]
    if len(data) - offset < overhead:
        return None
    if version == 1:
        length, crc = _V1.unpack_from(data, offset)
    else:
        mark, length, crc, head_crc = _V2.unpack_from(data, offset)
        if mark != FRAME_MARK or zlib.crc32(data[offset : offset + 12]) != head_crc:
            return None
    end = offset + overhead + length
    if length > MAX_FRAME or end > len(data):
        return None
    payload = data[offset + overhead : end]
    return payload if zlib.crc32(payload) == crc else None


def _next_frame(data: memoryview, start: int, version: int) -> int | None:
    """The offset of the first valid frame at or after ``start``, or None."""
    if version == 1:  # no sync mark in v1 frames: try every offset (old files only)
        return next((o for o in range(start, len(data) - _V1.size + 1) if _frame_at(data, o, 1) is not None),
                    None)
    blob = bytes(data)  # a copy, only on the damage path: bytes.find is the fast sync-mark search
    at = blob.find(FRAME_MARK, start)
    while at != -1:
        if _frame_at(data, at, 2) is not None:
            return at
        at = blob.find(FRAME_MARK, at + 1)
    return None


def _decode(path: Path, offset: int, payload: memoryview) -> Any:
    try:
        return unpack(payload)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptionError(
            f"{path}: undecodable frame at offset {offset}", path=str(path), offset=offset
        ) from exc


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or a new file in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """The temp file :func:`write_atomic` writes ``path`` through: ``.<name>.tmp-<pid>-<thread>``."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def temp_pattern(name_pattern: str) -> re.Pattern[str]:
    """Matches :func:`temp_path` names of files whose names match ``name_pattern``; group 1
    is the writer's pid."""
    return re.compile(rf"\.{name_pattern}\.tmp-(\d+)-\d+")


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview], *, durable: bool = True,
                 progress: Callable[[int], None] | None = None) -> int:
    """Write ``chunks`` to ``path`` (mode 0600) through a temp file, fsync and rename;
    ``progress`` is told the bytes written so far after each chunk (what it raises stops
    the write, as a failing chunk does).

    Returns the byte count. Raises :class:`StorageError` on I/O failure
    (:class:`StorageFullError` when the disk is full); the old file, if any, is
    left untouched.
    """
    tmp = temp_path(path)
    written = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                written += len(chunk)
                if progress is not None:
                    progress(written)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise storage_error(f"cannot write {path}", path, exc) from exc
    except BaseException:  # a chunk that could not be produced: the old file stays, no temp file
        tmp.unlink(missing_ok=True)
        raise
    return written


def storage_error(what: str, path: Path, exc: OSError) -> StorageError:
    """Our error for an OSError: StorageFullError for a full disk or quota."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"{what}: the disk is full ({exc.strerror}); nothing was written",
                                path=str(path))
    return StorageError(f"{what}: {exc.strerror or exc}", path=str(path))


def write_snapshot(path: Path, frames: Iterable[Any], version: int = SNAPSHOT_VERSION,
                   progress: Callable[[int], None] | None = None) -> int:
    """Atomically replace ``path`` with a snapshot of ``frames`` in a file of format
    ``version`` (tests write earlier ones); returns bytes written.  ``progress`` is
    told the bytes written so far, chunk by chunk."""
    return write_atomic(path, _snapshot_chunks(frames, version), progress=progress)


def _snapshot_chunks(frames: Iterable[Any], version: int) -> Iterator[bytes | memoryview]:
    offset = HEADER_SIZE
    yield header(SNAPSHOT, version)
    for frame in frames:
        if isinstance(frame, RawBin):
            chunks = frame.chunks(offset)
        elif isinstance(frame, Packed):
            chunks = [_payload_header(frame.payload), frame.payload]  # a big payload is not copied
        else:
            chunks = [encode_frame(frame)]
        for chunk in chunks:
            offset += len(chunk)
            yield chunk
        del frame, chunks  # written: not held while the next frame is produced


def side_path(path: Path, suffix: str) -> Path:
    """A new, unused name ``<name>.<suffix>-<epoch>[.<n>]`` beside ``path`` for set-aside data."""
    base = path.with_name(f"{path.name}.{suffix}-{int(time.time())}")
    candidate, n = base, 1
    while candidate.exists():
        candidate, n = base.with_name(f"{base.name}.{n}"), n + 1
    return candidate


def copy_aside(path: Path, suffix: str, start: int = 0) -> Path:
    """Copy bytes ``start..`` of ``path`` to ``<name>.<suffix>-<epoch>`` (fsynced); returns it."""
    with open(path, "rb") as fh:
        fh.seek(start)
        data = fh.read()
    aside = side_path(path, suffix)
    write_atomic(aside, [data])
    return aside


class Journal:
    """An append-only journal of frames with a configurable fsync policy.

    ``always``: every append is fsynced before it returns (survives power cuts).
    ``batch``: appends reach the OS at once (they survive ``kill -9``) and are
    fsynced together at most ``window_ms`` later (group commit); a failure of
    that fsync is raised by the next append.
    ``never``: the OS decides when to write back.

    An append either writes its whole frame or leaves the file as it was
    (rolled back to the last frame boundary).  After a failed fsync the journal
    is read-only (``failure`` says why) until it is reopened.
    Frames are written in the file's own format version (old journals stay
    readable by the version that wrote them until the next compaction).
    """

    def __init__(self, path: Path, policy: FsyncPolicy = "always", window_ms: float = 5.0) -> None:
        self.path = path
        self._policy = policy
        self._window = window_ms / 1000.0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dirty = False
        self._timer: threading.Timer | None = None
        self._version = VERSION
        self._sync_error: OSError | None = None
        self.failure: str | None = None
        self.size = 0
        self._synced = 0  # bytes known durable (every fsync of this journal raises it)

    @property
    def version(self) -> int:
        """The frame format version this journal's file is written in."""
        return self._version

    def open(self, first_frame: Any) -> ReadResult:
        """Open (creating with ``first_frame`` if absent) and return what it held.

        A torn tail is copied to ``journal.rmj.torn-<epoch>`` and then cut away,
        with a warning.  Raises CorruptionError for damage that is not a torn
        tail (the file is left as it is).
        """
        if not self.path.exists():
            write_atomic(self.path, [header(JOURNAL), encode_frame(first_frame)])
        result = read_file(self.path, JOURNAL)
        self._version = result.version
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            if result.torn_at is not None:
                self._set_aside_torn_tail(result)
        except OSError as exc:
            raise storage_error(f"cannot open {self.path}", self.path, exc) from exc
        self.size = result.end
        return result

    def adopt(self) -> None:
        """Open a journal this process has just written and synced (the compaction's
        next journal) for appending, without reading it back."""
        try:
            with open(self.path, "rb") as handle:
                self._version = _check_header(self.path, memoryview(handle.read(HEADER_SIZE)), JOURNAL)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            self.size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise storage_error(f"cannot open {self.path}", self.path, exc) from exc

    def _set_aside_torn_tail(self, result: ReadResult) -> None:
        aside = copy_aside(self.path, "torn", result.end)
        log.warning("journal %s: a torn last frame at offset %d (a write cut short by a crash) was "
                    "copied to %s and cut away", self.path, result.end, aside)
        assert self._fd is not None
        os.ftruncate(self._fd, result.end)
        os.fsync(self._fd)

    def append(self, obj: Any, *, durable: bool = False, defer: bool = False) -> None:
        """Append one frame; durable per the policy when this returns, or synced
        whatever the policy with ``durable``.  ``defer`` (policy ``always``, not
        ``durable``): written but not synced; the caller makes it durable with
        :meth:`sync_through` (:attr:`size` after this call) before it says so.

        Raises StorageFullError (disk full; nothing written, the journal stays
        usable), ReadOnlyError (an earlier fsync failed), StorageError.
        """
        frame = encode_frame(obj, self._version)
        with self._lock:
            fd = self._require_writable()
            self._write_frame(fd, frame)
            try:
                if durable:
                    _os.fdatasync(fd)
                elif not (defer and self._policy == "always"):
                    self._sync_per_policy(fd)
            except OSError as exc:
                self._fail(f"fsync of {self.path} failed ({exc.strerror}); the last write may not be durable")
                raise ReadOnlyError(self.failure or "", path=str(self.path)) from exc
            self.size += len(frame)
            if durable or (self._policy == "always" and not defer):
                self._synced = self.size

    def _write_frame(self, fd: int, frame: bytes) -> None:
        """Write all of ``frame`` or roll the file back to ``self.size``."""
        view = memoryview(frame)
        try:
            while view:
                view = view[_os.write(fd, view) :]
        except OSError as exc:
            self._roll_back(fd)
            raise storage_error(f"cannot append to {self.path}", self.path, exc) from exc

    def _roll_back(self, fd: int) -> None:
        try:
            _os.ftruncate(fd, self.size)
        except OSError as exc:
            self._fail(f"could not cut a partial write from {self.path} ({exc.strerror})")

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("journal is now read-only: %s; reopen the store (restart the daemon) to write again", reason)

    def _sync_per_policy(self, fd: int) -> None:
        if self._policy == "always":
            _os.fdatasync(fd)
        elif self._policy == "batch" and not self._dirty:
            self._dirty = True
            self._timer = threading.Timer(self._window, self._timed_sync)
            self._timer.daemon = True
            self._timer.start()

    def _timed_sync(self) -> None:
        with contextlib.suppress(StorageError):  # remembered in self.failure; the next append raises it
            self.sync()

    def sync(self) -> None:
        """fsync pending appends now (the group-commit timer and close).

        Raises ReadOnlyError when the fsync fails (and the journal stays read-only).
        """
        with self._lock:
            if self._fd is not None and self._dirty:
                self._dirty = False
                try:
                    _os.fdatasync(self._fd)
                except OSError as exc:
                    self._fail(f"fsync of {self.path} failed ({exc.strerror}); recent writes may not be durable")
                    raise ReadOnlyError(self.failure or "", path=str(self.path)) from exc
                self._synced = self.size

    def synced_through(self, end: int) -> bool:
        """Whether every frame up to byte ``end`` is as durable as the policy promises:
        fsynced (``always``: by an fsync that returned, before a failure or since the
        journal was closed, closing syncs), or written (``batch``, ``never``: their
        replies never waited for an fsync; a failed one is refused, as by :meth:`append`)."""
        with self._lock:
            return self._synced >= end or (self.failure is None and (self._policy != "always" or self._fd is None))

    def sync_through(self, end: int) -> None:
        """Make every frame up to byte ``end`` durable (a deferred append's :attr:`size`):
        at once when an fsync already covered it (one fsync serves every append made
        before it: group commit), and when this journal was closed since (closing
        syncs).  The fsync runs outside the lock, on a duplicate of the descriptor,
        so appends (and :meth:`close`) go on meanwhile.

        Raises ReadOnlyError when this fsync, or an earlier one, failed (and ``end`` was
        not covered before it); StorageError when no descriptor is left to duplicate
        (the frames may still be made durable by a later call).
        """
        with self._lock:
            if self._synced >= end:
                return
            if self.failure is not None:
                raise self.read_only()
            if self._fd is None:
                return
            try:
                fd, upto = os.dup(self._fd), self.size
            except OSError as exc:
                raise storage_error(f"cannot make the last writes to {self.path} durable", self.path, exc) from exc
        try:
            _os.fdatasync(fd)
        except OSError as exc:
            with self._lock:
                self._fail(f"fsync of {self.path} failed ({exc.strerror}); recent writes may not be durable")
            raise ReadOnlyError(self.failure or "", path=str(self.path)) from exc
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        with self._lock:
            if self.failure is not None:  # another fsync of this file failed meanwhile: the kernel
                # reports a writeback error to one fsync of a file description, and ours shares it
                raise self.read_only()
            self._synced = max(self._synced, upto)

    def read_only(self) -> ReadOnlyError:
        """The error every write gets once :attr:`failure` is set (it names the failure)."""
        return ReadOnlyError(f"the store is read-only: {self.failure}", path=str(self.path))

    def _require_writable(self) -> int:
        if self.failure is not None:
            raise self.read_only()
        if self._fd is None:
            raise StorageError(f"journal {self.path} is not open", path=str(self.path))
        return self._fd

    def close(self) -> None:
        """Flush and close; idempotent.  A failing final fsync is logged (the
        journal is already read-only then)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._fd is None:
            return
        if self._policy != "never" and self.failure is None:
            self._dirty = True
            try:
                self.sync()
            except ReadOnlyError as exc:
                log.error("closing %s: %s", self.path, exc)
        with self._lock:
            os.close(self._fd)
            self._fd = None


class DirLock:
    """An exclusive flock on ``<dir>/LOCK``; a second holder gets StoreLockedError."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "LOCK"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; raises StoreLockedError if held, StorageError
        when ``LOCK`` cannot be opened."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StorageError(f"cannot open {self.path}: {exc.strerror}", path=str(self.path)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise StoreLockedError(
                    f"data directory {self.path.parent} is in use by another process (pid {holder or '?'})",
                    path=str(self.path.parent), holder=holder,
                ) from exc
            raise StorageError(f"cannot lock {self.path}: {exc.strerror}", path=str(self.path)) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock; idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def is_locked(directory: Path) -> bool:
    """True if another process holds ``directory``'s lock.  A probe on a read-only
    open: it creates and writes nothing (``verify`` used to leave its pid in LOCK)."""
    try:
        fd = os.open(directory / "LOCK", os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StorageError(f"cannot read {directory / 'LOCK'}: {exc.strerror}", path=str(directory)) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return True
        raise StorageError(f"cannot lock {directory / 'LOCK'}: {exc.strerror}", path=str(directory)) from exc
    finally:
        os.close(fd)
    return False


@dataclass
class RepairReport:
    """What :func:`repair_file` did: frames kept, damaged ranges, where the original went."""

    path: str
    kept_frames: int
    damaged_at: int | None
    moved_to: str | None
    damaged: list[tuple[int, int]] = field(default_factory=list)
    torn_at: int | None = None


def repair_file(path: Path, kind: bytes) -> RepairReport:
    """Keep every valid frame of ``path``, before and after any damage; move the original aside.

    The original is renamed to ``<name>.damaged-<epoch>`` (never deleted) and a
    clean file holding every valid frame, in order, replaces it.  A file with
    no damage (a torn tail at most) is left as it is: opening handles a torn tail.
    """
    data = read_bytes(path)
    found = scan(path, data, kind)
    undecodable = [o for o, p in found.frames if not _decodes(p)]
    damaged = sorted(found.damaged + [(o, o) for o in undecodable])
    if not damaged:
        return RepairReport(str(path), len(found.frames), None, None, torn_at=found.torn_at)
    good = [p for o, p in found.frames if o not in set(undecodable)]
    aside = side_path(path, "damaged")
    os.link(path, aside)  # the original stays reachable at every instant: link, then replace
    frames = [frame_header(len(p), zlib.crc32(p), found.version) + bytes(p) for p in good]
    write_atomic(path, [header(kind, found.version), *frames])
    log.warning("repaired %s: kept %d frames, damaged copy moved to %s", path, len(good), aside)
    return RepairReport(str(path), len(good), damaged[0][0], str(aside), damaged, found.torn_at)


def _decodes(payload: memoryview) -> bool:
    try:
        unpack(payload)
    except Exception:  # msgpack raises several unrelated types
        return False
    return True


_ID = re.compile(rb"[0-9a-f]{32}")


def ids_in(data: bytes | memoryview) -> list[str]:
    """Memory ids (32 hex digits, as the store makes them) readable in damaged bytes."""
    return sorted({m.decode() for m in _ID.findall(bytes(data))})
