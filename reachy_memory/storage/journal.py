"""Durable msgpack files: checksummed frames, an append-only journal, atomic
snapshots, the journal's head file and the data directory lock.  ``docs/FORMAT.md``
is the contract.

File layout (all integers little-endian)::

    header    b"RMEM" kind:u8 version:u8 0x00 0x00     kind: b"J" journal, b"S" snapshot
    header v4 the 8 bytes above, key:16, 0:u32, crc32(first 28 bytes):u32     (journals of format 4)
    frame v4  b"\xa7RMF" length:u32 seq:u64 synced:u64 crc32(payload):u32 tag:16 payload
              (tag: BLAKE2b-128 keyed with the file's key, over bytes 0..27)
    frame v2  b"\xa7RMF" length:u32 crc32(payload):u32 crc32(first 12 bytes):u32 payload
    frame v1  length:u32 crc32(payload):u32 payload      (read only)

Journals are written at format 4: a key of the file's own, made at random when it
is made and never shown, tags every frame, so a text stored by a user (which
reaches the journal byte for byte) can never hold a frame this file accepts, and
a frame found by resynchronising after damage is one this store wrote there.
Frames of a journal carry a sequence number (``seq``, strictly increasing, across
generations too: a snapshot says up to which ``seq`` it holds the ops) and the
offset known durable when they were written (``synced``).  Snapshot files are
written at version 3: v2 frames, and a bf16 vector block; v1 and v2 journals are
read (the store compacts at open to move on to format 4).

Recovery rules, shared by every reader (:func:`scan`):

* a frame is valid when its header check (v2: CRC, v4: keyed tag), its length
  bound (``MAX_FRAME``, inside the file) and its payload check all hold, and (v4)
  its ``seq`` is above the frame before it;
* v4: unusable bytes at or after the **durable point** (the highest ``synced`` of a
  valid frame, or the reach the head file promises) are a torn tail: a write a
  power cut or crash left unfinished, with every byte after it (no frame there was
  acknowledged: an fsync covering one would have covered the damage too).  Unusable
  bytes before that point are damage;
* v1/v2: unusable bytes with no valid frame after them are a torn tail, unusable
  bytes followed by a valid frame are damage;
* a torn tail is copied to ``journal.rmj.torn-<epoch>`` and cut away on open;
  damage makes :func:`read_file` raise :class:`CorruptionError` (open refuses,
  nothing is changed on disk) and :func:`repair_file` keeps every valid frame,
  moving the original aside (``<name>.damaged-<epoch>``).

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
import hashlib
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
    ReachyMemoryError,
    ReadOnlyError,
    StorageError,
    StorageFullError,
    StoreLockedError,
    TooLargeError,
    ValidationError,
)

log = logging.getLogger(__name__)

MAGIC = b"RMEM"
VERSION = 2  # plain frames (snapshots' frames, a restore's intent) are written at 2
JOURNAL_VERSION = 4  # journal files: keyed v4 frames (see the module doc)
SNAPSHOT_VERSION = 3  # snapshot files: v2 frames, bf16 vectors (see the module doc)
READABLE = {b"J": (1, 2, 3, 4), b"S": (1, 2, 3)}  # a kind -> the file versions read
JOURNAL = b"J"
SNAPSHOT = b"S"
HEADER_SIZE = 8
KEY_SIZE = 16
_KEYED_HEADER = struct.Struct("<8s16s4xI")  # header, key, zero, crc32 of the first 28 bytes
FRAME_MARK = b"\xa7RMF"
_V1 = struct.Struct("<II")
_V2 = struct.Struct("<4sIII")
_V2_HEAD = struct.Struct("<4sII")
_V4 = struct.Struct("<4sIQQI16s")  # mark, length, seq, synced, crc32 of the payload, tag
_V4_FIELDS = 28  # the bytes the tag covers
MAX_FRAME = (1 << 31) - 1  # a frame's payload; the vector block of a very large snapshot stays below
MAX_SEQ = (1 << 63) - 1
FRAME_OVERHEAD = {1: _V1.size, 2: _V2.size, 3: _V2.size, 4: _V4.size}  # a file's version -> its frames' header size


def header_size(version: int) -> int:
    """The bytes before the first frame in a file of ``version``."""
    return _KEYED_HEADER.size if version >= 4 else HEADER_SIZE


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


def new_key() -> bytes:
    """A journal file's key: random, made when the file is made, kept in its header only."""
    return os.urandom(KEY_SIZE)


def keyed_header(key: bytes) -> bytes:
    """The 32-byte header of a format-4 journal keyed with ``key``."""
    head = header(JOURNAL, JOURNAL_VERSION) + key + bytes(4)
    return head + struct.pack("<I", zlib.crc32(head))


def journal_id(key: bytes) -> bytes:
    """The 16-byte name of the journal keyed with ``key`` (recorded in the head file; it
    tells nothing of the key)."""
    return hashlib.blake2b(key, digest_size=16, person=b"rmem-journal-id").digest()


def _tag(key: bytes, fields: bytes | memoryview) -> bytes:
    """The keyed tag of a v4 frame's first 28 bytes (its payload's CRC among them): no one
    without the key can make one, and it costs the same whatever the payload's size."""
    return hashlib.blake2b(fields, key=key, digest_size=16, person=b"rmem-frame").digest()


def keyed_header_of(payload: bytes | memoryview, key: bytes, seq: int, synced: int) -> bytes:
    """The v4 frame header of ``payload`` (number ``seq``; ``synced``: the journal bytes known
    durable when it is written).  Raises TooLargeError past :data:`MAX_FRAME`."""
    if len(payload) > MAX_FRAME:
        raise TooLargeError(f"a frame of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit",
                            field="frame", size=len(payload), limit=MAX_FRAME)
    fields = struct.pack("<4sIQQI", FRAME_MARK, len(payload), seq, synced, zlib.crc32(payload))
    return fields + _tag(key, fields)


def encode_keyed(obj: Any, key: bytes, seq: int, synced: int) -> bytes:
    """One v4 frame of ``obj`` (see :func:`keyed_header_of`)."""
    payload = pack(obj)
    return keyed_header_of(payload, key, seq, synced) + payload


def journal_chunks(first_frame: Any, base_seq: int, frames: Iterable[tuple[int, Any]] = (),
                   key: bytes | None = None) -> list[bytes]:
    """A whole format-4 journal: its header (a new key unless ``key``), ``first_frame``
    numbered ``base_seq``, then ``frames`` ((seq, ops), seqs above ``base_seq``, increasing).
    Each frame says it follows durable bytes up to its own offset: the file is used only
    once all of it is durable (written atomically, or appended to and synced first)."""
    key = key or new_key()
    chunks = [keyed_header(key)]
    offset = len(chunks[0])
    for seq, obj in [(base_seq, first_frame), *frames]:
        chunks.append(encode_keyed(obj, key, seq, offset))
        offset += len(chunks[-1])
    return chunks


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


def frames_from(path: Path, offset: int, version: int, end: int | None = None) -> list[tuple[int | None, Any]]:
    """The frames of ``path`` from byte ``offset`` to ``end`` (frame boundaries; default
    the end of the file) as (seq, decoded payload); seq is None in files before format 4.

    Used to carry the ops appended during a background compaction into the
    next journal.  Raises CorruptionError when a frame there is not valid.
    """
    try:
        with open(path, "rb") as handle:
            key = _read_key(path, memoryview(handle.read(header_size(version)))) if version >= 4 else None
            handle.seek(offset)
            data = memoryview(handle.read(-1 if end is None else end - offset))
    except OSError as exc:
        raise storage_error(f"cannot read {path}", path, exc) from exc
    frames: list[tuple[int | None, Any]] = []
    at = 0
    while at < len(data):
        found = _keyed_frame_at(data, at, key) if key is not None else (_frame_at(data, at, version), None, 0)
        if found is None or found[0] is None:
            raise CorruptionError(f"{path}: no valid frame at offset {offset + at}", path=str(path),
                                  offset=offset + at)
        payload, seq, _ = found
        assert payload is not None  # (checked above: found[0])
        frames.append((seq, _decode(path, offset + at, payload)))
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

    ``damaged`` lists ``(start, end)`` ranges of real damage (v1/v2: followed by a valid
    frame; v4: starting before the durable point); ``torn_at`` is where a torn tail starts
    (v1/v2: unusable bytes reaching the end of the file with no valid frame after them;
    v4: the first unusable byte at or after the durable point, everything after it
    included).  v4 files also give each frame's ``seqs``, their ``key`` and ``durable``:
    the durable point used.
    """

    version: int
    size: int
    frames: list[tuple[int, memoryview]] = field(default_factory=list)
    damaged: list[tuple[int, int]] = field(default_factory=list)
    torn_at: int | None = None
    key: bytes | None = None
    seqs: list[int] = field(default_factory=list)
    durable: int = 0


@dataclass
class ReadResult:
    """What a file held: the decoded frames and where a torn tail began (v4 journals:
    each frame's seq, the file's key and the durable point too)."""

    frames: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    end: int = HEADER_SIZE  # offset just past the last good frame
    torn_at: int | None = None
    version: int = VERSION
    seqs: list[int] = field(default_factory=list)
    key: bytes | None = None
    durable: int = 0

    @property
    def journal_id(self) -> bytes | None:
        """The name of the format-4 journal read (None before format 4)."""
        return journal_id(self.key) if self.key is not None else None

    @property
    def last_seq(self) -> int | None:
        """The seq of the last frame read (None before format 4, or without frames)."""
        return self.seqs[-1] if self.seqs else None


def read_file(path: Path, kind: bytes, raw: frozenset[int] = frozenset(), reach: int = 0) -> ReadResult:
    """Read and check every frame of ``path``.

    Frames whose index is in ``raw`` are returned undecoded, as writable views
    into one buffer (so a large vector block is never copied).  ``reach`` (v4): bytes
    known durable besides what the frames say (the head file's promise).
    Raises :class:`FormatVersionError` for a foreign header and
    :class:`CorruptionError` for damage that is not a torn tail.
    """
    return _result(path, read_bytes(path), kind, raw, reach)


def _result(path: Path, data: memoryview, kind: bytes, raw: frozenset[int], reach: int) -> ReadResult:
    found = scan(path, data, kind, reach)
    if found.damaged:
        start, end = found.damaged[0]
        raise CorruptionError(
            f"{path}: damaged bytes {start}..{end} before the point known written durably, or with valid frames "
            "after them; nothing was changed. "
            "Run 'reachy-memory verify' to see what is affected and 'reachy-memory verify --repair' "
            "to keep every valid frame", path=str(path), offset=start, end=end,
        )
    result = ReadResult(end=header_size(found.version), torn_at=found.torn_at, version=found.version,
                        seqs=found.seqs, key=found.key, durable=found.durable)
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
    if data[5] not in READABLE[kind]:
        raise FormatVersionError(
            f"{path} has format version {data[5]}; this reachy-memory reads versions {READABLE[kind]}",
            path=str(path), found=data[5], expected=JOURNAL_VERSION if kind == JOURNAL else SNAPSHOT_VERSION,
        )
    return int(data[5])


def _read_key(path: Path, data: memoryview) -> bytes:
    """The key of a format-4 journal; CorruptionError when its header is damaged (no
    frame can be checked without it: refused, never guessed)."""
    if len(data) < _KEYED_HEADER.size:
        raise CorruptionError(f"{path}: the journal header is cut short ({len(data)} bytes)", path=str(path), offset=0)
    _, key, crc = _KEYED_HEADER.unpack_from(data, 0)
    if zlib.crc32(data[:28]) != crc:
        raise CorruptionError(f"{path}: the journal header (which holds the key its frames are checked with) is "
                              "damaged; nothing was changed", path=str(path), offset=0)
    return bytes(key)


def scan(path: Path, data: memoryview, kind: bytes, reach: int = 0) -> Scan:
    """Every valid frame of ``data`` and every unusable range (see :class:`Scan`);
    ``reach`` (v4): bytes known durable besides what the frames say."""
    version = _check_header(path, data, kind)
    if version >= 4:
        return _scan_keyed(Scan(version, len(data), key=_read_key(path, data)), data, reach)
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


def _scan_keyed(result: Scan, data: memoryview, reach: int) -> Scan:
    """The v4 scan: frames are found only where their keyed tags hold and their seq
    rises; the unusable ranges are then split at the durable point (the highest
    ``synced`` any valid frame names, or ``reach``) into damage and a torn tail."""
    key = result.key
    assert key is not None
    offset, last, synced = header_size(result.version), -1, 0
    bad: list[tuple[int, int | None]] = []
    while offset < len(data):
        found = _keyed_frame_at(data, offset, key)
        if found is not None and found[1] > last:
            payload, last, through = found
            result.frames.append((offset, payload))
            result.seqs.append(last)
            synced = max(synced, through)
            offset += _V4.size + len(payload)
            continue
        resume = _next_keyed(data, offset + 1, key, last)
        bad.append((offset, resume))
        if resume is None:
            break
        offset = resume
    result.durable = max(synced, reach, header_size(result.version))
    for start, resume in bad:
        if start >= result.durable:  # a write a crash cut short, and whatever was written after it
            result.torn_at = start
            kept = sum(1 for offset, _ in result.frames if offset < start)
            del result.frames[kept:], result.seqs[kept:]
            break
        result.damaged.append((start, resume if resume is not None else len(data)))
    return result


def _keyed_frame_at(data: memoryview, offset: int, key: bytes) -> tuple[memoryview, int, int] | None:
    """(payload, seq, synced) of a valid v4 frame starting at ``offset``, or None."""
    if len(data) - offset < _V4.size:
        return None
    mark, length, seq, synced, crc, tag = _V4.unpack_from(data, offset)
    if mark != FRAME_MARK or _tag(key, data[offset : offset + _V4_FIELDS]) != tag:
        return None
    end = offset + _V4.size + length
    if length > MAX_FRAME or end > len(data):
        return None
    payload = data[offset + _V4.size : end]
    return (payload, seq, synced) if zlib.crc32(payload) == crc else None


def _next_keyed(data: memoryview, start: int, key: bytes, last: int) -> int | None:
    """The offset of the first valid v4 frame at or after ``start`` whose seq is above
    ``last``, or None.  Only this store's frames pass: a text holding a frame (of any
    format, or of another store) fails the keyed tag, at the cost of one short hash."""
    blob = bytes(data)  # a copy, only on the damage path: bytes.find is the fast sync-mark search
    at = blob.find(FRAME_MARK, start)
    while at != -1:
        found = _keyed_frame_at(data, at, key)
        if found is not None and found[1] > last:
            return at
        at = blob.find(FRAME_MARK, at + 1)
    return None


def _frame_at(data: memoryview, offset: int, version: int) -> memoryview | None:
    """The payload of a valid v1/v2 frame starting at ``offset``, or None."""
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
    """The offset of the first valid v1/v2 frame at or after ``start``, or None."""
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


def read_if_present(path: Path) -> bytes | None:
    """The bytes of ``path``; None when it does not exist.  Raises StorageError when it
    cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror}", path=str(path)) from exc


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


HEAD_SLOT = 64
_HEAD = struct.Struct("<8sQQ16sQQ")  # header b"RMEM" b"H" 1 0 0, counter, generation, journal id, reach, seq
HEAD_KIND = b"H"
HEAD_VERSION = 1


@dataclass(frozen=True)
class HeadState:
    """What the head file says: journal ``journal_id`` (of ``generation``) is the store's,
    and its first ``reach`` bytes (up to frame ``seq``) were written durably."""

    counter: int
    generation: int
    journal_id: bytes
    reach: int
    seq: int


def _encode_head(state: HeadState) -> bytes:
    body = _HEAD.pack(header(HEAD_KIND, HEAD_VERSION), state.counter, state.generation, state.journal_id,
                      state.reach, state.seq)
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(HEAD_SLOT, b"\0")


def _head_slot(data: bytes, at: int) -> HeadState | None:
    if len(data) < at + _HEAD.size + 4:
        return None
    body = data[at : at + _HEAD.size]
    (crc,) = struct.unpack_from("<I", data, at + _HEAD.size)
    magic, counter, generation, jid, reach, seq = _HEAD.unpack(body)
    if zlib.crc32(body) != crc or magic != header(HEAD_KIND, HEAD_VERSION):
        return None
    return HeadState(counter, generation, jid, reach, seq)


class Head:
    """The head file (``head.rmh``): which journal is the store's and how much of it was
    written durably, so that a journal cut short (at a frame boundary too), put back
    from an older copy or swapped for another generation's is noticed at open.

    Two 64-byte slots, each with a CRC-32; a write goes to the slot the older state is in,
    so a write cut short leaves the other (the reader takes the valid one with the higher
    counter).  Only ever written after the journal bytes it promises are durable, so it
    may lag behind the journal but never promises more than is there.  Any thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state: HeadState | None = None
        self._fd: int | None = None
        self._dirty = False
        self._lock = threading.Lock()

    @staticmethod
    def read(path: Path) -> HeadState | None:
        """The state ``path`` holds; None when there is no head (a store from before the
        head file, or one restored); CorruptionError when both slots are damaged."""
        data = read_if_present(path)
        if data is None:
            return None
        states = [s for s in (_head_slot(data, 0), _head_slot(data, HEAD_SLOT)) if s is not None]
        if not states and data.strip(b"\0"):
            raise CorruptionError(f"{path}: both copies of the journal head are damaged; nothing was changed. "
                                  "'reachy-memory verify --repair' writes it anew from the journal",
                                  path=str(path), offset=0)
        return max(states, key=lambda s: s.counter) if states else None

    def load(self) -> HeadState | None:
        """Read the head file (see :meth:`read`); later writes continue from it."""
        self.state = self.read(self.path)
        return self.state

    def write(self, generation: int, jid: bytes, reach: int, seq: int, *, durable: bool = True) -> None:
        """Record journal ``jid`` and its durable ``reach``; synced (with the directory entry
        of a new file) when ``durable``.  Raises StorageError."""
        with self._lock:
            self._write(generation, jid, reach, seq, durable)

    def _write(self, generation: int, jid: bytes, reach: int, seq: int, durable: bool) -> None:
        try:
            created = self._fd is None and not self.path.exists()
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            state = HeadState((self.state.counter if self.state else 0) + 1, generation, jid, reach, seq)
            os.pwrite(self._fd, _encode_head(state), (state.counter % 2) * HEAD_SLOT)
            self.state, self._dirty = state, True
            if durable:
                os.fdatasync(self._fd)
                self._dirty = False
                if created:
                    fsync_dir(self.path.parent)
        except OSError as exc:
            raise storage_error(f"cannot write {self.path}", self.path, exc) from exc

    def advance(self, jid: bytes, reach: int, seq: int) -> None:
        """The journal ``jid`` is durable up to ``reach`` now: recorded without a sync
        (the kernel writes it back; :meth:`sync` and every journal switch make it
        durable).  A failure is logged: the head only lags then."""
        with self._lock:
            state = self.state
            if state is None or state.journal_id != jid or reach <= state.reach:
                return
            try:
                self._write(state.generation, jid, reach, seq, False)
            except StorageError as exc:
                log.warning("the journal head lags behind: %s", exc)

    def sync(self) -> None:
        """Make the last recorded reach durable (close, idle time); a failure is logged."""
        with self._lock:
            if self._fd is None or not self._dirty:
                return
            try:
                os.fdatasync(self._fd)
                self._dirty = False
            except OSError as exc:
                log.warning("cannot sync %s: %s", self.path, exc.strerror)

    def close(self) -> None:
        """Sync and close; idempotent."""
        self.sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_journal(path: Path, head: HeadState | None = None) -> ReadResult:
    """:func:`read_file` for the store's journal, held against what the head file says.

    A format-4 journal the head names must hold at least the ``reach`` it promises (the
    durable point of the torn-tail rule too); one it does not name must say it comes
    ``after`` the one it names (a journal switch or a repair whose head update a crash cut
    off).  Raises CorruptionError (nothing changed) when the journal is shorter than
    promised, or not the one the head names: an older copy, another generation's
    journal, a file from before the head.
    """
    data = read_bytes(path)
    version = _check_header(path, data, JOURNAL)
    jid = journal_id(_read_key(path, data)) if version >= 4 else None
    named = head is not None and jid == head.journal_id
    if head is not None and named and len(data) < head.reach:
        raise CorruptionError(
            f"{path} holds {len(data)} bytes, but the head file promises {head.reach} were written durably: "
            "its end was cut off, and acknowledged writes with it; nothing was changed. Put the whole file back, "
            "or run 'reachy-memory verify --repair' to go on with what it holds", path=str(path), offset=len(data))
    result = _result(path, data, JOURNAL, frozenset(), head.reach if head is not None and named else 0)
    if head is not None and not named:
        first = result.frames[0] if result.frames else None
        after = first.get("after") if isinstance(first, dict) else None
        if after != head.journal_id:
            raise CorruptionError(
                f"{path} is not the journal this store last wrote (the head file names journal "
                f"{head.journal_id.hex()[:12]} of generation {head.generation}; this file is "
                f"{'journal ' + jid.hex()[:12] if jid else f'a format-{version} journal'}, "
                f"generation {_generation_of(first)}): an older copy or another generation's journal was put in "
                "its place; nothing was changed. Put the store's journal back, or run 'reachy-memory verify "
                "--repair' to go on with this one", path=str(path), offset=0)
    return result


def file_journal_id(path: Path) -> bytes | None:
    """The id of the format-4 journal ``path`` (None: an earlier format, or unreadable)."""
    try:
        with open(path, "rb") as handle:
            data = memoryview(handle.read(_KEYED_HEADER.size))
        return journal_id(_read_key(path, data)) if _check_header(path, data, JOURNAL) >= 4 else None
    except (OSError, ReachyMemoryError):
        return None


def _generation_of(first: Any) -> Any:
    return first.get("generation") if isinstance(first, dict) else None


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
    Frames are written in the file's own format version (a journal of an earlier
    format is read, and written to only until the compaction the store runs at open).
    Format 4: every frame carries the next ``seq`` and the bytes known durable; each
    fsync that moves the durable point records it in ``head`` (without syncing it).
    """

    def __init__(self, path: Path, policy: FsyncPolicy = "always", window_ms: float = 5.0,
                 head: Head | None = None) -> None:
        self.path = path
        self.head = head
        self._policy = policy
        self._window = window_ms / 1000.0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dirty = False
        self._timer: threading.Timer | None = None
        self._version = JOURNAL_VERSION
        self._key: bytes | None = None
        self._sync_error: OSError | None = None
        self.failure: str | None = None
        self.size = 0
        self.body_start = 0  # the end of the first frame (the journal's head): the ops frames follow
        self.seq = 0  # the seq of the last frame written (format 4)
        self._synced = 0  # bytes known durable (every fsync of this journal raises it)
        self._synced_seq = 0

    @property
    def version(self) -> int:
        """The frame format version this journal's file is written in."""
        return self._version

    @property
    def id(self) -> bytes | None:
        """The journal's name (format 4; the head file records it), else None."""
        return journal_id(self._key) if self._key is not None else None

    @property
    def synced(self) -> int:
        """The bytes known durable."""
        return self._synced

    def open(self, first_frame: Any, *, base_seq: int = 0) -> ReadResult:
        """Open (creating a format-4 journal with ``first_frame``, numbered ``base_seq``, if
        absent) and return what it held, checked against :attr:`head` (:func:`read_journal`).

        A torn tail is copied to ``journal.rmj.torn-<epoch>`` and then cut away,
        with a warning; then what was read is synced (after a ``kill -9`` it may be only in
        the page cache), so that later frames can say it is durable.  Raises
        CorruptionError for damage that is not a torn tail (the file is left as it is).
        """
        named = self.head.state if self.head is not None else None
        if not self.path.exists():  # where the head names a journal: a rebuild without it (verify --repair)
            if named is not None:
                first_frame = first_frame | {"after": named.journal_id}
            write_atomic(self.path, journal_chunks(first_frame, base_seq))
        result = read_journal(self.path, named)
        self._version, self._key = result.version, result.key
        self.seq = self._synced_seq = max(base_seq, result.last_seq or 0)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            if result.torn_at is not None:
                self._set_aside_torn_tail(result)
            os.fdatasync(self._fd)
        except OSError as exc:
            raise storage_error(f"cannot open {self.path}", self.path, exc) from exc
        self.size = self._synced = result.end
        self.body_start = result.offsets[1] if len(result.offsets) > 1 else result.end
        return result

    def adopt(self, seq: int) -> None:
        """Open a journal this process has just written and synced (the compaction's
        next journal; ``seq``: its last frame's) for appending, without reading it back."""
        try:
            with open(self.path, "rb") as handle:
                head = memoryview(handle.read(_KEYED_HEADER.size + _V4.size))
            self._version = _check_header(self.path, head, JOURNAL)
            self._key = _read_key(self.path, head) if self._version >= 4 else None
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            self.size = self._synced = os.fstat(self._fd).st_size
            first = _V4.unpack_from(head, _KEYED_HEADER.size)[1] if len(head) == _KEYED_HEADER.size + _V4.size else 0
            self.body_start = min(self.size, _KEYED_HEADER.size + _V4.size + first)
            self.seq = self._synced_seq = seq
        except OSError as exc:
            raise storage_error(f"cannot open {self.path}", self.path, exc) from exc

    def floor(self, seq: int) -> None:
        """Number the next frame above ``seq`` (the snapshot's: a journal cut short of the
        point the snapshot holds must not get frames the next open would skip)."""
        with self._lock:
            self.seq = max(self.seq, seq)

    @property
    def holds_ops(self) -> bool:
        """Whether frames follow the journal's head frame."""
        return self.size > self.body_start

    def _set_aside_torn_tail(self, result: ReadResult) -> None:
        aside = copy_aside(self.path, "torn", result.end)
        log.warning("journal %s: a torn end at offset %d (a write cut short by a crash, and anything written "
                    "after it) was copied to %s and cut away", self.path, result.end, aside)
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
        payload = pack(obj) if self._version >= 4 else None
        frame = encode_frame(obj, self._version) if payload is None else b""
        with self._lock:
            fd = self._require_writable()
            if os.fstat(fd).st_nlink == 0:  # one cheap call: a write into a deleted file is never acknowledged
                self._fail(f"{self.path} was deleted while the store had it open (with its directory?)")
                raise self.read_only()
            if payload is not None:
                assert self._key is not None
                frame = keyed_header_of(payload, self._key, self.seq + 1, self._synced) + payload
            self._write_frame(fd, frame)
            self.seq += 1
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
                self._reached(self.size, self.seq)

    def _reached(self, size: int, seq: int) -> None:
        """Under the lock: the first ``size`` bytes (frames up to ``seq``) are durable."""
        if size > self._synced:
            self._synced, self._synced_seq = size, seq
            if self.head is not None and self._key is not None:
                self.head.advance(journal_id(self._key), size, seq)

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

    def fail(self, reason: str) -> None:
        """Refuse every later write with ``reason`` (the store's files were taken away)."""
        with self._lock:
            self._fail(reason)

    def lost(self) -> str | None:
        """Why this journal is no longer the file ``path`` names (deleted, or replaced by
        another file), or None while it is."""
        with self._lock:
            if self._fd is None:
                return None
            try:
                mine = os.fstat(self._fd)
            except OSError as exc:
                return f"{self.path} cannot be checked ({exc.strerror})"
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.path} was deleted while the store had it open"
        except OSError as exc:
            return f"{self.path} cannot be checked ({exc.strerror})"
        if mine.st_nlink == 0 or (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            return f"{self.path} was deleted or replaced by another file while the store had it open"
        return None

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
                self._reached(self.size, self.seq)

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
                fd, upto, seq = os.dup(self._fd), self.size, self.seq
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
            self._reached(upto, seq)

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
    """An exclusive flock on the data directory itself, and one on ``<dir>/LOCK`` (which
    holds the holder's pid, and excludes versions before the directory lock).  Deleting
    ``LOCK`` does not free the directory: a second holder gets StoreLockedError as long
    as the first has it open.  :meth:`lost` tells when the directory was taken away."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "LOCK"
        self._fd: int | None = None
        self._dir_fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; raises StoreLockedError if held, StorageError
        when the directory or ``LOCK`` cannot be opened."""
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise StorageError(f"cannot open {self.directory}: {exc.strerror}", path=str(self.directory)) from exc
        try:
            _flock(dir_fd, self.directory, self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            os.close(dir_fd)
            raise StorageError(f"cannot open {self.path}: {exc.strerror}", path=str(self.path)) from exc
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            _flock(fd, self.directory, self.path)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            os.close(dir_fd)
            raise
        self._fd, self._dir_fd = fd, dir_fd

    def lost(self) -> str | None:
        """Why the store no longer has its data directory (removed, or another directory
        now has its name), or None.  A ``LOCK`` file deleted meanwhile is made again (and
        locked: versions before the directory lock look at it only)."""
        if self._dir_fd is None:
            return None
        try:
            mine, there = os.fstat(self._dir_fd), os.stat(self.directory)
        except FileNotFoundError:
            return f"the data directory {self.directory} was removed while the store had it open"
        except OSError as exc:
            return f"the data directory {self.directory} cannot be checked ({exc.strerror})"
        if mine.st_nlink == 0 or (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            return f"the data directory {self.directory} was removed or replaced while the store had it open"
        self._relock()
        return None

    def _relock(self) -> None:
        try:
            if self._fd is not None and os.fstat(self._fd).st_nlink > 0:
                return
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            log.warning("cannot check %s: %s", self.path, exc.strerror)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            log.warning("%s was deleted and cannot be made again (%s); the directory lock holds", self.path,
                        exc.strerror)
            return
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        log.warning("%s was deleted while the store had it open; made again (the directory itself stays locked)",
                    self.path)

    def release(self) -> None:
        """Drop the lock; idempotent."""
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._dir_fd = None


def _flock(fd: int, directory: Path, lock_file: Path) -> None:
    """An exclusive non-blocking flock on ``fd``; StoreLockedError when another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            holder = _holder(lock_file)
            raise StoreLockedError(
                f"data directory {directory} is in use by another process (pid {holder or '?'})",
                path=str(directory), holder=holder,
            ) from exc
        raise StorageError(f"cannot lock {directory}: {exc.strerror}", path=str(directory)) from exc


def _holder(lock_file: Path) -> str:
    try:
        return lock_file.read_bytes()[:32].decode(errors="replace").strip()
    except OSError:
        return ""


def is_locked(directory: Path) -> bool:
    """True if another process holds ``directory``'s lock (the directory's flock, or
    ``LOCK``'s for a version before it).  A probe on read-only opens: it creates and
    writes nothing (``verify`` used to leave its pid in LOCK)."""
    for target, flags in ((directory, os.O_RDONLY | os.O_DIRECTORY), (directory / "LOCK", os.O_RDONLY)):
        try:
            fd = os.open(target, flags)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StorageError(f"cannot read {target}: {exc.strerror}", path=str(directory)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                return True
            raise StorageError(f"cannot lock {target}: {exc.strerror}", path=str(directory)) from exc
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


def repair_file(path: Path, kind: bytes, reach: int = 0) -> RepairReport:
    """Keep every valid frame of ``path``, before and after any damage; move the original aside.

    The original is renamed to ``<name>.damaged-<epoch>`` (never deleted) and a
    clean file holding every valid frame, in order, replaces it.  A file with
    no damage (a torn tail at most) is left as it is: opening handles a torn tail.
    ``reach``: bytes the head file promises (the durable point of a format-4 journal).
    A format-4 journal is written anew under a new key, each frame keeping its seq, its
    first frame saying it comes ``after`` the journal it replaces (:func:`read_journal`).
    """
    data = read_bytes(path)
    found = scan(path, data, kind, reach)
    undecodable = [o for o, p in found.frames if not _decodes(p)]
    damaged = sorted(found.damaged + [(o, o) for o in undecodable])
    if not damaged:
        return RepairReport(str(path), len(found.frames), None, None, torn_at=found.torn_at)
    good = [(i, p) for i, (o, p) in enumerate(found.frames) if o not in set(undecodable)]
    aside = side_path(path, "damaged")
    os.link(path, aside)  # the original stays reachable at every instant: link, then replace
    if found.key is not None:
        write_atomic(path, _rekeyed(found, good))
    else:
        frames = [frame_header(len(p), zlib.crc32(p), found.version) + bytes(p) for _, p in good]
        write_atomic(path, [header(kind, found.version), *frames])
    log.warning("repaired %s: kept %d frames, damaged copy moved to %s", path, len(good), aside)
    return RepairReport(str(path), len(good), damaged[0][0], str(aside), damaged, found.torn_at)


def _rekeyed(found: Scan, good: list[tuple[int, memoryview]]) -> list[bytes]:
    """A format-4 journal of the ``good`` frames of ``found`` (index, payload) under a new key."""
    assert found.key is not None
    frames = [(found.seqs[i], unpack(p)) for i, p in good]
    if not frames:
        return [keyed_header(new_key())]
    (base, first), rest = frames[0], frames[1:]
    if isinstance(first, dict) and first.get("kind") == "journal":
        first = first | {"after": journal_id(found.key)}
    return journal_chunks(first, base, rest)


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
