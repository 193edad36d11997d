"""The :class:`~reachy_memory.integrations.reachy_mini.MemoryBridge` whose worker runs in a
helper process: the control process keeps no thread of the bridge's.

Why: a worker *thread* in the control process decodes replies, retries and waits in the
control loop's own interpreter; whenever it holds the GIL the loop's next tick waits for it
(up to the 5 ms switch interval), which measured as +1 to +6 ms tick p99 on a 50 Hz loop.
Here a child process (``python -m reachy_memory.integrations.bridge_helper``, started by
:meth:`HelperBridge.start`; :mod:`.bridge_helper`) runs a thread-mode bridge that owns the client, the queue, the
retries and the refreshes; the control process talks to it over two pipes:

* calls (``record_turn``, ``search``...) are checked on the caller's thread (owner, type)
  and written to the helper as one small frame, non-blocking: a call that would wait (the
  helper has ``queue_size`` jobs not yet finished, or the pipe is full) is dropped and
  counted, as a full queue is in thread mode;
* replies, snapshots, counters and the helper's log records come back as frames that are
  read only inside the bridge's own calls (``latest()``, a future's ``done()`` or
  ``result()``, ``stats``, ``pending``...), non-blocking and in small pieces; a reply's
  value is decoded when ``result()`` asks for it, a snapshot when ``latest()`` first
  returns it.  Nothing runs in the control process between those calls.

Frames are msgpack (the format: "the pipe's format" below), never pickle: replies arrive as
a thread-mode bridge's (Memory, SearchResult lists, the context, dicts), through the daemon
protocol's codecs; a failed call's error as the same class of the error tree, with its
message and fields (:func:`~reachy_memory.daemon.protocol.error_to_wire`; a foreign one as
a ServiceError naming its type); an argument msgpack cannot carry is a ValidationError on
the caller's thread (TooLargeError for arguments over the pipe's frame), and a tuple map key
arrives as one (the call fails as in thread mode, the helper lives on). A frame, reply or
snapshot from the helper that does not decode ends
the bridge as a dead helper does (below); no msgpack error reaches the caller.

Differences from thread mode, all documented on :class:`MemoryBridge`: a future's done
callbacks run on the thread whose bridge call received the reply (often the control loop:
keep them short); the helper's log records are logged again in this process, under the
same logger names, when they arrive; a helper that dies (killed, out of memory) ends the
bridge as a failed worker does (``stats.discarded_at_failure``, futures fail with
ClosedError, ``latest().error`` says so).

The helper ignores SIGINT (a Ctrl-C or the dashboard's stop reaches the app, which closes
the bridge) and ends by itself when the control process is gone (its pipe closes): it then
gives the queued writes ``CLOSE_ON_EXIT`` seconds to reach the daemon.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgpack

from reachy_memory.config import Config, to_dict
from reachy_memory.daemon import protocol as proto
from reachy_memory.engine.ingest import check_seconds
from reachy_memory.errors import BusyError, ClosedError, ProtocolError, ServiceError, TooLargeError, ValidationError
from reachy_memory.integrations.reachy_mini import (
    BridgeStats,
    MemoryBridge,
    MemorySnapshot,
    _owned,
    log,
)
from reachy_memory.model import SEARCH_LIMIT, Memory, MemoryType, SearchResult

_HEADER = struct.Struct(">I")
_READ_CHUNK = 1 << 16
_READ_BUDGET = 1 << 20  # bytes read per pump at most: one call never drains an unbounded backlog
_POLL_EVERY = 0.001  # seconds: calls closer together than this (one tick's) read the pipe once
_PIPE_SIZE = 1 << 20  # asked of Linux for both pipes (F_SETPIPE_SZ); the default 64 KiB also works
_F_SETPIPE_SZ = 1031
#: Seconds close() waits past its own timeout for the helper's last report (its final
#: counters and the futures of the jobs it discarded) before ending it.
CLOSE_GRACE = 0.5
#: Added to the helper's nice value: under contention the control loop's process runs first.
HELPER_NICE = 5
#: Seconds the helper gives the queued writes when the control process ended without close().
CLOSE_ON_EXIT = 5.0
_CALLS = frozenset({"record_turn", "set_current_person", "remember", "search", "context_for", "pause_remembering",
                    "resume_remembering"})
_FINISHED = ("done", "errors", "discarded_at_close", "discarded_at_failure")  # every job ends in one (or dropped)
_STATS = frozenset(f.name for f in dataclasses.fields(BridgeStats))


# -- the pipe's format ------------------------------------------------------------------------
# Every message is one frame: a 4-byte big-endian length, then one msgpack array whose first
# item names it (msgpack, not pickle: unpickling runs code named by the bytes; a garbled or
# hostile frame must end the bridge, not run anything). The control process sends
# ["init", settings], ["call", seq, name, args, kwargs, answered], ["close", deadline]; the
# helper ["done", seq, true, reply bytes] or ["done", seq, false, error map], ["snap", bytes],
# ["stats", counters], ["log", logger, level, text], ["closed", counters]. A reply's value and a
# snapshot travel as msgpack bytes within the frame: decoded only when asked for (module
# docstring); errors as :func:`~reachy_memory.daemon.protocol.error_to_wire` maps.

_MAX_FRAME = 1 << 26  # bytes: a longer length is a garbled stream (a reply that big is refused when sent)


def _pack(value: Any) -> bytes:
    """msgpack bytes of ``value`` (bin type for bytes); TypeError, ValueError or
    OverflowError for what msgpack cannot carry."""
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes | bytearray, *, keys: bool = False) -> Any:
    """The value of msgpack ``data``; ``keys``: a map key that is an array (a tuple key
    sent as msgpack carries it) arrives as a tuple, else unhashable, the frame would not
    decode (a call's arguments: the call then goes on as in thread mode)."""
    if keys:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=_map)
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    return {_hashable(key): value for key, value in pairs}


def _hashable(key: Any) -> Any:
    return tuple(map(_hashable, key)) if isinstance(key, list) else key


def _frame(message: list[Any]) -> bytes:
    data = _pack(message)
    return _HEADER.pack(len(data)) + data


class _Frames:
    """Splits a byte stream into frames (4-byte length, one msgpack array); ``calls``: the
    helper's reading of the control process's calls (tuple map keys kept, :func:`_unpack`)."""

    def __init__(self, *, calls: bool = False) -> None:
        self._buffer = bytearray()
        self._calls = calls

    def feed(self, data: bytes) -> list[list[Any]]:
        """The messages completed by ``data``; ProtocolError for a frame that is not one
        (a length past ``_MAX_FRAME``, undecodable bytes, not a named array): the stream
        cannot be trusted past it."""
        self._buffer += data
        out: list[list[Any]] = []
        start = 0
        while len(self._buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer, start)
            if size > _MAX_FRAME:
                raise ProtocolError(f"memory bridge pipe: a frame of {size} bytes (garbled stream)")
            end = start + _HEADER.size + size
            if len(self._buffer) < end:
                break
            try:
                message = _unpack(self._buffer[start + _HEADER.size:end], keys=self._calls)
            except Exception as exc:  # msgpack raises many types for bad input
                raise ProtocolError(f"memory bridge pipe: undecodable frame ({exc.__class__.__name__})") from exc
            if not isinstance(message, list) or not message or not isinstance(message[0], str):
                raise ProtocolError("memory bridge pipe: a frame that is not a named message")
            out.append(message)
            start = end
        del self._buffer[:start]
        return out


def _plain_type(memory_type: MemoryType | str | None) -> str | None:
    return memory_type.value if isinstance(memory_type, MemoryType) else memory_type


#: What each answered call's reply is on the pipe: (to msgpack-able, from it), the daemon
#: protocol's own codecs: a reply arrives as the same types as from a thread-mode bridge.
_REPLIES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "remember": (proto.memory_to_wire, proto.memory_from_wire),
    "search": (proto.results_to_wire, proto.results_from_wire),
    "context_for": (proto.context_to_wire, proto.context_from_wire),
    "pause_remembering": (dict, dict),
    "resume_remembering": (dict, dict),
}


def _encode_reply(name: str, value: Any) -> bytes:
    """The reply bytes of call ``name``'s ``value`` (raises what the encoders raise)."""
    return _pack(_REPLIES[name][0](value))


def _encode_snapshot(snapshot: MemorySnapshot) -> bytes:
    return _pack([list(snapshot.window), snapshot.person, list(snapshot.person_facts), snapshot.fetched_at,
                  snapshot.error])


def _decode_snapshot(data: bytes) -> MemorySnapshot:
    """The MemorySnapshot of :func:`_encode_snapshot`'s bytes; ProtocolError if they are not one."""
    window, person, facts, fetched_at, error = _unpack(data)
    if not (isinstance(window, list) and all(isinstance(w, dict) for w in window) and isinstance(facts, list)
            and all(isinstance(f, str) for f in facts) and isinstance(person, str | None)
            and isinstance(fetched_at, float | int) and isinstance(error, str | None)):
        raise ProtocolError("memory bridge pipe: a snapshot of the wrong shape")
    return MemorySnapshot(tuple(window), person, tuple(facts), float(fetched_at), error)


def _grow_pipe(fd: int) -> None:
    with contextlib.suppress(OSError, ImportError):
        import fcntl

        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)


class _Encoded:
    """A reply's value, still msgpack bytes: decoded by the first ``result()`` that asks for it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class _HelperFuture(Future):  # type: ignore[type-arg]
    """A future answered by the helper: ``done()``, ``result()`` and ``exception()`` read
    the replies that arrived first (non-blocking for ``done()``; ``result(timeout)`` waits
    for the pipe, not on a lock); the value is decoded on the first ``result()``. A reply
    that does not decode ends the bridge as a failed helper does; that ``result()`` raises
    ClosedError (``exception()`` before it: None, the value not being decoded yet)."""

    def __init__(self, bridge: HelperBridge, name: str) -> None:
        super().__init__()
        self._bridge = bridge
        self._name = name

    def done(self) -> bool:
        if not super().done():
            self._bridge._poll()
        return super().done()

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not super().done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._bridge._poll(wait=0.05 if left is None else min(left, 0.05))

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        value = super().result(timeout=0)  # not done by now: TimeoutError
        return self._decoded() if isinstance(value, _Encoded) else value

    def _decoded(self) -> Any:
        """Decode the reply, once (the first result()); a reply that does not decode fails
        this future with ClosedError and ends the bridge (never a msgpack error here)."""
        failed: Exception | None = None
        with self._condition:  # type: ignore[attr-defined]
            current: Any = self._result  # type: ignore[attr-defined]
            if isinstance(current, _Encoded):
                try:
                    current = self._result = _REPLIES[self._name][1](_unpack(current.data))
                except Exception as exc:  # msgpack or the shape: the helper is not to be trusted
                    failed, current = exc, None
                    self._result = None
                    self._exception = ClosedError(f"memory bridge helper sent an undecodable {self._name} reply")
        if failed is not None:
            self._bridge._fail(f"an undecodable {self._name} reply ({failed.__class__.__name__}: {failed})")
        if self._exception is not None:  # type: ignore[attr-defined]
            raise self._exception  # type: ignore[attr-defined]
        return current

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return super().exception(timeout=0)


class HelperBridge(MemoryBridge):
    """:class:`MemoryBridge` with its worker in a helper process (what ``MemoryBridge(...)``
    makes by default on POSIX systems); same calls, same promises (module docstring)."""

    def __init__(self, endpoint: str | None = None, *, config: Any = None, queue_size: int = 64,
                 refresh_interval: float = 0.5, timeout: float = 2.0, person_facts: int = 5,
                 turn_retry_for: float = 60.0, client_factory: Callable[[], Any] | None = None,
                 helper: bool | None = None) -> None:
        """Raises ValidationError as MemoryBridge does, and for a ``config`` that is not a
        Config (it crosses to the helper as its plain dict); no process is started before start()."""
        if client_factory is not None:
            raise ValidationError("a client_factory makes its clients in this process: use helper=False")
        if config is not None and not isinstance(config, Config):
            raise ValidationError(f"config must be a Config, not {type(config).__name__}", field="config")
        super().__init__(endpoint, config=config, queue_size=queue_size, refresh_interval=refresh_interval,
                         timeout=timeout, person_facts=person_facts, turn_retry_for=turn_retry_for,
                         helper=False)
        # The helper's own queue takes a few more than ours: it never drops what we let through.
        self._settings = {"endpoint": endpoint, "config": None if config is None else to_dict(config),
                          "queue_size": queue_size + 8,
                          "refresh_interval": refresh_interval, "timeout": timeout, "person_facts": person_facts,
                          "turn_retry_for": turn_retry_for}
        self._queue_size = queue_size
        self._link = threading.Lock()  # pipe I/O and the counters below; never held across a wait
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_helper: int | None = None
        self._from_helper: int | None = None
        self._outbox = bytearray()
        self._frames = _Frames()
        self._futures: dict[int, _HelperFuture] = {}
        self._ready: list[tuple[_HelperFuture, bool, Any]] = []  # replies to hand over outside the lock
        self._logs: list[tuple[str, int, str]] = []
        self._seq = 0
        self._sent = 0  # calls written (or queued for writing) to the helper
        self._turns_sent = 0
        self._heard = False  # the helper reported at least once
        self._finished = 0  # of those, the ones the helper finished (its counters)
        self._dropped_here = 0
        self._helper_dropped = 0
        self._polled_at = 0.0  # time.monotonic() of the last read of the helper's pipe
        self._snap_data: bytes | None = None
        self._snap_from: bytes | None = None
        self._ended = threading.Event()  # the helper reported its close, or is gone
        self._in_callbacks = threading.local()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> HelperBridge:
        """Start the helper process (idempotent; returns at once, the helper connects on its
        own); raises ClosedError after close(), ServiceError when no process can be started."""
        with self._link:
            if self._closed:
                raise ClosedError("MemoryBridge is closed")
            if self._proc is not None:
                return self
            to_r, to_w = os.pipe()
            from_r, from_w = os.pipe()
            for fd in (to_w, from_w):
                _grow_pipe(fd)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "reachy_memory.integrations.bridge_helper", str(to_r), str(from_w)],
                    pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL, close_fds=True)
            except (OSError, ValueError) as exc:
                for fd in (to_r, to_w, from_r, from_w):
                    os.close(fd)
                raise ServiceError(f"could not start the memory bridge's helper process ({exc}); "
                                   "MemoryBridge(helper=False) runs its worker on a thread instead") from exc
            os.close(to_r)
            os.close(from_w)
            os.set_blocking(to_w, False)
            os.set_blocking(from_r, False)
            self._to_helper, self._from_helper = to_w, from_r
            self._outbox[:0] = _frame(["init", self._settings])
            self._flush()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """As :meth:`MemoryBridge.close`: the helper drains the queued jobs for up to
        ``timeout`` seconds and reports; this returns once it has (at most ``CLOSE_GRACE``
        seconds past ``timeout``: a helper that has not reported by then is ended, and what
        it had not finished is counted in ``stats.discarded_at_close``). Called from a
        future's done callback it returns at once (a later call waits, as in thread mode)."""
        seconds = check_seconds(timeout, "timeout", finite=True)
        with self._link:
            first = not self._closed
            if first:
                self._closed = True
                self._close_by = time.monotonic() + seconds
                if self._proc is not None and not self._ended.is_set():
                    # the deadline, not the seconds: a helper still starting must not extend it
                    # (time.monotonic() is one clock for every process of the machine)
                    self._outbox += _frame(["close", self._close_by])
                    self._flush()
            never_started = self._proc is None
        if never_started:
            self._discard_unsent()
            return
        if getattr(self._in_callbacks, "active", False):
            return
        limit = self._close_by + CLOSE_GRACE
        wait_until = limit if first else min(limit, time.monotonic() + seconds)  # a later call: its own timeout
        while not self._ended.is_set() and time.monotonic() < wait_until:
            self._poll(wait=min(0.05, max(0.0, wait_until - time.monotonic())))
        if self._ended.is_set() or time.monotonic() >= limit:
            self._end_helper()

    stop = close

    # -- the control loop's calls --------------------------------------------------------------

    def latest(self) -> MemorySnapshot:
        """The last snapshot the helper sent; reads what arrived (non-blocking, skipped
        when another thread is reading), decodes a new snapshot once (one that does not
        decode ends the bridge as a failed helper does: its ``error`` says so). Never
        waits, never raises."""
        self._poll(blocking=False)
        data = self._snap_data
        if data is not None and data is not self._snap_from:
            try:
                snapshot = _decode_snapshot(data)
            except Exception as exc:  # msgpack or the shape: the helper is not to be trusted
                self._fail(f"an undecodable snapshot ({exc.__class__.__name__}: {exc})")
                return self._snapshot
            self._snapshot, self._snap_from = snapshot, data
        return self._snapshot

    def record_turn(self, role: str, text: str, person: str | None = None, *, owner: str | None = None) -> bool:
        """As :meth:`MemoryBridge.record_turn` (the helper makes the turn's id)."""
        _owned(owner)
        return self._call("record_turn", (role, text, person), {"owner": owner})

    def set_current_person(self, name: str | None) -> bool:
        """As :meth:`MemoryBridge.set_current_person`."""
        return self._call("set_current_person", (name,), {})

    def remember(self, content: str, memory_type: MemoryType | str = MemoryType.FACT,
                 metadata: dict[str, Any] | None = None, *, owner: str | None = None) -> Future[Memory]:
        """As :meth:`MemoryBridge.remember` (the helper makes the memory's id)."""
        _owned(owner)
        MemoryType.parse(memory_type)
        return self._submit_remote("remember", (content, _plain_type(memory_type), metadata), {"owner": owner})

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               where: dict[str, Any] | None = None) -> Future[list[SearchResult]]:
        """As :meth:`MemoryBridge.search`."""
        return self._submit_remote("search", (query, _plain_type(memory_type), limit, where), {})

    def context_for(self, message: str, *, max_tokens: int = 800) -> Future[Any]:
        """As :meth:`MemoryBridge.context_for`."""
        return self._submit_remote("context_for", (message,), {"max_tokens": max_tokens})

    def pause_remembering(self, minutes: float) -> Future[dict[str, Any]]:
        """As :meth:`MemoryBridge.pause_remembering`."""
        return self._submit_remote("pause_remembering", (minutes,), {})

    def resume_remembering(self) -> Future[dict[str, Any]]:
        """As :meth:`MemoryBridge.resume_remembering`."""
        return self._submit_remote("resume_remembering", (), {})

    @property
    def pending(self) -> int:
        """Calls sent to the helper that it has not finished yet."""
        self._poll(blocking=False)
        return max(0, self._sent - self._finished)

    @property
    def stats(self) -> BridgeStats:  # type: ignore[override]
        """The counters (``enqueued`` and part of ``dropped`` kept here, the rest the helper's
        as last reported: read what arrived first)."""
        self._poll(blocking=False)
        return self._stats

    @stats.setter
    def stats(self, value: BridgeStats) -> None:
        self._stats = value

    # -- sending -------------------------------------------------------------------------------

    def _submit_remote(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        future = _HelperFuture(self, name)
        try:
            if not self._call(name, args, kwargs, future):
                future.set_exception(BusyError(f"memory bridge queue full or closed; {name} dropped"))
        except ValidationError as exc:  # an argument msgpack cannot carry, as the client refuses it
            future.set_exception(exc)
        return future

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              future: _HelperFuture | None = None) -> bool:
        """Write one call to the helper (never waits); False when dropped: closed, helper gone,
        ``queue_size`` calls unfinished, or the pipe full. ValidationError (field "args"),
        nothing queued, for an argument the pipe (msgpack) cannot carry."""
        with self._link:
            self._read()
            if self._closed or self._ended.is_set() or self._sent - self._finished >= self._queue_size \
                    or len(self._outbox) > _PIPE_SIZE:
                self._dropped_here += 1
                self._stats.dropped = self._dropped_here + self._helper_dropped
                return False
            try:
                frame = _frame(["call", self._seq + 1, name, args, kwargs, future is not None])
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValidationError(f"the arguments of {name!r} cannot be sent to the memory bridge's helper: "
                                      f"{exc}", field="args") from exc
            if len(frame) - _HEADER.size > _MAX_FRAME:  # the helper would take the stream for garbled and end
                raise TooLargeError(f"the arguments of {name!r} are {len(frame)} bytes, over the memory bridge "
                                    f"pipe's {_MAX_FRAME}-byte frame", field="args", size=len(frame),
                                    limit=_MAX_FRAME)
            self._seq += 1
            if future is not None:
                self._futures[self._seq] = future
            self._outbox += frame
            self._sent += 1
            self._turns_sent += name == "record_turn"
            self._stats.enqueued += 1
            self._flush()
        self._hand_over()
        return True

    def _flush(self) -> None:
        """Write what the outbox holds, as much as the pipe takes now (lock held)."""
        if self._to_helper is None or not self._outbox:
            return
        try:
            written = os.write(self._to_helper, self._outbox)
        except BlockingIOError:
            return
        except OSError:  # the helper is gone: its pipe's end will say so when read
            self._outbox.clear()
            return
        del self._outbox[:written]

    # -- receiving -----------------------------------------------------------------------------

    def _poll(self, wait: float = 0.0, blocking: bool = True) -> None:
        """Read and apply what the helper sent; with ``wait``, first wait up to that long for
        something to arrive (on the pipe, no lock held). ``blocking=False``: skip the read
        when another thread holds the lock (latest() never waits)."""
        fd = self._from_helper
        if wait > 0:
            if fd is None or self._ended.is_set():
                time.sleep(wait)
            else:
                with contextlib.suppress(OSError, ValueError):
                    select.select([fd], [], [], wait)
        elif time.monotonic() - self._polled_at < _POLL_EVERY:  # a tick's many calls: one read
            self._hand_over()
            return
        if not self._link.acquire(blocking=blocking):
            return
        try:
            self._flush()
            self._read()
            self._polled_at = time.monotonic()
        finally:
            self._link.release()
        self._hand_over()

    def _read(self) -> None:
        """Read what arrived, up to a budget, and apply it (lock held)."""
        fd = self._from_helper
        if fd is None or (self._ended.is_set() and not self._futures):
            return
        budget = _READ_BUDGET
        while budget > 0:
            try:
                data = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                data = b""
            if not data:
                self._helper_gone()
                return
            budget -= len(data)
            try:
                for message in self._frames.feed(data):
                    self._apply(message)
            except Exception as exc:  # a garbled frame or message: no foreign error reaches the caller
                self._fail_locked(f"an undecodable message ({exc.__class__.__name__}: {exc})")
                return

    def _apply(self, message: list[Any]) -> None:
        """Apply one message (lock held); ProtocolError (or the error of a wrong shape)
        for one that is not as the helper sends them."""
        kind = message[0]
        if kind == "done":
            _, seq, ok, payload = message
            if not (isinstance(seq, int) and (isinstance(payload, bytes) if ok is True
                                              else ok is False and isinstance(payload, dict))):
                raise ProtocolError("a reply of the wrong shape")
            future = self._futures.pop(seq, None)
            if future is not None:
                self._ready.append((future, ok, payload))
        elif kind == "snap":
            _, data = message
            if not isinstance(data, bytes):
                raise ProtocolError("a snapshot that is not bytes")
            self._snap_data = data
        elif kind in ("stats", "closed"):
            _, counters = message
            self._merge(counters)
            if kind == "closed":
                self._ended.set()
        elif kind == "log":
            _, name, level, text = message
            if not (isinstance(name, str) and isinstance(level, int) and isinstance(text, str)):
                raise ProtocolError("a log record of the wrong shape")
            self._logs.append((name, level, text))
        else:
            raise ProtocolError(f"an unknown message {kind!r}")

    def _merge(self, counters: dict[str, Any]) -> None:
        if not (isinstance(counters, dict) and set(counters) == _STATS
                and all(isinstance(counters[n], int) for n in (*_FINISHED, "dropped"))):
            raise ProtocolError("counters of the wrong shape")
        self._heard = True
        for name, value in counters.items():
            if name not in ("enqueued", "dropped"):
                setattr(self._stats, name, value)
        self._helper_dropped = counters["dropped"]
        self._stats.dropped = self._dropped_here + self._helper_dropped
        self._finished = sum(counters[name] for name in _FINISHED) + counters["dropped"]

    def _hand_over(self) -> None:
        """Complete the futures whose replies arrived and log the helper's records, outside
        the lock (a done callback may call the bridge)."""
        if not self._ready and not self._logs:
            return
        with self._link:
            ready, self._ready = self._ready, []
            logs, self._logs = self._logs, []
        for name, level, text in logs:
            logging.getLogger(name).log(level, "%s", text)
        self._in_callbacks.active = True
        try:
            for future, ok, payload in ready:
                if future.done():
                    continue
                if ok is True:
                    future.set_result(_Encoded(payload))
                else:  # our own ClosedError, or the helper's error map
                    future.set_exception(payload if isinstance(payload, BaseException)
                                         else proto.error_from_wire(payload))
        finally:
            self._in_callbacks.active = False

    # -- the end -------------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        """The helper sent ``why`` (something undecodable): end the bridge as a failed helper."""
        with self._link:
            self._fail_locked(why)
        self._hand_over()

    def _fail_locked(self, why: str) -> None:
        """:meth:`_fail` with the lock held: log, end the helper (it is not to be trusted: what
        it had not finished is discarded), and fail what waits for it."""
        if self._ended.is_set():
            return
        log.error("memory bridge helper process sent %s: the bridge ends", why)
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.kill()  # reaped by close()
        self._helper_gone("memory bridge helper process sent an undecodable message; see the log")

    def _helper_gone(self, error: str = "memory bridge helper process ended; see the log") -> None:
        """The helper's pipe closed (lock held): without its last report it died (a failed
        worker: what it had not finished is discarded at failure; ``latest().error`` is ``error``)."""
        if self._ended.is_set():
            return
        self._ended.set()
        self._from_helper_closed()
        lost = max(0, self._sent - self._finished)
        if self._closed:
            self._stats.discarded_at_close += lost
            why = "closed"
        else:
            self._stats.discarded_at_failure += lost
            why = "worker failed (see the log)"
            self._snapshot = MemorySnapshot(error=error)
            self._snap_data = None
        if not self._heard:  # it never started its worker: nothing was sent, as thread mode says it
            log.warning("memory bridge %s: %d queued job(s) (%d turn(s)) never sent, discarded",
                        "closed before its helper process started" if self._closed else "helper process failed",
                        lost, self._turns_sent)
        elif lost:
            log.warning("memory bridge helper process ended before reporting: %d job(s) not finished, discarded",
                        lost)
        for future in self._futures.values():
            self._ready.append((future, False, ClosedError(f"memory bridge {why} before the job ran")))
        self._futures.clear()
        self._finished = self._sent

    def _from_helper_closed(self) -> None:
        if self._from_helper is not None:
            with contextlib.suppress(OSError):
                os.close(self._from_helper)
            self._from_helper = None

    def _end_helper(self) -> None:
        """After close(): make sure the helper is gone (it exits by itself after its report;
        one that has not reported by close()'s deadline is killed) and free the pipes."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=0.2 if self._ended.is_set() else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
        with self._link:
            if not self._ended.is_set():
                self._read()
                self._helper_gone()
            if self._to_helper is not None:
                with contextlib.suppress(OSError):
                    os.close(self._to_helper)
                self._to_helper = None
            self._from_helper_closed()
        self._hand_over()

    def _discard_unsent(self) -> None:
        """close() before start(): nothing could send the calls made meanwhile."""
        with self._link:
            self._stats.discarded_at_close += self._sent
            self._ready += [(future, False, ClosedError("memory bridge closed before the job ran"))
                            for future in self._futures.values()]
            self._futures.clear()
            self._outbox.clear()
            self._finished = self._sent
            self._ended.set()
        if self._sent:
            log.warning("memory bridge closed before it started: %d queued job(s) never sent, discarded", self._sent)
        self._hand_over()
