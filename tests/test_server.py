"""The daemon as a real process: ops, bad input, timeouts, restarts, crashes, backups."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from reachy_memory import (
    AsyncMemoryClient,
    BusyError,
    ClosedError,
    Config,
    MemoryClient,
    MemoryStore,
    ReachyMemoryError,
    RequestTimeoutError,
    TooLargeError,
    ValidationError,
)
from reachy_memory._threads import release_free_heap
from reachy_memory.config import ServerConfig
from reachy_memory.engine import vector_index
from reachy_memory.engine.store import GRAPH_FILE
from reachy_memory.storage import backup as bk
from tests.daemon_util import ROOT, DaemonProcess, words_only_daemon

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path).start()
    yield d
    assert d.stop() == 0, d.log.read_text()[-2000:]


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the cases that need no fresh store (the bad-input table)."""
    d = DaemonProcess(tmp_path_factory.mktemp("shared")).start()
    yield d
    assert d.stop() == 0, d.log.read_text()[-2000:]


@pytest.fixture
def raw(shared_daemon: DaemonProcess) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.connect(shared_daemon.endpoint)
    yield sock
    sock.close(linger=0)
    ctx.term()


def test_every_op_round_trips(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        assert c.ping()["pong"] is True
        fact = c.store("Sarah likes Italian food", "fact", {"person": "Sarah"})
        assert c.get(fact.id) == fact
        batch = c.store_batch([{"content": f"turn {i} about robots", "memory_type": "conversation"} for i in range(3)])
        assert len(batch) == 3
        assert c.search("what food does Sarah enjoy")[0].memory.id == fact.id
        assert [h.memory.id for h in c.search("robots", memory_type="conversation", limit=10, min_score=0)]
        assert c.search("Sarah", where={"person": "Sarah"}, min_score=0)[0].memory.id == fact.id
        c.add_to_context_window("user", "hello")
        assert [m["content"] for m in c.get_context_window()] == ["hello"]
        c.clear_context_window()
        assert c.get_context_window() == []
        c.set_context("task", "tidy the living room")
        assert c.get_context("task") == "tidy the living room"
        assert c.forget(fact.id) is True and c.get(fact.id) is None
        assert c.cleanup_expired() == 0
        page, cursor = c.export_page(limit=2)
        assert len(page) == 2 and cursor is not None
        health, stats = c.health(), c.stats()
        assert health["status"] == "ok" and health["embedder"]["state"] == "ready"
        assert health["last_cleanup"] is not None  # the start-up sweep ran
        assert stats["ops"]["store"]["count"] == 1 and stats["store"]["memories"] == 4
        search = stats["ops"]["search"]  # where a search's time went: queues, embedding, the engine
        assert set(search["stages_p50_ms"]) == {"wait", "embed", "engine"}
        assert search["stages_p50_ms"]["embed"] > 0 and search["stages_p50_ms"]["engine"] > 0
        assert sum(search["stages_p50_ms"].values()) <= 3 * search["p50_ms"]  # parts of the whole, not extra time
        # nothing to embed; its reply waited for the fsync (on the sync thread, not the engine's)
        assert set(stats["ops"]["forget"]["stages_p50_ms"]) == {"wait", "engine", "sync"}
        assert "stages_p50_ms" not in stats["ops"]["ping"]  # answered inline


@pytest.mark.parametrize("every, requests, expect_trims", [
    (0.2, True, True),  # due every 0.2 s after requests: trims run at idle moments and are counted
    (0.0, True, False),  # 0 turns them off
    (0.2, False, False),  # nothing queued since start (inline pings only): nothing to give back
])
def test_heap_is_trimmed_as_configured(tmp_path: Path, every: float, requests: bool, expect_trims: bool) -> None:
    with DaemonProcess(tmp_path, server={"heap_trim_seconds": every}) as d, d.client() as c:
        deadline = time.monotonic() + (1.5 if requests else 0)
        while time.monotonic() < deadline:
            c.store("the robot waters the basil on sundays", memory_type="fact")
            c.search("basil", limit=3)
            time.sleep(0.05)
        time.sleep(0.5)  # idle time: a trim waits for it
        trims = c.stats()["heap_trims"]
    assert (trims["recent"] > 0) is expect_trims, trims
    if expect_trims:
        assert 0 <= trims["p50_ms"] <= trims["max_ms"]


def test_socket_is_private(daemon: DaemonProcess) -> None:
    sock = Path(daemon.endpoint[len("ipc://"):])
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


def test_the_socket_is_private_from_its_bind_whatever_the_umask(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket took its mode from the umask (0777 under umask 0) and was chmodded 0600 only
    after the bind: in between any user who could reach the directory could connect, and a
    connection made then stays. Each (re)start binds under umask 0177 now."""
    from reachy_memory.daemon import server

    d = DaemonProcess(tmp_path)
    daemon: Any = server.Daemon.__new__(server.Daemon)  # only what _bind reads
    daemon.config, daemon.endpoint, daemon._ctx = d.config, d.endpoint, zmq.Context()
    seen: list[int] = []
    chmod = Path.chmod

    def spy(path: Path, mode: int, **kwargs: Any) -> None:
        if path.is_socket():
            seen.append(stat.S_IMODE(path.stat().st_mode))
        chmod(path, mode, **kwargs)

    monkeypatch.setattr(Path, "chmod", spy)
    previous = os.umask(0)
    try:
        router = daemon._bind()
    finally:
        assert os.umask(previous) == 0  # the caller's umask is given back
        monkeypatch.undo()
    router.close(linger=0)
    daemon._ctx.term()
    assert seen == [0o600]


def test_async_client_mirrors_the_spec_api(daemon: DaemonProcess) -> None:
    async def scenario() -> None:
        async with AsyncMemoryClient(daemon.endpoint, config=daemon.config) as c:
            fact = await c.remember_fact("User prefers to be called Alex", {"category": "user_profile"})
            await c.remember_conversation("we talked about dinosaurs")
            hits, window = await asyncio.gather(c.search("what is the user's name"), c.get_context_window())
            assert hits[0].memory.id == fact.id and window == []
            await c.add_to_context_window("user", "hi")
            await c.set_context("topic", "dinosaurs")
            assert await c.get_context("topic") == "dinosaurs"
            assert await c.cleanup_expired() == 0
            assert await c.forget(fact.id) is True
            many = await asyncio.gather(*(c.ping() for _ in range(20)))  # concurrent, matched by id
            assert all(p["pong"] for p in many)
            with pytest.raises(ValidationError):
                await c.store("", "fact")

    asyncio.run(scenario())


def _send(raw: zmq.Socket, payload: bytes) -> dict:
    raw.send(payload)
    return msgpack.unpackb(raw.recv(), raw=False)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\xc1\xc1\xc1", "bad_request"),  # undecodable msgpack
        (msgpack.packb([1, 2, 3]), "bad_request"),  # not a map
        (msgpack.packb({"v": 1, "op": "ping"}), "bad_request"),  # no id
        (msgpack.packb({"v": 2, "id": "a", "op": "ping"}), "bad_request"),  # future version
        (msgpack.packb({"v": 1, "id": "a", "op": "explode"}), "bad_request"),  # unknown op
        (msgpack.packb({"v": 1, "id": "a", "op": "get", "args": []}), "bad_request"),  # args not a map
        (msgpack.packb({"v": 1, "id": "a", "op": "get", "args": {}}), "bad_request"),  # missing argument
        (msgpack.packb({"v": 1, "id": "a", "op": "get", "args": {"id": 5}}), "bad_request"),  # wrong type
        (msgpack.packb({"v": 1, "id": "a", "op": "store", "args": {"content": "x", "bogus": 1}}), "bad_request"),
        (msgpack.packb({"v": 1, "id": "a", "op": "search", "args": {"query": "x", "limit": "9"}}), "bad_request"),
        (msgpack.packb({"v": 1, "id": "a", "op": "store", "args": {"content": "x" * 20000}}), "too_large"),
        (b"\x00" * (1024 * 1024 + 1), "too_large"),  # over max_message_bytes: refused before decoding
        (msgpack.packb({"v": 1, "id": "a", "op": "ping", "timeout_ms": "soon"}), "bad_request"),
    ],
)
def test_bad_input_gets_an_error_reply(raw: zmq.Socket, payload: bytes, code: str) -> None:
    reply = _send(raw, payload)
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert _send(raw, msgpack.packb({"v": 1, "id": "p", "op": "ping", "args": {}}))["ok"] is True


def test_fuzzed_frames_never_take_the_daemon_down(shared_daemon: DaemonProcess, raw: zmq.Socket) -> None:
    daemon = shared_daemon
    rng = random.Random(7)
    valid = msgpack.packb({"v": 1, "id": "x", "op": "search", "args": {"query": "robots", "limit": 3}})
    raw.rcvtimeo = 0
    for i in range(10_000):
        if i % 3 == 0:
            frame = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        else:  # mutate a valid request: flip, insert, truncate
            data = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(len(data))
                data[pos] = rng.getrandbits(8)
            frame = bytes(data[: rng.randint(1, len(data))])
        raw.send_multipart([frame] if i % 5 else [b"", frame])
        if i % 200 == 0:
            while True:  # drain replies so nothing piles up
                try:
                    raw.recv_multipart()
                except zmq.Again:
                    break
    with daemon.client() as c:
        memory = c.store("still alive after the fuzzing", "fact")
        assert c.get(memory.id) == memory
        assert c.ping()["pong"]


def test_client_timeout_leaves_client_usable_and_reconnects(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    with d.client(timeout=0.3) as c:
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            c.ping()  # no daemon yet
        assert time.monotonic() - started < 2.0
        d.start()
        try:
            assert c.ping(timeout=5)["pong"]  # same client, now connected
            memory = c.store("before restart", "fact", timeout=10)
            assert d.stop() == 0
            d.start()
            assert c.get(memory.id, timeout=10) == memory  # reconnected to the new daemon
        finally:
            d.stop()


@pytest.mark.parametrize("client_class", [MemoryClient, AsyncMemoryClient])
def test_a_socket_with_no_peer_to_send_to_times_out_instead_of_hanging(
        client_class: type[MemoryClient] | type[AsyncMemoryClient], monkeypatch: pytest.MonkeyPatch) -> None:
    # A DEALER without a live pipe blocks a plain send forever; libzmq drops the pipe
    # after a failed CURVE handshake (the CI hang of stop 26). ZMQ_IMMEDIATE towards a
    # port nobody listens on gives that state deterministically.

    def no_pipe(self: Any, ctx: zmq.Context) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.linger, sock.immediate = 0, 1
        sock.connect(self.endpoint)
        return sock

    monkeypatch.setattr(client_class, "_socket", no_pipe)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"  # closed again below: nobody listens
    outcome: dict[str, BaseException] = {}

    async def async_ping() -> None:
        async with AsyncMemoryClient(endpoint, timeout=0.3) as client:
            await client.ping()

    def call() -> None:
        try:
            if client_class is AsyncMemoryClient:
                asyncio.run(async_ping())
            else:
                with MemoryClient(endpoint, timeout=0.3) as client:
                    client.ping()
        except BaseException as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "the send waited past the call's timeout"
    assert isinstance(outcome.get("error"), RequestTimeoutError), outcome


def test_a_timeout_with_no_socket_says_no_daemon_is_there(tmp_path: Path) -> None:
    """It said only "no reply ... within 0.05 s": a first try of the README's client example,
    before starting the daemon, gave no clue that nothing was listening."""
    d = DaemonProcess(tmp_path)  # not started: no socket at its endpoint
    with MemoryClient(d.endpoint, config=d.config, timeout=0.05) as c, \
            pytest.raises(RequestTimeoutError, match="no socket there: is the daemon running"):
        c.get_context_window()

    async def scenario() -> None:
        async with AsyncMemoryClient(d.endpoint, config=d.config, timeout=0.05) as c:
            with pytest.raises(RequestTimeoutError, match="no socket there: is the daemon running"):
                await c.get_context_window()
    asyncio.run(scenario())
    socket_path = Path(d.endpoint.removeprefix("ipc://"))
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.touch()  # something there (a stalled daemon's socket): no guess about why
    with MemoryClient(d.endpoint, config=d.config, timeout=0.05) as c, pytest.raises(RequestTimeoutError) as raised:
        c.get_context_window()
    assert "no socket" not in str(raised.value)


def test_an_async_call_that_timed_out_never_reaches_a_later_daemon(tmp_path: Path) -> None:
    # AsyncMemoryClient kept one socket, and a DEALER queues a request while no daemon
    # listens: after RequestTimeoutError the request still went out to the next daemon
    # that started (at boot, or after a restart) and was done then.
    d = DaemonProcess(tmp_path)

    async def scenario() -> None:
        async with AsyncMemoryClient(d.endpoint, config=d.config, timeout=0.3) as c:
            with pytest.raises(RequestTimeoutError):
                await c.store("said while no daemon listened", id="before-start")
            await asyncio.to_thread(d.start)
            await c.store("a write after it", id="first", timeout=10)  # the engine does writes in order
            assert await c.get("before-start", timeout=10) is None
            await asyncio.to_thread(d.stop)
            with pytest.raises(RequestTimeoutError):
                await c.store("said while the daemon restarted", id="during-restart")
            await asyncio.to_thread(d.start)
            await c.store("a write after that", id="second", timeout=10)
            assert await c.get("during-restart", timeout=10) is None
            assert (await c.get("first", timeout=10)).content == "a write after it"

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        d.stop()


def test_clients_take_spec_000_keyword_metadata(daemon: DaemonProcess) -> None:
    # spec 000: remember_fact(content, **metadata); a TypeError on both clients before
    with daemon.client() as c:
        fact = c.remember_fact("User prefers to be called Alex", category="user_profile")
        turn = c.remember_conversation("hello", {"role": "user"}, person="Alex")
    assert fact.metadata == {"category": "user_profile"} and fact.memory_type.value == "fact"
    assert turn.metadata == {"role": "user", "person": "Alex"}

    async def run() -> Any:
        async with AsyncMemoryClient(daemon.endpoint, config=daemon.config, timeout=10) as ac:
            return await ac.remember_fact("User likes jazz", category="user_profile")

    assert asyncio.run(run()).metadata == {"category": "user_profile"}


def test_second_daemon_is_refused(daemon: DaemonProcess, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    same_endpoint = subprocess.run([sys.executable, "-m", "reachy_memory.cli", "serve", "--config",
                                    str(daemon.config_path)], capture_output=True, text=True, timeout=60, env=env)
    assert same_endpoint.returncode != 0 and "already serves" in same_endpoint.stderr
    other = f"ipc://{tmp_path}/other/memory.sock"
    same_data = subprocess.run([sys.executable, "-m", "reachy_memory.cli", "serve", "--config",
                                str(daemon.config_path), "--endpoint", other],
                               capture_output=True, text=True, timeout=60, env=env)
    assert same_data.returncode != 0 and "in use by another process" in same_data.stderr
    with daemon.client() as c:
        assert c.ping()["pong"]  # the first one is untouched


def test_non_loopback_tcp_needs_curve(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, server={"endpoint": "tcp://0.0.0.0:45811"})
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=60) == 2
    assert "CURVE" in d.log.read_text()


# What a storm client may meet while the daemon is killed, stopping or full: each is counted
# and the client goes on; anything else is kept as unexpected and ends that client.
_NOT_NOW = (RequestTimeoutError, ClosedError, BusyError)


class _Storm:
    """What the clients of a store storm saw: the ids acknowledged, the expected refusals
    by error class, and anything else (which the test asserts never happens)."""

    def __init__(self) -> None:
        self.acked: list[str] = []
        self.refused: dict[str, int] = {}
        self.unexpected: list[BaseException] = []
        self._lock = threading.Lock()

    def refuse(self, exc: BaseException) -> None:
        with self._lock:
            self.refused[type(exc).__name__] = self.refused.get(type(exc).__name__, 0) + 1


def _storm(d: DaemonProcess, n_clients: int, storm: _Storm, stop: threading.Event) -> list[threading.Thread]:
    def worker(k: int) -> None:
        try:
            with d.client(timeout=2.0) as c:
                i = 0
                while not stop.is_set():
                    memory_id = f"c{k}-{i}"
                    try:
                        c.store(f"client {k} note {i}", "conversation", {"k": k}, id=memory_id)
                        storm.acked.append(memory_id)
                    except _NOT_NOW as exc:
                        storm.refuse(exc)
                        time.sleep(0.05)  # daemon down or full: keep trying
                    i += 1
        except BaseException as exc:  # kept for the test to report: a thread's exception fails nothing
            storm.unexpected.append(exc)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n_clients)]
    for t in threads:
        t.start()
    return threads


def _storm_for(d: DaemonProcess, clients: int, seconds: float,
               during: Callable[[], object]) -> tuple[_Storm, object]:
    """Store from ``clients`` threads for ``seconds``, then call ``during`` and stop the storm."""
    storm = _Storm()
    stop = threading.Event()
    threads = _storm(d, clients, storm, stop)
    time.sleep(seconds)
    try:
        result = during()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a storm client did not stop"
    assert storm.unexpected == [], f"storm clients failed: {storm.unexpected!r}"
    return storm, result


def test_sigkill_during_store_storm_loses_nothing_and_retries_do_not_duplicate(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path).start()
    storm, _ = _storm_for(d, 4, 1.5, d.kill)
    acked = storm.acked
    assert len(acked) > 20
    # the daemon answered until the kill: what went unanswered is the stores in flight then,
    # and any tried again before the storm stopped (timeouts only: nothing was busy or closing)
    assert set(storm.refused) <= {"RequestTimeoutError"} and sum(storm.refused.values()) < len(acked)
    d.start()
    try:
        with d.client() as c:
            assert all(c.get(i) is not None for i in acked)
            # Retrying every store with the same ids creates nothing new.
            before = c.stats()["store"]["memories"]
            for memory_id in acked[:50]:
                k, i = memory_id[1:].split("-")
                c.store(f"client {k} note {i}", "conversation", {"k": int(k)}, id=memory_id)
            assert c.stats()["store"]["memories"] == before
    finally:
        assert d.stop() == 0


def _cached_nodes(data: Path) -> int:
    """The nodes the graph cache's meta in ``data`` lists, over every group (0: no cache)."""
    meta = vector_index._read_meta(data / GRAPH_FILE)
    return sum(len(slots) // 8 for slots, _, _ in meta["nodes"].values()) if meta else 0


def test_a_daemon_killed_after_a_quiet_spell_keeps_the_graph_it_cached(tmp_path: Path, embedder: Any) -> None:
    """A power cut (SIGKILL) of a daemon never stopped cleanly: it had no graph cache,
    and the next start rebuilt every graph in idle time.  After a quiet spell it now
    saves a graph that changed enough, and after the kill only what was stored since
    the save is inserted again."""
    d = DaemonProcess(tmp_path, search={"exact_below": 40, "exact_threshold": 5},
                      server={"graph_cache_quiet_seconds": 0.3}).start()
    try:
        with d.client(timeout=60) as c:
            c.store_batch([{"content": f"the robot learned fact number {i}", "memory_type": "fact"}
                           for i in range(300)])  # over CACHE_MIN_CHANGES in one memory type
            deadline = time.monotonic() + 60
            while _cached_nodes(d.data) < 300 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _cached_nodes(d.data) == 300
            later = c.store_batch([{"content": f"a later fact {i}", "memory_type": "fact"} for i in range(3)])
    finally:
        d.kill()
    with MemoryStore(d.data, config=d.config, embedder=embedder) as store:
        vectors = store._state.vectors
        assert vectors._adopt_loaded(wait=True)
        assert {store._state.by_slot[slot].id for slot in vectors.pending} == {m.id for m in later}


def test_sigterm_during_store_storm_exits_cleanly_and_keeps_every_acknowledged_write(tmp_path: Path) -> None:
    """SIGTERM while four clients store flat out, with background compactions every
    few KB: the daemon drains, compacts and exits 0 in time, and the data dir opens
    with every acknowledged memory (README: "SIGTERM/SIGINT finish in-flight requests,
    compact and close")."""
    d = DaemonProcess(tmp_path, memory={"compact_journal_bytes": 16384}).start()
    storm, code = _storm_for(d, 4, 1.5, d.stop)
    acked = storm.acked
    assert code == 0
    assert len(acked) > 20
    # only the stores met by the stop go unanswered (not read, or their store closing)
    assert set(storm.refused) <= {"RequestTimeoutError", "ClosedError"} and sum(storm.refused.values()) < len(acked)
    with MemoryStore(d.data, config=d.config, embedder=None) as store:
        missing = [i for i in acked if store.get(i) is None]
        assert missing == []


def test_backup_during_write_storm_verifies_and_restores(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path).start()
    dest = tmp_path / "backup.rms"

    def take_backup() -> dict:
        with d.client(timeout=60) as c:
            return c.backup(str(dest))

    try:
        storm, info = _storm_for(d, 3, 0.7, take_backup)
    finally:
        assert d.stop() == 0
    assert isinstance(info, dict)
    assert storm.refused == {} and len(storm.acked) > 0  # the backup held no store up for 2 s
    report = bk.verify(dest)
    assert report.ok, report.problems
    assert report.memories == info["memories"] > 0
    restored = tmp_path / "restored"
    bk.restore(dest, restored)
    assert bk.verify(restored).ok
    with MemoryStore(restored, config=d.config, embedder=None) as store:
        assert len(store) == info["memories"]
    with pytest.raises(ValidationError, match="already holds a store"):  # bad usage (exit 2), not a lock
        bk.restore(dest, restored)  # refuses to overwrite without --force


def test_searches_and_writes_are_answered_while_a_backup_is_written(tmp_path: Path) -> None:
    """The backup runs on a thread of its own: while health says it is being written, a
    search and a store (engine ops) are answered (they used to queue behind it: at 100k
    memories ~1.2 s of a stopped engine, the control loop's searches waiting); the backup
    holds the store as it was when asked for."""
    d = words_only_daemon(tmp_path, 30_000).start()
    dest, out, seen = tmp_path / "backup.rms", {}, []

    def take_backup() -> None:
        with d.client(timeout=60) as c:
            out.update(c.backup(str(dest)))

    taker = threading.Thread(target=take_backup, daemon=True)
    try:
        with d.client(timeout=10) as c:
            taker.start()
            deadline = time.monotonic() + 20
            while not c.health()["backup_running"] and time.monotonic() < deadline:
                time.sleep(0.002)
            seen.append(c.health()["backup_running"])
            found = c.search("fox number 123 river", mode="lexical", limit=3)
            stored = c.store("written while the backup was being written")
            seen.append(c.health()["backup_running"])
            taker.join(60)
            assert c.health()["backup_running"] is None and c.stats()["queues"]["background"] == 0
    finally:
        assert d.stop() == 0
    assert seen[0] and seen[0]["path"] == str(dest)
    assert seen[1] is not None, "the search and the store waited for the backup"
    assert found[0].memory.content.startswith("the fox number 123 ") and stored.id
    assert out["memories"] == 30_000 and bk.verify(dest).ok  # the late write is not in it


def test_sigterm_abandons_a_backup_being_written_and_exits_cleanly(tmp_path: Path) -> None:
    """Stopping the daemon does not wait for a backup: it is abandoned at once, its
    client is told so, no file is left, and the daemon exits 0 with every memory kept
    (it waited for the whole backup, tens of seconds at 100k memories on an SD card,
    and systemd kills a daemon still stopping after 90 s)."""
    d = words_only_daemon(tmp_path, 30_000).start()
    dest, outcome = tmp_path / "backups", []
    dest.mkdir()

    def take_backup() -> None:
        with d.client(timeout=60) as c:
            try:
                outcome.append(c.backup(str(dest)))
            except ReachyMemoryError as exc:
                outcome.append(exc)

    taker = threading.Thread(target=take_backup, daemon=True)
    with d.client(timeout=10) as c:
        taker.start()
        deadline = time.monotonic() + 20
        while not (running := c.health()["backup_running"]) and time.monotonic() < deadline:
            time.sleep(0.002)
    assert running, "the backup never started"
    code = d.stop()
    taker.join(30)
    assert code == 0 and len(outcome) == 1 and isinstance(outcome[0], ReachyMemoryError), outcome
    # abandoned while written, or refused when the stop came between health's report and the freeze
    assert isinstance(outcome[0], ClosedError) and "closing" in str(outcome[0]) and list(dest.iterdir()) == []
    with MemoryStore(d.data, config=d.config, embedder=None) as store:
        assert len(store) == 30_000


def test_cheap_ops_answer_while_searches_run(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        c.store_batch([{"content": f"memory {i} about gardens and robots", "memory_type": "fact"}
                       for i in range(300)])
    stop = threading.Event()

    def searcher() -> None:
        with daemon.client() as s:
            while not stop.is_set():
                s.search("gardens robots", limit=5, min_score=0)

    threads = [threading.Thread(target=searcher, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        with daemon.client(timeout=2.0) as c:
            for _ in range(200):
                assert c.ping()["pong"]
                c.get_context_window()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def test_full_queue_answers_busy(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, server={"queue_size": 1}).start()
    try:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(d.endpoint)
        for i in range(200):
            sock.send(msgpack.packb({"v": 1, "id": i, "op": "search", "args": {"query": f"garden {i}"}}))
        codes = []
        sock.rcvtimeo = 10_000
        for _ in range(200):
            reply = msgpack.unpackb(sock.recv(), raw=False)
            codes.append("ok" if reply["ok"] else reply["error"]["code"])
        sock.close()
        ctx.term()
        assert "busy" in codes and "ok" in codes and set(codes) <= {"ok", "busy"}
        with d.client() as c:
            assert c.ping()["pong"]
    finally:
        d.stop()
    assert BusyError.code == "busy"


def test_systemd_notify_ready_and_watchdog(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    d = DaemonProcess(tmp_path)
    d.start(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}, wait=False)
    try:
        messages = set()
        deadline = time.monotonic() + 60
        while not {"READY=1", "WATCHDOG=1"} <= messages and time.monotonic() < deadline:
            for line in sock.recv(4096).decode().splitlines():
                messages.add(line)
        assert {"READY=1", "WATCHDOG=1"} <= messages
        d.wait_ready()
    finally:
        assert d.stop() == 0
        sock.close()


def test_oversized_value_errors_are_structured(daemon: DaemonProcess) -> None:
    with daemon.client() as c, pytest.raises(TooLargeError) as info:
        c.store("x" * 20_000, "fact")
    assert info.value.limit == 16_000 and info.value.field == "content"


@pytest.mark.parametrize("size", [1_100_000, 20_000_000])  # over the 1 MiB limit; over the 16 MiB hard cap
def test_an_oversized_request_is_too_large_at_once_on_both_clients(shared_daemon: DaemonProcess, size: int) -> None:
    # The daemon answers a frame over the limit without decoding it, so its error carries
    # no request id: AsyncMemoryClient waited its whole timeout and raised RequestTimeoutError
    # (which the MCP tools report as "no daemon"); over the hard cap both clients timed out.
    waited: list[float] = []
    text = "x" * size

    async def via_async() -> None:
        async with AsyncMemoryClient(shared_daemon.endpoint, config=shared_daemon.config, timeout=30) as c:
            started = time.monotonic()
            with pytest.raises(TooLargeError):
                await c.store(text)
            waited.append(time.monotonic() - started)
            assert (await c.ping())["pong"]

    with shared_daemon.client(timeout=30) as c:
        started = time.monotonic()
        with pytest.raises(TooLargeError) as info:
            c.store(text)
        waited.append(time.monotonic() - started)
        assert c.ping()["pong"]
    asyncio.run(via_async())
    assert max(waited) < 10.0  # neither waited for its 30 s timeout
    assert info.value.limit == shared_daemon.config.server.max_message_bytes and info.value.size > size


def test_curve_lets_in_allowed_clients_only(tmp_path: Path) -> None:
    from zmq import auth

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = auth.create_certificates(str(keys), "server")
    client_public, client_secret = auth.create_certificates(str(keys), "client")
    _, stranger_secret = auth.create_certificates(str(keys), "stranger")
    Path(client_public).rename(allowed / "client.key")
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = DaemonProcess(tmp_path, server={"endpoint": f"tcp://127.0.0.1:{port}", "curve_secret_key": server_secret,
                                        "curve_authorized_dir": str(allowed)})
    d.start(wait=False)
    try:
        def client(secret: str) -> MemoryClient:
            cfg = d.config.replace("server", curve_server_public_key=server_public, curve_client_secret_key=secret)
            return MemoryClient(d.endpoint, config=cfg, timeout=1.0)

        deadline = time.monotonic() + 60
        with client(client_secret) as c:
            while True:
                try:
                    assert c.ping()["pong"]
                    break
                except RequestTimeoutError:
                    assert time.monotonic() < deadline, d.log.read_text()[-2000:]
        with client(stranger_secret) as c, pytest.raises(RequestTimeoutError):
            c.ping()  # a key not in the allowed folder gets nothing back
        with MemoryClient(d.endpoint, config=d.config, timeout=1.0) as plain, pytest.raises(RequestTimeoutError):
            plain.ping()  # and neither does a client without encryption
    finally:
        assert d.stop() == 0


def test_sigterm_during_startup_exits_cleanly(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    d.start(wait=False)
    deadline = time.monotonic() + 60  # wait for the handlers (a readiness line), not a fixed sleep
    while "starting (pid" not in d.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.stop() == 0, d.log.read_text()[-2000:]


def test_the_daemon_does_not_load_asyncio() -> None:
    """asyncio (AsyncMemoryClient's) costs a daemon ~9 MB RSS it never uses (issue 11)."""
    import subprocess
    import sys

    code = "import sys, reachy_memory, reachy_memory.daemon.server, reachy_memory.cli; print('asyncio' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


class _UpkeepStore:
    """A store whose maintain() reports ``work`` units done per call (then 0)."""

    def __init__(self, work: list[int], on_call: Callable[[int], None] = lambda n: None) -> None:
        self.work, self.on_call = work, on_call
        self.budgets: list[int] = []
        self.save_cache: list[bool] = []

    def maintain(self, budget: int, *, save_cache: bool = True) -> int:
        self.budgets.append(budget)
        self.save_cache.append(save_cache)
        self.on_call(len(self.budgets))
        return self.work.pop(0) if self.work else 0

    def latest_time(self) -> float:
        return 0.0


def _idle_lanes(store: _UpkeepStore) -> Any:
    """The daemon's lanes over ``store``, no thread started: what the engine's idle upkeep reads."""
    from reachy_memory.daemon.jobs import Stats
    from reachy_memory.daemon.lanes import Lanes

    return Lanes(None, store, Config(), Stats(), zmq.Context.instance())


def test_a_fault_in_idle_upkeep_pauses_it_instead_of_ending_the_engine_thread(
        caplog: pytest.LogCaptureFixture) -> None:
    """Idle upkeep caught only ReachyMemoryError: any other fault (a bug, a foreign
    exception) ended the engine thread, and the daemon answered no request again."""
    def broken(calls: int) -> None:
        raise TypeError("a bug in upkeep")

    store = _UpkeepStore([1], broken)
    upkeep = _idle_lanes(store).upkeep
    assert upkeep.idle() is False  # no exception out of it
    assert "idle upkeep pauses" in caplog.text
    assert upkeep.idle() is False and len(store.budgets) == 1  # paused: not retried every 50 ms
    upkeep.paused_until = time.monotonic() - 1
    upkeep.idle()
    assert len(store.budgets) == 2  # back after the pause


@pytest.mark.parametrize(("quiet_for", "saves"), [
    (0.0, False),  # a request just came: a graph save (tens of ms at 100k) could meet the next one
    (ServerConfig.graph_cache_quiet_seconds - 1, False),  # not quiet for long enough yet
    (ServerConfig.graph_cache_quiet_seconds + 1, True),  # a quiet spell: a due graph may be cached
])
def test_idle_upkeep_saves_the_graph_cache_only_after_a_quiet_spell(quiet_for: float, saves: bool) -> None:
    lanes = _idle_lanes(_UpkeepStore([1]))
    lanes.last_request = time.monotonic() - quiet_for
    lanes.upkeep.idle()
    assert lanes.store.save_cache == [saves, saves]


@pytest.mark.skipif(not release_free_heap(), reason="no malloc_trim in this C library (glibc only)")
@pytest.mark.parametrize(("inflight", "queued", "trimmed"), [
    (0, False, True),  # idle: the due trim runs and is counted
    (1, False, False),  # a request in flight: the trim waits for a later idle moment
    (0, True, False),  # work queued for the engine: that goes first
])
def test_a_due_heap_trim_waits_for_idle_time(inflight: int, queued: bool, trimmed: bool) -> None:
    lanes = _idle_lanes(_UpkeepStore([], lambda n: None))
    lanes.inflight = inflight
    if queued:
        lanes.engine_q.put(lambda: None)
    lanes.upkeep.trim_due.set()
    lanes.upkeep.idle()
    assert (len(lanes.upkeep.trims) == 1) is trimmed
    assert lanes.upkeep.trim_due.is_set() is not trimmed  # still due when it did not run


class _Pushed:
    """A PUSH socket that keeps what is sent, and the PULL end the I/O thread reads it from."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], *flags: Any) -> None:
        self.sent.append(frames)

    def recv_multipart(self, *flags: Any) -> list[bytes]:
        if not self.sent:
            raise zmq.Again()
        return self.sent.pop(0)

    def close(self) -> None:
        pass


@pytest.mark.timeout(30)
def test_idle_upkeep_goes_on_while_a_backup_is_in_flight() -> None:
    """A backup runs beside the engine for seconds (minutes on an SD card), and was counted
    as a request in flight, so the engine's idle upkeep (pending vectors into the graphs, a
    mass expiry's burial, the backfill, heap trims) stopped for all of it and the engine
    polled every 5 ms.  Upkeep yields to engine requests, not to a backup, queued or
    being written."""
    import queue

    from reachy_memory.daemon import server
    from reachy_memory.daemon.handlers import Handler
    from reachy_memory.daemon.jobs import Job
    from reachy_memory.daemon.operations import OPERATIONS
    from reachy_memory.daemon.upkeep import IDLE_STEP

    lanes = _idle_lanes(_UpkeepStore([5, 5]))
    lanes.background_q = queue.Queue(2)  # room for the sentinel
    pushed, router = _Pushed(), _Pushed()
    lanes._push_socket = lambda: pushed
    daemon = server.Daemon.__new__(server.Daemon)  # only what _forward reads
    daemon.lanes, daemon.replies_dropped = lanes, 0
    upkeep: list[bool] = []

    def backup(d: Any, job: Any) -> dict[str, Any]:
        upkeep.append(lanes.upkeep.idle())  # the engine's idle time while the backup is written
        return {"path": job.args["path"]}

    lanes.handlers = {"backup": Handler(backup), "compact": Handler(lambda d, job: None)}

    def job(op: str, **args: Any) -> Any:
        return Job([b"client"], 1, OPERATIONS[op], args, None, time.monotonic())

    assert lanes.submit(job("backup", path="/b.rms")) is None
    assert lanes.inflight == 1 and lanes.quiet(), "a queued backup stopped idle upkeep"
    lanes.background_q.put(None)
    lanes.background_loop()
    assert upkeep == [False] and lanes.store.budgets == [IDLE_STEP] * 3, "no upkeep beside the backup"
    daemon._forward(pushed, router)
    assert lanes.inflight == 0 and len(router.sent) == 1 and lanes.quiet()
    assert lanes.submit(job("compact")) is None
    lanes.engine_q.get()  # the engine took it: in flight, not queued
    assert not lanes.quiet(), "idle upkeep ran while an engine request was in flight"


@pytest.mark.parametrize(("work", "calls"), [
    ([], 1),  # nothing to do: one look, no spinning
    ([5, 5, 5], 4),  # three small steps, then a look that finds nothing left
])
def test_idle_upkeep_runs_in_small_steps_until_nothing_is_left(work: list[int], calls: int) -> None:
    from reachy_memory.daemon.upkeep import IDLE_STEP

    store = _UpkeepStore(list(work))
    assert _idle_lanes(store).upkeep.idle() is False  # nothing left: the engine may wait the long way
    assert store.budgets == [IDLE_STEP] * calls


def test_idle_upkeep_stops_as_soon_as_a_request_is_in_flight() -> None:
    lanes: Any = None

    def arrive(n: int) -> None:
        if n == 3:
            lanes.inflight = 1  # a request came in during step 3

    store = _UpkeepStore([1] * 100, arrive)
    lanes = _idle_lanes(store)
    assert lanes.upkeep.idle() is True  # work left: the engine comes back to it soon
    assert len(store.budgets) == 3


def test_idle_upkeep_gives_the_engine_back_after_its_slice() -> None:
    from reachy_memory.daemon.upkeep import IDLE_SLICE

    store = _UpkeepStore([1] * 10_000, lambda n: time.sleep(0.005))  # ~50 s of work in 5 ms steps
    started = time.monotonic()
    assert _idle_lanes(store).upkeep.idle() is True
    assert time.monotonic() - started < IDLE_SLICE + 0.5  # bounded, not until the work is done
    assert 1 <= len(store.budgets) <= IDLE_SLICE / 0.005 + 1


class _Closable:
    """Stands in for what ``_shutdown`` closes (sockets, context, store, endpoint lock)."""

    def __init__(self) -> None:
        self.closed = False

    def close(self, linger: int | None = None) -> None:
        self.closed = True

    def begin_closing(self) -> None:
        pass

    term = release = close

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        raise zmq.Again  # no reply left to forward


@pytest.mark.timeout(30)
def test_stop_gives_stuck_workers_one_shared_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker busy for good and every queue full: ``_shutdown`` waits
    STOP_WORKERS_SECONDS in all, then closes everything (it waited forever for room in
    the embed queue, then 5 + 30 + 30 s one after another, past systemd's TimeoutStopSec)."""
    import queue

    from reachy_memory.daemon import server

    monkeypatch.setattr(server, "STOP_WORKERS_SECONDS", 0.5)
    busy = threading.Event()
    ctx = zmq.Context()

    def stuck() -> None:  # as a real worker: a socket of the daemon's context open while busy
        sock = ctx.socket(zmq.PUSH)
        busy.wait()
        sock.close(linger=0)

    names = ("embed", "engine", "sync", "background")
    workers = [threading.Thread(target=stuck, name=name, daemon=True) for name in names]
    from types import SimpleNamespace

    daemon: Any = server.Daemon.__new__(server.Daemon)  # only what _shutdown reads
    full: list[queue.Queue[Any]] = [queue.Queue(1) for _ in names]
    daemon.lanes = SimpleNamespace(queues=lambda: full)
    for jobs in full:
        jobs.put("job")
    daemon._auth, daemon.endpoint, daemon._ctx = None, "tcp://127.0.0.1:1", ctx
    daemon.store, daemon._endpoint_lock = _Closable(), _Closable()
    router, replies = _Closable(), _Closable()
    for w in workers:
        w.start()
    finished = threading.Event()
    started = time.monotonic()
    stopper = threading.Thread(target=lambda: (daemon._shutdown(workers, router, replies), finished.set()),
                               daemon=True)
    stopper.start()
    try:
        # term() of a context whose sockets a stuck worker holds would wait for good
        assert finished.wait(5), "_shutdown waited for a stuck worker's sockets"
        took = time.monotonic() - started
    finally:
        busy.set()
        stopper.join(5)
        ctx.term()
    assert 0.45 < took < 0.5 + 1.0
    assert all(c.closed for c in (router, replies, daemon.store, daemon._endpoint_lock))


@pytest.mark.parametrize("appended", [
    0,  # nothing yet: nothing held
    5,  # fewer than it holds: all of them
    2048,  # exactly full
    5000,  # wrapped twice: only the latest 2048
])
def test_the_latency_ring_holds_the_latest_samples(appended: int) -> None:
    from reachy_memory.daemon.jobs import Recent

    ring = Recent(2048)
    for i in range(appended):
        ring.append(i / 1000)
    latest = set(range(max(0, appended - 2048), appended))
    assert len(ring) == len(latest)
    assert {round(float(v) * 1000) for v in ring.values()} == latest
