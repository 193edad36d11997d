"""Durable msgpack files: CRC-checked frames, an append-only journal, atomic
snapshots and the data directory lock.

File layout (all integers little-endian)::

    header   b"RMEM" kind:u8 version:u8 0x00 0x00        kind: b"J" journal, b"S" snapshot
    frame*   length:u32 crc32(payload):u32 payload         payload: one msgpack object

Recovery rules, shared by every reader:

* a frame cut short at the end of the file (a torn write) is dropped and
  reported in ``ReadResult.torn_at``; the journal truncates it away on open;
* a bad frame with more bytes after it is corruption: :class:`CorruptionError`
  names the file and offset, and :func:`repair_file` keeps the valid prefix and
  moves the damaged file aside.  Nothing is dropped silently.

Snapshots are written to a temporary file, fsynced, renamed over the old one,
and the directory is fsynced, so a crash leaves either the old or the new one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgpack
import numpy as np

from .errors import CorruptionError, FormatVersionError, StorageError, StoreLockedError

log = logging.getLogger(__name__)

MAGIC = b"RMEM"
VERSION = 1
JOURNAL = b"J"
SNAPSHOT = b"S"
HEADER_SIZE = 8
_FRAME = struct.Struct("<II")
MAX_FRAME = 1 << 31  # 2 GiB: the vector block of a very large snapshot stays below

FsyncPolicy = Literal["always", "batch", "never"]


def header(kind: bytes) -> bytes:
    """The 8-byte file header for ``kind``."""
    return MAGIC + kind + bytes([VERSION, 0, 0])


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` (bin type for bytes, no pickle-like extensions)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | memoryview) -> Any:
    """Decode msgpack; raises ValueError-family errors on bad data."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def encode_frame(obj: Any) -> bytes:
    """One frame: length, CRC32 and the msgpack payload."""
    payload = pack(obj)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


ALIGN = 64


class RawBin:
    """A large binary frame written without copying, its data 64-byte aligned
    in the file so it can be used in place.  On disk it is the msgpack array
    ``[pad: bin8, data: bin32]``."""

    def __init__(self, data: memoryview | bytes) -> None:
        self.data = memoryview(data)

    def chunks(self, offset: int) -> list[bytes | memoryview]:
        """The frame's bytes when it starts at file ``offset``."""
        fixed = _FRAME.size + 1 + 2 + 5  # frame header, array, bin8 header, bin32 header
        pad = -(offset + fixed) % ALIGN
        head = b"\x92\xc4" + bytes([pad]) + bytes(pad) + b"\xc6" + struct.pack(">I", len(self.data))
        crc = zlib.crc32(self.data, zlib.crc32(head))
        return [_FRAME.pack(len(head) + len(self.data), crc) + head, self.data]


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
class ReadResult:
    """What a file held: the decoded frames and where a torn tail began."""

    frames: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    end: int = HEADER_SIZE  # offset just past the last good frame
    torn_at: int | None = None


def read_file(path: Path, kind: bytes, raw: frozenset[int] = frozenset()) -> ReadResult:
    """Read and check every frame of ``path``.

    Frames whose index is in ``raw`` are returned undecoded, as writable views
    into one buffer (so a large vector block is never copied).
    Raises :class:`FormatVersionError` for a foreign header and
    :class:`CorruptionError` for damage that is not a torn tail.
    """
    data = _read_bytes(path)
    _check_header(path, data, kind)
    result = ReadResult()
    for offset, payload in _scan(path, data):
        index = len(result.frames)
        result.frames.append(payload if index in raw else _decode(path, offset, payload))
        result.offsets.append(offset)
        result.end = offset + _FRAME.size + len(payload)
    if result.end < len(data):
        result.torn_at = result.end
    return result


def _read_bytes(path: Path) -> memoryview:
    """The whole file in one writable buffer (each fresh large buffer costs page faults)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            raw = np.empty(size + ALIGN, np.uint8)  # aligned like the file: data frames stay aligned
            start = -raw.ctypes.data % ALIGN
            buf = raw.data[start : start + size]
            fh.readinto(buf)
        return buf
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror}", path=str(path)) from exc


def _check_header(path: Path, data: memoryview, kind: bytes) -> None:
    if len(data) < HEADER_SIZE or data[:4] != MAGIC or data[4:5] != kind:
        raise FormatVersionError(
            f"{path} is not a reachy-memory {'journal' if kind == JOURNAL else 'snapshot'} file",
            path=str(path), found=bytes(data[:6]), expected=header(kind)[:6],
        )
    if data[5] != VERSION:
        raise FormatVersionError(
            f"{path} has format version {data[5]}; this reachy-memory reads version {VERSION}",
            path=str(path), found=data[5], expected=VERSION,
        )


def _scan(path: Path, data: memoryview) -> Iterator[tuple[int, memoryview]]:
    """Yield (offset, payload) of each good frame; stop at a torn tail."""
    offset, size = HEADER_SIZE, len(data)
    while offset < size:
        if size - offset < _FRAME.size:
            return  # torn frame header
        length, crc = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + length
        if end > size:
            return  # the payload was cut short: torn tail
        payload = data[offset + _FRAME.size : end]
        if zlib.crc32(payload) != crc:
            if end == size:
                return  # a last frame whose bytes never all reached the disk
            raise CorruptionError(
                f"{path}: checksum mismatch in the frame at offset {offset}; "
                "run 'reachy-memory verify --repair' to keep the valid prefix",
                path=str(path), offset=offset,
            )
        yield offset, payload
        offset = end


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


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview], *, durable: bool = True) -> int:
    """Write ``chunks`` to ``path`` through a temp file, fsync and rename.

    Returns the byte count. Raises :class:`StorageError` on I/O failure; the old
    file, if any, is left untouched.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    written = 0
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                written += len(chunk)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(f"cannot write {path}: {exc.strerror}", path=str(path)) from exc
    return written


def write_snapshot(path: Path, frames: Iterable[Any]) -> int:
    """Atomically replace ``path`` with a snapshot of ``frames``; returns bytes written."""
    return write_atomic(path, _snapshot_chunks(frames))


def _snapshot_chunks(frames: Iterable[Any]) -> Iterator[bytes | memoryview]:
    offset = HEADER_SIZE
    yield header(SNAPSHOT)
    for frame in frames:
        chunks = frame.chunks(offset) if isinstance(frame, RawBin) else [encode_frame(frame)]
        for chunk in chunks:
            offset += len(chunk)
            yield chunk


class Journal:
    """An append-only journal of frames with a configurable fsync policy.

    ``always``: every append is fsynced before it returns (survives power cuts).
    ``batch``: appends reach the OS at once (they survive ``kill -9``) and are
    fsynced together at most ``window_ms`` later (group commit).
    ``never``: the OS decides when to write back.
    """

    def __init__(self, path: Path, policy: FsyncPolicy = "always", window_ms: float = 5.0) -> None:
        self.path = path
        self._policy = policy
        self._window = window_ms / 1000.0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dirty = False
        self._timer: threading.Timer | None = None
        self.size = 0

    def open(self, first_frame: Any) -> ReadResult:
        """Open (creating with ``first_frame`` if absent) and return what it held.

        A torn tail is truncated away, with a warning naming the offset.
        """
        if not self.path.exists():
            write_atomic(self.path, [header(JOURNAL), encode_frame(first_frame)])
        result = read_file(self.path, JOURNAL)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        if result.torn_at is not None:
            log.warning("journal %s: dropped a torn frame at offset %d (a write cut short by a crash)",
                        self.path, result.torn_at)
            os.ftruncate(self._fd, result.end)
            os.fsync(self._fd)
        self.size = result.end
        return result

    def append(self, obj: Any) -> None:
        """Append one frame; durable per the policy when this returns."""
        frame = encode_frame(obj)
        with self._lock:
            fd = self._require_open()
            try:
                os.write(fd, frame)
                self.size += len(frame)
                self._sync_per_policy(fd)
            except OSError as exc:
                raise StorageError(f"cannot append to {self.path}: {exc.strerror}", path=str(self.path)) from exc

    def _sync_per_policy(self, fd: int) -> None:
        if self._policy == "always":
            os.fdatasync(fd)
        elif self._policy == "batch" and not self._dirty:
            self._dirty = True
            self._timer = threading.Timer(self._window, self.sync)
            self._timer.daemon = True
            self._timer.start()

    def sync(self) -> None:
        """fsync pending appends now (used by the group-commit timer and close)."""
        with self._lock:
            if self._fd is not None and self._dirty:
                os.fdatasync(self._fd)
            self._dirty = False

    def _require_open(self) -> int:
        if self._fd is None:
            raise StorageError(f"journal {self.path} is not open", path=str(self.path))
        return self._fd

    def close(self) -> None:
        """Flush and close; idempotent."""
        if self._timer is not None:
            self._timer.cancel()
        if self._fd is None:
            return
        if self._policy != "never":
            self._dirty = True
            self.sync()
        with self._lock:
            os.close(self._fd)
            self._fd = None


class DirLock:
    """An exclusive flock on ``<dir>/LOCK``; a second holder gets StoreLockedError."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "LOCK"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; raises StoreLockedError if held."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
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
    """True if another process holds ``directory``'s lock."""
    lock = DirLock(directory)
    if not lock.path.exists():
        return False
    try:
        lock.acquire()
    except StoreLockedError:
        return True
    lock.release()
    return False


@dataclass
class RepairReport:
    """What :func:`repair_file` did."""

    path: str
    kept_frames: int
    damaged_at: int | None
    moved_to: str | None


def repair_file(path: Path, kind: bytes) -> RepairReport:
    """Keep the valid prefix of ``path``; move the damaged original aside.

    The original is renamed to ``<name>.damaged-<epoch>`` (never deleted) and a
    clean file holding every frame before the damage replaces it.
    """
    data = _read_bytes(path)
    _check_header(path, data, kind)
    good: list[memoryview] = []
    damaged_at: int | None = None
    try:
        for _offset, payload in _scan(path, data):
            unpack(payload)
            good.append(payload)
    except CorruptionError as exc:
        damaged_at = exc.fields.get("offset")
    except Exception:
        damaged_at = HEADER_SIZE + sum(_FRAME.size + len(p) for p in good)
    if damaged_at is None:
        return RepairReport(str(path), len(good), None, None)
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    os.replace(path, aside)
    frames = [_FRAME.pack(len(p), zlib.crc32(p)) + p for p in good]
    write_atomic(path, [header(kind), *frames])
    log.warning("repaired %s: kept %d frames, damaged copy moved to %s", path, len(good), aside)
    return RepairReport(str(path), len(good), damaged_at, str(aside))
