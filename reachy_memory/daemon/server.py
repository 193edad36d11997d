"""The daemon: serves a MemoryStore over ZeroMQ (see ``protocol`` for the wire format).

Threads, so that the robot's control loop never waits behind slow work::

    I/O thread (main)   ROUTER socket: decode, check the arguments against the op's row,
                        answer inline ops (ping, health, stats, get, get_context,
                        get_context_window), queue the others on their row's lane,
                        forward replies, run the scheduler and the watchdog
    embed thread        embeds queries and new memories (onnxruntime releases the GIL)
    engine thread       the thread that mutates the store (but dedupe) and searches its indexes;
                        idle time inserts pending vectors into the graph (``upkeep``)
    sync thread         makes each write durable (fsync), then sends its reply: the engine
                        goes on meanwhile (a search never waits behind a write's fsync),
                        and one fsync serves every write made before it (group commit)
    background thread   writes backups from a frozen view of the store, one at a time
                        (the store lock only to freeze and thaw: the engine goes on), and
                        merges copies (dedupe: the lock a step at a time; its frames go
                        through the commit funnel like the engine's writes)

This module is the daemon's life (start, the I/O thread, stop); ``lanes`` holds the
worker threads and their queues, ``handlers`` one function per op, ``operations``
the op table every request is routed and run by, ``upkeep`` the engine's work
between requests.  Queues between the threads are bounded: when one is full the
request is answered ``busy`` at once.  A request's ``timeout_ms`` is checked before
work starts.  SIGTERM/SIGINT stop intake, finish what is queued (up to
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
from pathlib import Path
from typing import Any

import zmq

from reachy_memory._threads import bound_native_heap
from reachy_memory.config import Config, ServerConfig
from reachy_memory.daemon import protocol as proto
from reachy_memory.daemon.clock import clock_synchronized
from reachy_memory.daemon.endpoint import (
    EndpointLock,
    check_endpoint,
    ipc_path,
    load_certificate,
    prepare_ipc_dir,
    resolve_endpoint,
)
from reachy_memory.daemon.handlers import BackupProgress
from reachy_memory.daemon.jobs import Job, Stats
from reachy_memory.daemon.lanes import REPLIES, Lanes
from reachy_memory.daemon.operations import OPERATIONS, check_args
from reachy_memory.daemon.systemd import notify, watchdog_interval
from reachy_memory.embedding.embedder import describe, load_embedder
from reachy_memory.embedding.model_files import local_weights, weights_signature
from reachy_memory.engine.store import MemoryStore
from reachy_memory.errors import (
    AlreadyRunningError,
    ConfigError,
    ModelUnavailableError,
    ProtocolError,
    ReachyMemoryError,
    TooLargeError,
    ValidationError,
)

log = logging.getLogger(__name__)
# Replies queued per client before further ones are dropped and counted (a client may pipeline
# a burst of requests, so not fewer); with reads capped at server.max_reply_bytes (1 MiB) a
# client that never reads holds at most 256 MiB, and in practice far less (README, abuse).
REPLY_HWM = 256
MODEL_POLL_SECONDS = 5.0  # a daemon started before 'model fetch' looks for the weights this often (stat calls)
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
    """A running reachy-memory service. ``serve()`` blocks until stopped.

    Owned by the I/O thread: the sockets, ``bad_requests``, ``replies_dropped``, the model
    watch.  ``lanes`` owns the worker threads, their queues and the jobs in flight;
    ``upkeep`` (the engine thread's) the last sweep and redate that ``health`` shows;
    the background thread sets ``backup_running`` while it writes one.
    """

    def __init__(self, config: Config, *, store: MemoryStore | None = None, endpoint: str | None = None,
                 insecure_tcp: bool = False, clock_sync: Callable[[], bool | None] = clock_synchronized) -> None:
        self._stopping = threading.Event()
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
        self._stats = Stats()
        self.lanes = Lanes(self, self.store, config, self._stats, self._ctx, clock_sync=clock_sync)
        self.upkeep = self.lanes.upkeep
        self.bad_requests = BadRequestLog()
        self.replies_dropped = 0
        self._started = time.monotonic()  # uptime: not moved by a step of the wall clock
        self.backup_running: BackupProgress | None = None
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
        workers = self.lanes.threads()
        for w in workers:
            w.start()
        self.lanes.engine_q.put(self.upkeep.cleanup)  # at start-up, then every cleanup_interval
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
                self.lanes.schedule(self.upkeep.cleanup)
            if now >= next_trim:
                next_trim = now + trim_every
                if self.lanes.enqueued != trimmed_at:  # an idle daemon has nothing new to give back
                    trimmed_at = self.lanes.enqueued
                    self.upkeep.trim_due.set()  # done by the engine at its next idle moment
            if self._model_watch.active and now >= next_model_check:
                next_model_check = now + MODEL_POLL_SECONDS
                self._look_for_model()
            if beat and self.config.server.watchdog and now >= next_beat and now - self.lanes.engine_beat < 2 * beat:
                notify("WATCHDOG=1")
                next_beat = now + beat
            self.bad_requests.summarise()
            if self._stopping.is_set():
                if drain_until is None:  # a backup being written is abandoned now, its reply sent while
                    self.store.begin_closing()  # the loop still runs (one left to _shutdown could be lost)
                drain_until = drain_until or now + self.config.server.drain_seconds
                if self.lanes.inflight <= 0 or now > drain_until:
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
                self.lanes.engine_q.put(adopt, timeout=1.0)
                return
            except queue.Full:
                continue

    def _forward(self, replies: zmq.Socket, router: zmq.Socket) -> None:
        while True:
            try:
                frames = replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.lanes.answered()
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
        self._route(router, job)

    def _parse(self, envelope: list[bytes], body: bytes) -> Job:
        """The request in ``body`` as a Job of its op's row, arguments checked; raises the
        ReachyMemoryError to answer (with the request's id when it was read)."""
        message = proto.decode(body, untrusted=True)
        request_id = message.get("id")
        if not proto.is_request_id(request_id):
            raise ProtocolError("request 'id' must be a string or an integer")
        name, args = message.get("op"), message.get("args", {})
        if message.get("v") != proto.VERSION:
            raise _with_id(ProtocolError(f"unsupported protocol version {message.get('v')!r}; this daemon speaks 1"),
                           request_id)
        op = OPERATIONS.get(name) if isinstance(name, str) else None
        if op is None:
            raise _with_id(ProtocolError(f"unknown op {name!r}"), request_id)
        if not isinstance(args, dict):
            raise _with_id(ProtocolError("'args' must be a map"), request_id)
        try:
            args = check_args(op, args)
        except ValidationError as exc:
            raise _with_id(exc, request_id) from None
        timeout_ms = message.get("timeout_ms")
        if timeout_ms is not None and (isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float)):
            raise _with_id(ProtocolError("'timeout_ms' must be a number"), request_id)
        now = time.monotonic()
        deadline = now + timeout_ms / 1000.0 if timeout_ms is not None else None
        return Job(envelope, request_id, op, args, deadline, now)

    def _route(self, router: zmq.Socket, job: Job) -> None:
        """Answer an inline op now; queue any other on its row's lane (``busy`` when full)."""
        if job.op.lane == "inline":
            self._reply(router, [*job.envelope, self.lanes.run(job)])
            return
        busy = self.lanes.submit(job)
        if busy is not None:
            self._reply(router, [*job.envelope, proto.error_from(job.request_id, busy)])

    def health(self) -> dict[str, Any]:
        """Liveness summary: embedder state, counts, last cleanup, a backup being written, uptime,
        the pause of remembering."""
        read_only, running = self.store.read_only, self.backup_running
        status = "stopping" if self._stopping.is_set() else "read_only" if read_only else "ok"
        return {"status": status, "read_only": read_only,
                "embedder": describe(self.store.embedder) | {"error": self.store.embedder_error},
                "memories": len(self.store), "last_cleanup": self.upkeep.last_cleanup,
                "last_redate": self.upkeep.last_redate,
                "backup_running": running and running.to_dict(),
                "uptime_s": round(time.monotonic() - self._started, 3), "endpoint": self.endpoint,
                "data_dir": str(self.store.path.resolve()),  # absolute: a client compares it from elsewhere
                "remembering": self.store.remembering()}  # the pause (a brief lock, no store lock)

    def stats(self) -> dict[str, Any]:
        """Per-op counts and latency percentiles, store sizes, queue depths, uptime."""
        return {"ops": self._stats.summary(), "store": self.store.stats(),
                "uptime_s": round(time.monotonic() - self._started, 3), "queues": self.lanes.depths(),
                "replies_dropped": self.replies_dropped, "heap_trims": self.upkeep.trim_summary()}

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
            lanes = getattr(self, "lanes", None)  # None: stopped while starting, nothing in flight yet
            log.info("stopping: finishing %d in-flight requests", lanes.inflight if lanes else 0)

    def _shutdown(self, workers: list[threading.Thread], router: zmq.Socket, replies: zmq.Socket) -> None:
        """Stop the embed thread, then the engine and background threads (their sentinels
        and joins share one deadline, STOP_WORKERS_SECONDS from now; a worker still busy
        then is left running; a backup being written is abandoned first),
        forward the last replies, close the store and release the endpoint."""
        deadline = time.monotonic() + STOP_WORKERS_SECONDS
        self.store.begin_closing()  # a backup being written is abandoned now, not waited for
        stages = list(zip(self.lanes.queues(), workers, strict=True))
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


def _request_id(exc: ReachyMemoryError, body: bytes) -> Any:
    """The id to answer a refused request with: the one ``_parse`` read, else the one
    at the start of a frame it could not decode (None: the client cannot tell which
    of its requests this was)."""
    request_id = getattr(exc, "request_id", None)
    return request_id if request_id is not None else proto.peek_id(body)


def _with_id(exc: ReachyMemoryError, request_id: Any) -> ReachyMemoryError:
    exc.request_id = request_id  # type: ignore[attr-defined]
    return exc


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


def serve(config: Config, endpoint: str | None = None, *, insecure_tcp: bool = False) -> None:
    """Run a daemon in this thread until it is stopped (the CLI's ``serve``)."""
    Daemon(config, endpoint=endpoint, insecure_tcp=insecure_tcp).serve()
