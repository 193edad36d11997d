"""The daemon: serves a MemoryStore over ZeroMQ (see ``protocol`` for the wire format).

Threads, so that the robot's control loop never waits behind slow work::

    I/O thread (main)   ROUTER socket: decode, validate, answer cheap ops inline
                        (ping, health, stats, get, get_context, get_context_window),
                        forward replies, run the scheduler and the watchdog
    embed thread        embeds queries and new memories (onnxruntime releases the GIL)
    engine thread       the only thread that mutates the store or searches its indexes;
                        idle time inserts pending vectors into the graph
    sync thread         makes each write durable (fsync), then sends its reply: the engine
                        goes on meanwhile (a search never waits behind a write's fsync),
                        and one fsync serves every write made before it (group commit)
    background thread   writes backups from a frozen view of the store, one at a time
                        (the store lock only to freeze and thaw: the engine goes on)

Queues between them are bounded: when one is full the request is answered
``busy`` at once.  A request's ``timeout_ms`` is checked before work starts.
SIGTERM/SIGINT stop intake, finish what is queued (up to
``server.drain_seconds``), flush and close the store.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import signal
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import zmq

from reachy_memory._threads import bound_native_heap, release_free_heap
from reachy_memory.config import Config, ServerConfig
from reachy_memory.daemon import protocol as proto
from reachy_memory.daemon.clock import STEP_SECONDS, ClockWatch, Redate, SyncWatch, clock_synchronized
from reachy_memory.daemon.endpoint import (
    EndpointLock,
    check_endpoint,
    ipc_path,
    load_certificate,
    prepare_ipc_dir,
    resolve_endpoint,
)
from reachy_memory.daemon.operations import LANES, OPERATIONS, check_args
from reachy_memory.daemon.systemd import notify, watchdog_interval
from reachy_memory.embedding.embedder import describe, load_embedder
from reachy_memory.embedding.model_files import local_weights, weights_signature
from reachy_memory.engine.store import MemoryStore
from reachy_memory.errors import (
    AlreadyRunningError,
    BusyError,
    ConfigError,
    ModelUnavailableError,
    ProtocolError,
    ReachyMemoryError,
    RequestTimeoutError,
    TooLargeError,
    ValidationError,
)
from reachy_memory.model import to_epoch

log = logging.getLogger(__name__)
REPLIES = "inproc://reachy-memory-replies"
# Replies queued per client before further ones are dropped and counted (a client may pipeline
# a burst of requests, so not fewer); with reads capped at server.max_reply_bytes (1 MiB) a
# client that never reads holds at most 256 MiB, and in practice far less (README, abuse).
REPLY_HWM = 256
# Reads whose result can outgrow their request are capped at server.max_reply_bytes (a write's
# reply echoes what it stored, so it is bounded by the request limit, and is never refused
# after the write was made durable).
CAPPED = frozenset({"search", "recall", "export", "history", "context_for", "people"})
# Engine-thread reads: answered at once, never held for the fsync of an earlier write (what
# they return may be a write not durable yet, whose own reply still waits for it). Every
# other engine-thread op is answered once what the journal holds is durable, even when it
# wrote nothing itself: a retried store finds its memory written but maybe not synced.
READS = frozenset({"search", "export", "recall", "history", "find_person", "person_by_external_id", "people",
                   "person_redirects", "note", "context_for"})
IDLE_STEP = 8  # vectors (or buried records) per upkeep step: 2-4 ms of graph insertion on this VM
IDLE_SLICE = 0.04  # seconds of upkeep per idle tick (the engine then checks its queue again)
UPKEEP_PAUSE_SECONDS = 60.0  # after an unexpected fault in idle upkeep (not retried every 50 ms)
MODEL_POLL_SECONDS = 5.0  # a daemon started before 'model fetch' looks for the weights this often (stat calls)
INLINE = LANES["inline"]  # answered on the I/O thread (lock-free views)
EMBEDDED = LANES["embed"]  # embedded on the embedding thread, committed on the engine thread
BACKGROUND = LANES["background"]  # long jobs on a thread of their own (a backup of 100k memories: seconds)
# SIGTERM's worst case, part by part: the I/O loop lets in-flight requests finish for up to
# server.drain_seconds; _shutdown gives the workers STOP_WORKERS_SECONDS in all (one deadline
# for their sentinels and joins); the store's close (a closing compaction, after any background
# one in flight: 4.3 s at 100k memories on the dev VM, README; a backup is abandoned) is allowed STOP_CLOSE_SECONDS but
# not cut short (a kill there is a crash, recovered at the next open).  TimeoutStopSec in
# systemd/reachy-memory.service must stay above STOP_BUDGET_SECONDS (tests/test_systemd_units.py)
# or systemd SIGKILLs a daemon still stopping: raise it with server.drain_seconds.
STOP_WORKERS_SECONDS = 30.0
FINAL_REPLIES_LINGER_MS = 500  # how long the last replies may take to leave when the ROUTER closes
STOP_CLOSE_SECONDS = 30.0
STOP_BUDGET_SECONDS = ServerConfig.drain_seconds + STOP_WORKERS_SECONDS + STOP_CLOSE_SECONDS


@dataclass
class _Job:
    """One request on its way through the queues."""

    envelope: list[bytes]
    request_id: Any
    op: str
    args: dict[str, Any]
    deadline: float | None
    received: float
    prepared: Any = None
    stages: dict[str, float] = field(default_factory=dict)  # seconds spent per stage (see stats)
    done: bool = False  # it succeeded (its reply is an ok one)


class _BackupProgress:
    """The backup being written, as ``health`` shows it: the background thread writes
    ``written``, the I/O thread reads it (one int, replaced whole)."""

    def __init__(self, path: str) -> None:
        self.path, self.since, self.written = path, time.monotonic(), 0

    def wrote(self, total: int) -> None:
        self.written = total

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "seconds": round(time.monotonic() - self.since, 3), "bytes": self.written}


class _Recent:
    """The latest ``size`` durations (seconds) in a float32 ring: a deque of Python
    floats cost ~32 bytes a sample (2 MB over a daemon's ops) and kept every sample
    alive for 2,048 requests among the long-lived objects, fragmenting the heap.
    Two threads appending at once may overwrite one sample (stats only)."""

    def __init__(self, size: int = 2048) -> None:
        self._values = np.zeros(size, np.float32)
        self._count = 0

    def append(self, seconds: float) -> None:
        self._values[self._count % len(self._values)] = seconds
        self._count += 1

    def values(self) -> np.ndarray:
        """The samples held (at most ``size``, in no particular order)."""
        return self._values[: len(self)]

    def __len__(self) -> int:
        return min(self._count, len(self._values))


@dataclass
class _OpStats:
    count: int = 0
    errors: int = 0
    latencies: _Recent = field(default_factory=_Recent)
    # Where a request's time went: "wait" (in queues and handoffs), "embed", "engine".
    stages: dict[str, _Recent] = field(default_factory=dict)


class BadRequestLog:
    """Bad requests are logged at DEBUG one by one and summarised at WARNING at most once
    per ``every`` seconds (counts by code), so a fuzzing or buggy client cannot flood the
    journal.  Owned by the I/O thread (the engine thread's failures arrive as replies)."""

    def __init__(self, every: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._every, self._clock = every, clock
        self._counts: Counter[str] = Counter()
        self._next = clock() + every

    def note(self, code: str, detail: object) -> None:
        self._counts[code] += 1
        log.debug("bad request (%s): %s", code, detail)

    def summarise(self) -> None:
        """Log the counts since the last summary, if the interval has passed and there are any."""
        if self._clock() < self._next:
            return
        self._next = self._clock() + self._every
        if self._counts:
            log.warning("refused %d bad requests in the last %.0f s: %s", sum(self._counts.values()), self._every,
                        ", ".join(f"{code} {n}" for code, n in sorted(self._counts.items())))
            self._counts.clear()


class _ModelWatch:
    """Which model weights to load, and when, for a store running without a model: weights
    on disk, unchanged since the last poll (a copy by hand may be half done), and not the
    files a load already failed on (tried again once they change).

    Threads: :meth:`due` on the I/O thread; :meth:`failed` on the model-load thread and
    ``active = False`` on the engine thread, each after the I/O thread started that load."""

    def __init__(self, config: Config, active: bool) -> None:
        self._config = config
        self.active = active  # still waiting for a model
        self._seen: tuple[Any, ...] | None = None  # the weights' signature at the last poll
        folder = self._folder() if active else None
        self._failed = weights_signature(folder) if folder is not None else None  # the open's load failed on these
        self._loading = False

    def _folder(self) -> Path | None:
        try:
            return local_weights(self._config)
        except ModelUnavailableError:  # a configured model_dir without the files: they may come
            return None

    def due(self) -> tuple[Path, tuple[Any, ...]] | None:
        """(folder, signature) of weights to load now, or None; a load is then running."""
        folder = None if self._loading else self._folder()
        if folder is None:
            return None
        signature = weights_signature(folder)
        seen, self._seen = self._seen, signature
        if signature != seen or signature == self._failed:
            return None
        self._loading = True
        return folder, signature

    def failed(self, signature: tuple[Any, ...]) -> None:
        """The load of ``signature`` failed: polling goes on, for other files."""
        self._failed, self._loading = signature, False


class Daemon:
    """A running reachy-memory service. ``serve()`` blocks until stopped."""

    _handlers: ClassVar[dict[str, Callable[[Daemon, _Job], Any]]]
    _upkeep_paused_until = 0.0  # engine thread: idle upkeep stays off until then (monotonic) after a fault

    def __init__(self, config: Config, *, store: MemoryStore | None = None, endpoint: str | None = None,
                 insecure_tcp: bool = False, clock_sync: Callable[[], bool | None] = clock_synchronized) -> None:
        self._stopping = threading.Event()
        self._inflight = 0  # I/O thread writes; the engine thread only reads it (idle upkeep yields)
        self._last_request = time.monotonic()  # I/O thread writes (monotonic, a request's arrival); engine reads
        self._enqueued = 0  # I/O thread only: requests queued so far (a trim is due only after some)
        # Backups in flight are in _inflight too, but the engine's idle upkeep need not yield to
        # them (they run beside it): queued (I/O thread only) and answered (background thread only).
        self._background_queued = 0
        self._background_answered = 0
        self._install_signals()  # first: a SIGTERM while the model loads must still stop cleanly
        log.info("starting (pid %d): SIGTERM/SIGINT now stop cleanly", os.getpid())
        self.config = config
        self.endpoint = resolve_endpoint(endpoint, config)
        check_endpoint(self.endpoint, config, insecure_tcp=insecure_tcp)
        self._endpoint_lock = EndpointLock(self.endpoint)
        self._endpoint_lock.acquire()
        try:
            bound_native_heap()  # before the model loads and the threads start (arenas are per thread)
            self.store = store if store is not None else MemoryStore(config=config)  # an empty one is falsy
        except BaseException:
            self._endpoint_lock.release()
            raise
        # Started before 'model fetch', or on weights that failed to load: the I/O thread looks
        # for (changed) weights and loads them (the store then embeds what it holds in idle time).
        self._model_watch = _ModelWatch(config, store is None and self.store.embedder is None
                                        and config.embedding.enabled)
        self._ctx = zmq.Context()
        self._embed_q: queue.Queue[_Job | None] = queue.Queue(config.server.queue_size)
        self._engine_q: queue.Queue[_Job | Callable[[], None] | None] = queue.Queue(config.server.queue_size)
        self._background_q: queue.Queue[_Job | None] = queue.Queue(1)  # one running, one waiting
        # (job, reply, what makes it durable): bounded, so a write flood on a slow disk holds the
        # engine back (backpressure) instead of growing without end
        self._sync_q: queue.Queue[tuple[_Job | None, bytes, Callable[[], None]] | None] = queue.Queue(
            4 * config.server.queue_size)
        self._upkeep_syncing = threading.Event()  # the engine's own writes wait in _sync_q (see _sync_later)
        self._stats: dict[str, _OpStats] = {}  # op -> stats; threads add ops by setdefault
        self.bad_requests = BadRequestLog()
        self.replies_dropped = 0  # I/O thread only
        self._started = time.monotonic()  # uptime: not moved by a step of the wall clock
        self._clock = ClockWatch()  # engine thread (the sweep): a forward step defers a sweep
        # engine thread: NTP's first sync redates the stale period (after what the store held at start)
        self._sync = SyncWatch(synced=clock_sync, after=self.store.latest_time())
        self.last_redate: dict[str, Any] | None = None  # engine thread swaps it whole; health reads it
        self._engine_beat = time.monotonic()
        self._upkeep_left = False  # engine thread: the last idle slice ended with index work left
        self.last_cleanup: dict[str, Any] | None = None
        self.backup_running: _BackupProgress | None = None  # background thread sets and updates it
        self._trim_due = threading.Event()  # the I/O loop sets it every server.heap_trim_seconds
        self._trims: list[float] = []  # engine thread appends; durations (ms) of the last heap trims
        self._auth: Any = None

    # -- sockets -----------------------------------------------------------------------

    def _bind(self) -> zmq.Socket:
        router = self._ctx.socket(zmq.ROUTER)
        router.linger = 0
        # A hard cap far above the soft limit: bigger frames drop the peer before
        # they are buffered whole; the soft limit is answered ``too_large``.
        router.setsockopt(zmq.MAXMSGSIZE, self.config.server.max_message_bytes * 16 + 65536)
        # Replies to one client are bounded: past REPLY_HWM queued replies (a client that
        # stops reading) the next one is dropped and counted, so the daemon's memory stays bounded.
        router.setsockopt(zmq.SNDHWM, REPLY_HWM)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # report unroutable/full instead of silently dropping
        try:
            self._setup_curve(router)
            path = ipc_path(self.endpoint)
            if path is not None:
                prepare_ipc_dir(path)
                _remove_stale_socket(path)
            _bind_private(router, self.endpoint, path is not None)
            if path is not None:
                path.chmod(0o600)  # (made so by the umask already; kept for filesystems that ignore it)
        except BaseException:
            router.close()  # whatever failed: a CURVE key, the ipc directory, the path, the bind
            raise
        return router

    def _setup_curve(self, router: zmq.Socket) -> None:
        server = self.config.server
        if not server.curve_secret_key:
            return
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = load_certificate(server.curve_secret_key, "server.curve_secret_key")
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=server.curve_authorized_dir or "")
        router.curve_secretkey, router.curve_publickey, router.curve_server = secret, public, True

    # -- main loop ---------------------------------------------------------------------

    def serve(self) -> None:
        """Serve until SIGTERM/SIGINT or :meth:`stop`; closes everything on return."""
        router = self._bind()
        replies = self._ctx.socket(zmq.PULL)
        replies.bind(REPLIES)
        workers = [threading.Thread(target=self._embed_loop, name="embed", daemon=True),
                   threading.Thread(target=self._engine_loop, name="engine", daemon=True),
                   threading.Thread(target=self._sync_loop, name="sync", daemon=True),
                   threading.Thread(target=self._background_loop, name="background", daemon=True)]
        for w in workers:
            w.start()
        self._engine_q.put(self._cleanup)  # at start-up, then every cleanup_interval
        log.info("serving %s on %s (%d memories, embedder %s)", self.store.path.resolve(), self.endpoint,
                 len(self.store), describe(self.store.embedder)["state"])
        notify(f"READY=1\nSTATUS=serving {self.endpoint}")
        try:
            self._loop(router, replies)
        finally:
            notify("STOPPING=1")
            self._shutdown(workers, router, replies)

    def _loop(self, router: zmq.Socket, replies: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        next_cleanup = time.monotonic() + self.config.memory.cleanup_interval
        trim_every = self.config.server.heap_trim_seconds or float("inf")
        next_trim, trimmed_at = time.monotonic() + trim_every, 0
        beat, next_beat = watchdog_interval(), time.monotonic()
        next_model_check = time.monotonic() + MODEL_POLL_SECONDS
        drain_until: float | None = None
        while True:
            events = dict(poller.poll(50))
            if replies in events:
                self._forward(replies, router)
            if router in events and not self._stopping.is_set():
                self._receive(router)
            now = time.monotonic()
            if now >= next_cleanup:
                next_cleanup = now + self.config.memory.cleanup_interval
                self._enqueue_internal(self._cleanup)
            if now >= next_trim:
                next_trim = now + trim_every
                if self._enqueued != trimmed_at:  # an idle daemon has nothing new to give back
                    trimmed_at = self._enqueued
                    self._trim_due.set()  # done by the engine at its next idle moment
            if self._model_watch.active and now >= next_model_check:
                next_model_check = now + MODEL_POLL_SECONDS
                self._look_for_model()
            if beat and self.config.server.watchdog and now >= next_beat and now - self._engine_beat < 2 * beat:
                notify("WATCHDOG=1")
                next_beat = now + beat
            self.bad_requests.summarise()
            if self._stopping.is_set():
                if drain_until is None:  # a backup being written is abandoned now, its reply sent while
                    self.store.begin_closing()  # the loop still runs (one left to _shutdown could be lost)
                drain_until = drain_until or now + self.config.server.drain_seconds
                if self._inflight <= 0 or now > drain_until:
                    return

    def _look_for_model(self) -> None:
        """I/O thread: load the weights :class:`_ModelWatch` says are due on a thread of
        their own (a first load builds the graph, ~1-3 s) and hand them to the engine thread."""
        due = self._model_watch.due()
        if due is None:
            return
        log.info("the embedding model is now on disk (%s): loading it", due[0])
        threading.Thread(target=self._load_model, args=(due[1],), name="model-load", daemon=True).start()

    def _load_model(self, signature: tuple[Any, ...]) -> None:
        """Model-load thread: load, then queue the adoption for the engine thread."""
        try:
            embedder = load_embedder(self.store.model_config(), data_dir=self.store.path)
        except Exception as exc:  # anything (a full disk while building, a half-copied file): logged, retried
            self.store.embedder_error = f"the model on disk could not be loaded: {exc}"
            log.warning("%s; tried again when its files change", self.store.embedder_error)
            self._model_watch.failed(signature)
            return

        def adopt() -> None:  # engine thread
            self.store.adopt_embedder(embedder)  # adopted, or refused for good (embedder_error says why)
            self._model_watch.active = False

        while not self._stopping.is_set():  # the engine adopts it between requests
            try:
                self._engine_q.put(adopt, timeout=1.0)
                return
            except queue.Full:
                continue

    def _forward(self, replies: zmq.Socket, router: zmq.Socket) -> None:
        while True:
            try:
                frames = replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._inflight -= 1
            self._reply(router, frames)

    def _reply(self, router: zmq.Socket, frames: list[bytes]) -> None:
        """Send a reply without ever blocking the I/O thread; a client that went away or
        stopped reading loses it (counted in ``stats``)."""
        try:
            router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.replies_dropped += 1
            log.debug("reply dropped: %s", exc)

    def _receive(self, router: zmq.Socket) -> None:
        for _ in range(256):  # bounded, so replies and the scheduler keep flowing
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle(router, frames)

    def _handle(self, router: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        envelope, body = frames[:-1], frames[-1]
        limit = self.config.server.max_message_bytes
        if len(body) > limit:
            self.bad_requests.note("too_large", f"a {len(body)}-byte message")
            refused = TooLargeError(f"message of {len(body)} bytes exceeds {limit}", field="request",
                                    size=len(body), limit=limit)
            self._reply(router, [*envelope, proto.error_from(proto.peek_id(body), refused)])
            return
        try:
            job = self._parse(envelope, body)
        except ReachyMemoryError as exc:
            self.bad_requests.note(exc.code, exc)
            self._reply(router, [*envelope, proto.error_from(_request_id(exc, body), exc)])
            return
        if job.op in INLINE:
            self._reply(router, [*envelope, self._run(job, self._handlers)])
        else:
            self._enqueue(router, job)

    def _parse(self, envelope: list[bytes], body: bytes) -> _Job:
        message = proto.decode(body, untrusted=True)
        request_id = message.get("id")
        if not proto.is_request_id(request_id):
            raise ProtocolError("request 'id' must be a string or an integer")
        op, args = message.get("op"), message.get("args", {})
        if message.get("v") != proto.VERSION:
            raise _with_id(ProtocolError(f"unsupported protocol version {message.get('v')!r}; this daemon speaks 1"),
                           request_id)
        if not isinstance(op, str) or op not in OPERATIONS:
            raise _with_id(ProtocolError(f"unknown op {op!r}"), request_id)
        if not isinstance(args, dict):
            raise _with_id(ProtocolError("'args' must be a map"), request_id)
        try:
            args = check_args(OPERATIONS[op], args)
        except ValidationError as exc:
            raise _with_id(exc, request_id) from None
        timeout_ms = message.get("timeout_ms")
        if timeout_ms is not None and (isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float)):
            raise _with_id(ProtocolError("'timeout_ms' must be a number"), request_id)
        now = time.monotonic()
        deadline = now + timeout_ms / 1000.0 if timeout_ms is not None else None
        return _Job(envelope, request_id, op, args, deadline, now)

    def _enqueue(self, router: zmq.Socket, job: _Job) -> None:
        target: queue.Queue[Any] = (self._embed_q if job.op in EMBEDDED else
                                    self._background_q if job.op in BACKGROUND else self._engine_q)
        background = target is self._background_q
        self._inflight += 1  # before the put: the engine must never see the job queued but not in flight
        self._last_request = job.received
        self._enqueued += 1
        self._background_queued += background
        try:
            target.put_nowait(job)
        except queue.Full:
            self._inflight -= 1
            self._background_queued -= background
            self._record(job.op, time.monotonic() - job.received, failed=True)
            busy = BusyError("a backup is being written and another waits; try again when they are done"
                             if background else "daemon queues are full")
            self._reply(router, [*job.envelope, proto.error_from(job.request_id, busy)])

    def _enqueue_internal(self, task: Callable[[], None]) -> None:
        try:
            self._engine_q.put_nowait(task)
        except queue.Full:
            log.warning("engine queue full; scheduled maintenance postponed")

    # -- workers -----------------------------------------------------------------------

    def _embed_loop(self) -> None:
        push = self._push_socket()
        while (job := self._embed_q.get()) is not None:
            try:
                self._check_deadline(job)
                started = time.monotonic()
                job.prepared = self._prepare(job)
                job.stages["embed"] = time.monotonic() - started
                self._engine_q.put(job, timeout=1.0)
            except queue.Full:
                push.send_multipart([*job.envelope, proto.error_from(job.request_id, BusyError("engine queue full"))])
            except Exception as exc:
                push.send_multipart([*job.envelope, self._failure(job, exc)])
        push.close()

    def _engine_loop(self) -> None:
        push = self._push_socket()
        while True:
            self._engine_beat = time.monotonic()
            try:  # with upkeep left, idle time starts 5 ms after the last request, not 50
                item = self._engine_q.get(timeout=0.005 if self._upkeep_left else 0.05)
            except queue.Empty:
                self._check_sync()
                with self.store.deferred_durability():
                    self._upkeep_left = self._idle()
                self._sync_later()
                continue
            if item is None:
                break
            self._check_sync()  # before each job too: a write after a sync lands after its redate
            if isinstance(item, _Job):
                self._answer(push, item)
            else:
                with self.store.deferred_durability():
                    self._internal(item)
                self._sync_later()
        push.close()

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
                self._sync_q.put_nowait((None, b"", mark))
            except queue.Full:
                self._upkeep_syncing.clear()

    def _answer(self, push: zmq.Socket, job: _Job) -> None:
        """Engine thread: run ``job``; a read's reply goes at once, another's once what
        the journal holds is durable (on the sync thread, when an fsync is due)."""
        if job.op in READS:
            push.send_multipart([*job.envelope, self._run(job, self._handlers)])
            return
        with self.store.deferred_durability():
            reply = self._run(job, self._handlers, record=False)
        mark = self.store.durability_mark()
        if mark is None:
            self._record_done(job)
            push.send_multipart([*job.envelope, reply])
        else:
            self._sync_q.put((job, reply, mark))

    def _sync_loop(self) -> None:
        """Sync thread: make each write durable, then send its reply (an fsync that
        fails replaces it by the error; the store then refuses writes). One fsync covers
        every write queued before it: the later marks return at once."""
        push = self._push_socket()
        while (item := self._sync_q.get()) is not None:
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

    def _durable_reply(self, job: _Job, reply: bytes, mark: Callable[[], None]) -> bytes:
        """``reply`` once ``mark`` has returned; when it raises, the error instead (a
        reply that already was an error stays that error, counted once).  Never raises:
        whatever ``mark`` raises, the sync thread goes on (else every later write would
        wait for good, and the engine with them once the queue is full)."""
        started = time.monotonic()
        try:
            mark()
        except Exception as exc:
            return self._failure(job, exc) if job.done else reply
        job.stages["sync"] = time.monotonic() - started
        self._record_done(job)
        return reply

    def _background_loop(self) -> None:
        """Background thread: long jobs (backups), one at a time, beside the engine."""
        push = self._push_socket()
        while (job := self._background_q.get()) is not None:
            push.send_multipart([*job.envelope, self._run(job, self._handlers)])
            self._background_answered += 1  # after the reply: until the I/O thread counts it, still in flight
        push.close()

    def _internal(self, task: Callable[[], None]) -> None:
        try:
            task()
        except Exception:  # maintenance must never take the daemon down
            log.exception("maintenance task failed")

    def _idle(self) -> bool:
        """Index upkeep in small steps (``IDLE_STEP`` vectors, 2-4 ms) for up to
        ``IDLE_SLICE`` seconds, stopping as soon as a request is in flight: one step
        of 256 vectors held the engine ~50 ms, and a search arriving then waited for
        it (p99 43.5 ms, max 76 ms while 3,000 new vectors went into the graphs).
        A heap trim that is due goes first (:meth:`_trim_heap`).
        Returns True when work is left (the engine then comes back sooner)."""
        if time.monotonic() < self._upkeep_paused_until:
            return False
        if self._trim_due.is_set() and self._quiet():
            self._trim_due.clear()
            self._trim_heap()
        until = time.monotonic() + IDLE_SLICE
        try:
            while self._quiet() and time.monotonic() < until:
                if not self.store.maintain(budget=IDLE_STEP, save_cache=self._quiet_for_a_while()):
                    return False  # nothing left, or nothing doable yet (graphs still loading)
        except ReachyMemoryError as exc:
            log.warning("index maintenance failed: %s", exc)
            return False
        except Exception:  # a fault in upkeep must not end the engine thread: no request would be answered
            log.exception("index maintenance failed; idle upkeep pauses for %.0f s", UPKEEP_PAUSE_SECONDS)
            self._upkeep_paused_until = time.monotonic() + UPKEEP_PAUSE_SECONDS
            return False
        return True

    def _quiet_for_a_while(self) -> bool:
        """No request for ``server.graph_cache_quiet_seconds``: a graph cache save (tens of
        milliseconds at 100k memories, holding the GIL) may run without meeting one."""
        return time.monotonic() - self._last_request >= self.config.server.graph_cache_quiet_seconds

    def _quiet(self) -> bool:
        """Nothing queued for the engine and no request in flight but backups (idle work
        may run: a backup is written beside the engine, and takes seconds to minutes)."""
        background = self._background_queued - self._background_answered
        return self._engine_q.empty() and self._inflight - background <= 0

    def _push_socket(self) -> zmq.Socket:
        push = self._ctx.socket(zmq.PUSH)
        push.linger = 1000
        push.connect(REPLIES)
        return push

    def _run(self, job: _Job, table: dict[str, Callable[[Daemon, _Job], Any]], *, record: bool = True) -> bytes:
        """``job``'s reply (its error's, when it fails: recorded then); a success is
        recorded in the stats unless ``record`` is False (see :meth:`_record_done`)."""
        started = time.monotonic()
        try:
            self._check_deadline(job)
            result = table[job.op](self, job)
        except Exception as exc:
            return self._failure(job, exc)
        if job.op not in INLINE:  # an inline op's whole time is its work on the I/O thread
            job.stages["engine"] = time.monotonic() - started
        reply = proto.ok(job.request_id, result)
        if job.op in CAPPED and len(reply) > self.config.server.max_reply_bytes:
            limit = self.config.server.max_reply_bytes
            return self._failure(job, TooLargeError(
                f"{job.op}: the result is {len(reply)} bytes, over the {limit}-byte reply limit; ask for fewer "
                "results (limit) or raise server.max_reply_bytes", field="result", size=len(reply), limit=limit))
        job.done = True
        if record:
            self._record_done(job)
        return reply

    def _record_done(self, job: _Job) -> None:
        """Record a job :meth:`_run` did not record (a success whose reply waited for its
        fsync: the wait counts)."""
        if job.done:
            self._record(job.op, time.monotonic() - job.received, failed=False, stages=job.stages)

    def _failure(self, job: _Job, exc: Exception) -> bytes:
        self._record(job.op, time.monotonic() - job.received, failed=True)
        if isinstance(exc, ReachyMemoryError):
            return proto.error_from(job.request_id, exc)
        log.exception("internal error in %s", job.op)
        return proto.error(job.request_id, "internal", f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _check_deadline(job: _Job) -> None:
        if job.deadline is not None and time.monotonic() > job.deadline:
            raise RequestTimeoutError(f"{job.op}: deadline passed before the work started")

    def _record(self, op: str, seconds: float, *, failed: bool, stages: dict[str, float] | None = None) -> None:
        # one atomic setdefault: two threads meeting a new op must not both make one
        stats = self._stats.get(op) or self._stats.setdefault(op, _OpStats())
        stats.count += 1
        stats.errors += failed
        stats.latencies.append(seconds)
        if stages:  # what the stages do not account for waited in queues and handoffs
            for name, spent in (stages | {"wait": seconds - sum(stages.values())}).items():
                stats.stages.setdefault(name, _Recent()).append(spent)

    # -- op implementations ------------------------------------------------------------

    def _prepare(self, job: _Job) -> Any:
        a, store = job.args, self.store
        if job.op == "search":  # every argument checked here, once, before the embedding and the engine queue
            query = store.check_search(a["query"], a.get("memory_type"), a["limit"], a["min_score"], a.get("where"),
                                       mode=a.get("mode"), about=a.get("about"), owner=a.get("owner"),
                                       include_superseded=a["include_superseded"])
            return query, store.embed_query(query.text) if query.mode != "lexical" else None
        if job.op == "set_context":
            return store.prepare_context(a["key"], a["value"])
        if job.op == "import":
            return store.prepare_import(a["memories"], a.get("people") or ())
        if job.op == "record_turn":
            return store.prepare_turn(a["role"], a["content"], a.get("metadata"), owner=a.get("owner"), id=a.get("id"))
        return store.prepare(_store_items(job.op, a))

    def _check_sync(self) -> None:
        """Engine thread: redate the memories written since boot when NTP's first sync
        has just stepped the wall clock (``_clock.SyncWatch``); two clock reads otherwise.
        Never raises: a failure is logged and the memories keep their times."""
        try:
            redate = self._sync.check()
            if redate is not None:
                self._redate(redate)
        except Exception:  # the engine thread must go on answering
            log.exception("redating the memories written before the clock's first sync failed")

    def _redate(self, redate: Redate) -> None:
        """Journal and apply ``redate`` (``MemoryStore.redate``), log it, show it in ``health``."""
        moved = self.store.redate(redate.since, redate.until, redate.delta)
        self.last_redate = {"time": time.time(), "memories": moved, "delta_s": round(redate.delta, 3),
                            "since": redate.since, "until": redate.until}
        log.warning("NTP's first sync stepped the wall clock by %+.0f s: %d memories written since boot by the "
                    "stale clock redated by that much", redate.delta, moved)

    def _cleanup(self) -> None:
        """The scheduled expiry sweep, deferred by one interval when the wall clock just
        stepped forward (see ``_clock``): a step undone meanwhile deletes nothing then.
        NTP's first sync, seen first, redates what the stale clock dated (``_check_sync``)."""
        self._check_sync()
        step = self._clock.step()
        if step > STEP_SECONDS:
            self.last_cleanup = {"time": time.time(), "deleted": 0, "duration_ms": None, "deferred_s": round(step, 3)}
            log.warning("the wall clock stepped forward by %.0f s since the last expiry sweep: sweep deferred by "
                        "one cleanup_interval (a clock glitch would otherwise delete memories for good)", step)
            return
        started = time.monotonic()
        deleted = self.store.cleanup_expired()
        took = (time.monotonic() - started) * 1000
        self.last_cleanup = {"time": time.time(), "deleted": deleted, "duration_ms": round(took, 3)}
        log.info("cleanup_expired: deleted %d expired memories in %.1f ms (%d remain)", deleted, took, len(self.store))

    def _trim_heap(self) -> None:
        """Give the C heap's free pages back (``malloc_trim``, 1-6 ms at 10k memories),
        on the engine thread when no request is in flight.  A request arriving
        during it may wait: the trim holds each malloc arena while it walks it, so
        even the I/O thread's inline answers can block on ``malloc`` that long.
        Embedding frees its activations every call and the freed space stays
        scattered through the heap: 30 s after a 2-minute mixed load
        (``tools/bench_daemon.py``) RSS was 180 MB without trims and 173-177 MB
        with them.  Under a continuous load it gains nothing lasting (the heap
        fills again within seconds: peak 186 MB either way), so it waits for idle time."""
        started = time.monotonic()
        if release_free_heap():
            self._trims = [*self._trims[-99:], (time.monotonic() - started) * 1000]

    def health(self) -> dict[str, Any]:
        """Liveness summary: embedder state, counts, last cleanup, a backup being written, uptime."""
        read_only, running = self.store.read_only, self.backup_running
        status = "stopping" if self._stopping.is_set() else "read_only" if read_only else "ok"
        return {"status": status, "read_only": read_only,
                "embedder": describe(self.store.embedder) | {"error": self.store.embedder_error},
                "memories": len(self.store), "last_cleanup": self.last_cleanup, "last_redate": self.last_redate,
                "backup_running": running and running.to_dict(),
                "uptime_s": round(time.monotonic() - self._started, 3), "endpoint": self.endpoint,
                "data_dir": str(self.store.path.resolve())}  # absolute: a client compares it from elsewhere

    def stats(self) -> dict[str, Any]:
        """Per-op counts and latency percentiles, store sizes, queue depths, uptime."""
        ops: dict[str, dict[str, Any]] = {}
        for op, s in sorted(self._stats.items()):
            lat = s.latencies.values() * 1000 if len(s.latencies) else np.zeros(1)
            ops[op] = {"count": s.count, "errors": s.errors, "p50_ms": round(float(np.percentile(lat, 50)), 3),
                       "p99_ms": round(float(np.percentile(lat, 99)), 3)}
            if s.stages:
                ops[op]["stages_p50_ms"] = {name: round(1000 * float(np.percentile(v.values(), 50)), 3)
                                            for name, v in sorted(s.stages.items())}
        return {"ops": ops, "store": self.store.stats(), "uptime_s": round(time.monotonic() - self._started, 3),
                "queues": {"embed": self._embed_q.qsize(), "engine": self._engine_q.qsize(),
                           "sync": self._sync_q.qsize(), "background": self._background_q.qsize()},
                "replies_dropped": self.replies_dropped, "heap_trims": _trim_summary(self._trims)}

    # -- lifecycle ---------------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def stop(self) -> None:
        """Ask the daemon to stop: intake ends, queued work finishes, the store closes.

        Safe from a signal handler at any point of start-up.
        """
        first = not self._stopping.is_set()
        self._stopping.set()
        if first:
            log.info("stopping: finishing %d in-flight requests", self._inflight)

    def _shutdown(self, workers: list[threading.Thread], router: zmq.Socket, replies: zmq.Socket) -> None:
        """Stop the embed thread, then the engine and background threads (their sentinels
        and joins share one deadline, STOP_WORKERS_SECONDS from now; a worker still busy
        then is left running; a backup being written is abandoned first),
        forward the last replies, close the store and release the endpoint."""
        deadline = time.monotonic() + STOP_WORKERS_SECONDS
        self.store.begin_closing()  # a backup being written is abandoned now, not waited for
        queues: list[queue.Queue[Any]] = [self._embed_q, self._engine_q, self._sync_q, self._background_q]
        stages = list(zip(queues, workers, strict=True))
        for jobs, worker in stages:
            try:
                jobs.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                log.error("%s queue did not drain; stopping anyway", worker.name)
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        self._forward(replies, router)
        # Replies forwarded just before the loop ended may still be queued in the ROUTER:
        # linger 0 dropped them (one in ~8 abandoned backups' replies under load; a write's
        # acknowledgement could go the same way, its client then timing out and retrying).
        router.close(linger=FINAL_REPLIES_LINGER_MS)
        replies.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.store.close()
        if any(w.is_alive() for w in workers):
            # A worker still busy holds its sockets open, and term() would wait for it
            # for good; the workers are daemon threads, so the process ends without it.
            log.error("a worker thread is still busy; the ZeroMQ context is left to the exit")
        else:
            self._ctx.term()
        path = ipc_path(self.endpoint)
        if path is not None:
            path.unlink(missing_ok=True)
        self._endpoint_lock.release()
        log.info("stopped")


def _trim_summary(trims: list[float]) -> dict[str, float | None]:
    """Count, median and max (ms; None before the first) of the last heap trims."""
    if not trims:
        return {"recent": 0, "p50_ms": None, "max_ms": None}
    return {"recent": len(trims), "p50_ms": round(float(np.median(trims)), 3), "max_ms": round(max(trims), 3)}


def _request_id(exc: ReachyMemoryError, body: bytes) -> Any:
    """The id to answer a refused request with: the one ``_parse`` read, else the one
    at the start of a frame it could not decode (None: the client cannot tell which
    of its requests this was)."""
    request_id = getattr(exc, "request_id", None)
    return request_id if request_id is not None else proto.peek_id(body)


def _with_id(exc: ReachyMemoryError, request_id: Any) -> ReachyMemoryError:
    exc.request_id = request_id  # type: ignore[attr-defined]
    return exc


def _store_items(op: str, a: dict[str, Any]) -> list[dict[str, Any]]:
    """The items of the store-like ops (arguments already checked against the table)."""
    if op == "store_batch":
        return a["items"]  # type: ignore[no-any-return]
    kind = {"remember_fact": "fact", "remember_conversation": "conversation"}.get(op) or a["memory_type"]
    item = {"content": a["content"], "memory_type": kind, "metadata": a.get("metadata"), "id": a.get("id")}
    if op == "store":
        item |= {"owner": a.get("owner"), "shared": a["shared"]}
    return [item]


def _memory(m: Any) -> dict[str, Any] | None:
    return proto.memory_to_wire(m) if m is not None else None


def _memories(ms: list[Any]) -> list[dict[str, Any]]:
    return [proto.memory_to_wire(m) for m in ms]


def _person(p: Any) -> dict[str, Any] | None:
    return proto.person_to_wire(p) if p is not None else None


def _search(d: Daemon, job: _Job) -> list[dict[str, Any]]:
    return proto.results_to_wire(d.store.search_checked(*job.prepared))  # checked by _prepare


def _commit(d: Daemon, job: _Job) -> Any:
    memories = d.store.commit(job.prepared)
    return _memories(memories) if job.op == "store_batch" else _memory(memories[0])


def _export(d: Daemon, job: _Job) -> dict[str, Any]:
    limit = job.args["limit"]
    if not 1 <= limit <= 5000:
        raise ValidationError("limit must be an integer from 1 to 5000", field="limit")
    page, cursor = d.store.export_page(job.args.get("after"), limit)
    kept: list[Any] = []
    size = 0
    for memory in page:  # long memories: a shorter page, so the reply stays under the reply limit
        size += len(memory.content) * 4 + 512
        if kept and size > d.config.server.max_reply_bytes // 2:
            cursor = kept[-1].id
            break
        kept.append(memory)
    return {"memories": _memories(kept), "next": cursor}


def _backup(d: Daemon, job: _Job) -> dict[str, Any]:
    path = job.args["path"]
    if not path:
        raise ValidationError("path must be a non-empty string", field="path")
    if not os.path.isabs(os.path.expanduser(path)):  # else it lands in the daemon's working directory
        raise ValidationError(f"backup path {path[:200]!r} must be absolute", field="path")
    d.backup_running = running = _BackupProgress(path)
    try:
        return d.store.backup(path, force=job.args["force"], progress=running.wrote)
    finally:
        d.backup_running = None


def _remove_stale_socket(path: Path) -> None:
    """Remove the socket a dead daemon left (the endpoint lock is ours); anything else at
    the endpoint's path is refused, never deleted (an endpoint mistyped onto a journal or
    a config file must not erase it)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"the endpoint's path {path} exists and is not a socket: choose another endpoint "
                          "(nothing was removed)", key="server.endpoint")
    path.unlink(missing_ok=True)


def _bind_private(router: zmq.Socket, endpoint: str, ipc: bool) -> None:
    """Bind ``router``; an ipc socket is created 0600 (umask 0177 for the bind: the mode it
    took from the caller's umask, 0777 under umask 0, let any user who can reach the
    directory connect before the chmod, and a connection made then stays). Raises the
    ReachyMemoryError of :func:`_bind_error`."""
    previous = os.umask(0o177) if ipc else None  # process-wide, for an instant: a file made meanwhile gets <= 0600
    try:
        router.bind(endpoint)
    except zmq.ZMQError as exc:
        raise _bind_error(endpoint, exc) from exc
    finally:
        if previous is not None:
            os.umask(previous)


def _bind_error(endpoint: str, exc: zmq.ZMQError) -> ReachyMemoryError:
    """What a failed bind means, in words: in use (another daemon), or a bad endpoint."""
    if exc.errno == errno.EADDRINUSE:
        return AlreadyRunningError(f"cannot bind {endpoint}: another process is serving it ({exc})", where=endpoint)
    if "longer than" in str(exc):
        return ConfigError(f"the ipc path of {endpoint} is too long for a socket ({len(endpoint) - 6} characters; "
                           "the limit is about 107): set a shorter server.endpoint, --endpoint or "
                           "REACHY_MEMORY_ENDPOINT", key="server.endpoint")
    return ConfigError(f"cannot bind {endpoint}: {exc}", key="server.endpoint")


def _past(now: Any) -> Any:
    """A client's ``now``, unless in the future: a client may replay an old "now"
    (tests, imports), never expire the future early.  Raises ValidationError."""
    if now is not None and to_epoch(now) > time.time() + 1.0:  # type: ignore[operator]
        raise ValidationError("now must not be in the future", field="now")
    return now


def _retention_op(d: Daemon, job: _Job) -> dict[str, Any]:
    result = d.store.apply_retention(dry_run=job.args["dry_run"], max_deletions=job.args.get("max_deletions"),
                                     now=_past(job.args.get("now")))
    if not job.args["dry_run"]:  # it swept: health shows it as a cleanup
        d.last_cleanup = {"time": time.time(), "deleted": result["deleted"], "duration_ms": None}
    return result


def _cleanup_op(d: Daemon, job: _Job) -> dict[str, int]:
    deleted = d.store.cleanup_expired(_past(job.args.get("now")))
    d.last_cleanup = {"time": time.time(), "deleted": deleted, "duration_ms": None}
    return {"deleted": deleted}


def _context_for(d: Daemon, job: _Job) -> dict[str, Any]:
    return proto.context_to_wire(d.store.context_for(**job.args))


def _update_person(d: Daemon, job: _Job) -> dict[str, Any] | None:
    fields = dict(job.args)
    return _person(d.store.update_person(fields.pop("id"), **fields))


def _resolve_person(d: Daemon, job: _Job) -> dict[str, Any]:
    person, created = d.store.resolve_person(**job.args)
    return {"person": _person(person), "created": created}


_Handler = Callable[[Daemon, _Job], Any]
_HANDLERS: dict[str, _Handler] = {
    "ping": lambda d, j: {"pong": True, "time": time.time()},
    "health": lambda d, j: d.health(),
    "stats": lambda d, j: d.stats(),
    "get": lambda d, j: _memory(d.store.get(j.args["id"])),
    "get_context": lambda d, j: d.store.get_context(j.args["key"]),
    "get_context_window": lambda d, j: d.store.get_context_window(),
    "search": _search,
    "store": _commit, "store_batch": _commit, "remember_fact": _commit, "remember_conversation": _commit,
    "set_context": lambda d, j: _memory(d.store.commit_context(j.args["key"], j.prepared)),
    "record_turn": lambda d, j: _memory(d.store.commit_turn(j.args["role"], j.prepared)),
    "forget": lambda d, j: {"deleted": d.store.forget(j.args["id"])},
    "cleanup_expired": _cleanup_op,
    "apply_retention": _retention_op,
    "add_to_context_window": lambda d, j: d.store.add_to_context_window(j.args["role"], j.args["content"]),
    "clear_context_window": lambda d, j: d.store.clear_context_window(),
    "export": _export,
    "backup": _backup,
    "compact": lambda d, j: d.store.compact(),
    "remember": lambda d, j: _memories(d.store.remember(**j.args)),
    "recall": lambda d, j: proto.results_to_wire(d.store.recall(**j.args)),
    "history": lambda d, j: _memories(d.store.history(j.args["id"])),
    "correct": lambda d, j: _memory(d.store.correct(j.args["id"], j.args["content"])),
    "confirm": lambda d, j: _memory(d.store.confirm(j.args["id"])),
    "supersede": lambda d, j: _memory(d.store.supersede(**j.args)),
    "add_person": lambda d, j: _person(d.store.add_person(**j.args)),
    "find_person": lambda d, j: _person(d.store.find_person(**j.args)),
    "resolve_person": _resolve_person,
    "person_by_external_id": lambda d, j: _person(d.store.person_by_external_id(j.args["external_id"])),
    "people": lambda d, j: [_person(p) for p in d.store.people(j.args.get("owner"))],
    "person_redirects": lambda d, j: d.store.person_redirects(),
    "update_person": _update_person,
    "merge_people": lambda d, j: _person(d.store.merge_people(**j.args)),
    "delete_person": lambda d, j: {"deleted": d.store.delete_person(j.args["id"])},
    "note": lambda d, j: _memory(d.store.note(j.args["name"])),
    "rename_note": lambda d, j: _memory(d.store.rename_note(**j.args)),
    "alias_note": lambda d, j: _memory(d.store.alias_note(**j.args)),
    "rewrite_note": lambda d, j: _memory(d.store.rewrite_note(**j.args)),
    "remove_note": lambda d, j: {"deleted": d.store.remove_note(j.args["name"])},
    "archive_conversation": lambda d, j: _memory(d.store.archive_conversation(**j.args)),
    "context_for": _context_for,
    "import": lambda d, j: d.store.commit_import(j.prepared),
}
Daemon._handlers = _HANDLERS


def serve(config: Config, endpoint: str | None = None, *, insecure_tcp: bool = False) -> None:
    """Run a daemon in this thread until it is stopped (the CLI's ``serve``)."""
    Daemon(config, endpoint=endpoint, insecure_tcp=insecure_tcp).serve()
