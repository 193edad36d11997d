"""The helper process of :class:`~reachy_memory.integrations.bridge_process.HelperBridge`
(``python -m reachy_memory.integrations.bridge_helper FROM_FD TO_FD``): a thread-mode
:class:`~reachy_memory.integrations.reachy_mini.MemoryBridge` fed with the control
process's calls from one pipe, its replies, snapshots, counters and log records written
back on the other (the framing, msgpack: :mod:`.bridge_process`). It gives way to the control
loop (SCHED_BATCH, a higher nice), ignores SIGINT, and ends after the control process's
close(), or by itself when that process is gone (its pipe closes), having given the queued
writes ``CLOSE_ON_EXIT`` seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from reachy_memory.config import from_dict
from reachy_memory.daemon.protocol import error_to_wire
from reachy_memory.errors import ReachyMemoryError, TooLargeError
from reachy_memory.integrations.bridge_process import (
    _CALLS,
    _MAX_FRAME,
    _READ_CHUNK,
    CLOSE_ON_EXIT,
    HELPER_NICE,
    _encode_reply,
    _encode_snapshot,
    _frame,
    _Frames,
)
from reachy_memory.integrations.reachy_mini import MemoryBridge, MemorySnapshot, log


class _Forward(logging.Handler):
    """Sends the helper's log records to the control process, which logs them again."""

    def __init__(self, helper: _Helper) -> None:
        super().__init__(logging.INFO)
        self._helper = helper
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self._helper.post(["log", record.name, record.levelno, self.format(record)])


class _Helper:
    """The helper process: a thread-mode MemoryBridge fed from the control process's calls;
    its replies, snapshots, counters and log records written back."""

    def __init__(self, from_control: int, to_control: int) -> None:
        self._in, self._out = from_control, to_control
        self._outbox: list[bytes] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._finished = threading.Event()
        self._bridge: MemoryBridge | None = None

    def post(self, message: Any) -> None:
        with self._lock:
            self._outbox.append(_frame(message))
        self._wake.set()

    def run(self) -> int:
        frames = _Frames(calls=True)
        first: list[Any] = []
        while not first:
            data = os.read(self._in, _READ_CHUNK)
            if not data:
                return 0
            first = frames.feed(data)
        kind, settings = first[0]
        assert kind == "init", kind
        if settings["config"] is not None:
            settings["config"] = from_dict(settings["config"])
        self._bridge = MemoryBridge(helper=False, **settings).start()
        reader = threading.Thread(target=self._read_calls, args=(frames, first[1:]), name="bridge-calls",
                                  daemon=True)
        reader.start()
        try:
            self._report_until_finished()
        except BrokenPipeError:  # the control process is gone: nobody to report to
            self._finished.wait(CLOSE_ON_EXIT + 1)
        return 0

    def _read_calls(self, frames: _Frames, pending: list[Any]) -> None:
        assert self._bridge is not None
        try:
            for message in pending:
                if self._apply(message):
                    return
            while True:
                data = os.read(self._in, _READ_CHUNK)
                if not data:  # the control process ended without close()
                    self._bridge.close(CLOSE_ON_EXIT)
                    return
                for message in frames.feed(data):
                    if self._apply(message):
                        return
        except Exception:  # a garbled pipe (ProtocolError, a message of the wrong shape): end as at the app's end
            log.exception("memory bridge helper: the control process's pipe is garbled")
            self._bridge.close(CLOSE_ON_EXIT)
        finally:
            self._finished.set()
            self._wake.set()

    def _apply(self, message: list[Any]) -> bool:
        """Run one message; True once close() ran (nothing follows it)."""
        assert self._bridge is not None
        if message[0] == "close":
            self._bridge.close(max(0.0, message[1] - time.monotonic()))
            return True
        _, seq, name, args, kwargs, answered = message
        try:
            if name not in _CALLS:
                raise ReachyMemoryError(f"not a bridge call: {name!r}")
            result = getattr(self._bridge, name)(*args, **kwargs)
        except Exception as exc:  # checked on the caller's side already: say it, do not die
            log.exception("memory bridge helper: %s failed", name)
            if answered:
                self._post_error(seq, exc)
            return False
        if answered and isinstance(result, Future):
            result.add_done_callback(functools.partial(self._settle, seq, name))
        return False

    def _settle(self, seq: int, name: str, future: Future[Any]) -> None:
        exc = future.exception()
        if exc is not None:
            self._post_error(seq, exc)
            return
        try:
            payload = _encode_reply(name, future.result())
        except Exception as exc:  # a value msgpack cannot carry: the caller gets why
            self._post_error(seq, ReachyMemoryError(f"memory bridge reply could not be sent: {exc}"))
            return
        if len(payload) > _MAX_FRAME - 64:
            self._post_error(seq, TooLargeError(f"memory bridge reply of {len(payload)} bytes could not be sent",
                                                field="reply", size=len(payload), limit=_MAX_FRAME - 64))
            return
        self.post(["done", seq, True, payload])

    def _post_error(self, seq: int, exc: BaseException) -> None:
        """Answer call ``seq`` with ``exc`` (its error map: the same class arrives; a message
        msgpack cannot carry, a lone surrogate, goes escaped and without the fields)."""
        body = error_to_wire(exc)
        try:
            self.post(["done", seq, False, body])
        except (TypeError, ValueError, OverflowError):
            body |= {"message": body["message"].encode("utf-8", "backslashreplace").decode(), "fields": {}}
            self.post(["done", seq, False, body])

    def _report_until_finished(self) -> None:
        """Send snapshots and counters when they change, replies and logs as they come; then
        the last report, once close() (or the end of the control process) has run."""
        assert self._bridge is not None
        bridge = self._bridge
        snapshot: MemorySnapshot | None = None
        counters: dict[str, Any] | None = None
        while True:
            finished = self._finished.is_set()
            if bridge.latest() is not snapshot:
                snapshot = bridge.latest()
                self.post(["snap", self._snapshot_bytes(snapshot)])
            now = dataclasses.asdict(bridge.stats)
            if now != counters:
                counters = now
                self.post(["stats" if not finished else "closed", now])
            elif finished:
                self.post(["closed", now])
            self._write()
            if finished:
                return
            self._wake.wait(0.01)
            self._wake.clear()

    @staticmethod
    def _snapshot_bytes(snapshot: MemorySnapshot) -> bytes:
        """The snapshot's bytes; one msgpack cannot carry (a window entry the daemon never
        sends) goes as its fetch time with the error: the loop sees why."""
        try:
            return _encode_snapshot(snapshot)
        except Exception as exc:
            return _encode_snapshot(MemorySnapshot(fetched_at=snapshot.fetched_at,
                                                   error=f"memory bridge snapshot could not be sent: {exc}"))

    def _write(self) -> None:
        with self._lock:
            out, self._outbox = self._outbox, []
        data = b"".join(out)
        view = memoryview(data)
        while view:
            view = view[os.write(self._out, view):]


def _yield_to_the_loop() -> None:
    """Make this process (its threads, started after this) give way to the control loop:
    SCHED_BATCH (Linux: a woken helper does not preempt a running loop, which measured
    as +3 ms p99 for a record_turn on a busy 2-core machine) and a nice of ``HELPER_NICE``."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # type: ignore[attr-defined]
    with contextlib.suppress(AttributeError, OSError):
        os.nice(HELPER_NICE)


def main(argv: list[str]) -> int:
    """``python -m reachy_memory.integrations.bridge_process FROM_FD TO_FD`` (HelperBridge's child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _yield_to_the_loop()
    helper = _Helper(int(argv[1]), int(argv[2]))
    root = logging.getLogger("reachy_memory")
    root.addHandler(_Forward(helper))
    root.setLevel(logging.INFO)
    root.propagate = False
    return helper.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
