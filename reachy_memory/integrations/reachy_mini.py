"""Memory for a Reachy Mini app without blocking its control loop.

A Reachy Mini app moves the head from a loop (typically 50 Hz, 20 ms per
tick).  A daemon round trip is usually under a millisecond, but when the CPU is
busy (embedding, the LLM, the robot's own daemon) it can take tens of
milliseconds, and a timeout cannot be honoured while the CPU is saturated.  So
the loop must never call the daemon.  :class:`MemoryBridge` does it for the loop:

* one worker owns a blocking :class:`~reachy_memory.MemoryClient` (and is the
  only one that touches it).  By default (POSIX) the worker runs in a **helper
  process** (:mod:`~reachy_memory.integrations.bridge_process`): decoding replies,
  retrying and waiting happen outside the control process's interpreter, so they
  never hold the GIL the loop needs; the control process keeps no thread of the
  bridge's and reads the helper's replies only inside the bridge's own calls,
  non-blocking, in small pieces.  ``helper=False`` (or a ``client_factory``, for
  tests) runs the worker on a thread of this process instead;
* :meth:`MemoryBridge.latest` returns the last fetched :class:`MemorySnapshot`
  (context window, current person, what is remembered about them): a plain
  attribute read, no I/O, no lock;
* :meth:`~MemoryBridge.record_turn`, :meth:`~MemoryBridge.set_current_person`
  and :meth:`~MemoryBridge.remember` put a job on a bounded queue and return at
  once; when the queue is full the job is dropped and counted, never waited for;
* :meth:`~MemoryBridge.search` and :meth:`~MemoryBridge.remember` return a
  :class:`concurrent.futures.Future`: poll ``done()`` from the loop, or
  ``add_done_callback`` (with a helper process, callbacks run on the thread whose
  bridge call or ``done()``/``result()`` received the reply, often the loop: keep
  them short; on a worker thread, on that thread).  A future of a dropped job fails with
  :class:`~reachy_memory.BusyError`; a job that raises fails its own future
  only.  While the daemon restarts, a read (``search``, ``context_for``) fails
  within ``timeout`` (the writes are sent again: below) and a failed refresh keeps
  the last snapshot with ``error`` set; the same worker and client carry on and the
  snapshot is fresh again once the daemon answers.
* The writes survive a daemon restart: a turn (``record_turn``) and a memory
  (``remember``) get an id when queued, and a call that fails for "not now"
  (:func:`~reachy_memory.daemon.protocol.retryable`: daemon unavailable or stopping, timed
  out, busy) is sent again with that id, with backoff, until ``turn_retry_for``
  seconds (60 by default) after it was queued (one attempt at least); the daemon
  keeps it once however often it arrives.  ``set_current_person`` is sent again the
  same way without an id: it replaces the named context's value, so a second
  arrival changes nothing.  Writes keep their order: jobs queued behind a waiting
  write wait too (the queue stays bounded; when full, later calls are dropped and
  counted), and no refresh is done meanwhile (``latest().error`` says it waits).  A
  write given up (the bound or close()'s deadline passed, or an error that is not
  "not now") is counted in ``stats.errors`` (a turn also in ``stats.turns_lost``;
  ``remember``'s future fails with that error).  A daemon from before the ids (it
  refuses them, storing nothing) gets the write once without its id, never again.
* :meth:`~MemoryBridge.pause_remembering` / :meth:`~MemoryBridge.resume_remembering`
  (a guest, a private moment) queue like a search and return a future of the status.
* :meth:`~MemoryBridge.close` (or leaving the ``with`` block) takes no new job
  and lets the queued ones reach the daemon (writes with their retries) for up to
  its ``timeout`` (5 s by default), then stops the worker.  Jobs still queued then
  are discarded, counted in ``stats.discarded_at_close`` and logged; their futures
  fail with :class:`~reachy_memory.ClosedError`.  close() returns within its
  ``timeout`` even when the daemon is gone or frozen (a call in flight is not
  waited for); it blocks its caller meanwhile, so a control loop calls it once it
  has ended; ``close(timeout=0)`` discards at once.
* Should the worker itself end (its client cannot be made), the queued jobs are
  discarded, counted in ``stats.discarded_at_failure`` and logged; their futures fail
  with :class:`~reachy_memory.ClosedError`, later calls are dropped, and
  ``latest().error`` says so.

This module does not import ``reachy_mini``; any app (or test) can use it.
Guide: README.md, "For apps and language models".
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from reachy_memory.client import MemoryClient, refuses_ids
from reachy_memory.config import Config
from reachy_memory.daemon import protocol as proto
from reachy_memory.engine.ingest import check_owner, check_seconds
from reachy_memory.errors import BusyError, ClosedError, ReachyMemoryError, ValidationError
from reachy_memory.model import SEARCH_LIMIT, Memory, MemoryType, SearchResult

log = logging.getLogger("reachy_memory.bridge")

#: Named context (``set_context``) holding who is in front of the robot; shared
#: with every other client of the daemon (an LLM's MCP tools see it too).
PERSON_KEY = "current_person"
NOBODY = "(nobody)"  # the stored value when nobody is there (context values cannot be empty)
#: Protocol error codes that mean "not now" (the daemon restarting, stopping, slow or full):
#: a write failing with one is sent again, with its id, until ``turn_retry_for`` passes
#: (unless it is a ClosedError of the bridge's own client: :func:`~reachy_memory.daemon.protocol.retryable`).
RETRY_CODES = proto.RETRY_CODES
_FIRST_PAUSE, _LONGEST_PAUSE = 0.05, 1.0  # seconds between a write's attempts: doubling, capped


@dataclass(frozen=True)
class MemorySnapshot:
    """What the bridge last fetched from memory (immutable; safe to keep).

    ``fetched_at`` is a ``time.monotonic()`` stamp (0.0 before the first fetch);
    ``error`` is the last fetch's error message, or None when it succeeded.
    """

    window: tuple[dict[str, Any], ...] = ()
    person: str | None = None
    person_facts: tuple[str, ...] = ()
    fetched_at: float = 0.0
    error: str | None = None

    @property
    def age(self) -> float:
        """Seconds since the fetch (infinite before the first one)."""
        return time.monotonic() - self.fetched_at if self.fetched_at else float("inf")


@dataclass
class BridgeStats:
    """Counters, written by the worker, except ``enqueued`` and ``dropped`` (the callers,
    under the bridge's lock) and the ``discarded_*`` ones (close() or the worker, under it).

    Every queued job ends counted once: in ``done``, ``errors``, ``discarded_at_close``
    or ``discarded_at_failure`` (a job whose future was cancelled before it ran: in none)."""

    enqueued: int = 0
    dropped: int = 0
    done: int = 0
    errors: int = 0
    refreshes: int = 0
    retries: int = 0  # a write (turn, remember, set_current_person) sent again after a "not now" failure
    turns_lost: int = 0  # turns given up after being sent (also counted in ``errors``)
    # Jobs queued but never sent (turns among them are not in ``turns_lost``: they were
    # never tried; their futures failed with ClosedError): close()'s timeout passed first...
    discarded_at_close: int = 0
    # ...or the worker ended without sending them (its client could not be made; logged).
    discarded_at_failure: int = 0
    last_error: str | None = None


@dataclass
class _Job:
    run: Callable[[MemoryClient], Any]
    future: Future[Any] | None = None
    refresh: bool = False  # the snapshot changes: fetch it again after this job
    label: str = field(default="job")
    retry: bool = False  # a write sent again after a "not now" failure (kept once however often it arrives)
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def turn(self) -> bool:
        return self.label == "record_turn"


class MemoryBridge:
    """The control loop's way to memory: non-blocking calls, work on one worker thread.

    ``MemoryBridge(endpoint=None, config=None)`` connects like
    :class:`~reachy_memory.MemoryClient` (the private ipc socket by default).
    ``refresh_interval`` is how often the snapshot is fetched again;
    ``queue_size`` bounds the pending jobs; ``timeout`` bounds each daemon call
    (on the worker).  ``turn_retry_for`` bounds how long a write (a turn, ``remember``,
    ``set_current_person``) is sent again while the daemon is away (seconds from its
    queueing; 0: sent once).  ``helper``: run the worker in a helper process (None, the
    default: yes on POSIX unless a ``client_factory`` is given; True; False: a thread of
    this process).  ``client_factory`` replaces the client (tests; a thread only).
    Use as a context manager, or :meth:`start` / :meth:`close` (idempotent).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> MemoryBridge:
        """A :class:`~reachy_memory.integrations.bridge_process.HelperBridge` unless the
        worker is to run on a thread (``helper=False``, a ``client_factory``, not POSIX)."""
        helper = kwargs.get("helper")
        if helper is None:
            helper = os.name == "posix" and kwargs.get("client_factory") is None
        if cls is MemoryBridge and helper:
            from reachy_memory.integrations.bridge_process import HelperBridge

            return super().__new__(HelperBridge)
        return super().__new__(cls)

    def __init__(self, endpoint: str | None = None, *, config: Config | None = None, queue_size: int = 64,
                 refresh_interval: float = 0.5, timeout: float = 2.0, person_facts: int = 5,
                 turn_retry_for: float = 60.0, client_factory: Callable[[], Any] | None = None,
                 helper: bool | None = None) -> None:
        """Raises ValidationError for a ``turn_retry_for`` that is not seconds >= 0."""
        self._retry_for = check_seconds(turn_retry_for, "turn_retry_for", finite=True)
        self._factory = client_factory or (lambda: MemoryClient(endpoint, config=config, timeout=timeout))
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._refresh_interval = refresh_interval
        self._person_facts = person_facts
        self._snapshot = MemorySnapshot()
        self._person: str | None = None  # worker-owned: the person the snapshot is about
        self._dirty = False  # worker-owned: a job changed what the snapshot shows
        self._stop = threading.Event()  # the worker takes no more jobs
        self._thread: threading.Thread | None = None
        # Queueing and close() (and the worker's end) take this lock, never across I/O or a
        # wait: a job is either queued before close() started (and drained) or refused.
        self._lock = threading.Lock()
        self._closed = False
        self._close_by = float("inf")  # close()'s deadline (time.monotonic()): the drain ends there
        self.stats = BridgeStats()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> MemoryBridge:
        """Start the worker thread (idempotent); raises ClosedError after close()."""
        if self._closed:
            raise ClosedError("MemoryBridge is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="reachy-memory-bridge", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Take no new job, let the queued ones reach the daemon, then stop the worker.

        From the call on, ``record_turn`` & co. return False (futures: BusyError). Jobs
        already queued (turns, ``remember``, searches...) still run in order, a write with
        its retries, until the queue is empty or ``timeout`` seconds have passed; then the
        worker stops. Jobs still queued then are discarded: counted in
        ``stats.discarded_at_close``, logged once, their futures fail with ClosedError.
        A call in flight at the deadline is not waited for (it ends on the worker within
        the client's timeout), so close() returns within ``timeout`` (plus a few ms) also
        when the daemon is gone or frozen; ``close(timeout=0)`` discards at once. It
        blocks its caller meanwhile: a control loop calls it once its loop has ended.
        Called from the worker's thread (a future's done callback) it returns at once and
        the worker drains as above once the callback returns. A later call (another thread,
        or the ``with`` block's after a callback's) waits for that drain too, up to its own
        ``timeout``, and cuts nothing short: it returns at once only once the drain is over
        (the first call's own deadline still bounds it). Raises ValidationError for a
        ``timeout`` that is not seconds >= 0 (the bridge stays open then).
        """
        seconds = check_seconds(timeout, "timeout", finite=True)
        with self._lock:
            first = not self._closed
            if first:
                self._close_by = time.monotonic() + seconds  # first: a worker seeing _closed sees it too
                self._closed = True
        if first:
            with contextlib.suppress(queue.Full):  # full: the worker is not idle, it finds the end itself
                self._jobs.put_nowait(None)  # the queue ends here; wakes an idle worker now
        worker = self._thread
        if worker is threading.current_thread():  # a done callback: the worker cannot wait for itself
            return  # it drains once the callback returns, then discards what is left itself
        # A later call waits too: after a callback's close() nobody else would, and an app
        # leaving its `with` block (then exiting) lost the queued jobs, neither sent nor counted.
        wait_until = self._close_by if first else min(self._close_by, time.monotonic() + seconds)
        if worker is not None:
            worker.join(max(0.0, wait_until - time.monotonic()))
        if first or worker is None or not worker.is_alive() or time.monotonic() >= self._close_by:
            self._stop.set()  # the deadline passed (or the queue is drained): no more jobs
            self._discard_pending()

    stop = close

    def __enter__(self) -> MemoryBridge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the control loop's calls (no I/O) ------------------------------------------------------

    def latest(self) -> MemorySnapshot:
        """The last fetched snapshot; one attribute read, never waits."""
        return self._snapshot

    def record_turn(self, role: str, text: str, person: str | None = None, *, owner: str | None = None) -> bool:
        """Queue one conversation turn: appended to the daemon's context window and kept
        as a CONVERSATION memory (``memory.conversation_ttl_days``, 30 by default) tagged
        with ``role`` and ``person`` (default: the current person; a display name in
        metadata), owned by ``owner`` (the user of the robot whose turn it is, None:
        unscoped). Returns False if it was dropped
        (queue full or closed). Raises ValidationError for a bad owner, queueing nothing.
        The turn gets its id here: sent again while the daemon restarts (up to
        ``turn_retry_for`` seconds), it is kept once."""
        owned = _owned(owner) | {"id": uuid.uuid4().hex}
        tagged: list[dict[str, Any] | None] = []  # the first attempt's metadata, sent again as it was

        def run(c: MemoryClient) -> None:
            if not tagged:
                who = person or self._person
                tagged.append({"person": who} if who else None)
            # window and memory: one write
            _with_id(lambda **kw: c.record_turn(role, text, tagged[0], **kw), owned, "turn")

        return self._put(_Job(run, refresh=True, label="record_turn", retry=True)) is not None

    def set_current_person(self, name: str | None) -> bool:
        """Queue "this person is in front of the robot" (None: nobody). The snapshot's
        ``person`` and ``person_facts`` follow once the worker has run it. Sent again while
        the daemon restarts, as a turn is, but with no id: it replaces the named context's
        value, so arriving twice is arriving once. Returns False if it was dropped."""
        def run(c: MemoryClient) -> None:
            self._person = name.strip() if name and name.strip() else None
            c.set_context(PERSON_KEY, self._person or NOBODY)

        return self._put(_Job(run, refresh=True, label="set_current_person", retry=True)) is not None

    def remember(self, content: str, memory_type: MemoryType | str = MemoryType.FACT,
                 metadata: dict[str, Any] | None = None, *, owner: str | None = None) -> Future[Memory]:
        """Queue a store (owned by ``owner``, None: unscoped); the future gives the stored
        :class:`~reachy_memory.Memory`. Raises ValidationError for a bad owner, queueing nothing.
        The memory gets its id here: sent again while the daemon restarts (up to
        ``turn_retry_for`` seconds after now), it is kept once. The future fails with the
        write's own error at once (a refusal: nothing stored), with the last "not now" error
        once ``turn_retry_for`` passed, or with ClosedError at close()'s deadline."""
        owned = _owned(owner) | {"id": uuid.uuid4().hex}
        kept = dict(metadata) if metadata else None  # as it was now, on every attempt
        refresh = MemoryType.parse(memory_type) is MemoryType.FACT
        return self._submit(lambda c: _with_id(lambda **kw: c.store(content, memory_type, kept, **kw), owned,
                                               "memory"), "remember", refresh=refresh, retry=True)

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               where: dict[str, Any] | None = None) -> Future[list[SearchResult]]:
        """Queue a search; the future gives the list of :class:`~reachy_memory.SearchResult`."""
        return self._submit(lambda c: c.search(query, memory_type, limit, where=where), "search")

    def context_for(self, message: str, *, max_tokens: int = 800) -> Future[Any]:
        """Queue the prompt context for ``message`` (the window, relevant facts and past
        turns, known people, ``.text`` within ``max_tokens``); the future gives a
        RetrievedContext, one daemon round trip, for an app to put before its LLM call."""
        return self._submit(lambda c: c.context_for(message, max_tokens=max_tokens), "context_for")

    # -- guests and private moments (docs/HOUSEHOLD.md) -------------------------------------------

    def pause_remembering(self, minutes: float) -> Future[dict[str, Any]]:
        """Queue "stop remembering for ``minutes``" (a guest, a private moment): until then the
        daemon keeps the turns this bridge records in its context window only, in memory, and
        writes no memory (a ``remember`` fails with RememberingPausedError); the pause ends by
        itself. The future gives the status (``paused``, ``until``, ``seconds_left``). Sent
        again while the daemon restarts, as a turn is (a restart ends a pause in force)."""
        return self._submit(lambda c: c.pause_remembering(minutes), "pause_remembering", retry=True)

    def resume_remembering(self) -> Future[dict[str, Any]]:
        """Queue "remember again"; the future gives the status."""
        return self._submit(lambda c: c.resume_remembering(), "resume_remembering", retry=True)

    @property
    def pending(self) -> int:
        """Jobs waiting in the queue (approximate)."""
        return self._jobs.qsize()

    # -- queueing ---------------------------------------------------------------------------------

    def _submit(self, run: Callable[[MemoryClient], Any], label: str, refresh: bool = False,
                retry: bool = False) -> Future[Any]:
        future: Future[Any] = Future()
        if self._put(_Job(run, future, refresh, label, retry)) is None and not future.done():  # done: cancelled
            future.set_exception(BusyError(f"memory bridge queue full or closed; {label} dropped"))
        return future

    def _put(self, job: _Job) -> _Job | None:
        """Queue ``job``; None when it is dropped (queue full, closing or closed, worker ended)."""
        with self._lock:  # close() cannot start between the check and the put (see __init__)
            queued = not (self._closed or self._stop.is_set()) and _put_nowait(self._jobs, job)
            if not queued:
                self.stats.dropped += 1
                return None
            self.stats.enqueued += 1
        return job

    def _discard_pending(self, failed: bool = False) -> None:
        """Take every job still queued and fail its future with ClosedError; count them in
        ``stats.discarded_at_failure`` when the worker ``failed``, else (close() started)
        in ``stats.discarded_at_close``, and log the count. Once: no job is queued after
        close() started or the worker ended, so whichever of close() and the worker's end
        comes first takes them all."""
        jobs: list[_Job] = []
        with self._lock:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    jobs.append(job)
            if failed:
                self.stats.discarded_at_failure += len(jobs)
            elif self._closed:
                self.stats.discarded_at_close += len(jobs)
        turns = sum(job.turn for job in jobs)
        if jobs and failed:
            log.warning("memory bridge worker failed: %d queued job(s) (%d turn(s)) never sent, discarded",
                        len(jobs), turns)
        elif jobs and self._closed:
            log.warning("memory bridge closed: %d queued job(s) (%d turn(s)) not sent within close()'s timeout,"
                        " discarded", len(jobs), turns)
        why = "worker failed (see the log)" if failed else "closed"
        for job in jobs:  # outside the lock: a done callback may call the bridge
            if job.future is not None and not job.future.done():
                job.future.set_exception(ClosedError(f"memory bridge {why} before the job ran"))

    # -- the worker thread ------------------------------------------------------------------------

    def _work(self) -> None:
        client = None
        failed = False
        try:
            client = self._factory()
            if not self._closed:  # closing: the deadline is for the queued jobs
                self._refresh(client)
            while self._step(client):
                pass
        except Exception:  # the worker must not die silently: the snapshot says why
            failed = True
            log.exception("memory bridge worker failed")
            self._snapshot = MemorySnapshot(error="memory bridge worker failed; see the log")
        finally:
            # No job is taken after this: refuse new ones and fail the queued ones (their
            # futures would otherwise never finish); close() does the same.
            with self._lock:  # a job is queued before this (and discarded) or refused
                self._stop.set()
            self._discard_pending(failed)
            if client is not None:
                client.close()

    def _step(self, client: Any) -> bool:
        """Run the next job, and a refresh when one is due; False when the worker is to end
        (stopped, or close() started and the queue is drained or its deadline passed)."""
        if self._stop.is_set():
            return False
        if self._closed:
            return self._drain_one(client)
        due = self._snapshot.fetched_at + self._refresh_interval if self._snapshot.fetched_at else 0.0
        try:
            job = self._jobs.get(timeout=max(0.0, min(due - time.monotonic(), self._refresh_interval)))
        except queue.Empty:
            job = None
        if job is not None:
            self._dirty = self._run(client, job) or self._dirty
        now = time.monotonic()
        # Refresh after a burst of jobs rather than after each one, but never let
        # a steady stream of jobs keep the snapshot older than two intervals.
        wanted = self._dirty or now >= due
        if wanted and not self._closed and not self._stop.is_set() \
                and (self._jobs.empty() or now >= due + self._refresh_interval):
            self._refresh(client)
            self._dirty = False
        return True

    def _drain_one(self, client: Any) -> bool:
        """close() started: run the next queued job (no refresh: nobody reads the snapshot
        for long now); False when none is left or close()'s deadline passed (the jobs left
        are discarded by whichever of close() and the worker's end comes first)."""
        if time.monotonic() >= self._close_by:
            return False
        try:
            job = self._jobs.get_nowait()
        except queue.Empty:
            return False
        if job is None:  # close()'s mark: nothing is queued behind it
            return False
        self._run(client, job)
        return True

    def _run(self, client: Any, job: _Job) -> bool:
        if job.future is not None and not job.future.set_running_or_notify_cancel():
            return False
        try:
            result = self._run_retrying(client, job) if job.retry else job.run(client)
        except Exception as exc:  # the job's own failure (any type): its future says it, the worker goes on
            if not isinstance(exc, ReachyMemoryError):
                log.exception("memory bridge job %s failed", job.label)
            self.stats.errors += 1
            self.stats.last_error = f"{job.label}: {exc}"
            if job.future is not None:
                job.future.set_exception(exc)
            elif job.retry:  # a turn or set_current_person: nobody else hears of it
                what = "turn" if job.turn else job.label
                self.stats.turns_lost += job.turn
                log.warning("memory bridge gave up a %s: %s", what, exc)
                self._snapshot = replace(self._snapshot, error=f"a {what} was lost: {exc}")
            return False
        self.stats.done += 1
        if job.future is not None:
            job.future.set_result(result)
        return job.refresh

    def _run_retrying(self, client: Any, job: _Job) -> Any:
        """``job.run(client)``, run again with backoff after each "not now" failure
        (:func:`~reachy_memory.daemon.protocol.retryable`: a code of :data:`RETRY_CODES`, not a
        ClosedError of the client itself) until it succeeds or ``turn_retry_for`` seconds have passed
        since it was queued (one attempt at least), or close()'s deadline, whichever comes
        first; ``latest().error`` says it waits meanwhile. Raises the last failure when
        ``turn_retry_for`` passed, ClosedError when close()'s deadline passed or the worker
        stopped, any other failure at once."""
        deadline = job.queued_at + self._retry_for
        pause = _FIRST_PAUSE
        while True:
            try:
                return job.run(client)
            except ReachyMemoryError as exc:
                if not proto.retryable(exc):  # its own error, or the client is closed: sending again cannot help
                    raise
                now = time.monotonic()
                if now >= self._close_by or self._stop.is_set():
                    raise ClosedError(f"memory bridge closed while a {job.label} waited for the daemon: {exc}",
                                      label=job.label) from exc
                left = min(deadline, self._close_by) - now
                if left <= 0:
                    raise
                self.stats.retries += 1
                self.stats.last_error = f"{job.label}: {exc} (sending it again)"
                self._snapshot = replace(self._snapshot, error=f"{job.label} waits for the daemon: {exc}")
            if self._stop.wait(min(pause, left)):
                raise ClosedError(f"memory bridge closed while a {job.label} waited for the daemon")
            pause = min(2 * pause, _LONGEST_PAUSE)

    def _refresh(self, client: Any) -> None:
        """Fetch window, person and what is known about them; publish one new snapshot.
        A failed fetch (of any type: a foreign error from a custom client ended the worker,
        and the bridge stayed dead after the daemon came back) keeps the last snapshot,
        stamped with the error; the next interval tries again."""
        try:
            window = tuple(client.get_context_window())
            person = self._person if self._person is not None else client.get_context(PERSON_KEY)
            person = None if person in (None, NOBODY) else person
            self._person = person
            facts = self._facts(client, person) if person else ()
        except Exception as exc:  # any type: a refresh is retried at the next interval, the worker goes on
            if not isinstance(exc, ReachyMemoryError):
                log.exception("memory bridge refresh failed")
            self.stats.last_error = f"refresh: {exc}"
            old = self._snapshot
            self._snapshot = MemorySnapshot(old.window, old.person, old.person_facts, time.monotonic(), str(exc))
            return
        self.stats.refreshes += 1
        self._snapshot = MemorySnapshot(window, person, facts, time.monotonic())

    def _facts(self, client: Any, person: str) -> tuple[str, ...]:
        """The facts about ``person``: those whose subjects hold them (``remember``) or whose
        ``metadata.person`` names them, for a person the daemon knows; by ``metadata.person``
        alone otherwise (``about=`` an unknown person would not filter at all)."""
        if client.find_person(person) is not None:
            hits = client.search(person, MemoryType.FACT, self._person_facts, 0.0, about=person)
        else:
            hits = client.search(person, MemoryType.FACT, self._person_facts, 0.0, where={"person": person})
        return tuple(h.memory.content for h in hits)


__all__ = ["NOBODY", "PERSON_KEY", "RETRY_CODES", "BridgeStats", "MemoryBridge", "MemorySnapshot"]


def _put_nowait(jobs: queue.Queue[_Job | None], job: _Job) -> bool:
    """Put ``job`` on ``jobs`` without waiting; False when the queue is full."""
    try:
        jobs.put_nowait(job)
    except queue.Full:
        return False
    return True


def _with_id(send: Callable[..., Any], kwargs: dict[str, Any], what: str) -> Any:
    """``send(**kwargs)``, ``kwargs`` holding the write's client-made ``id``. A daemon that
    refuses the id (one from before ids on that op, not restarted since an upgrade:
    :func:`~reachy_memory.client.refuses_ids`; it stored nothing) gets the write once
    without: the id leaves ``kwargs`` for good, and a later attempt (a retry after that
    send failed) raises ReachyMemoryError (code "internal": not sent again), as sending it
    again could keep it twice. Raises what ``send`` raises."""
    if "id" not in kwargs:
        raise ReachyMemoryError(f"the daemon takes no {what} id (a version from before them): not sent again")
    try:
        return send(**kwargs)
    except ValidationError as exc:
        if not refuses_ids(exc):
            raise
        del kwargs["id"]
        return send(**kwargs)


def _owned(owner: str | None) -> dict[str, Any]:
    """The client's ``owner`` keyword, none without an owner (an owner-less call is the
    call as it was, for any client); ``owner`` checked on the caller's thread (no I/O):
    a bad one raises ValidationError there, not later on the worker, where a turn has no
    future to fail."""
    return {} if owner is None else {"owner": check_owner(owner)}
