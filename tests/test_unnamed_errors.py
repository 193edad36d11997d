"""Errors for requests the daemon refuses before it can read them whole (over its size
limit, undecodable): the daemon answers with the id at the frame's start, so a client
whose config allows more than the daemon's gets a prompt error, not its whole timeout;
and the async client gives an error without an id (an older daemon's) only to a call
it can only be about."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from reachy_memory import AsyncMemoryClient, MemoryClient, load_config
from reachy_memory.daemon import protocol as proto
from reachy_memory.errors import RequestTimeoutError, TooLargeError
from tests.daemon_util import DaemonProcess

pytestmark = pytest.mark.timeout(120)

LIMIT = 64 * 1024  # the daemon's max_message_bytes; the clients keep the default 1 MiB


@pytest.fixture(scope="module")
def small_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon (words only: no model to load) whose request limit is below the clients'."""
    d = DaemonProcess(tmp_path_factory.mktemp("small"), embedding={"enabled": False},
                      server={"max_message_bytes": LIMIT}).start()
    yield d
    assert d.stop() == 0, d.log.read_text()[-2000:]


def _items() -> list[dict[str, Any]]:
    """A store_batch over the daemon's limit, under the client's and the daemon's hard cap."""
    return [{"content": f"item {i} " + "x" * 9_000} for i in range(20)]  # ~180 KB


def test_a_request_over_a_smaller_daemon_limit_fails_at_once_on_both_clients(small_daemon: DaemonProcess) -> None:
    """Before: the daemon's too_large carried no id; AsyncMemoryClient waited its whole
    timeout and raised RequestTimeoutError (the LLM tools' "no daemon")."""
    client_config = load_config(small_daemon.config_path).replace("server", max_message_bytes=1024 * 1024)
    errors: list[TooLargeError] = []
    started = time.monotonic()
    with MemoryClient(small_daemon.endpoint, config=client_config, timeout=20) as c:
        with pytest.raises(TooLargeError) as info:
            c.store_batch(_items())
        errors.append(info.value)
        assert c.ping()["pong"]

    async def scenario() -> None:
        async with AsyncMemoryClient(small_daemon.endpoint, config=client_config, timeout=20) as c:
            # several calls in flight: the error goes to the one it is about, the others succeed
            results = await asyncio.gather(c.store_batch(_items()), c.ping(), c.store("a small fact"),
                                           return_exceptions=True)
            assert isinstance(results[0], TooLargeError), results
            errors.append(results[0])
            assert results[1]["pong"] and results[2].content == "a small fact"
            with pytest.raises(TooLargeError):
                await c.store_batch(_items())  # alone in flight too

    asyncio.run(scenario())
    assert time.monotonic() - started < 10.0  # no call waited for its 20 s timeout
    for error in errors:
        assert error.limit == LIMIT and error.size > LIMIT and error.field == "request", error.fields


def _exchange(sock: zmq.Socket, frame: bytes) -> dict[str, Any]:
    sock.send(frame)
    return msgpack.unpackb(sock.recv(), raw=False)


_WIDE = {"query": "x", "where": {"$or": [{"k": i} for i in range(proto.MAX_CONTAINER + 1)]}}


@pytest.mark.parametrize(("frame", "want_id", "code"), [
    (proto.request("big", "store", {"content": "x" * 2 * LIMIT}), "big", "too_large"),  # over the limit
    (proto.request(7, "store", {"content": "x" * 2 * LIMIT}), 7, "too_large"),  # an integer id
    (msgpack.packb({"op": "store", "args": {"content": "x" * 2 * LIMIT}, "id": "late"}), None, "too_large"),
    (proto.request("cut", "ping", {"pad": "y" * 200})[:-50], "cut", "bad_request"),  # truncated
    (proto.request("tail", "ping", {}) + b"\xc1junk", "tail", "bad_request"),  # bytes after the map
    (proto.request("wide", "search", _WIDE), "wide", "too_large"),  # a list past MAX_CONTAINER
    (msgpack.packb({"v": 1, "id": True, "op": "ping"}), None, "bad_request"),  # not an id
    (msgpack.packb({"v": 1, "id": ["a"], "op": "ping"}), None, "bad_request"),
    (b"\x81\xa2id" + b"\x91" * 60_000, None, "bad_request"),  # 60k nested arrays as the id
    (b"\x91" * (2 * LIMIT), None, "too_large"),
    (b"\xdf\xff\xff\xff\xff", None, "too_large"),  # a map declaring 2^32 entries
])
def test_a_refused_frame_is_answered_with_the_id_at_its_start(small_daemon: DaemonProcess, frame: bytes,
                                                              want_id: Any, code: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger, sock.rcvtimeo = 0, 5000
    sock.connect(small_daemon.endpoint)
    try:
        reply = _exchange(sock, frame)
        assert reply["ok"] is False and reply["error"]["code"] == code and reply["id"] == want_id, reply
        assert _exchange(sock, proto.request("p", "ping", {}))["ok"] is True  # and it serves on
    finally:
        sock.close(linger=0)
        ctx.term()


class OldDaemon:
    """A stand-in for a daemon that answers some requests with an error without an id
    (as daemons did before they read the id of a refused frame); ``policy`` gets each
    request and returns "answer", "hold" (no reply yet) or "unnamed" (an id-less error)."""

    def __init__(self, endpoint: str, policy: Callable[[dict[str, Any]], str]) -> None:
        self.endpoint, self.policy = endpoint, policy
        self.held: list[tuple[list[bytes], dict[str, Any]]] = []
        self.release = threading.Event()  # answer the held requests now
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind(endpoint)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.release.is_set():
                self.release.clear()
                for envelope, request in self.held:
                    self._sock.send_multipart([*envelope, proto.ok(request["id"], {"pong": True})])
                self.held.clear()
            if not self._sock.poll(20):
                continue
            *envelope, body = self._sock.recv_multipart()
            request = msgpack.unpackb(body, raw=False)
            action = self.policy(request)
            if action == "answer":
                self._sock.send_multipart([*envelope, proto.ok(request["id"], {"pong": True})])
            elif action == "unnamed":
                self._sock.send_multipart([*envelope, proto.error(None, "too_large", "message too big",
                                                                  {"field": "request"}, "TooLargeError")])
            else:
                self.held.append((envelope, request))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/old.sock"


def _by_op(**actions: str) -> Callable[[dict[str, Any]], str]:
    return lambda request: actions.get(request["op"], "answer")


def test_an_older_daemons_error_without_an_id_goes_to_no_call_and_the_timeout_says_so(endpoint: str) -> None:
    """Two calls sent, one id-less error (a daemon from before peek_id): which call's it is
    cannot be known, so no call gets it; the ping gets its own reply, and the call left
    without one times out saying the error may have been its."""
    old = OldDaemon(endpoint, _by_op(ping="hold", store="unnamed"))

    async def scenario() -> None:
        async with AsyncMemoryClient(endpoint, config=load_config(None), timeout=1.0) as c:
            ping = asyncio.ensure_future(c.ping(timeout=10))
            while not old.held:  # the ping reached the daemon first
                await asyncio.sleep(0.01)
            with pytest.raises(RequestTimeoutError, match="may have been this one"):
                await c.store("anything")
            old.release.set()
            assert (await ping)["pong"]

    try:
        asyncio.run(scenario())
    finally:
        old.close()


_LEAF = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=40)
         | st.binary(max_size=40))
_KEY = st.text(max_size=4) | st.integers(-2**63, 2**63)
_VALUE = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEY, inner, max_size=4),
                      max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEY | st.none(), _VALUE, max_size=6))
def test_peek_id_finds_the_id_of_any_request_map_and_never_raises_on_a_cut_one(message: dict[Any, Any]) -> None:
    """peek_id reads attacker-made bytes on the daemon's I/O thread: any map, cut at any byte."""
    frame = msgpack.packb(message)
    if len(frame) <= proto.PEEK_BYTES:
        expected = message.get("id")
        assert proto.peek_id(frame) == (expected if proto.is_request_id(expected) else None)
    for cut in range(len(frame)):
        found = proto.peek_id(frame[:cut])
        assert found is None or found == message.get("id")


@pytest.mark.parametrize("frame", [
    b"\xdf\xff\xff\xff\xff" + b"\xc0" * 8192,  # a map of 4 G entries
    b"\xdd\xff\xff\xff\xff" + b"\xc0" * 8192,  # an array of 4 G entries, no map at all
    b"\x81" + b"\x91" * 8192,  # a key nested 8192 arrays deep
    b"\x81\xa2id" + b"\x91" * 8192,  # an id nested 8192 arrays deep
    b"\x81\xa2id\xdb\xff\xff\xff\xff" + b"x" * 8192,  # an id string said to be 4 GiB
    b"\x81\xa2id\xc7\x05\x01abcde",  # an ext type
    b"\x81\xa2id\xd6\xff\x00\x00\x00\x01",  # a msgpack timestamp
    b"\x81\xc4\x02id\xa1x",  # the key as bytes
    b"\x82\xa2id\xc3\xa2id\xa1x",  # a bool id, then a second id
])
def test_peek_id_on_crafted_frames_is_quick_and_finds_no_id(frame: bytes) -> None:
    started = time.perf_counter()
    assert proto.peek_id(frame) is None
    assert time.perf_counter() - started < 0.5  # bounded work (a few ms; generous for a shared machine)
