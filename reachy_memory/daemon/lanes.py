"""The daemon's worker threads and the bounded queues that feed them: where a request
goes after the I/O thread read it, and how its reply comes back.

One path for every op, read from its row of the op table (``operations.py``):

* the row's ``lane`` is the queue :meth:`Lanes.submit` puts it on (an inline op is
  answered by the I/O thread itself, :meth:`Lanes.run`);
* ``embed``: the embedding thread runs the op's ``prepare`` (``handlers.py``), then
  hands it to the engine queue;
* the engine thread runs the op's handler: a ``read``'s reply goes at once, a
  write's once what the journal holds is durable (the sync thread makes it so:
  one fsync serves every write made before it, and the engine goes on meanwhile);
* ``background``: a thread of its own, one job at a time, beside the engine;
* a ``capped`` read whose reply would pass ``server.max_reply_bytes`` is refused.

Replies go back to the I/O thread through an inproc PUSH socket per worker (a
ZeroMQ socket is one thread's): only the I/O thread touches the ROUTER.

Who owns what: the I/O thread writes ``inflight``, ``enqueued``, ``last_request``
and the count of backups queued; the background thread the count of backups
answered; the engine thread ``engine_beat`` and its :class:`Upkeep`.  The engine
thread reads the counts to know when it is idle (:meth:`quiet`); the I/O thread
reads ``engine_beat`` for the watchdog.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from reachy_memory.config import Config
from reachy_memory.daemon import protocol as proto
from reachy_memory.daemon.clock import clock_synchronized
from reachy_memory.daemon.handlers import HANDLERS, Handler
from reachy_memory.daemon.jobs import Job, Stats
from reachy_memory.daemon.upkeep import Upkeep
from reachy_memory.errors import BusyError, ReachyMemoryError, RequestTimeoutError, TooLargeError

log = logging.getLogger(__name__)

__all__ = ["REPLIES", "Lanes"]

REPLIES = "inproc://reachy-memory-replies"


class Lanes:
    """The embed, engine, sync and background threads, their queues, and the jobs in
    flight.  ``context`` is what every handler gets as ``d`` (the Daemon)."""

    def __init__(self, context: Any, store: Any, config: Config, stats: Stats, ctx: zmq.Context, *,
                 clock_sync: Callable[[], bool | None] = clock_synchronized,
                 handlers: dict[str, Handler] = HANDLERS) -> None:
        self._context, self.store, self.config, self.stats, self._ctx = context, store, config, stats, ctx
        self.handlers = handlers
        size = config.server.queue_size
        self.embed_q: queue.Queue[Job | None] = queue.Queue(size)
        self.engine_q: queue.Queue[Job | Callable[[], None] | None] = queue.Queue(size)
        self.background_q: queue.Queue[Job | None] = queue.Queue(1)  # one running, one waiting
        # (job, reply, what makes it durable): bounded, so a write flood on a slow disk holds the
        # engine back (backpressure) instead of growing without end
        self.sync_q: queue.Queue[tuple[Job | None, bytes, Callable[[], None]] | None] = queue.Queue(4 * size)
        self._upkeep_syncing = threading.Event()  # the engine's own writes wait in sync_q (see _sync_later)
        self.inflight = 0  # requests queued or being run, not yet answered
        self.enqueued = 0  # requests queued so far (a heap trim is due only after some)
        self.last_request = time.monotonic()  # a request's arrival (monotonic)
        # Backups in flight are in ``inflight`` too, but the engine's idle upkeep need not yield
        # to them (they run beside it): queued (I/O thread) and answered (background thread).
        self._background_queued = 0
        self._background_answered = 0
        self.engine_beat = time.monotonic()
        self.upkeep = Upkeep(store, config, quiet=self.quiet, last_request=lambda: self.last_request,
                             clock_sync=clock_sync)

    def threads(self) -> list[threading.Thread]:
        """The worker threads (not started), in the order :meth:`queues` stops them."""
        loops = (("embed", self.embed_loop), ("engine", self.engine_loop), ("sync", self.sync_loop),
                 ("background", self.background_loop))
        return [threading.Thread(target=loop, name=name, daemon=True) for name, loop in loops]

    def queues(self) -> list[queue.Queue[Any]]:
        """The workers' queues, in the order of :meth:`threads` (a None put on one stops its worker)."""
        return [self.embed_q, self.engine_q, self.sync_q, self.background_q]

    def depths(self) -> dict[str, int]:
        return {"embed": self.embed_q.qsize(), "engine": self.engine_q.qsize(), "sync": self.sync_q.qsize(),
                "background": self.background_q.qsize()}

    # -- the I/O thread's side -----------------------------------------------------------

    def submit(self, job: Job) -> BusyError | None:
        """Queue ``job`` on its row's lane; the BusyError to answer (counted) when that queue is full."""
        background = job.op.lane == "background"
        self.inflight += 1  # before the put: the engine must never see the job queued but not in flight
        self.last_request = job.received
        self.enqueued += 1
        self._background_queued += background
        try:
            lane = self.embed_q if job.op.lane == "embed" else self.background_q if background else self.engine_q
            lane.put_nowait(job)
        except queue.Full:
            self.inflight -= 1
            self._background_queued -= background
            self.stats.record(job.op.name, time.monotonic() - job.received, failed=True)
            return BusyError("a long job (a backup, a dedupe) runs and another waits; try again when they are done"
                             if background else "daemon queues are full")
        return None

    def answered(self) -> None:
        """A queued job's reply left (the I/O thread forwarded it)."""
        self.inflight -= 1

    def schedule(self, task: Callable[[], None]) -> None:
        """Queue engine-thread maintenance (``task()``); postponed, logged, when the queue is full."""
        try:
            self.engine_q.put_nowait(task)
        except queue.Full:
            log.warning("engine queue full; scheduled maintenance postponed")

    # -- running a job -------------------------------------------------------------------

    def run(self, job: Job, *, record: bool = True) -> bytes:
        """``job``'s reply, from its row's handler (its error's, when it fails: recorded
        then); a success is recorded in the stats unless ``record`` is False (see
        :meth:`record_done`)."""
        started = time.monotonic()
        try:
            self._check_deadline(job)
            result = self.handlers[job.op.name].run(self._context, job)
        except Exception as exc:
            return self.failure(job, exc)
        if job.op.lane != "inline":  # an inline op's whole time is its work on the I/O thread
            job.stages["engine"] = time.monotonic() - started
        reply = proto.ok(job.request_id, result)
        limit = self.config.server.max_reply_bytes
        if job.op.capped and len(reply) > limit:
            return self.failure(job, TooLargeError(
                f"{job.op.name}: the result is {len(reply)} bytes, over the {limit}-byte reply limit; ask for fewer "
                "results (limit) or raise server.max_reply_bytes", field="result", size=len(reply), limit=limit))
        job.done = True
        if record:
            self.record_done(job)
        return reply

    def record_done(self, job: Job) -> None:
        """Record a job :meth:`run` did not record (a success whose reply waited for its
        fsync: the wait counts)."""
        if job.done:
            self.stats.record(job.op.name, time.monotonic() - job.received, failed=False, stages=job.stages)

    def failure(self, job: Job, exc: Exception) -> bytes:
        """The error reply for ``exc`` (recorded); an exception not ours is logged and ``internal``."""
        self.stats.record(job.op.name, time.monotonic() - job.received, failed=True)
        if isinstance(exc, ReachyMemoryError):
            return proto.error_from(job.request_id, exc)
        log.exception("internal error in %s", job.op.name)
        return proto.error(job.request_id, "internal", f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _check_deadline(job: Job) -> None:
        if job.deadline is not None and time.monotonic() > job.deadline:
            raise RequestTimeoutError(f"{job.op.name}: deadline passed before the work started")

    def _push_socket(self) -> zmq.Socket:
        push = self._ctx.socket(zmq.PUSH)
        push.linger = 1000
        push.connect(REPLIES)
        return push

    # -- the workers ---------------------------------------------------------------------

    def embed_loop(self) -> None:
        """Embedding thread: an embed op's ``prepare`` (checks, then the embedding), then on to the engine."""
        push = self._push_socket()
        while (job := self.embed_q.get()) is not None:
            try:
                self._check_deadline(job)
                started = time.monotonic()
                job.prepared = self.handlers[job.op.name].prepare(self._context, job)  # type: ignore[misc]
                job.stages["embed"] = time.monotonic() - started
                self.engine_q.put(job, timeout=1.0)
            except queue.Full:
                push.send_multipart([*job.envelope, proto.error_from(job.request_id, BusyError("engine queue full"))])
            except Exception as exc:
                push.send_multipart([*job.envelope, self.failure(job, exc)])
        push.close()

    def engine_loop(self) -> None:
        """Engine thread: jobs and maintenance tasks in arrival order; upkeep when idle."""
        push, upkeep = self._push_socket(), self.upkeep
        while True:
            self.engine_beat = time.monotonic()
            try:  # with upkeep left, idle time starts 5 ms after the last request, not 50
                item = self.engine_q.get(timeout=0.005 if upkeep.left else 0.05)
            except queue.Empty:
                upkeep.check_sync()
                with self.store.deferred_durability():
                    upkeep.left = upkeep.idle()
                self._sync_later()
                continue
            if item is None:
                break
            upkeep.check_sync()  # before each job too: a write after a sync lands after its redate
            if isinstance(item, Job):
                self._answer(push, item)
            else:
                with self.store.deferred_durability():
                    _internal(item)
                self._sync_later()
        push.close()

    def _answer(self, push: zmq.Socket, job: Job) -> None:
        """Engine thread: run ``job``; a read's reply goes at once (never held for the
        fsync of an earlier write: what it returns may be a write not durable yet, whose
        own reply still waits for it), a write's once what the journal holds is durable
        (on the sync thread, when an fsync is due)."""
        if job.op.read:
            push.send_multipart([*job.envelope, self.run(job)])
            return
        with self.store.deferred_durability():
            reply = self.run(job, record=False)
        mark = self.store.durability_mark()
        if mark is None:
            self.record_done(job)
            push.send_multipart([*job.envelope, reply])
        else:
            self.sync_q.put((job, reply, mark))

    def _sync_later(self) -> None:
        """Engine thread, after its own upkeep (decay clock refreshes, vectors embedded
        late, the scheduled expiry sweep): their fsync goes to the sync thread too, so
        that a search arriving meanwhile does not wait for it.  Nobody waits for their
        durability: with the sync queue full, the next write's fsync (or closing) covers
        them; a power cut before that loses only what the daemon redoes by itself."""
        if self._upkeep_syncing.is_set():  # one at a time (an idle tick comes every 5-50 ms)
            return
        mark = self.store.durability_mark()
        if mark is not None:
            self._upkeep_syncing.set()  # (before the put: the sync thread clears it once done)
            try:
                self.sync_q.put_nowait((None, b"", mark))
            except queue.Full:
                self._upkeep_syncing.clear()

    def sync_loop(self) -> None:
        """Sync thread: make each write durable, then send its reply (an fsync that
        fails replaces it by the error; the store then refuses writes). One fsync covers
        every write queued before it: the later marks return at once."""
        push = self._push_socket()
        while (item := self.sync_q.get()) is not None:
            job, reply, mark = item
            if job is None:  # the engine's own upkeep: no reply waits for it
                try:
                    mark()
                except Exception as exc:
                    log.warning("the engine's upkeep writes are not known durable yet: %s", exc)
                self._upkeep_syncing.clear()
                continue
            push.send_multipart([*job.envelope, self._durable_reply(job, reply, mark)])
        push.close()

    def _durable_reply(self, job: Job, reply: bytes, mark: Callable[[], None]) -> bytes:
        """``reply`` once ``mark`` has returned; when it raises, the error instead (a
        reply that already was an error stays that error, counted once).  Never raises:
        whatever ``mark`` raises, the sync thread goes on (else every later write would
        wait for good, and the engine with them once the queue is full)."""
        started = time.monotonic()
        try:
            mark()
        except Exception as exc:
            return self.failure(job, exc) if job.done else reply
        job.stages["sync"] = time.monotonic() - started
        self.record_done(job)
        return reply

    def background_loop(self) -> None:
        """Background thread: long jobs (backups), one at a time, beside the engine."""
        push = self._push_socket()
        while (job := self.background_q.get()) is not None:
            push.send_multipart([*job.envelope, self.run(job)])
            self._background_answered += 1  # after the reply: until the I/O thread counts it, still in flight
        push.close()

    def quiet(self) -> bool:
        """Nothing queued for the engine and no request in flight but backups (idle work
        may run: a backup is written beside the engine, and takes seconds to minutes)."""
        background = self._background_queued - self._background_answered
        return self.engine_q.empty() and self.inflight - background <= 0


def _internal(task: Callable[[], None]) -> None:
    try:
        task()
    except Exception:  # maintenance must never take the daemon down
        log.exception("maintenance task failed")
