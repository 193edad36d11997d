"""The queue of memories that have no vector yet, embedded in idle time.

A memory is stored without a vector when the store had no model (a daemon
started before ``reachy-memory model fetch``) or the model failed on the
write; such a memory is found by its words only.  Before, only a manual
``reachy-memory reindex`` gave it a vector.  Now the store queues it, at open
(a scan) and whenever a write lands without a vector (:meth:`Backfill.note`),
and :meth:`MemoryStore.maintain <reachy_memory.MemoryStore.maintain>` (the
daemon's idle time) embeds it, oldest first, a step of a few milliseconds at
a time.  A failing model, or a frame that cannot be written, pauses the queue
instead of retrying in a loop.

Thread: owned by the thread that commits and calls ``maintain`` (the daemon's
engine thread; the caller in-process).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from reachy_memory.engine.records import Record, encode, is_put

PAUSE_SECONDS = 300.0  # after the model failed on a backfill: try again this much later
COMMIT_EVERY = 16  # embedded memories per journal frame: one fsync per 16, not per memory (SD cards)


def lacking_vector(records: Iterable[Record], key: str | None) -> list[Record]:
    """The records without a vector from ``key``, in stored order (by time; ``sorted``
    keeps the table's order among equal times): what a backfill or a reindex embeds."""
    return sorted((r for r in records if r.vkey != key), key=lambda r: r.created)


class Backfill:
    """Ids of memories waiting for a vector from the current model, oldest first.

    Oldest first, as they were stored: a re-put memory moves to the end of the
    record table, and turns stored in one batch share a time, so re-putting them in
    their stored order is what keeps the newest turn the newest (after a restart too).
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._ids: deque[str] = deque()  # taken from the left
        self._queued: set[str] = set()
        self._paused_until = 0.0
        self._clock = clock or (lambda: time.monotonic())  # looked up per call: tests move time
        self._held: list[tuple[Record, bytes]] = []  # embedded, not yet committed
        self.embedded = 0  # committed since open, for the log

    def __len__(self) -> int:
        """Memories still waiting for a vector (queued or embedded but not yet committed);
        one forgotten by an expiry sweep counts until its turn comes."""
        return len(self._queued) + len(self._held)

    def plan(self, records: Iterable[Record], key: str | None) -> int:
        """Queue every record without a vector from ``key`` in stored order (one scan, at
        open; ``sorted`` keeps the table's order among equal times); returns how many."""
        self._ids = deque(r.id for r in lacking_vector(records, key))
        self._queued = set(self._ids)
        return len(self._ids)

    def note(self, ops: list[list[Any]]) -> None:
        """Queue the memories that ``ops`` (a committed frame) wrote without a vector
        (person ops, which are maps, pass by)."""
        for op in ops:
            if is_put(op) and op[2] is None:
                self._queue(op[1]["id"])
            elif isinstance(op, list) and op[:1] == ["del"]:
                self._queued.discard(op[1])  # its entry in _ids is skipped when reached

    def _queue(self, memory_id: str, *, first: bool = False) -> None:
        if memory_id in self._queued:
            return
        self._queued.add(memory_id)
        if first:
            self._ids.appendleft(memory_id)
        else:
            self._ids.append(memory_id)

    def ready(self) -> bool:
        """Work waits and the queue is not paused."""
        return bool(self._ids) and self._clock() >= self._paused_until

    def take(self, records: Mapping[str, Record], key: str | None) -> Record | None:
        """The oldest queued record that still lacks a vector from ``key``, or None
        (forgotten ones and ones given a vector meanwhile are dropped)."""
        while self._ids:
            memory_id = self._ids.popleft()
            if memory_id not in self._queued:
                continue  # forgotten since it was queued (or queued again further on)
            self._queued.discard(memory_id)
            rec = records.get(memory_id)
            if rec is not None and rec.vkey != key:
                return rec
        return None

    def hold(self, rec: Record, vector: bytes) -> None:
        """``rec`` embedded as ``vector``, to commit with the next frame."""
        self._held.append((rec, vector))

    def due(self) -> bool:
        """Held vectors make a frame: :data:`COMMIT_EVERY` of them, or all there will be for now."""
        return len(self._held) >= COMMIT_EVERY or bool(self._held and not self.ready())

    def drain(self, records: Mapping[str, Record], key: str | None) -> list[list[Any]]:
        """The ``put`` ops of the held vectors whose memory is unchanged since it was
        embedded, in the order taken; one changed meanwhile (and still without a
        vector) is queued again.  Call :meth:`committed` or :meth:`failed` after."""
        ops: list[list[Any]] = []
        for rec, vector in self._held:
            now = records.get(rec.id)
            if now is rec:
                ops.append(["put", encode(rec.replace(vkey=key)), vector])
            elif now is not None and now.vkey != key:
                self._queue(now.id)
        self._held = []
        return ops

    def committed(self, ops: list[list[Any]]) -> None:
        self.embedded += len(ops)

    def failed(self, ops: list[list[Any]]) -> None:
        """The frame of ``ops`` could not be written (disk full, read-only): their
        memories go back to the front of the queue, which pauses."""
        for op in reversed(ops):
            self._queue(op[1]["id"], first=True)
        self._paused_until = self._clock() + PAUSE_SECONDS

    def put_back(self, rec: Record) -> None:
        """The model failed on ``rec``: it goes to the end of the queue (one text the
        model keeps failing on does not hold up the others) and the queue pauses."""
        self._queue(rec.id)
        self._paused_until = self._clock() + PAUSE_SECONDS
