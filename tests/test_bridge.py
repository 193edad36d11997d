"""MemoryBridge: the control loop's calls never do I/O; the worker does it all.

Runs without reachy-mini. Structural checks use a recording stand-in client (which
thread called what, how many jobs ran while the "daemon" was stalled): a client_factory
runs the worker on a thread. The tests with a real daemon process run it as apps do,
in the bridge's helper process; the last ones check that process itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack
import pytest

from reachy_memory import (
    BusyError,
    ClosedError,
    DaemonUnavailableError,
    Memory,
    MemoryType,
    ReachyMemoryError,
    RequestTimeoutError,
    ValidationError,
)
from reachy_memory.daemon import protocol as proto
from reachy_memory.errors import (
    NotFoundError,
    ProtocolError,
    RememberingPausedError,
    RemoteError,
    StorageFullError,
    TooLargeError,
)
from reachy_memory.integrations.reachy_mini import NOBODY, PERSON_KEY, MemoryBridge
from reachy_memory.model import SearchResult, to_datetime
from tests.daemon_util import DaemonProcess, ReplyLost, restartable_daemon, stop_as_systemd


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll until ``predicate()``; the timeout only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class RecordingClient:
    """A stand-in MemoryClient: records (thread, op); ``gate`` cleared = a stalled daemon."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.window: list[dict[str, Any]] = []
        self.context: dict[str, str] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_refresh = False
        self.closed = 0

    def _op(self, name: str) -> None:
        self.calls.append((threading.get_ident(), name))
        self.entered.set()
        assert self.gate.wait(30), "test left the client stalled"

    def add_to_context_window(self, role: str, content: str) -> None:
        self._op("add_to_context_window")
        self.window.append({"role": role, "content": content})

    def record_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                    id: str | None = None) -> Memory:
        self._op("record_turn")
        self.window.append({"role": role, "content": content})
        return Memory(f"id{len(self.calls)}", content, MemoryType.CONVERSATION, to_datetime(0),
                      {**(metadata or {}), "role": role})

    def store(self, content: str, memory_type: Any = "fact", metadata: dict[str, Any] | None = None, *,
              id: str | None = None) -> Memory:
        self._op("store")
        return Memory(id or f"id{len(self.calls)}", content, MemoryType.parse(memory_type), to_datetime(0),
                      metadata or {})

    def search(self, query: str, memory_type: Any = None, limit: int = 5, min_score: float = 0.3,
               where: dict[str, Any] | None = None, about: str | None = None) -> list[SearchResult]:
        self._op("search")
        return [SearchResult(Memory("m1", f"about {query}", MemoryType.FACT, to_datetime(0)), 0.9)]

    def find_person(self, reference: str) -> None:
        self._op("find_person")  # nobody known: the bridge filters on metadata.person

    def get_context_window(self) -> list[dict[str, Any]]:
        self._op("get_context_window")
        if self.fail_refresh:
            raise RequestTimeoutError("no reply", op="get_context_window", endpoint="test")
        return list(self.window)

    def set_context(self, key: str, value: str) -> None:
        self._op("set_context")
        self.context[key] = value

    def get_context(self, key: str) -> str | None:
        self._op("get_context")
        return self.context.get(key)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def fake() -> RecordingClient:
    return RecordingClient()


@pytest.fixture
def bridge(fake: RecordingClient) -> Iterator[MemoryBridge]:
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as b:
        yield b


def test_client_is_only_used_on_the_worker_thread(bridge: MemoryBridge, fake: RecordingClient) -> None:
    bridge.record_turn("user", "hello")
    bridge.set_current_person("Alex")
    found = bridge.search("tea").result(timeout=30)
    wait_for(lambda: bridge.latest().person == "Alex" and len(bridge.latest().window) == 1)
    assert found[0].memory.content == "about tea"
    threads = {t for t, _ in fake.calls}
    assert threading.get_ident() not in threads
    assert len(threads) == 1


def test_stalled_daemon_never_blocks_callers(fake: RecordingClient) -> None:
    # No periodic refresh: the only client call in flight is the search below.
    bridge = MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=3600).start()
    wait_for(lambda: bridge.latest().fetched_at > 0)
    fake.gate.clear()
    fake.entered.clear()
    first = bridge.search("first")  # the worker takes it and stalls inside the client
    assert fake.entered.wait(30)
    calls_before = len(fake.calls)
    results = [bridge.record_turn("user", f"turn {i}") for i in range(50)]
    futures = [bridge.search(f"q{i}") for i in range(10)]
    snapshot = bridge.latest()
    # All 60 calls returned while the client was stalled: nothing waited for it.
    assert len(fake.calls) == calls_before
    assert results.count(True) == 8 and bridge.stats.dropped == 52  # queue_size 8
    assert all(isinstance(f.exception(timeout=0), BusyError) for f in futures)
    assert not first.done() and snapshot.window == ()
    fake.gate.set()
    assert first.result(timeout=30)[0].memory.content == "about first"
    wait_for(lambda: len(bridge.latest().window) == 8)
    bridge.close()


def test_refresh_error_keeps_the_last_window(bridge: MemoryBridge, fake: RecordingClient) -> None:
    bridge.record_turn("user", "kept")
    wait_for(lambda: len(bridge.latest().window) == 1)
    fake.fail_refresh = True
    wait_for(lambda: bridge.latest().error is not None)
    assert bridge.latest().window[0]["content"] == "kept"
    assert "no reply" in (bridge.stats.last_error or "")


def test_close_with_timeout_0_cancels_queued_jobs_at_once(fake: RecordingClient) -> None:
    bridge = MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=3600).start()
    wait_for(lambda: bridge.latest().fetched_at > 0)
    fake.gate.clear()
    fake.entered.clear()
    in_flight = bridge.search("in flight")
    assert fake.entered.wait(30)
    queued = bridge.search("queued")
    threading.Timer(0.2, fake.gate.set).start()  # the call in flight finishes after close returned
    assert _timed(lambda: bridge.close(timeout=0)) < 0.5
    bridge.close()
    assert isinstance(queued.exception(timeout=0), ClosedError)
    assert bridge.stats.discarded_at_close == 1
    assert in_flight.result(timeout=30)  # not waited for, not cancelled
    wait_for(lambda: fake.closed == 1)
    assert bridge.record_turn("user", "late") is False
    assert isinstance(bridge.search("late").exception(timeout=0), BusyError)
    with pytest.raises(ClosedError):
        bridge.start()


def test_current_person_none_is_stored_as_nobody(bridge: MemoryBridge, fake: RecordingClient) -> None:
    bridge.set_current_person("Alex")
    wait_for(lambda: bridge.latest().person == "Alex")
    bridge.set_current_person(None)
    wait_for(lambda: fake.context.get(PERSON_KEY) == NOBODY and bridge.latest().person is None)


def test_remember_future_gives_the_memory(bridge: MemoryBridge) -> None:
    future: Future[Memory] = bridge.remember("Alex likes green tea", metadata={"person": "Alex"})
    memory = future.result(timeout=30)
    assert memory.content == "Alex likes green tea" and memory.memory_type is MemoryType.FACT


# -- with the real daemon --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("bridge")) as d:
        yield d


def test_round_trip_with_the_daemon(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        c.remember_fact("Alex likes green tea", {"person": "Alex"})
    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=0.1) as bridge:
        bridge.set_current_person("Alex")
        assert bridge.record_turn("user", "I am back from Lyon")
        wait_for(lambda: "Alex likes green tea" in bridge.latest().person_facts)
        wait_for(lambda: any(m["content"] == "I am back from Lyon" for m in bridge.latest().window))
        hits = bridge.search("back from Lyon", memory_type="conversation").result(timeout=30)
    assert hits and hits[0].memory.content == "I am back from Lyon"
    assert hits[0].memory.metadata == {"role": "user", "person": "Alex"}
    with daemon.client() as c:
        assert c.get_context(PERSON_KEY) == "Alex"


def test_the_person_facts_include_what_remember_linked(daemon: DaemonProcess) -> None:
    # ROBOT.md's demo: `reachy-memory remember "Nora likes jazz" --about Nora`, then the greeter
    # asks the bridge what it knows of Nora; the bridge read metadata.person only and found nothing.
    with daemon.client() as c:
        c.remember("Nora likes jazz", subjects=["Nora"])
        c.remember_fact("Nora grows tomatoes", person="Nora")  # spec 000's way, same person
        c.remember_fact("Sam likes rock", person="Sam")
    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=0.1) as bridge:
        bridge.set_current_person("Nora")
        wait_for(lambda: {"Nora likes jazz", "Nora grows tomatoes"} <= set(bridge.latest().person_facts))
        assert "Sam likes rock" not in bridge.latest().person_facts


def test_context_for_gives_a_prompt_context_off_the_loop(daemon: DaemonProcess) -> None:
    # context_for (one call: window, facts, people, text) was not reachable from the bridge.
    with daemon.client() as c:
        c.remember("Ines keeps bees", subjects=["Ines"])
    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=3600) as bridge:
        context = bridge.context_for("what does Ines keep?", max_tokens=200).result(timeout=30)
    assert "Ines keeps bees" in context.text and any(p.display_name == "Ines" for p in context.people)


@contextlib.contextmanager
def frozen(daemon: DaemonProcess) -> Iterator[None]:
    """The daemon SIGSTOPped (its socket accepts, nobody answers) for the block, then continued."""
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


def kept_turns(daemon: DaemonProcess, person: str) -> list[str]:
    """The contents of the conversation memories tagged with ``person``, sorted."""
    with daemon.client() as c:
        hits = c.search(person, "conversation", limit=50, min_score=0.0, where={"person": person})
    return sorted(h.memory.content for h in hits)


def test_turns_queued_just_before_close_reach_the_daemon(daemon: DaemonProcess) -> None:
    # close() cancelled the jobs still queued: an app that said goodbye and left the `with`
    # block lost its last turns (record_turn had said True) and nothing counted them.
    turns = [f"Dora says goodbye, part {i}" for i in range(10)]
    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=3600) as bridge:
        assert all(bridge.record_turn("user", turn, person="Dora") for turn in turns)
        noted = bridge.remember("Dora leaves at noon", "context", {"person": "Dora"})
    # The block's close() (5 s by default) returned: the turns are in the daemon.
    assert kept_turns(daemon, "Dora") == sorted(turns)
    assert noted.result(timeout=0).content == "Dora leaves at noon"
    assert (bridge.stats.done, bridge.stats.discarded_at_close, bridge.stats.errors) == (11, 0, 0)


@pytest.mark.parametrize("state", ["frozen", "absent"])
def test_close_returns_within_its_timeout_and_counts_what_it_discarded(
        daemon: DaemonProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture, state: str) -> None:
    # The worker waits in a call (up to the bridge's 5 s timeout) on a frozen or absent daemon:
    # close(timeout=0.5) does not wait for it, and says what it could not send.
    endpoint = daemon.endpoint if state == "frozen" else f"ipc://{tmp_path}/nobody.sock"
    with frozen(daemon) if state == "frozen" else contextlib.nullcontext():
        bridge = MemoryBridge(endpoint, config=daemon.config, timeout=5.0, refresh_interval=3600).start()
        assert all(bridge.record_turn("user", f"never sent {i}") for i in range(6))
        found = bridge.search("never sent")
        with caplog.at_level(logging.WARNING, logger="reachy_memory.bridge"):
            took = _timed(lambda: bridge.close(timeout=0.5))
        assert 0.4 <= took < 0.5 + 1.0
        assert bridge.stats.discarded_at_close == 7
        assert isinstance(found.exception(timeout=0), ClosedError)
        warnings = [r.getMessage() for r in caplog.records if r.name == "reachy_memory.bridge"]
        assert len(warnings) == 1 and "7 queued job(s) (6 turn(s))" in warnings[0]
        assert bridge.record_turn("user", "after close") is False


def test_close_twice_the_second_call_returns_at_once_and_cuts_no_drain_short(daemon: DaemonProcess) -> None:
    turns = [f"Cleo waves, part {i}" for i in range(5)]
    with frozen(daemon):  # the worker waits in its first fetch: the turns stay queued
        bridge = MemoryBridge(daemon.endpoint, config=daemon.config, timeout=20.0, refresh_interval=3600).start()
        assert all(bridge.record_turn("user", turn, person="Cleo") for turn in turns)
        first = threading.Thread(target=bridge.close, kwargs={"timeout": 30.0}, daemon=True)
        first.start()
        wait_for(lambda: bridge.record_turn("user", "too late", person="Probe") is False, timeout=10)
        assert _timed(lambda: bridge.close(timeout=0)) < 0.5
        assert first.is_alive()  # still draining: the second call cut nothing short
    first.join(30)  # continued: the worker's fetch is answered, then the queued turns are sent
    assert not first.is_alive()
    assert kept_turns(daemon, "Cleo") == sorted(turns)
    assert bridge.stats.discarded_at_close == 0
    assert _timed(bridge.close) < 0.5


# -- failures that are not the daemon's ---------------------------------------------------------


def test_a_turn_and_a_memory_the_bridge_owns_are_found_by_their_owner_only(daemon: DaemonProcess) -> None:
    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=0.1) as bridge:
        bridge.set_current_person("Liz")  # a display name for metadata; the owner is separate
        assert bridge.record_turn("user", "Liz here: my salary is going up in spring", owner="liz")
        noted = bridge.remember("Liz wants a quiet birthday", "context", owner="liz").result(timeout=30)
        wait_for(lambda: any("salary" in m["content"] for m in bridge.latest().window))
    with daemon.client() as c:
        def found(owner: str | None) -> set[str]:
            return {h.memory.content for h in c.search("salary spring quiet birthday", limit=10, min_score=0.0,
                                                       owner=owner) if h.memory.content.startswith("Liz ")}

        assert found("liz") == found(None) == {"Liz here: my salary is going up in spring",
                                                  "Liz wants a quiet birthday"}
        assert found("max") == set()  # another user (was: both)
        turn = next(h.memory for h in c.search("salary spring", "conversation", min_score=0.0)
                    if h.memory.content.startswith("Liz"))
    assert (turn.owner, turn.metadata, noted.owner) == ("liz", {"role": "user", "person": "Liz"}, "liz")


@pytest.mark.parametrize("owner", ["", "x" * 201, 7])  # empty, too long, not a string
def test_a_bad_owner_is_refused_on_the_callers_thread_and_queues_nothing(bridge: MemoryBridge,
                                                                        fake: RecordingClient, owner: Any) -> None:
    from reachy_memory import ValidationError

    with pytest.raises(ValidationError):
        bridge.record_turn("user", "hello", owner=owner)
    with pytest.raises(ValidationError):
        bridge.remember("a fact", owner=owner)
    bridge.search("tea").result(timeout=30)  # queued after them: they would have run first
    assert not {name for _, name in fake.calls} & {"record_turn", "store"}


class BrokenStoreClient(RecordingClient):
    """``store`` fails with a foreign error (a bug, or a value the client cannot send)."""

    def store(self, content: str, memory_type: Any = "fact", metadata: dict[str, Any] | None = None, *,
              id: str | None = None) -> Memory:
        raise TypeError("can not serialize 'datetime.datetime' object")


def test_a_job_failing_with_a_foreign_error_fails_its_future_only() -> None:
    # Only ReachyMemoryError was caught: any other error ended the worker thread, the
    # job's future never finished and every later job was queued for nobody.
    fake = BrokenStoreClient()
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        failed = bridge.remember("Alex likes tea")
        assert isinstance(failed.exception(timeout=10), TypeError)
        assert bridge.search("tea").result(timeout=10)[0].memory.content == "about tea"
        assert bridge.stats.errors == 1 and bridge.latest().error is None


class FlakyRefreshClient(RecordingClient):
    """A client whose window fetch fails once with a foreign error (zmq.Again leaked so
    from the blocking client when a restart dropped its connection mid-send)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_once = False

    def get_context_window(self) -> list[dict[str, Any]]:
        if self.fail_once:
            self.fail_once = False
            raise RuntimeError("Resource temporarily unavailable")
        return super().get_context_window()


def test_a_refresh_failing_with_a_foreign_error_does_not_end_the_bridge() -> None:
    # Only ReachyMemoryError was caught in a refresh: any other error ended the worker, and
    # the bridge stayed dead (every later call dropped) after the daemon was back.
    fake = FlakyRefreshClient()
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        assert bridge.record_turn("user", "kept")
        wait_for(lambda: len(bridge.latest().window) == 1)
        fake.fail_once = True
        wait_for(lambda: bridge.latest().error is not None)
        assert [m["content"] for m in bridge.latest().window] == ["kept"]  # the last snapshot, with the error
        assert bridge.record_turn("user", "after")  # still taken
        wait_for(lambda: bridge.latest().error is None and len(bridge.latest().window) == 2)


def _client_that_cannot_be_made(gate: threading.Event) -> Callable[[], RecordingClient]:
    """A client factory that fails (ConfigError) once ``gate`` is set: the worker ends."""
    from reachy_memory import ConfigError

    def factory() -> RecordingClient:
        assert gate.wait(10)
        raise ConfigError("bad endpoint", key="server.endpoint")
    return factory


def test_a_worker_that_cannot_start_fails_futures_instead_of_leaving_them_pending() -> None:
    # The client factory raising (a bad endpoint, unreadable CURVE keys) ended the worker;
    # futures of jobs queued before or after never finished, record_turn kept saying True.
    gate = threading.Event()
    bridge = MemoryBridge(client_factory=_client_that_cannot_be_made(gate), queue_size=8).start()
    try:
        queued = bridge.search("queued before the failure")
        gate.set()
        assert isinstance(queued.exception(timeout=10), ClosedError)
        wait_for(lambda: bridge.latest().error is not None, timeout=10)
        assert isinstance(bridge.search("after").exception(timeout=10), BusyError)
        assert bridge.record_turn("user", "hello") is False
    finally:
        gate.set()
        bridge.close()


class FlakyTurnClient(RecordingClient):
    """record_turn raises ``errors`` in turn before it works; the ids it was sent are kept."""

    def __init__(self, *errors: Exception) -> None:
        super().__init__()
        self.errors = list(errors)
        self.ids: list[str | None] = []

    def record_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                    id: str | None = None) -> Memory:
        self.ids.append(id)
        if self.errors:
            raise self.errors.pop(0)
        return super().record_turn(role, content, metadata, id=id)


def test_a_turn_failing_for_not_now_is_sent_again_with_its_id_and_keeps_its_place() -> None:
    # A failed record_turn was dropped (stats.errors) after record_turn had said True.
    fake = FlakyTurnClient(DaemonUnavailableError("restarting"), RequestTimeoutError("no reply"), BusyError("full"))
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        assert bridge.record_turn("user", "first") and bridge.record_turn("user", "second")
        found = bridge.search("after both")
        assert found.result(timeout=10)
        assert [m["content"] for m in fake.window] == ["first", "second"]
        assert [name for _, name in fake.calls if name in ("record_turn", "search")] == \
            ["record_turn", "record_turn", "search"]  # the search waited behind the turns
        assert len(set(fake.ids[:4])) == 1 and fake.ids[4] != fake.ids[0]  # one id per turn, every attempt
        assert (bridge.stats.retries, bridge.stats.errors, bridge.stats.turns_lost) == (3, 0, 0)


def test_a_turn_refused_by_the_daemon_is_not_sent_again() -> None:
    fake = FlakyTurnClient(ValidationError("too long", field="content"))
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        assert bridge.record_turn("user", "refused")
        wait_for(lambda: bridge.stats.turns_lost == 1)
        assert len(fake.ids) == 1 and bridge.stats.retries == 0 and bridge.stats.errors == 1
        assert "lost" in (bridge.latest().error or "")


def test_a_turn_is_given_up_after_turn_retry_for_and_the_loop_never_waits() -> None:
    fake = FlakyTurnClient(*[DaemonUnavailableError("down")] * 10**6)
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05,
                      turn_retry_for=0.5) as bridge:
        started = time.monotonic()
        assert bridge.record_turn("user", "never kept")
        wait_for(lambda: bridge.stats.retries > 0)
        assert "waits for the daemon" in (bridge.latest().error or "")
        worst = max(_timed(lambda: bridge.record_turn("user", "behind it")) for _ in range(3))
        assert worst < 0.05  # queued, not waited for
        wait_for(lambda: bridge.stats.turns_lost == 4)  # each given up once 0.5 s from its queueing passed
        assert 0.5 <= time.monotonic() - started < 0.5 + 10
        assert bridge.stats.errors == 4 and "down" in (bridge.stats.last_error or "")


def test_close_gives_up_a_turn_waiting_for_the_daemon_at_its_deadline() -> None:
    fake = FlakyTurnClient(*[DaemonUnavailableError("down")] * 10**6)
    bridge = MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05).start()
    assert bridge.record_turn("user", "waiting")
    wait_for(lambda: bridge.stats.retries > 0)
    assert _timed(lambda: bridge.close(timeout=0.3)) < 2.0  # not the 60 s of turn_retry_for
    wait_for(lambda: bridge.stats.turns_lost == 1, timeout=10)
    assert bridge.stats.discarded_at_close == 0  # it was sent (and failed), not left in the queue


def test_close_from_a_done_callback_returns_and_the_worker_drains(fake: RecordingClient) -> None:
    # A callback runs on the worker thread: close() there joined the worker from itself
    # (RuntimeError, swallowed by the future) and the queued jobs were cancelled.
    bridge = MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=3600).start()
    wait_for(lambda: bridge.latest().fetched_at > 0)
    fake.gate.clear()
    first = bridge.search("first")
    assert bridge.record_turn("user", "queued behind it")
    queued = bridge.search("queued")
    returned: list[float] = []
    first.add_done_callback(lambda f: returned.append(_timed(bridge.close)))
    fake.gate.set()
    assert queued.result(timeout=10)[0].memory.content == "about queued"
    wait_for(lambda: fake.closed == 1, timeout=10)
    assert returned and returned[0] < 0.5 and fake.window[-1]["content"] == "queued behind it"
    assert bridge.stats.discarded_at_close == 0 and bridge.record_turn("user", "late") is False


class SlowTurnClient(RecordingClient):
    """record_turn takes ``seconds`` (a daemon answering slowly)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def record_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                    id: str | None = None) -> Memory:
        time.sleep(self.seconds)
        return super().record_turn(role, content, metadata, id=id)


def test_close_after_one_from_a_done_callback_waits_for_the_drain() -> None:
    # close() from a done callback returns at once (the worker cannot wait for itself), and the
    # app's own close() (leaving the `with` block) then returned at once too, "idempotent": nobody
    # waited for the drain, and an app exiting then lost the queued turns, neither sent nor counted.
    fake = SlowTurnClient(0.2)
    bridge = MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=3600).start()
    wait_for(lambda: bridge.latest().fetched_at > 0)
    fake.gate.clear()
    first = bridge.search("first")
    assert fake.entered.wait(30)
    turns = [f"goodbye {i}" for i in range(4)]
    assert all(bridge.record_turn("user", turn) for turn in turns)
    called = threading.Event()
    first.add_done_callback(lambda f: (bridge.close(timeout=10), called.set()))
    fake.gate.set()
    assert called.wait(10)
    took = _timed(lambda: bridge.close(timeout=10))
    assert [m["content"] for m in fake.window] == turns  # sent before the app's close() returned
    assert bridge.stats.done == 5 and bridge.stats.discarded_at_close == 0 and took < 5
    wait_for(lambda: fake.closed == 1, timeout=10)
    assert _timed(lambda: bridge.close(timeout=10)) < 0.5  # drained: a third call returns at once


def test_a_later_close_waits_no_longer_than_its_own_timeout_and_cuts_nothing_short() -> None:
    fake = SlowTurnClient(0.3)
    bridge = MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=3600).start()
    wait_for(lambda: bridge.latest().fetched_at > 0)
    turns = [f"goodbye {i}" for i in range(4)]
    assert all(bridge.record_turn("user", turn) for turn in turns)
    first = threading.Thread(target=bridge.close, kwargs={"timeout": 30.0}, daemon=True)
    first.start()
    wait_for(lambda: bridge.record_turn("user", "probe") is False)
    assert 0.15 <= _timed(lambda: bridge.close(timeout=0.2)) < 0.6  # its own timeout, not the first's
    first.join(30)
    assert not first.is_alive() and [m["content"] for m in fake.window] == turns
    assert bridge.stats.discarded_at_close == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "5", None])
def test_close_timeout_must_be_seconds_and_a_refused_one_closes_nothing(bad: Any) -> None:
    bridge = MemoryBridge(client_factory=RecordingClient, queue_size=8)
    with pytest.raises(ValidationError, match="timeout"):
        bridge.close(bad)
    assert bridge.record_turn("user", "still open")
    bridge.close(timeout=0)
    assert bridge.stats.discarded_at_close == 1  # never started: nothing could send it


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "60", True])
def test_turn_retry_for_must_be_seconds(bad: Any) -> None:
    with pytest.raises(ValidationError, match="turn_retry_for"):
        MemoryBridge(client_factory=RecordingClient, turn_retry_for=bad)


def _timed(call: Callable[[], Any]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


class OldDaemonClient(FlakyTurnClient):
    """A daemon from before turn ids: ``id`` is an unknown argument; ``errors`` then in turn."""

    def record_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                    id: str | None = None) -> Memory:
        if id is not None:
            self.ids.append(id)
            raise ValidationError("record_turn: unknown arguments ['id']", field="args")
        return super().record_turn(role, content, metadata)


def test_a_daemon_from_before_turn_ids_still_gets_the_turn_once() -> None:
    # A new bridge beside a daemon not restarted since the upgrade lost every turn ("unknown arguments").
    fake = OldDaemonClient()
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        assert bridge.record_turn("user", "kept by an old daemon")
        wait_for(lambda: bridge.stats.done == 1)
        assert [m["content"] for m in fake.window] == ["kept by an old daemon"]
        assert fake.ids[1:] == [None] and (bridge.stats.errors, bridge.stats.turns_lost) == (0, 0)


def test_a_turn_sent_without_its_id_is_never_sent_again() -> None:
    fake = OldDaemonClient(RequestTimeoutError("no reply"))  # the id-less send times out: it may have been kept
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        assert bridge.record_turn("user", "maybe kept")
        wait_for(lambda: bridge.stats.turns_lost == 1)
        assert fake.ids[1:] == [None]  # one id-less attempt, no second one that could keep it twice
        assert fake.window == []


# -- remember and set_current_person survive a daemon restart too; failures counted -----------------


class FlakyWriteClient(RecordingClient):
    """``store`` and ``set_context`` raise ``errors[op]`` in turn before they work; the ids
    each store was sent with are kept (None: sent without one). ``refuses_ids``: a daemon
    from before ids (an unknown argument, nothing stored)."""

    def __init__(self, refuses_ids: bool = False, **errors: list[Exception]) -> None:
        super().__init__()
        self.errors = errors
        self.ids: list[str | None] = []
        self.refuses_ids = refuses_ids
        self.tries: dict[str, int] = {}
        self.order: list[str] = []  # the writes that worked and the searches, in order

    def search(self, query: str, *args: Any, **kwargs: Any) -> list[SearchResult]:
        self.order.append(f"search {query}")
        return super().search(query, *args, **kwargs)

    def _fail(self, op: str) -> None:
        self.tries[op] = self.tries.get(op, 0) + 1
        if self.errors.get(op):
            raise self.errors[op].pop(0)

    def store(self, content: str, memory_type: Any = "fact", metadata: dict[str, Any] | None = None, *,
              id: str | None = None) -> Memory:
        self.ids.append(id)
        if id is not None and self.refuses_ids:
            raise ValidationError("store: unknown arguments ['id']", field="args")
        self._fail("store")
        self.order.append("store")
        return super().store(content, memory_type, metadata, id=id)

    def set_context(self, key: str, value: str) -> None:
        self._fail("set_context")
        self.order.append("set_context")
        super().set_context(key, value)


def _not_now() -> list[Exception]:
    return [DaemonUnavailableError("restarting"), RequestTimeoutError("no reply"), BusyError("full")]


def test_remember_and_set_current_person_failing_for_not_now_are_sent_again_in_order() -> None:
    # remember's store was sent once, without an id made for it: a fact told while the daemon
    # restarted was lost (its future failed) though the turns beside it were kept.
    fake = FlakyWriteClient(store=_not_now(), set_context=_not_now())
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        assert bridge.set_current_person("Alex")
        noted = bridge.remember("Alex likes green tea", metadata={"person": "Alex"})
        found = bridge.search("after both")
        memory = noted.result(timeout=10)
        assert found.result(timeout=10)
        assert fake.context[PERSON_KEY] == "Alex" and fake.tries == {"set_context": 4, "store": 4}
        assert [op for op in fake.order if op != "search Alex"] == ["set_context", "store", "search after both"]
        assert len(set(fake.ids)) == 1 and memory.id == fake.ids[0] and len(memory.id) == 32  # one id, each time
        assert (bridge.stats.retries, bridge.stats.errors, bridge.stats.turns_lost) == (6, 0, 0)


def test_a_remember_refused_or_given_up_fails_its_future_with_that_error() -> None:
    fake = FlakyWriteClient(store=[ValidationError("too long", field="content"),
                                   *[DaemonUnavailableError("down")] * 10**6])
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05,
                      turn_retry_for=0.3) as bridge:
        with pytest.raises(ValidationError, match="too long"):
            bridge.remember("refused").result(timeout=10)
        assert fake.tries["store"] == 1  # its own error: not sent again
        started = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="down"):
            bridge.remember("never kept").result(timeout=10)
        assert fake.tries["store"] > 2 and 0.3 <= time.monotonic() - started < 0.3 + 5
        assert bridge.stats.errors == 2 and bridge.stats.turns_lost == 0


@pytest.mark.parametrize("then", [None, RequestTimeoutError("no reply")])
def test_a_daemon_refusing_the_memory_id_gets_it_once_without(then: Exception | None) -> None:
    # The same fallback as a turn's (store took ids from the first daemon on: a client_factory's).
    fake = FlakyWriteClient(refuses_ids=True, store=[then] if then else [])
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        future = bridge.remember("kept by an old daemon")
        if then is None:
            assert future.result(timeout=10).content == "kept by an old daemon"
        else:  # the id-less send may have been kept: never sent again
            with pytest.raises(ReachyMemoryError, match="no memory id"):
                future.result(timeout=10)
        assert len(fake.ids) == 2 and fake.ids[0] and fake.ids[1] is None


def test_a_closed_client_is_not_sent_again_and_a_stopping_daemon_is(daemon: DaemonProcess) -> None:
    # ClosedError's code is "unavailable" (a "not now" code): a bridge on a client closed
    # elsewhere (a client_factory's) sent each turn again for turn_retry_for (60 s by default).
    closed = daemon.client()
    closed.close()
    with MemoryBridge(client_factory=lambda: closed, queue_size=8, refresh_interval=3600,
                      turn_retry_for=5) as bridge:
        started = time.monotonic()
        assert bridge.record_turn("user", "never sent")
        with pytest.raises(ClosedError):
            bridge.remember("never sent either").result(timeout=10)
        wait_for(lambda: bridge.stats.turns_lost == 1, timeout=10)
        assert time.monotonic() - started < 1.0 and bridge.stats.retries == 0
    # The daemon's own ClosedError (its store closing while it stops: a restart) is "not now".
    with pytest.raises(ClosedError) as raised:  # as the client gets it
        proto.raise_for({"ok": False, "error": {"code": "unavailable", "type": "ClosedError",
                                                "message": "this MemoryStore is closed"}})
    stopping = raised.value
    fake = FlakyWriteClient(store=[stopping])
    with MemoryBridge(client_factory=lambda: fake, queue_size=8, refresh_interval=0.05) as bridge:
        assert bridge.remember("kept after the restart").result(timeout=10)
        assert fake.tries["store"] == 2 and bridge.stats.retries == 1


def test_jobs_discarded_when_the_worker_cannot_start_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    # They failed (futures: ClosedError) but no counter had them: enqueued 3, done/errors/discarded 0.
    gate = threading.Event()
    bridge = MemoryBridge(client_factory=_client_that_cannot_be_made(gate), queue_size=8).start()
    try:
        assert bridge.record_turn("user", "queued before the failure")
        noted = bridge.remember("queued too")
        found = bridge.search("queued too")
        with caplog.at_level(logging.WARNING, logger="reachy_memory.bridge"):
            gate.set()
            assert isinstance(noted.exception(timeout=10), ClosedError)
            assert isinstance(found.exception(timeout=10), ClosedError)
            wait_for(lambda: bridge.stats.discarded_at_failure == 3, timeout=10)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("3 queued job(s) (1 turn(s)) never sent" in w for w in warnings)
    finally:
        gate.set()
        bridge.close()
    stats = bridge.stats
    assert (stats.enqueued, stats.discarded_at_failure, stats.discarded_at_close, stats.done, stats.errors) == \
        (3, 3, 0, 0, 0)


# -- with a daemon that restarts -----------------------------------------------------------------


@pytest.fixture
def restarting(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A words-only daemon (no model to load: a restart takes about a second)."""
    yield from restartable_daemon(tmp_path)


def contents(d: DaemonProcess) -> list[str]:
    """Every stored fact's content, sorted (each one as often as it is stored)."""
    with d.client(timeout=5.0) as c:
        return sorted(m.content for m in c.export_page()[0] if m.memory_type is MemoryType.FACT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["term", "kill"])
def test_facts_told_while_the_daemon_restarts_are_kept_once(restarting: DaemonProcess, how: str) -> None:
    facts = [f"Ada's {pet} is called {name}" for pet, name in [("cat", "Miso"), ("dog", "Rex"), ("bird", "Kiwi")]]
    with MemoryBridge(restarting.endpoint, config=restarting.config, timeout=0.5, refresh_interval=0.05) as bridge:
        told = [bridge.remember(facts[0])]
        assert told[0].result(timeout=30)
        assert restarting.proc is not None
        os.kill(restarting.proc.pid, signal.SIGSTOP)
        told.append(bridge.remember(facts[1]))  # reaches the frozen daemon's socket
        time.sleep(0.1)
        stop_as_systemd(restarting, how)
        told.append(bridge.remember(facts[2]))  # no daemon listens
        assert bridge.set_current_person("Ada")
        wait_for(lambda: bridge.stats.retries > 0)
        restarting.start()
        kept = [future.result(timeout=30) for future in told]
        wait_for(lambda: bridge.latest().person == "Ada" and bridge.latest().error is None)
        assert (bridge.stats.errors, bridge.stats.dropped) == (0, 0)
    assert [m.content for m in kept] == facts
    assert contents(restarting) == sorted(facts)  # each once
    with restarting.client() as c:
        assert c.get_context(PERSON_KEY) == "Ada"
        assert [c.get(m.id) for m in kept] == kept


def test_a_fact_journaled_by_a_daemon_killed_before_its_reply_is_kept_once(restarting: DaemonProcess) -> None:
    # The first attempt is journaled, then the daemon is killed before the reply arrives:
    # the worker sends the fact again, with its id; the restarted daemon keeps nothing twice.
    real = restarting.client(timeout=5.0)

    client = ReplyLost(real, restarting, "store")
    try:
        with MemoryBridge(client_factory=lambda: client, refresh_interval=0.05) as bridge:
            memory = bridge.remember("Ada is allergic to peanuts").result(timeout=30)
            assert (bridge.stats.retries, bridge.stats.errors) == (1, 0)
    finally:
        real.close()
    assert client.sent == [memory, memory]  # the memory the killed daemon kept, not a second one
    assert contents(restarting) == ["Ada is allergic to peanuts"]


# -- the helper process (the default on POSIX) ----------------------------------------------------


_EXITS_WITHOUT_CLOSE = """
import os, sys
from reachy_memory.integrations.reachy_mini import MemoryBridge
from tests.daemon_util import DaemonProcess
bridge = MemoryBridge(sys.argv[1], refresh_interval=3600).start()
assert bridge.record_turn("user", "said just before the app died", person="Eve")
print(bridge._proc.pid, flush=True)
os._exit(0)  # no close(), no interpreter shutdown: as a crash
"""


def _helper_pid(bridge: MemoryBridge) -> int:
    proc = getattr(bridge, "_proc", None)
    assert proc is not None, "not a helper-process bridge"
    return int(proc.pid)


def test_by_default_the_worker_is_a_helper_process_that_yields_to_the_loop(daemon: DaemonProcess) -> None:
    # A worker thread of the control process decoded replies holding the loop's GIL (+1 to
    # +6 ms tick p99); now the control process keeps no thread of the bridge's at all.
    before = set(threading.enumerate())
    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=0.05) as bridge:
        pid = _helper_pid(bridge)
        assert bridge.record_turn("user", "Bo is here")
        hits = bridge.search("Bo is here", memory_type="conversation").result(timeout=30)
        assert [h.memory.content for h in hits] == ["Bo is here"] and isinstance(hits[0], SearchResult)
        assert set(threading.enumerate()) == before
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH
        assert os.getpriority(os.PRIO_PROCESS, pid) >= os.getpriority(os.PRIO_PROCESS, 0) + 5
    assert bridge._proc.poll() is not None  # type: ignore[attr-defined]  # ended, and reaped by close()
    assert MemoryBridge(helper=False).__class__ is MemoryBridge
    with pytest.raises(ValidationError):
        MemoryBridge(client_factory=RecordingClient, helper=True)


def test_a_stopped_helper_never_makes_the_loop_wait_and_its_queue_stays_bounded(daemon: DaemonProcess) -> None:
    with MemoryBridge(daemon.endpoint, config=daemon.config, queue_size=8, refresh_interval=0.05) as bridge:
        wait_for(lambda: bridge.latest().fetched_at > 0)
        pid = _helper_pid(bridge)
        os.kill(pid, signal.SIGSTOP)
        try:
            worst = 0.0
            found = bridge.search("sleeps")
            results = []
            for i in range(40):
                started = time.perf_counter()
                results.append(bridge.record_turn("user", f"while it sleeps {i}"))
                bridge.latest()
                found.done()
                worst = max(worst, time.perf_counter() - started)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert results[:7] == [True] * 7 and not any(results[7:])  # queue_size calls (with the search), then dropped
        assert worst < 0.05 and bridge.stats.dropped == 33
        wait_for(lambda: bridge.pending == 0)
        assert found.result(timeout=0) is not None
    with daemon.client() as c:
        said = {h.memory.content for h in c.search("while it sleeps", "conversation", limit=50, min_score=0.0)
                if h.memory.content.startswith("while it sleeps")}
    assert said == {f"while it sleeps {i}" for i in range(7)}


def test_a_helper_that_dies_ends_the_bridge_as_a_failed_worker(daemon: DaemonProcess) -> None:
    bridge = MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=3600).start()
    try:
        wait_for(lambda: bridge.latest().fetched_at > 0)
        with frozen(daemon):  # the helper's worker waits in a call: these stay unfinished
            futures = [bridge.search(f"query {i}") for i in range(3)]
            time.sleep(0.2)
            os.kill(_helper_pid(bridge), signal.SIGKILL)
            wait_for(lambda: bridge.latest().error is not None, timeout=10)
        assert "helper process ended" in (bridge.latest().error or "")
        assert all(isinstance(f.exception(timeout=5), ClosedError) for f in futures)
        assert bridge.stats.discarded_at_failure == 3 and bridge.record_turn("user", "too late") is False
    finally:
        assert _timed(lambda: bridge.close(timeout=1.0)) < 1.0


def test_the_helper_of_an_app_that_died_delivers_the_last_turn_and_ends(daemon: DaemonProcess) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "REACHY_MEMORY_CONFIG": str(daemon.config_path)}
    done = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_CLOSE, daemon.endpoint], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=15)  # ended by itself (reaped by init)
    assert kept_turns(daemon, "Eve") == ["said just before the app died"]


def test_the_helper_bridge_forwards_every_call_of_the_bridge() -> None:
    # A call added to MemoryBridge but not to HelperBridge would queue on the unused local
    # queue of the default (helper) bridge: its future would never finish.
    from reachy_memory.integrations.bridge_process import _CALLS, HelperBridge

    public = {name for name in vars(MemoryBridge) if not name.startswith("_")}
    assert public <= set(vars(HelperBridge))
    assert public - {"start", "close", "stop", "latest", "pending"} <= _CALLS


# -- the helper's pipe: msgpack, errors by class, garbled frames ---------------------------------


@pytest.mark.parametrize(("sent", "arrives", "fields"), [
    # one of ours with structured fields: the same class, the same fields
    (TooLargeError("content too long", field="content", size=9, limit=5), TooLargeError,
     {"field": "content", "size": 9, "limit": 5}),
    # a subclass two levels down, with a float field (a pause's end)
    (RememberingPausedError("paused", paused_until=1234.5), RememberingPausedError, {"paused_until": 1234.5}),
    # a storage error: a Path field arrives as its text (fields on the wire are scalars)
    (StorageFullError("disk full", path=Path("/data/x")), StorageFullError, {"path": "/data/x"}),
    # the base class itself, no fields
    (ReachyMemoryError("odd"), ReachyMemoryError, {}),
    # the bridge's own ClosedError: no remote_code, so not "not now" (proto.retryable stays False)
    (ClosedError("client closed"), ClosedError, {}),
    # a foreign exception: a ServiceError (RemoteError) whose message names the type
    (ValueError("bad value"), RemoteError, {}),
])
def test_an_error_crosses_the_pipe_as_the_same_class_with_its_fields(
        sent: BaseException, arrives: type[ReachyMemoryError], fields: dict[str, Any]) -> None:
    body = msgpack.unpackb(msgpack.packb(proto.error_to_wire(sent)))  # as the pipe carries it
    got = proto.error_from_wire(body)
    assert type(got) is arrives and got.fields == fields
    assert {name: getattr(got, name) for name in fields} == fields
    assert got.message == (str(sent) if isinstance(sent, ReachyMemoryError) else "ValueError: bad value")
    assert not hasattr(got, "remote_code") and proto.retryable(got) == proto.retryable(sent)


def test_a_daemon_error_keeps_its_remote_code_across_the_pipe_so_it_stays_retryable() -> None:
    # A ClosedError the daemon sent (it is stopping) is "not now"; one of this process is not.
    reply = proto.decode(proto.error_from("r1", ClosedError("store closing")))
    with pytest.raises(ClosedError) as raised:
        proto.raise_for(reply)
    assert proto.retryable(raised.value)
    again = proto.error_from_wire(msgpack.unpackb(msgpack.packb(proto.error_to_wire(raised.value))))
    assert type(again) is ClosedError and again.remote_code == "unavailable"  # type: ignore[attr-defined]
    assert proto.retryable(again)


def test_replies_and_errors_from_a_real_helper_arrive_as_the_thread_modes_types(daemon: DaemonProcess) -> None:
    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=0.05) as bridge:
        _helper_pid(bridge)
        memory = bridge.remember("Pia paints birds", MemoryType.FACT, {"person": "Pia", "tags": ["art"]}).result(30)
        assert isinstance(memory, Memory) and memory.metadata == {"person": "Pia", "tags": ["art"]}
        status = bridge.pause_remembering(1).result(timeout=30)
        assert isinstance(status, dict) and status["paused"] is True
        with pytest.raises(RememberingPausedError) as paused:  # the daemon's error, through the helper
            bridge.remember("Pia's secret").result(timeout=30)
        assert isinstance(paused.value.paused_until, float)  # type: ignore[attr-defined]
        assert bridge.resume_remembering().result(timeout=30)["paused"] is False
        with pytest.raises(ValidationError) as unsendable:  # refused here, as the client refuses it
            bridge.search("x", where={"when": object()}).result(timeout=0)
        assert unsendable.value.field == "args"  # type: ignore[attr-defined]
        with pytest.raises(ValidationError):
            bridge.record_turn("user", object())  # type: ignore[arg-type]
        assert bridge.record_turn("user", "Pia is here")
        wait_for(lambda: any(m["content"] == "Pia is here" for m in bridge.latest().window))
        assert isinstance(bridge.latest().window, tuple) and isinstance(bridge.latest().window[-1], dict)
    stats = bridge.stats
    assert (stats.enqueued, stats.done, stats.errors, bridge.pending) == (5, 4, 1, 0)
    assert stats.last_error is not None and "not stored" in stats.last_error


_FAKE_HELPER = """
import os, struct, sys
calls, out, junk, then = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4]
got = b""
def frames(data):
    n = 0
    while len(data) >= 4 and len(data) >= 4 + struct.unpack(">I", data[:4])[0]:
        data, n = data[4 + struct.unpack(">I", data[:4])[0]:], n + 1
    return n
while frames(got) < 2:  # the init, then the test's search
    got += os.read(calls, 65536)
os.write(out, junk)
if then == "exit":
    sys.exit(0)
while os.read(calls, 65536):  # until the bridge ends it
    pass
"""


def _frame_of(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


class _Boom:
    """Unpickled, it would make a directory: what a hostile pickle stream can do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


@pytest.mark.parametrize(("junk", "then", "says"), [
    # bytes msgpack never uses (0xc1): an undecodable frame
    (_frame_of(b"\xc1\xc1\xc1"), "stay", "undecodable"),
    # a length no frame has: a garbled stream, refused before it is buffered
    (b"\xff\xff\xff\xff" + b"x" * 100, "stay", "undecodable"),
    # valid msgpack that is not a named message
    (_frame_of(msgpack.packb({"a": 1})), "stay", "undecodable"),
    # a reply of the wrong shape (the payload of a success is bytes)
    (_frame_of(msgpack.packb(["done", 1, True, "text"])), "stay", "undecodable"),
    # a log record whose level is not a number (logging would raise TypeError in the loop)
    (_frame_of(msgpack.packb(["log", "reachy_memory", "high", "x"])), "stay", "undecodable"),
    # a well-framed reply whose value does not decode: found at result(), lazily
    (_frame_of(msgpack.packb(["done", 1, True, b"\xc1"])), "stay", "undecodable"),
    # a well-framed snapshot that does not decode: found when latest() first returns it
    (_frame_of(msgpack.packb(["snap", msgpack.packb(["not", "a", "snapshot"])])), "stay", "undecodable"),
    # a frame cut short, then the helper ends: a helper that died
    (_frame_of(msgpack.packb(["stats", {}]))[:6], "exit", "helper process ended"),
    # a pickle stream that would run os.mkdir: not decoded, let alone run
    ("pickle", "stay", "undecodable"),
])
def test_a_garbled_frame_ends_the_bridge_as_a_failed_helper_and_raises_nothing_foreign(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, junk: bytes | str, then: str, says: str) -> None:
    from reachy_memory.integrations import bridge_process

    pwned = tmp_path / "pwned"
    data = _frame_of(pickle.dumps(_Boom(pwned))) if junk == "pickle" else junk
    assert isinstance(data, bytes)
    real = subprocess.Popen

    def fake(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        return real([sys.executable, "-c", _FAKE_HELPER, args[-2], args[-1], data.hex(), then], **kwargs)

    monkeypatch.setattr(bridge_process.subprocess, "Popen", fake)
    bridge = MemoryBridge("ipc:///nowhere", refresh_interval=3600).start()
    try:
        found = bridge.search("anything")
        deadline = time.monotonic() + 10
        while not found.done():  # the loop's calls: none of them may raise
            assert time.monotonic() < deadline, "the bridge did not end"
            bridge.latest()
            assert bridge.pending >= 0 and bridge.stats.enqueued == 1
            time.sleep(0.01)
        with pytest.raises(ClosedError):
            found.result(timeout=0)
        assert says in (bridge.latest().error or "")
        assert bridge.stats.discarded_at_failure == 1 and bridge.record_turn("user", "too late") is False
        with pytest.raises(BusyError):
            bridge.search("later").result(timeout=0)
    finally:
        assert _timed(lambda: bridge.close(timeout=1.0)) < 2.0
    assert bridge._proc.poll() is not None  # type: ignore[attr-defined]  # ended and reaped
    assert not pwned.exists()


def test_a_helper_error_msgpack_cannot_carry_still_answers_its_call_with_its_class() -> None:
    # A message with a lone surrogate cannot be msgpack text: the call must still be answered
    # (else its future would wait forever), with the class kept and the message escaped.
    from reachy_memory.integrations.bridge_helper import _Helper
    from reachy_memory.integrations.bridge_process import _Frames

    read, write = os.pipe()
    try:
        helper = _Helper(-1, write)
        helper._post_error(3, NotFoundError("no memory \ud800", memory_id="\ud800"))
        helper._write()
        [message] = _Frames().feed(os.read(read, 65536))
    finally:
        os.close(read)
        os.close(write)
    assert message[:3] == ["done", 3, False]
    got = proto.error_from_wire(message[3])
    assert type(got) is NotFoundError and got.message == "no memory \\ud800" and got.fields == {}


def test_a_tuple_key_or_an_argument_over_the_pipes_frame_fails_its_call_not_the_helper(
        daemon: DaemonProcess) -> None:
    # msgpack packs {(1, 2): v} (an array key) but a plain unpack raises TypeError (a list is
    # unhashable), and a frame over _MAX_FRAME is a "garbled stream": either one used to end
    # the helper (the bridge dead for every later call) for one bad argument.
    from reachy_memory.integrations.bridge_process import _MAX_FRAME

    with MemoryBridge(daemon.endpoint, config=daemon.config, refresh_interval=0.05) as bridge:
        _helper_pid(bridge)
        with pytest.raises(ProtocolError):  # the daemon refuses it, as it does a thread-mode bridge's
            bridge.remember("Ida keys", MemoryType.FACT, {(1, (2, 3)): "v"}).result(timeout=30)
        with pytest.raises(TooLargeError) as too_large:
            bridge.record_turn("user", "x" * (_MAX_FRAME + 1))
        assert too_large.value.field == "args"  # type: ignore[attr-defined]
        with pytest.raises(TooLargeError):
            bridge.remember("y" * (_MAX_FRAME + 1)).result(timeout=0)
        memory = bridge.remember("Ida plays the cello").result(timeout=30)  # the helper lives on
        assert memory.content == "Ida plays the cello" and bridge.latest().error is None
        assert bridge.record_turn("user", "Ida is here")
        wait_for(lambda: any(m["content"] == "Ida is here" for m in bridge.latest().window))
