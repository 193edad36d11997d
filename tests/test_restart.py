"""The apps keep working while systemd restarts the daemon (an upgrade, a crash, the watchdog).

Each client stays up across the restart: the blocking and asyncio clients, the
MemoryBridge and the MCP server. A request in flight is made deterministic by
freezing the daemon (SIGSTOP) once the client is connected: the request waits in
the frozen daemon's socket, then the daemon is stopped (SIGTERM, then SIGCONT) or
killed (SIGKILL) and started again. Every check: the call in flight ends within its
timeout with one of the project's errors (or its result, when a stopping daemon
still answered it), every acknowledged write is there after the restart, and the
same client works again without being made anew. Words-only daemons (no model to
load): a restart takes about a second.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from reachy_memory import (
    AsyncMemoryClient,
    Memory,
    MemoryType,
    ReachyMemoryError,
    RequestTimeoutError,
    ValidationError,
)
from reachy_memory.daemon import protocol as proto
from reachy_memory.integrations.reachy_mini import MemoryBridge
from tests.daemon_util import ROOT, DaemonProcess, ReplyLost, restartable_daemon, stop_as_systemd

pytestmark = pytest.mark.timeout(180)
SLACK = 1.5  # seconds past a call's timeout allowed on a shared, noisy machine
HOW = ["term", "kill"]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    yield from restartable_daemon(tmp_path)


def freeze(d: DaemonProcess) -> None:
    """SIGSTOP: requests sent now wait, unread, in the daemon's socket."""
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)


def ended_later(d: DaemonProcess, how: str, delay: float = 0.3) -> threading.Thread:
    """Ends the daemon ``delay`` s from now on another thread (the caller's call is in flight)."""
    thread = threading.Thread(target=lambda: (time.sleep(delay), stop_as_systemd(d, how)), daemon=True)
    thread.start()
    return thread


def outcome(call: Any) -> tuple[Any, float]:
    """(the result or the exception, seconds taken) of ``call()``."""
    started = time.monotonic()
    try:
        result = call()
    except Exception as exc:  # any type: the test checks it
        result = exc
    return result, time.monotonic() - started


def assert_ours(result: Any, timeout: float, took: float) -> None:
    """A call in flight across a restart: its result, or one of our errors, within its timeout."""
    assert took < timeout + SLACK, f"the call in flight took {took:.2f} s (timeout {timeout} s)"
    if isinstance(result, BaseException):
        assert isinstance(result, ReachyMemoryError), f"foreign exception {result!r}"


def socket_mode(d: DaemonProcess) -> int:
    return stat.S_IMODE(Path(d.endpoint.removeprefix("ipc://")).stat().st_mode)


@pytest.mark.parametrize("how", HOW)
def test_the_blocking_client_across_restarts(daemon: DaemonProcess, how: str) -> None:
    with daemon.client(timeout=1.0) as c:
        acked = [c.store(f"said before the restart {i}", id=f"before-{i}").id for i in range(10)]
        freeze(daemon)
        stopper = ended_later(daemon, how)
        result, took = outcome(lambda: c.store("said while it restarted", id="in-flight"))
        stopper.join(60)
        assert_ours(result, 1.0, took)
        acked += [result.id] if isinstance(result, Memory) else []
        daemon.start()
        assert socket_mode(daemon) == 0o600  # private after the restart too
        acked.append(c.store("said after the restart", id="after").id)  # the same client
        stop_as_systemd(daemon, how)  # idle this time
        daemon.start()
        assert all(c.get(i) is not None for i in acked), "an acknowledged write is missing"
        assert len(c.export_page()[0]) == len(acked)
        assert c.ping()["pong"]


@pytest.mark.parametrize("how", HOW)
def test_the_async_client_across_restarts(daemon: DaemonProcess, how: str) -> None:
    async def scenario() -> None:
        async with AsyncMemoryClient(daemon.endpoint, config=daemon.config, timeout=1.0) as c:
            acked = [(await c.store(f"said before the restart {i}", id=f"before-{i}")).id for i in range(10)]
            freeze(daemon)
            stopper = ended_later(daemon, how)
            started = time.monotonic()
            calls = [c.store(f"in flight {i}", id=f"in-flight-{i}") for i in range(4)]
            results = await asyncio.gather(*calls, c.search("before"), c.get_context_window(),
                                           return_exceptions=True)
            took = time.monotonic() - started
            await asyncio.to_thread(stopper.join, 60)
            for result in results:
                assert_ours(result, 1.0, took)
            acked += [r.id for r in results[:4] if isinstance(r, Memory)]
            await asyncio.to_thread(daemon.start)
            acked.append((await c.store("said after the restart", id="after")).id)  # the same client
            await asyncio.to_thread(stop_as_systemd, daemon, how)  # idle this time
            await asyncio.to_thread(daemon.start)
            assert all([await c.get(i) is not None for i in acked]), "an acknowledged write is missing"
            assert len((await c.export_page())[0]) == len(acked)

    asyncio.run(asyncio.wait_for(scenario(), 120))


@pytest.mark.parametrize("how", HOW)
def test_the_bridge_keeps_the_control_loop_running_and_recovers(daemon: DaemonProcess, how: str) -> None:
    bridge = MemoryBridge(daemon.endpoint, config=daemon.config, timeout=0.5, refresh_interval=0.05).start()
    helper = getattr(bridge, "_proc", None)  # the worker's process (the default on POSIX)
    worst = 0.0

    def tick(text: str | None = None) -> None:
        """One 50 Hz control-loop step: what the loop may call (each must return at once)."""
        nonlocal worst
        started = time.perf_counter()
        bridge.latest()
        if text is not None:
            bridge.record_turn("user", text)
        worst = max(worst, time.perf_counter() - started)
        time.sleep(0.02)

    def run_until(done: Any, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, f"not reached: {bridge.latest()} {bridge.stats}"
            tick()

    try:
        tick("a turn before the restart")
        run_until(lambda: "a turn before the restart" in str(bridge.latest().window))
        freeze(daemon)
        stopper = ended_later(daemon, how, 0.1)
        tick("a turn said while it restarted")
        run_until(lambda: bridge.latest().error is not None)  # the loop goes on; the snapshot says why
        stopper.join(60)
        starter = threading.Thread(target=daemon.start, daemon=True)
        starter.start()
        while starter.is_alive():
            tick()
        tick("a turn after the restart")
        run_until(lambda: bridge.latest().error is None and "a turn after the restart" in str(bridge.latest().window))
        assert helper is not None and helper.poll() is None and bridge._proc is helper  # the same worker, on its own
        assert bridge.search("turn").result(timeout=10) is not None
    finally:
        bridge.close()
    # the calls are no I/O (tests/test_bridge.py); this bound only catches a wait for the daemon
    assert worst < 0.25, f"a control-loop call took {worst * 1000:.0f} ms"


def answered(daemon: DaemonProcess, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """The daemon's reply to one request sent on a raw socket of its own (closed after)."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger, raw.rcvtimeo = 0, 10_000
    raw.connect(daemon.endpoint)
    try:
        raw.send(msgpack.packb({"v": 1, "id": "r1", "op": op, "args": args}))
        return dict(msgpack.unpackb(raw.recv()))
    finally:
        raw.close(linger=0)
        ctx.term()


def test_a_write_whose_reply_was_lost_is_retried_without_a_duplicate(daemon: DaemonProcess) -> None:
    """The daemon journals a store, then dies before the client gets the reply: the client
    cannot know. ``store`` carries a client-made id, so the retry (``retries=``, or the
    caller's own) finds the memory the dead daemon kept and stores nothing twice."""
    # the first attempt: journaled and answered; the answer never reaches its caller
    assert answered(daemon, "store", {"content": "the keys are in the blue bowl", "memory_type": "fact",
                                      "id": "kept-once"})["ok"]
    daemon.kill()
    daemon.start()
    with daemon.client(timeout=5.0, retries=2) as c:
        again = c.store("the keys are in the blue bowl", "fact", id="kept-once")
        assert again.id == "kept-once"
        assert [m.content for m in c.export_page()[0]] == ["the keys are in the blue bowl"]
        with pytest.raises(ReachyMemoryError, match="already used by another memory"):
            c.store("the keys are on the hook", "fact", id="kept-once")  # an id is never reused


def test_writes_without_an_id_are_never_retried_automatically(daemon: DaemonProcess) -> None:
    """``record_turn`` (no client-made id) sent once, whatever ``retries`` says: a retry
    after a lost reply would keep the turn twice. ``store`` is retried, with its id."""
    with daemon.client(timeout=0.4, retries=3) as c:
        c.ping()  # connected: the first attempt reaches the frozen daemon's socket
        freeze(daemon)
        result, took = outcome(lambda: c.record_turn("user", "one turn, kept once"))
        assert isinstance(result, RequestTimeoutError) and took < 0.4 + SLACK  # one attempt, not four
        thaw(daemon)  # it reads the one request it was sent
        deadline = time.monotonic() + 10
        while not c.get_context_window(timeout=5):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [m["content"] for m in c.get_context_window(timeout=5)] == ["one turn, kept once"]
        assert [m.content for m in c.export_page(timeout=5)[0]] == ["one turn, kept once"]


def thaw(d: DaemonProcess) -> None:
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("how", HOW)
def test_the_mcp_server_answers_tool_errors_during_a_restart_and_works_after(daemon: DaemonProcess,
                                                                             how: str) -> None:
    pytest.importorskip("mcp", reason="the mcp extra is not installed (pip install '.[mcp]')")
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    def text(result: Any) -> str:
        return result.content[0].text if result.content else str(result.structured_content)

    async def scenario() -> None:
        env = {"PYTHONPATH": str(ROOT)}
        params = StdioServerParameters(command=sys.executable, env=env, args=[
            "-m", "reachy_memory.cli", "mcp", "--config", str(daemon.config_path), "--timeout", "1"])
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            stored = await session.call_tool("store_memory", {"content": "Sarah likes Italian food"})
            assert not stored.is_error, text(stored)
            freeze(daemon)
            stopper = ended_later(daemon, how)
            started = time.monotonic()
            in_flight = await session.call_tool("store_memory", {"content": "Tom likes tea"})
            took = time.monotonic() - started
            await asyncio.to_thread(stopper.join, 60)
            if how == "kill" or in_flight.is_error:  # (a stopping daemon may still have answered it)
                assert in_flight.is_error and "DaemonUnavailableError" in text(in_flight), text(in_flight)
                assert "search for it before storing it again" in text(in_flight)  # it may have been kept
            # the call's timeout, sent again (its id) for as long (--timeout) while no daemon listens, a
            # last attempt of 0.5 s at most, then a ping of 1 s: busy or gone?
            assert took < 1 + 1 + 0.5 + 1 + SLACK
            started = time.monotonic()
            down = await session.call_tool("search_memories", {"query": "Sarah"})
            assert down.is_error and "DaemonUnavailableError" in text(down), text(down)
            assert time.monotonic() - started < 1.0  # no daemon listens: said at once, not after 1 + 1 s
            await asyncio.to_thread(daemon.start)
            after = await session.call_tool("store_memory", {"content": "Sarah's birthday is in May"})
            assert not after.is_error, text(after)
            found = await session.call_tool("search_memories", {"query": "Sarah birthday"})
            assert not found.is_error, text(found)

    asyncio.run(asyncio.wait_for(scenario(), 120))


class _DroppedBetweenPollAndSend:
    """A client's socket whose connection drops between a POLLOUT and the send (what a
    daemon restart can do): the next ``refusals`` sends are refused, as libzmq then does."""

    def __init__(self, sock: zmq.Socket, refusals: int) -> None:
        self._sock, self.refusals = sock, refusals

    def send(self, frame: bytes, flags: int = 0) -> Any:
        if self.refusals:
            self.refusals -= 1
            raise zmq.Again()
        return self._sock.send(frame, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_a_send_refused_after_pollout_waits_for_the_connection(daemon: DaemonProcess) -> None:
    """The blocking client sent again, unguarded, once POLLOUT said there was room; a
    connection lost in between raised zmq.Again to the caller (a foreign exception, which
    also ended a MemoryBridge's worker for good)."""
    with daemon.client(timeout=5.0) as c:
        c.ping()
        c._sock = _DroppedBetweenPollAndSend(c._sock, refusals=2)  # type: ignore[assignment]
        assert c.ping()["pong"]
        c._sock = _DroppedBetweenPollAndSend(c._sock._sock, refusals=10**9)  # type: ignore[assignment,attr-defined]
        with pytest.raises(RequestTimeoutError):
            c.ping(timeout=0.3)  # never any room: its timeout, as for no connection at all


# -- a turn queued on the bridge survives a restart, kept once ------------------------------------


def kept_turns(d: DaemonProcess) -> tuple[list[str], list[str]]:
    """(the window's turns, the CONVERSATION memories by creation time): their contents."""
    with d.client(timeout=5.0) as c:
        window = [m["content"] for m in c.get_context_window()]
        memories = sorted((m for m in c.export_page()[0] if m.memory_type is MemoryType.CONVERSATION),
                          key=lambda m: m.created_at)
    return window, [m.content for m in memories]


@pytest.mark.parametrize("how", HOW)
def test_turns_queued_on_the_bridge_while_the_daemon_restarts_are_all_kept_once_in_order(
        daemon: DaemonProcess, how: str) -> None:
    """The turn in flight (sent to the frozen daemon, which is then stopped or killed) and
    the turns queued while no daemon listens: each failed within its timeout and was dropped
    (counted in stats.errors) though record_turn had said True. Now each is sent again with
    its id until the daemon is back: all there once, in order, in the window and as memories."""
    turns = [f"turn {i} about the garden" for i in range(6)]
    with MemoryBridge(daemon.endpoint, config=daemon.config, timeout=0.5, refresh_interval=0.05,
                      turn_retry_for=60) as bridge:
        assert bridge.record_turn("user", turns[0])
        wait_until(lambda: turns[0] in str(bridge.latest().window))
        freeze(daemon)
        assert bridge.record_turn("user", turns[1])  # reaches the frozen daemon's socket
        time.sleep(0.1)
        stop_as_systemd(daemon, how)
        assert all(bridge.record_turn("user", t) for t in turns[2:5])  # no daemon listens
        wait_until(lambda: bridge.stats.retries > 0)
        assert bridge.latest().error is not None  # the loop can see a turn waits
        daemon.start()
        assert bridge.record_turn("user", turns[5])
        wait_until(lambda: turns[5] in str(bridge.latest().window))
        assert [m["content"] for m in bridge.latest().window] == turns
        assert (bridge.stats.errors, bridge.stats.turns_lost, bridge.stats.dropped) == (0, 0, 0)
        assert bridge.latest().error is None
    assert kept_turns(daemon) == (turns, turns)


def test_a_turn_journaled_by_a_daemon_killed_before_its_reply_is_kept_once(daemon: DaemonProcess) -> None:
    """The bridge's first attempt is journaled, then the daemon is killed (SIGKILL) before
    the reply arrives: the worker sends the turn again, with its id, to the restarted
    daemon, which finds it in its replayed journal and keeps nothing twice."""
    real = daemon.client(timeout=5.0)

    client = ReplyLost(real, daemon, "record_turn")
    with MemoryBridge(client_factory=lambda: client, refresh_interval=0.05) as bridge:
        assert bridge.record_turn("user", "I am back from Lyon")
        assert bridge.record_turn("assistant", "Welcome back!")
        wait_until(lambda: "Welcome back!" in str(bridge.latest().window))
        assert (bridge.stats.retries, bridge.stats.errors) == (1, 0)
    first, again, _ = client.sent
    assert again == first  # the memory the killed daemon kept, not a second one
    assert kept_turns(daemon) == (["I am back from Lyon", "Welcome back!"],) * 2


def test_record_turn_with_an_id_replayed_after_a_kill_gives_the_same_memory(daemon: DaemonProcess) -> None:
    """kill -9 after the daemon journaled a turn and before its caller got the reply: the
    retry (same id) is answered from the replayed journal with the same memory, one copy;
    the id reused for another turn is refused."""
    reply = answered(daemon, "record_turn", {"role": "user", "content": "the keys are in the blue bowl", "id": "t1"})
    assert reply["ok"], reply
    daemon.kill()
    daemon.start()
    with daemon.client(timeout=5.0, retries=2) as c:
        again = c.record_turn("user", "the keys are in the blue bowl", id="t1")
        assert again == proto.memory_from_wire(reply["result"])
        assert kept_turns(daemon) == (["the keys are in the blue bowl"],) * 2
        for other in (("user", "the keys are on the hook"), ("assistant", "the keys are in the blue bowl")):
            with pytest.raises(ValidationError, match="already used by another memory"):
                c.record_turn(*other, id="t1")

    async def from_async() -> Memory:
        async with AsyncMemoryClient(daemon.endpoint, config=daemon.config, timeout=5.0, retries=2) as c:
            return await c.record_turn("user", "the keys are in the blue bowl", id="t1")

    assert asyncio.run(asyncio.wait_for(from_async(), 30)) == again
    assert kept_turns(daemon) == (["the keys are in the blue bowl"],) * 2


def test_record_turn_with_an_id_is_retried_by_the_client_and_kept_once(daemon: DaemonProcess) -> None:
    """With its id, ``retries=`` sends a turn again after a timeout (without one it is
    sent once: test_writes_without_an_id_are_never_retried_automatically)."""
    with daemon.client(timeout=0.4, retries=2) as c:
        c.ping()
        freeze(daemon)
        result, took = outcome(lambda: c.record_turn("user", "one turn, kept once", id="t1"))
        assert isinstance(result, RequestTimeoutError) and took > 3 * 0.4 - 0.1  # three attempts
        thaw(daemon)
        assert c.record_turn("user", "one turn, kept once", id="t1", timeout=10).content == "one turn, kept once"
    assert kept_turns(daemon) == (["one turn, kept once"],) * 2


def test_remember_with_ids_replayed_after_a_kill_gives_the_same_memories(daemon: DaemonProcess) -> None:
    """``remember`` took no id: kill -9 after the daemon journaled a fact and before its
    caller got the reply, and the caller's retry stored the fact (and for a lexical-only
    daemon, its person link) twice. With its ids the retry is answered from the replayed
    journal with the same memories; ``retries=`` sends it again; the id of another fact is
    refused."""
    facts = [{"content": "Sarah likes green tea", "subjects": ["Sarah"], "id": "f1"},
             {"content": "Tom plays chess", "id": "f2"}]
    reply = answered(daemon, "remember", {"facts": facts})
    single = answered(daemon, "remember", {"content": "Trash day is Monday", "id": "f3"})
    assert reply["ok"] and single["ok"], (reply, single)
    daemon.kill()
    daemon.start()
    with daemon.client(timeout=5.0, retries=2) as c:
        assert c.remember(facts=facts) == [proto.memory_from_wire(m) for m in reply["result"]]
        assert c.remember("Trash day is Monday", id="f3") == [proto.memory_from_wire(single["result"][0])]
        with pytest.raises(ValidationError, match="already used by another memory"):
            c.remember("Trash day is Tuesday", id="f3")
        assert sorted(m.content for m in c.export_page()[0]) == [
            "Sarah likes green tea", "Tom plays chess", "Trash day is Monday"]
        assert sorted(p.name for p in c.people()) == ["Sarah", "Tom"]


def test_remember_with_its_ids_is_retried_by_the_client_and_kept_once(daemon: DaemonProcess) -> None:
    """With an id (or one in each fact), ``retries=`` sends ``remember`` again after a timeout;
    without, it is sent once (a retry after a lost reply would keep the fact twice)."""
    with daemon.client(timeout=0.4, retries=2) as c:
        c.ping()
        freeze(daemon)
        result, took = outcome(lambda: c.remember("Tom plays chess", id="f1"))
        assert isinstance(result, RequestTimeoutError) and took > 3 * 0.4 - 0.1  # three attempts
        result, took = outcome(lambda: c.remember(facts=[{"content": "Tom plays chess", "id": "f1"},
                                                         {"content": "Ann sings"}]))  # one fact without
        assert isinstance(result, RequestTimeoutError) and took < 0.4 + SLACK  # one attempt
        thaw(daemon)
        assert [m.id for m in c.remember("Tom plays chess", id="f1", timeout=10)] == ["f1"]
        assert [m.content for m in c.export_page(timeout=10)[0]] == ["Tom plays chess"]  # (late ones: dropped)


def _kept(d: DaemonProcess, content: str) -> int:
    """How many memories of ``content`` the daemon holds."""
    with d.client(timeout=5.0) as c:
        return [m.content for m in c.export_page()[0]].count(content)


@pytest.mark.parametrize(("tool", "args"), [
    ("store_memory", {"content": "the keys are in the blue bowl", "memory_type": "conversation"}),  # store
    ("remember", {"content": "Sarah likes green tea", "subjects": ["Sarah"]}),
])
def test_a_tool_write_whose_reply_a_kill_lost_is_answered_and_kept_once(daemon: DaemonProcess, tool: str,
                                                                        args: dict[str, Any]) -> None:
    """The daemon journals an LLM tool's write, then is killed (SIGKILL) before replying: the
    tool answered the model "may have been kept", and a model storing it again made a
    duplicate. Now the tool sends it again with its ids until the daemon is back (systemd
    restarts it), within its timeout: the restarted daemon finds it in its replayed journal;
    the model is told it is kept, with its id; one memory."""
    from reachy_memory.integrations.tools import TOOLS_BY_NAME, DaemonBackend

    restart = threading.Thread(target=daemon.start, daemon=True)

    async def scenario() -> tuple[list[Any], Any]:
        real = AsyncMemoryClient(daemon.endpoint, config=daemon.config, timeout=10.0)
        kept: list[Any] = []

        class AsyncReplyLost:
            """The real client; its first write's reply is lost with the daemon."""

            async def write(self, call: Any) -> Any:
                kept.append(await call)
                if len(kept) == 1:
                    daemon.kill()
                    restart.start()
                    raise RequestTimeoutError("the daemon died before replying")
                return kept[-1]

            async def store(self, *a: Any, **k: Any) -> Any:
                return await self.write(real.store(*a, **k))

            async def remember(self, *a: Any, **k: Any) -> Any:
                return await self.write(real.remember(*a, **k))

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        try:
            answer = await TOOLS_BY_NAME[tool].run(DaemonBackend(AsyncReplyLost(), own=False), args)  # type: ignore[arg-type]
        finally:
            await real.close()
        return kept, answer

    kept, answer = asyncio.run(asyncio.wait_for(scenario(), 60))
    restart.join(60)
    first, again = kept  # sent twice: the daemon's own answers
    assert again == first  # the memory the killed daemon kept, not a second one
    stored = answer["stored"][0] if tool == "remember" else answer
    assert stored["id"] == (first[0] if isinstance(first, list) else first).id  # told: kept, with its id
    assert _kept(daemon, args["content"]) == 1


@pytest.mark.parametrize("how", HOW)
def test_a_tool_write_in_flight_across_a_restart_is_answered_and_kept_once(daemon: DaemonProcess, how: str) -> None:
    """A tool's store reaches the frozen daemon, which is then stopped or killed and started
    again (systemd): the tool answered an error ("may have been kept"). Now it is sent again
    with its id until the daemon is back, within its timeout: kept once, answered."""
    from reachy_memory.integrations.tools import TOOLS_BY_NAME, DaemonBackend

    def restart() -> None:
        time.sleep(0.3)
        stop_as_systemd(daemon, how)
        daemon.start()

    async def scenario() -> tuple[Any, float]:
        backend = DaemonBackend.from_config(daemon.config, timeout=5.0)  # sent again for 5 s after the first try
        try:
            await TOOLS_BY_NAME["store_memory"].run(backend, {"content": "said before the restart"})  # connected
            freeze(daemon)
            restarter = threading.Thread(target=restart, daemon=True)
            restarter.start()
            started = time.monotonic()
            answer = await TOOLS_BY_NAME["store_memory"].run(backend, {"content": "Tom likes tea"})
            took = time.monotonic() - started
            await asyncio.to_thread(restarter.join, 60)
        finally:
            await backend.aclose()
        return answer, took

    answer, took = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert answer["content"] == "Tom likes tea" and answer["id"]
    assert took < 5 + 5 + SLACK  # the first attempt's timeout, then sent again until the daemon is back
    assert _kept(daemon, "Tom likes tea") == 1


def wait_until(done: Any, seconds: float = 30.0) -> None:
    """Poll ``done()``; the bound only ends a broken run."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.02)
