"""A careless or hostile local client and operator: unsafe endpoints, shared
socket directories, endpoint precedence, a future ``now``."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import (
    BusyError,
    ConfigError,
    MemoryClient,
    NotFoundError,
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
    TooLargeError,
    ValidationError,
    load_config,
)
from reachy_memory.config import Config
from reachy_memory.daemon.endpoint import ENV_ENDPOINT, check_endpoint, prepare_ipc_dir, resolve_endpoint
from tests.daemon_util import ROOT, DaemonProcess, never_reading_dealer


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("hostile")) as d:
        yield d


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:99999",  # libzmq bound port 34463 (99999 - 65536), not the port the config names
    "tcp://127.0.0.1:65536",  # one past the last port (zmq said only "Invalid argument")
    "tcp://127.0.0.1:0",  # a random port no client could find
    "tcp://127.0.0.1:*",  # the same, in zmq's own spelling
    "tcp://127.0.0.1:",  # no port at all
    "tcp://127.0.0.1:5555x",  # not a number
    "tcp://127.0.0.1:\u0665",  # a digit, but not an ASCII one
])
def test_a_tcp_endpoint_needs_a_real_port(endpoint: str) -> None:
    config = load_config()
    with pytest.raises(ConfigError, match="port from 1 to 65535") as info:
        check_endpoint(endpoint, config, insecure_tcp=True)
    assert info.value.key == "server.endpoint"
    check_endpoint("tcp://127.0.0.1:65535", config, insecure_tcp=True)  # the highest port is fine


@pytest.mark.parametrize(("endpoint", "insecure", "allowed"), [
    ("tcp://127.0.0.1:5555", False, False),  # loopback without CURVE: any local user could erase everything
    ("tcp://127.0.0.1:5555", True, True),  # ...unless the operator says so, loudly
    ("tcp://0.0.0.0:5555", True, False),  # --insecure-tcp never opens a non-loopback address
    ("ipc:///run/x/memory.sock", False, True),  # the private socket needs nothing
])
def test_tcp_without_curve_needs_an_explicit_insecure_flag(endpoint: str, insecure: bool, allowed: bool) -> None:
    config = load_config()
    if allowed:
        check_endpoint(endpoint, config, insecure_tcp=insecure)
    else:
        with pytest.raises(ConfigError, match="CURVE"):
            check_endpoint(endpoint, config, insecure_tcp=insecure)


def test_insecure_tcp_flag_serves_loopback_and_says_so(tmp_path: Path) -> None:
    port = _free_port()
    d = DaemonProcess(tmp_path, server={"endpoint": f"tcp://127.0.0.1:{port}"})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(ENV_ENDPOINT, None)
    refused = subprocess.run([sys.executable, "-m", "reachy_memory.cli", "serve", "--config", str(d.config_path)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2 and "--insecure-tcp" in refused.stderr
    proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "serve", "--config", str(d.config_path),
                             "--insecure-tcp"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        with MemoryClient(f"tcp://127.0.0.1:{port}", config=d.config, timeout=0.5) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    assert c.ping()["pong"]
                    break
                except RequestTimeoutError:
                    assert time.monotonic() < deadline and proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "INSECURE" in err


def test_an_existing_socket_directory_is_never_chmodded(tmp_path: Path) -> None:
    shared = tmp_path / "cwd"
    shared.mkdir()
    os.chmod(shared, 0o755)  # e.g. the daemon's working directory with ipc://rel.sock
    prepare_ipc_dir(shared / "memory.sock")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_a_socket_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        prepare_ipc_dir(open_dir / "memory.sock")
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o777  # refused, not changed
    sticky = tmp_path / "tmp-like"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: others cannot replace our socket
    prepare_ipc_dir(sticky / "memory.sock")


def test_a_new_socket_directory_is_private(tmp_path: Path) -> None:
    prepare_ipc_dir(tmp_path / "run" / "memory.sock")
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700


def test_endpoint_precedence_flag_env_file_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = load_config(server={"endpoint": "ipc:///file.sock"}, memory={"path": str(tmp_path)})
    monkeypatch.delenv(ENV_ENDPOINT, raising=False)
    assert resolve_endpoint(None, load_config(memory={"path": str(tmp_path)})).startswith("ipc://")  # default
    assert resolve_endpoint(None, from_file) == "ipc:///file.sock"  # config file beats the default
    monkeypatch.setenv(ENV_ENDPOINT, "ipc:///env.sock")
    assert resolve_endpoint(None, from_file) == "ipc:///env.sock"  # environment beats the file
    assert resolve_endpoint("ipc:///flag.sock", from_file) == "ipc:///flag.sock"  # the flag beats everything
    assert MemoryClient("ipc:///flag.sock", config=from_file).endpoint == "ipc:///flag.sock"


def test_cli_endpoint_flag_beats_the_environment(daemon: DaemonProcess) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), ENV_ENDPOINT: "ipc:///nonexistent/memory.sock"}
    done = subprocess.run([sys.executable, "-m", "reachy_memory.cli", "stats", "--config", str(daemon.config_path),
                           "--endpoint", daemon.endpoint, "--timeout", "5", "--json"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr


def test_a_future_now_cannot_expire_everything(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        memory = c.remember_conversation("said today")
        with pytest.raises(ValidationError):
            c._call("cleanup_expired", {"now": time.time() + 40 * 86400})
        assert c.get(memory.id) is not None
        assert c._call("cleanup_expired", {"now": time.time() - 60})["deleted"] == 0  # the past is fine


def _all_errors() -> list[type]:
    from reachy_memory.errors import ReachyMemoryError

    found, pending = [], [ReachyMemoryError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", _all_errors(), ids=lambda c: c.__name__)
def test_every_error_class_keeps_its_class_and_fields_over_the_wire(cls: type) -> None:
    from reachy_memory.daemon import protocol as proto

    sent = cls("what went wrong", path="/x", offset=7)
    reply = proto.decode(proto.error_from("r1", sent))
    with pytest.raises(cls) as info:
        proto.raise_for(reply)
    assert type(info.value) is cls and info.value.message == "what went wrong"
    assert info.value.fields["offset"] == 7 and info.value.path == "/x"


@pytest.mark.parametrize("cls", _all_errors(), ids=lambda c: c.__name__)
def test_an_error_field_named_self_is_still_our_error(cls: type) -> None:
    """A daemon's error fields become keyword arguments: one named ``self`` raised a
    TypeError (a foreign exception to every caller, and the end of the async client's
    reader when the error came without an id)."""
    from reachy_memory.daemon import protocol as proto

    reply = {"v": 1, "id": None, "ok": False,
             "error": {"type": cls.__name__, "code": cls.code, "message": "m", "fields": {"self": 1, "field": "x"}}}
    with pytest.raises(cls) as info:
        proto.raise_for(reply)
    assert info.value.fields == {"self": 1, "field": "x"} and info.value.message == "m"


def test_the_async_reader_outlives_an_id_less_error_with_odd_fields(tmp_path: Path) -> None:
    """The reader task gives an id-less error to no call (a daemon from before peek_id): one
    whose fields could not make an error ended the reader, and every call then timed out."""
    import asyncio

    from reachy_memory import AsyncMemoryClient

    def answer(request: dict[str, Any] | None) -> list[bytes]:
        odd = _reply(None, ok=False, error={"code": "too_large", "message": "m", "fields": {"self": 1}})
        return [odd, _reply(request, ok=True, result={"pong": True})]

    fake = FakeDaemon(tmp_path, answer)

    async def calls() -> list[Any]:
        async with AsyncMemoryClient(fake.endpoint, timeout=2.0) as c:
            return [await c.ping(), await c.ping()]

    try:
        assert asyncio.run(asyncio.wait_for(calls(), 10)) == [{"pong": True}] * 2
    finally:
        fake.close()


def test_remember_fact_timeout_is_a_timeout_not_metadata(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        memory = c.remember_fact("Sarah likes tea", {"person": "Sarah"}, timeout=5)
        assert memory.metadata == {"person": "Sarah"}  # no {"timeout": 5}
        # spec 000's keyword metadata sits beside the call's own options, which stay options
        tagged = c.remember_fact("Sarah likes tea", topic="drinks", timeout=5)
        assert tagged.metadata == {"topic": "drinks"}


def test_bad_requests_are_summarised_not_logged_one_by_one(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from reachy_memory.daemon.server import BadRequestLog

    now = [0.0]
    bad = BadRequestLog(every=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="reachy_memory.daemon.server"):
        for i in range(12_000):  # the fuzz run logged 8,005 lines at INFO
            bad.note("bad_request" if i % 3 else "too_large", "junk")
            bad.summarise()
        assert caplog.records == []  # nothing above DEBUG within the interval
        now[0] = 61.0
        bad.summarise()
        bad.summarise()  # once per interval
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "12000" in record.getMessage()
    assert "bad_request 8000" in record.getMessage() and "too_large 4000" in record.getMessage()


def test_a_client_that_never_reads_cannot_grow_the_daemon(daemon: DaemonProcess) -> None:
    import msgpack
    import zmq

    with daemon.client() as c:
        c.store_batch([{"content": f"long memory {i} " + "about robots " * 300} for i in range(20)])
        before = c.stats()["replies_dropped"]
    ctx = zmq.Context()
    greedy = never_reading_dealer(ctx, daemon.endpoint)
    try:
        for i in range(1500):  # ~80 KB replies (or busy), never read
            greedy.send(msgpack.packb({"v": 1, "id": i, "op": "search",
                                       "args": {"query": "robots", "limit": 20, "min_score": 0}}))
        with daemon.client(timeout=30) as c:
            deadline = time.monotonic() + 60
            while c.stats()["replies_dropped"] == before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.stats()["replies_dropped"] > before  # dropped and counted, not buffered without bound
            assert c.ping()["pong"]  # and everyone else is still served
    finally:
        greedy.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(("size", "answered"), [
    (1024 * 1024 + 1, True),  # just over the 1 MiB limit: too_large at once
    (8 * 1024 * 1024, True),  # far over it, under the hard cap: too_large too, not silence
    (20 * 1024 * 1024, False),  # over the hard cap (16 x the limit): zmq drops the frame unread
])
def test_oversized_frames(daemon: DaemonProcess, size: int, answered: bool) -> None:
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 3000
    sock.connect(daemon.endpoint)
    try:
        sock.send(msgpack.packb({"v": 1, "id": 1, "op": "store", "args": {"content": "x" * size}}))
        if answered:
            reply = msgpack.unpackb(sock.recv())
            assert reply["ok"] is False and reply["error"]["code"] == "too_large"
        else:
            with pytest.raises(zmq.Again):
                sock.recv()
    finally:
        sock.close(linger=0)
        ctx.term()
    with daemon.client() as c:
        assert c.ping()["pong"]  # the daemon serves on


def test_a_result_over_the_reply_limit_is_too_large_and_export_pages_shrink(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, server={"max_reply_bytes": 64 * 1024}).start()
    try:
        with d.client(timeout=30) as c:
            c.store_batch([{"content": f"long memory {i} " + "robots " * 2000} for i in range(20)])
            with pytest.raises(TooLargeError, match="reply limit"):
                c.search("robots", limit=20, min_score=0)
            assert len(c.search("robots", limit=2, min_score=0)) == 2  # fewer results fit
            page, cursor = c.export_page(None, 500)
            assert 0 < len(page) < 20 and cursor is not None  # a shorter page, not an error
            total = len(page)
            while cursor is not None:
                page, cursor = c.export_page(cursor, 500)
                total += len(page)
            assert total == 20
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize(("path", "says"), [
    ("/tmp/a\x00b", "NUL"),  # os functions raised a foreign ValueError ('internal' reply)
    ("/tmp/" + "x" * 300, "too long"),  # OSError ENAMETOOLONG ('internal' reply)
    ("relative.rms", "absolute"),  # would land in the daemon's working directory
    (" ", "absolute"),  # the same, with a name that is easy to miss
])
def test_a_bad_backup_path_is_a_validation_error_and_writes_nothing(
        daemon: DaemonProcess, path: str, says: str) -> None:
    with daemon.client() as c, pytest.raises(ValidationError, match=says):
        c.backup(path)
    if says == "absolute":  # the daemon runs in the repository (tests/daemon_util.py)
        assert not (ROOT / path).exists()


def test_a_huge_filter_is_refused_before_it_is_decoded(daemon: DaemonProcess) -> None:
    where = {"$or": [{"n": i} for i in range(125_000)]}  # 868 KB: under the frame limit
    with daemon.client(timeout=10) as c:
        with pytest.raises(TooLargeError, match="more than"):
            c.search("robots", where=where)
        assert c.ping()["pong"]


# -- a buggy or hostile daemon, as seen by the clients ------------------------------------------


class FakeDaemon:
    """An in-process ROUTER on a private ipc path: ``answer(request)`` gives the frames sent back
    (``request`` is None for an undecodable one). Stopped by ``close`` (linger 0, bounded join)."""

    def __init__(self, tmp: Path, answer: Callable[[dict[str, Any] | None], list[bytes]]) -> None:
        import zmq

        self.endpoint = f"ipc://{tmp}/fake.sock"
        self.answer = answer
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        self._router.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import msgpack

        while not self._stop.is_set():
            if not self._router.poll(20):
                continue
            frames = self._router.recv_multipart()
            try:
                request = msgpack.unpackb(frames[-1], raw=False)
            except Exception:
                request = None
            for frame in self.answer(request):
                self._router.send_multipart([frames[0], frame])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(linger=0)
        self._ctx.term()


def _reply(request: dict[str, Any] | None, **body: Any) -> bytes:
    import msgpack

    return msgpack.packb({"v": 1, "id": (request or {}).get("id"), **body}, use_bin_type=True)


def _in_thread(call: Callable[[], Any], limit: float = 10.0) -> Any:
    """``call()``'s result or exception, run on a daemon thread: a hang fails the test, not the run."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), "the client call hung"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def _client_call(client_class: type, endpoint: str, method: str, *args: Any) -> Any:
    """One call through a new client of ``client_class`` (blocking or asyncio), then a ping on
    the same client: it must still work after whatever the first call raised."""
    import asyncio

    from reachy_memory import AsyncMemoryClient, ReachyMemoryError

    async def via_async() -> Any:
        async with AsyncMemoryClient(endpoint, config=load_config(), timeout=2) as client:
            try:
                return await getattr(client, method)(*args)
            except ReachyMemoryError as exc:
                return exc
            finally:
                assert (await client.ping())["pong"]

    def call() -> Any:
        if client_class is AsyncMemoryClient:
            return asyncio.run(via_async())
        with MemoryClient(endpoint, config=load_config(), timeout=2) as client:
            try:
                return getattr(client, method)(*args)
            except ReachyMemoryError as exc:
                return exc
            finally:
                assert client.ping()["pong"]

    return _in_thread(call)


_MALFORMED_REPLIES: list[tuple[str, str, dict[str, Any], type]] = [
    ("error body not a map", "ping", {"ok": False, "error": "boom"}, RemoteError),
    ("error code not a string", "ping", {"ok": False, "error": {"code": [1], "message": "m"}}, RemoteError),
    ("error field named message", "ping", {"ok": False, "error": {"code": "not_found", "fields": {"message": 1}}},
     NotFoundError),
    ("error field named args", "ping", {"ok": False, "error": {"code": "busy", "fields": {"args": 1}}}, BusyError),
    ("error field named __class__", "ping", {"ok": False, "error": {"fields": {"__class__": 1}}}, RemoteError),
    ("memory without content", "get", {"ok": True, "result": {"id": "m1"}}, ProtocolError),
    ("memory as a string", "get", {"ok": True, "result": "m1"}, ProtocolError),
    ("memory of an unknown type", "get",
     {"ok": True, "result": {"id": "m", "content": "c", "type": "gossip", "created_at": 0}}, ProtocolError),
    ("memory from the year 10^300", "get",
     {"ok": True, "result": {"id": "m", "content": "c", "type": "fact", "created_at": 1e300}}, ProtocolError),
    ("forget without 'deleted'", "forget", {"ok": True, "result": None}, ProtocolError),
    ("search hits not a list", "search", {"ok": True, "result": 5}, ProtocolError),
    ("search score not a number", "search", {"ok": True, "result": [{"memory": None, "score": "x"}]},
     ProtocolError),
    ("person as a number", "people", {"ok": True, "result": [1]}, ProtocolError),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_class", ["MemoryClient", "AsyncMemoryClient"])
@pytest.mark.parametrize(("case", "method", "body", "expected"), _MALFORMED_REPLIES,
                         ids=[row[0] for row in _MALFORMED_REPLIES])
def test_a_malformed_reply_raises_our_error_and_the_client_stays_usable(
        tmp_path: Path, client_class: str, case: str, method: str, body: dict[str, Any], expected: type) -> None:
    import reachy_memory

    def answer(request: dict[str, Any] | None) -> list[bytes]:
        answered.append(request)
        if len(answered) == 1:  # the call under test; then the ping that shows the client still works
            return [_reply(request, **body)]
        return [_reply(request, ok=True, result={"pong": True})]

    answered: list[Any] = []
    fake = FakeDaemon(tmp_path, answer)
    try:
        args = {"get": ("m1",), "forget": ("m1",), "search": ("tea",), "people": (), "ping": ()}[method]
        outcome = _client_call(getattr(reachy_memory, client_class), fake.endpoint, method, *args)
    finally:
        fake.close()
    assert type(outcome) is expected, f"{case}: {outcome!r}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("odd_id", [[1], {"a": 1}], ids=["list", "map"])
def test_a_reply_with_an_unhashable_id_does_not_stop_the_async_reader(tmp_path: Path, odd_id: Any) -> None:
    # The reader task matched replies with a dict lookup: a list or map id raised TypeError,
    # ended the task, and every call in flight then waited for its full timeout.
    from reachy_memory import AsyncMemoryClient

    def answer(request: dict[str, Any] | None) -> list[bytes]:
        return [_reply({"id": odd_id}, ok=True, result=None), _reply(request, ok=True, result={"pong": True})]

    fake = FakeDaemon(tmp_path, answer)
    try:
        outcome = _client_call(AsyncMemoryClient, fake.endpoint, "ping")
    finally:
        fake.close()
    assert outcome == {"pong": True}


_UNSENDABLE: list[tuple[str, Callable[[Any], Any]]] = [
    ("a datetime in metadata", lambda c: c.store("x", metadata={"when": __import__("datetime").datetime.now()})),
    ("an object as content", lambda c: c.store(object())),
    ("an int past 64 bits", lambda c: c.search("x", limit=2**70)),
    ("a lone surrogate", lambda c: c.remember_fact("\ud800")),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_class", ["MemoryClient", "AsyncMemoryClient"])
@pytest.mark.parametrize(("case", "call"), _UNSENDABLE, ids=[row[0] for row in _UNSENDABLE])
def test_arguments_msgpack_cannot_carry_are_a_validation_error(
        tmp_path: Path, client_class: str, case: str, call: Callable[[Any], Any]) -> None:
    # msgpack's TypeError/OverflowError/UnicodeEncodeError escaped both clients (and, through
    # MemoryBridge.remember, ended the bridge's worker thread).
    import asyncio

    from reachy_memory import AsyncMemoryClient

    received: list[Any] = []
    fake = FakeDaemon(tmp_path, lambda r: received.append(r) or [_reply(r, ok=True, result={"pong": True})])

    async def via_async() -> None:
        async with AsyncMemoryClient(fake.endpoint, config=load_config(), timeout=2) as client:
            with pytest.raises(ValidationError) as info:
                await call(client)
            assert (await client.ping())["pong"]
        assert info.value.field == "args"

    def via_blocking() -> None:
        with MemoryClient(fake.endpoint, config=load_config(), timeout=2) as client:
            with pytest.raises(ValidationError) as info:
                call(client)
            assert client.ping()["pong"]
        assert info.value.field == "args"

    try:
        _in_thread(via_blocking if client_class == "MemoryClient" else lambda: asyncio.run(via_async()))
    finally:
        fake.close()
    assert [r["op"] for r in received] == ["ping"]  # nothing of the refused call was sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_class", ["MemoryClient", "AsyncMemoryClient"])
@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "5", 1e7, 1e12, float("inf")])
def test_timeouts_are_checked_and_long_ones_work(tmp_path: Path, client_class: str, timeout: Any) -> None:
    # The blocking client raised ValueError for NaN and OverflowError from zmq_poll for a
    # timeout of 1e7 s or more (an int of milliseconds) or inf; -1 was a timeout at once.
    import asyncio

    from reachy_memory import AsyncMemoryClient

    fake = FakeDaemon(tmp_path, lambda r: [_reply(r, ok=True, result={"pong": True})])

    async def via_async() -> Any:
        async with AsyncMemoryClient(fake.endpoint, config=load_config(), timeout=2) as client:
            return await client.ping(timeout=timeout)

    def via_blocking() -> Any:
        with MemoryClient(fake.endpoint, config=load_config(), timeout=2) as client:
            return client.ping(timeout=timeout)

    try:
        call = via_blocking if client_class == "MemoryClient" else lambda: asyncio.run(via_async())
        if isinstance(timeout, float) and timeout >= 0:
            assert _in_thread(call)["pong"]
        else:
            with pytest.raises(ValidationError) as info:
                _in_thread(call)
            assert info.value.field == "timeout"
    finally:
        fake.close()


@pytest.mark.timeout(60)
def test_threads_sharing_a_blocking_client_take_turns(tmp_path: Path) -> None:
    # Two threads on one MemoryClient took each other's replies (timeouts), and the
    # timed-out one replaced the socket under the other: zmq.ZMQError "Socket operation
    # on non-socket", and once a thread stuck past its timeout.
    fake = FakeDaemon(tmp_path, lambda r: [_reply(r, ok=True, result={"pong": True, "id": r and r["id"]})])
    outcomes: list[str] = []
    client = MemoryClient(fake.endpoint, config=load_config(), timeout=5)

    def pings() -> None:
        for _ in range(150):
            try:
                outcomes.append("ok" if client.ping()["pong"] else "wrong")
            except Exception as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=pings, daemon=True) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a call hung"
    finally:
        client.close()
        fake.close()
    assert outcomes == ["ok"] * 600, sorted(set(outcomes))


@pytest.mark.timeout(60)
def test_closing_a_blocking_client_from_another_thread_ends_its_call_with_closed_error(tmp_path: Path) -> None:
    # close() on another thread closed the socket under the call in flight: zmq.ZMQError.
    from reachy_memory import ClosedError

    fake = FakeDaemon(tmp_path, lambda r: [])  # never answers
    client = MemoryClient(fake.endpoint, config=load_config(), timeout=10)
    outcome: dict[str, Any] = {}

    def call() -> None:
        started = time.monotonic()
        try:
            client.ping()
        except Exception as exc:
            outcome["error"], outcome["after"] = exc, time.monotonic() - started

    caller = threading.Thread(target=call, daemon=True)
    try:
        caller.start()
        time.sleep(0.3)
        closer = threading.Thread(target=client.close, daemon=True)
        closer.start()
        closer.join(5)
        caller.join(5)
        assert not closer.is_alive() and not caller.is_alive(), "close or the call hung"
    finally:
        fake.close()
    assert isinstance(outcome.get("error"), ClosedError), outcome
    assert outcome["after"] < 2.0  # not the 10 s timeout
    with pytest.raises(ClosedError):
        client.ping()
    client.close()  # idempotent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["awaiting the reply", "in the send"])
def test_closing_an_async_client_ends_calls_in_flight_with_closed_error(tmp_path: Path, where: str) -> None:
    # A call awaiting its reply waited out its whole timeout and raised RequestTimeoutError;
    # one still in the send (no connection yet) raised CancelledError in a task nobody cancelled.
    import asyncio

    from reachy_memory import AsyncMemoryClient, ClosedError

    fake = FakeDaemon(tmp_path, lambda r: [])  # never answers
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{probe.getsockname()[1]}"  # closed again: nobody listens
    endpoint = fake.endpoint if where == "awaiting the reply" else nobody

    async def scenario() -> tuple[BaseException | None, float]:
        client = AsyncMemoryClient(endpoint, config=load_config(), timeout=10)
        call = asyncio.ensure_future(client.ping())
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await client.close()
        try:
            await call
        except BaseException as exc:
            return exc, time.monotonic() - started
        return None, time.monotonic() - started

    try:
        error, waited = _in_thread(lambda: asyncio.run(scenario()), limit=20)
    finally:
        fake.close()
    assert isinstance(error, ClosedError), repr(error)
    assert waited < 2.0  # not the 10 s timeout


def _curve_files(tmp: Path, case: str) -> dict[str, str]:
    """Client CURVE settings whose files are missing, not certificates, or lack the secret key."""
    import zmq.auth

    public, _ = zmq.auth.create_certificates(str(tmp), "good")
    (tmp / "junk").write_text("not a certificate")
    client = {"missing": str(tmp / "absent"), "junk": str(tmp / "junk"), "public only": public}[case]
    return {"curve_server_public_key": public, "curve_client_secret_key": client}


@pytest.mark.parametrize("client_class", ["MemoryClient", "AsyncMemoryClient"])
@pytest.mark.parametrize(("endpoint", "curve"), [
    ("nonsense", None), ("tcp://", None), ("ipc://", None),
    ("tcp://127.0.0.1:99999", None),  # libzmq connected to port 99999 - 65536 = 34463
    ("tcp://127.0.0.1:0", None),  # no daemon can listen on port 0
    ("tcp://127.0.0.1", None),  # no port
    ("tcp://127.0.0.1:5", "missing"), ("tcp://127.0.0.1:5", "junk"), ("tcp://127.0.0.1:5", "public only"),
])
def test_a_client_that_cannot_be_made_raises_config_error(
        tmp_path: Path, client_class: str, endpoint: str, curve: str | None) -> None:
    # zmq.ZMQError (endpoint zmq refuses), OSError or ValueError (zmq.auth on a missing or
    # junk file) and TypeError (a certificate with no secret key) escaped the constructors,
    # leaving a context with an open socket: when the garbage collector later finalised the
    # context first, its term() waited for that socket forever (the next test hung in gc).
    import asyncio
    import gc

    import reachy_memory

    config = load_config(server=_curve_files(tmp_path, curve)) if curve else load_config()

    async def make_async() -> None:
        reachy_memory.AsyncMemoryClient(endpoint, config=config)

    with pytest.raises(ConfigError) as info:
        if client_class == "MemoryClient":
            MemoryClient(endpoint, config=config)
        else:
            asyncio.run(make_async())
    assert info.value.key.startswith("server.")
    del info
    _in_thread(gc.collect)  # nothing left behind that blocks when collected


@pytest.mark.timeout(60)
def test_an_async_client_keeps_working_on_a_later_event_loop(tmp_path: Path) -> None:
    # The reader task lived on the first loop; run_until_complete leaves it pending when
    # that loop is closed, and the client never started another: every later call timed out.
    import asyncio

    from reachy_memory import AsyncMemoryClient

    fake = FakeDaemon(tmp_path, lambda r: [_reply(r, ok=True, result={"pong": True})])
    client = AsyncMemoryClient(fake.endpoint, config=load_config(), timeout=2)

    def on_a_new_loop() -> Any:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(client.ping())
        finally:
            loop.close()

    try:
        assert _in_thread(on_a_new_loop)["pong"]
        assert _in_thread(on_a_new_loop)["pong"]
        _in_thread(lambda: asyncio.run(client.close()))
    finally:
        fake.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_class", ["MemoryClient", "AsyncMemoryClient"])
def test_a_client_collected_unclosed_does_not_hang_the_garbage_collector(tmp_path: Path, client_class: str) -> None:
    # A client never closed, collected in a reference cycle (an AsyncMemoryClient that made a
    # call is one, with its reader task): the gc cleared pyzmq's weak list of the context's
    # sockets first, so Context.__del__ -> destroy() -> term() waited for the socket forever,
    # in whichever thread the collection happened to run (a robot's control loop, say).
    import asyncio
    import gc
    import weakref

    from reachy_memory import AsyncMemoryClient

    fake = FakeDaemon(tmp_path, lambda r: [_reply(r, ok=True, result={"pong": True})])

    async def forgotten_async() -> None:
        client = AsyncMemoryClient(fake.endpoint, config=load_config(), timeout=2)
        gone.append(weakref.ref(client))
        assert (await client.ping())["pong"]

    def forgotten_blocking() -> None:
        client = MemoryClient(fake.endpoint, config=load_config(), timeout=2)
        gone.append(weakref.ref(client))
        assert client.ping()["pong"]
        client.cycle = client  # type: ignore[attr-defined]

    gone: list[weakref.ref[Any]] = []

    try:
        gc.collect()
        gc.disable()  # the collection below, on a thread that cannot hang the run, is the one
        try:
            _in_thread(forgotten_blocking if client_class == "MemoryClient" else lambda: asyncio.run(forgotten_async()))
            _in_thread(gc.collect)
        finally:
            gc.enable()
    finally:
        fake.close()
    assert gone[0]() is None  # it was collected here, not later


@pytest.mark.parametrize("client_class", ["MemoryClient", "AsyncMemoryClient"])
@pytest.mark.parametrize(("option", "value"), [("retries", -1), ("retries", 2.5), ("retries", "2"),
                                               ("timeout", -1.0), ("timeout", float("nan"))])
def test_bad_client_options_are_a_validation_error_when_made(client_class: str, option: str, value: Any) -> None:
    # retries=-1 made every call raise AssertionError("unreachable"), 2.5 a TypeError;
    # a bad default timeout only failed at the first call.
    import asyncio

    import reachy_memory

    async def make() -> None:
        reachy_memory.AsyncMemoryClient("ipc:///nonexistent/x.sock", config=load_config(), **{option: value})

    with pytest.raises(ValidationError) as info:
        if client_class == "MemoryClient":
            MemoryClient("ipc:///nonexistent/x.sock", config=load_config(), **{option: value})
        else:
            asyncio.run(make())
    assert info.value.field == option


@pytest.mark.parametrize("stats", [
    {"store": {"conversation_ttl_days": float("nan")}}, {"store": {"conversation_ttl_days": float("inf")}},
    {"store": {"conversation_ttl_days": 0}}, {"store": {"conversation_ttl_days": -5.0}},
    {"store": {"conversation_ttl_days": 1e300}}, {"store": {"conversation_ttl_days": True}},
    {"store": {"conversation_ttl_days": "7"}}, {"store": {}}, {"store": [1]}, [1, 2], "stats", None,
])
def test_a_stats_reply_without_a_usable_retention_gives_the_configured_one(tmp_path: Path, stats: Any) -> None:
    """The LLM tools say how long conversation memories are kept from the daemon's stats: a
    reply from an older or foreign daemon saying NaN, 0 or 1e300 days went into every tool
    description ("kept nan days"), and one that was no map raised (AttributeError) where
    ``daemon_retention`` promises never to."""
    from reachy_memory.integrations import tools

    fake = FakeDaemon(tmp_path, lambda request: [_reply(request, ok=True, result=stats)])
    try:
        config = Config().replace("memory", conversation_ttl_days=3.0)
        tools._ASKED.clear()
        assert _in_thread(lambda: tools.daemon_retention(config, fake.endpoint, timeout=2.0)) == (3.0, False)
    finally:
        tools._ASKED.clear()
        fake.close()


def test_tools_for_takes_only_a_retention_the_configuration_takes() -> None:
    """``tools_for(nan)`` described "nan days" and cached a new table per call (NaN is no
    equal key); ``tools_for(7)`` and ``tools_for(7.0)`` were two tables."""
    from reachy_memory.integrations.tools import tools_for

    for days in (float("nan"), float("inf"), 0, -1.0, 1e9, True, "7"):
        with pytest.raises(ValidationError, match="conversation TTL"):
            tools_for(days)
    assert tools_for(7) is tools_for(7.0)
    assert "kept 1 hour" in tools_for(1 / 24)[1].description
