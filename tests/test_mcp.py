"""``reachy-memory mcp`` as a subprocess, driven by the official MCP SDK's stdio client."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_util import ROOT, DaemonProcess, run_cli

if os.environ.get("CI") != "true":
    pytest.importorskip("mcp", reason="the mcp extra is not installed (pip install '.[mcp]')")
from mcp import Client
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from reachy_memory.integrations.conversation import MAX_ERROR_CHARS, TOOL_CLASSES
from reachy_memory.integrations.tools import TOOLS
from reachy_memory.mcp_server import _Service, build_server


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("mcp")) as d:
        yield d


def session_run(args: list[str], calls: list[tuple[str, dict[str, Any]]]) -> tuple[Any, list[Any]]:
    """Start the server with ``args``, list its tools, make ``calls`` in order."""
    async def go() -> tuple[Any, list[Any]]:
        env = {"PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))}
        params = StdioServerParameters(command=sys.executable, args=["-m", "reachy_memory.cli", "mcp", *args], env=env)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools = await session.list_tools()
            return tools, [await session.call_tool(name, a) for name, a in calls]
    return asyncio.run(go())


def test_tools_schemas_and_round_trip(daemon: DaemonProcess) -> None:
    tools, (stored, found, bad, gone) = session_run(["--config", str(daemon.config_path)], [
        ("store_memory", {"content": "Sarah likes Italian food", "metadata": {"person": "Sarah"}}),
        ("search_memories", {"query": "what food does Sarah like?"}),
        ("search_memories", {"query": "x", "memory_type": "dream"}),  # not a memory type
        ("forget_memory", {"memory_id": "placeholder"}),
    ])
    by_name = {t.name: t for t in tools.tools}
    assert list(by_name) == ["search_memories", "store_memory", "forget_memory", "remember", "recall",
                             "memory_context", "forget_person", "pause_remembering", "resume_remembering"]
    assert all(by_name[t.name].input_schema == t.parameters_schema() for t in TOOLS)  # the table's schema
    assert by_name["search_memories"].input_schema["required"] == ["query"]
    assert by_name["forget_memory"].input_schema["required"] == ["memory_id"]
    assert not stored.is_error and stored.structured_content["type"] == "fact"
    hits = found.structured_content["result"]
    assert hits[0]["id"] == stored.structured_content["id"] and hits[0]["metadata"] == {"person": "Sarah"}
    assert bad.is_error and "search_memories: memory_type must be one of conversation, fact, context; got 'dream'" \
        in bad.content[0].text and "pydantic" not in bad.content[0].text
    assert gone.structured_content == {"success": False, "id": "placeholder"}


def test_daemon_message_and_no_daemon(daemon: DaemonProcess, tmp_path: Path) -> None:
    _, (big,) = session_run(["--config", str(daemon.config_path)], [("store_memory", {"content": "x" * 20_000})])
    assert big.is_error and "TooLargeError" in big.content[0].text
    absent = DaemonProcess(tmp_path)
    _, (res,) = session_run(["--config", str(absent.config_path)], [("search_memories", {"query": "x"})])
    assert res.is_error and "reachy-memory serve" in res.content[0].text


def test_endpoint_option_names_the_daemon(daemon: DaemonProcess, tmp_path: Path) -> None:
    """``mcp --endpoint`` was ignored: the tools asked the configured (here: absent) daemon."""
    elsewhere = DaemonProcess(tmp_path)  # a config whose endpoint no daemon serves
    _, (stored,) = session_run(["--config", str(elsewhere.config_path), "--endpoint", daemon.endpoint],
                               [("store_memory", {"content": "The bike pump is in the shed"})])
    assert not stored.is_error, stored.content[0].text
    with daemon.client() as c:
        assert c.get(stored.structured_content["id"]) is not None


def test_data_dir_of_the_running_daemon_says_to_leave_it_out(daemon: DaemonProcess) -> None:
    """Everywhere else --data-dir names the daemon's store; for mcp it opens one in-process,
    and the refusal said only 'in use by another process'."""
    out = run_cli(daemon, "mcp", "--data-dir", str(daemon.data))
    assert out.returncode == 4 and "in use by another process" in out.stderr, out.stderr
    assert "leave --data-dir out" in out.stderr and "Traceback" not in out.stderr


def test_in_process_data_dir(tmp_path: Path) -> None:
    cfg = DaemonProcess(tmp_path)
    _, (stored, found) = session_run(["--config", str(cfg.config_path), "--data-dir", str(tmp_path / "local")], [
        ("store_memory", {"content": "The garden gate sticks", "memory_type": "context"}),
        ("search_memories", {"query": "garden gate"}),
    ])
    assert stored.structured_content["type"] == "context"
    assert found.structured_content["result"][0]["content"] == "The garden gate sticks"


def test_spec_004_remember_and_recall_through_the_sdk_client(daemon: DaemonProcess) -> None:
    _, (stored, batch, found, bad) = session_run(["--config", str(daemon.config_path)], [
        ("remember", {"content": "my wife's name is Sarah", "subjects": ["my wife"]}),
        ("remember", {"facts": [{"content": "she likes Italian food", "subjects": ["my wife"]},
                                {"content": "John plays chess", "subjects": ["John"]}]}),
        ("recall", {"query": "what does my wife like to eat?", "about": "my wife"}),
        ("remember", {"facts": [{"subjects": ["x"]}]}),  # a fact without content
    ])
    assert not stored.is_error and stored.structured_content["count"] == 1
    wife = stored.structured_content["stored"][0]["subjects"]
    assert batch.structured_content["stored"][0]["subjects"] == wife
    hits = found.structured_content["result"]
    assert hits and hits[0]["content"] == "she likes Italian food" and hits[0]["about"] == ["Sarah"]
    assert bad.is_error and "content" in bad.content[0].text


def test_the_household_tools_on_the_daemon_through_the_sdk_client(daemon: DaemonProcess) -> None:
    _, (stored, plan, paused, refused, resumed, done, gone) = session_run(["--config", str(daemon.config_path)], [
        ("remember", {"content": "Zelda keeps bees on the roof", "subjects": ["Zelda"]}),
        ("forget_person", {"person": "Zelda", "dry_run": True}),
        ("pause_remembering", {"minutes": 30}),
        ("store_memory", {"content": "the guest's wifi code is okapi77"}),
        ("resume_remembering", {}),
        ("forget_person", {"person": "Zelda"}),
        ("forget_person", {"person": "Zelda"}),
    ])
    assert not stored.is_error
    assert plan.structured_content["dry_run"] is True and plan.structured_content["memories_deleted"] == 1
    assert paused.structured_content["paused"] is True and 1790 < paused.structured_content["seconds_left"] <= 1800
    assert refused.is_error and "RememberingPausedError" in refused.content[0].text
    assert resumed.structured_content["paused"] is False
    assert done.structured_content["dry_run"] is False and done.structured_content["memories_deleted"] == 1
    assert gone.is_error and "NotFoundError" in gone.content[0].text
    with daemon.client() as c:
        assert c.find_person("Zelda") is None
        assert not [m for m in c.export_page()[0] if "okapi" in m.content or "bees" in m.content]


class Recording:
    """A backend that finds nothing and records what each call reached it with."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def search(self, query: str, memory_type: str | None, limit: int) -> list[Any]:
        self.calls.append(("search", query, memory_type, limit))
        return []

    async def recall(self, query: str, about: str | None, limit: int) -> list[Any]:
        self.calls.append(("recall", query, about, limit))
        return []

    async def remember(self, args: dict[str, Any]) -> list[Any]:
        self.calls.append(("remember", args))
        return []

    async def forget(self, memory_id: str) -> bool:
        self.calls.append(("forget", memory_id))
        return False

    async def store(self, content: str, memory_type: str, metadata: dict[str, Any] | None) -> Any:
        raise AssertionError("not used here")

    async def knows(self, reference: str) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def in_process(backend: Recording, calls: list[tuple[str, dict[str, Any]]]) -> tuple[Any, list[Any]]:
    """The server built on ``backend``, driven in-process by the SDK's ``Client``."""
    async def go() -> tuple[Any, list[Any]]:
        async with Client(build_server(_Service(lambda: backend))) as client:
            return await client.list_tools(), [await client.call_tool(name, a) for name, a in calls]
    return asyncio.run(go())


def test_listed_schemas_are_the_tables() -> None:
    # the SDK listed a schema built by pydantic from annotations: fact items were bare objects, no maxItems
    tools, _ = in_process(Recording(), [])
    listed = {t.name: t.input_schema for t in tools.tools}
    assert listed == {t.name: t.parameters_schema() for t in TOOLS}
    remember = listed["remember"]["properties"]
    assert remember["facts"]["maxItems"] == 100 and remember["facts"]["items"]["required"] == ["content"]
    assert remember["subjects"]["maxItems"] == 16 and listed["search_memories"]["required"] == ["query"]


# (tool, arguments, the table's error message, or None: accepted). Over MCP the SDK validated these
# with pydantic first: "Fact" and null were refused, "5", "true", "7" and JSON strings were coerced.
CASES = [
    ("search_memories", {"query": "x", "limit": 0}, "search_memories: limit must be between 1 and 50, got 0"),
    ("search_memories", {}, "search_memories: query is required"),
    ("search_memories", {"query": "x", "memory_type": "Fact"}, None),
    ("search_memories", {"query": "x", "memory_type": None}, None),
    ("search_memories", {"query": "x", "limit": "5"}, "search_memories: limit must be an integer, got '5'"),
    ("search_memories", {"query": "true"}, None),  # a string, not JSON to parse
    ("search_memories", {"query": "x", "owner": "bob"},  # additionalProperties: false, it was ignored
     "search_memories: unknown argument 'owner'; it takes query, memory_type, limit"),
    ("recall", {"query": "x", "about": None}, None),
    ("remember", {"content": "x", "shared": None}, None),
    ("remember", {"content": "x", "deps": 1, "self": 2},  # unknown keys are refused on both
     "remember: unknown arguments 'deps', 'self'; it takes content, facts, subjects, expires_in_days, shared"),
    ("remember", {"content": "x", "shared": "true"}, "remember: shared must be true or false, got 'true'"),
    ("remember", {"content": "x", "expires_in_days": "7"}, "remember: expires_in_days must be an integer, got '7'"),
    ("remember", {"facts": json.dumps([{"content": "x"}])}, "remember: facts must be a list of at most 100 items"),
    ("forget_memory", {"memory_id": 42}, "forget_memory: memory_id must be a string, got 42"),
]


@pytest.mark.parametrize(("name", "args", "expect"), CASES)
def test_mcp_and_conversation_tools_check_arguments_alike(name: str, args: dict[str, Any], expect: str | None) -> None:
    over_mcp, in_app = Recording(), Recording()
    _, (res,) = in_process(over_mcp, [(name, args)])
    tool = next(c for c in TOOL_CLASSES if c.name == name)(backend=in_app)
    answer = asyncio.run(tool(None, **args))
    if expect is None:
        assert not res.is_error and "error" not in answer and over_mcp.calls and over_mcp.calls == in_app.calls
    else:
        assert set(answer) == {"error"} and answer["error"].startswith(f"ValidationError: {expect}")
        assert not over_mcp.calls and not in_app.calls
        assert res.is_error and res.content[0].text == f"Error executing tool {name}: {answer['error']}"
    if args.get("memory_type") == "Fact":
        assert over_mcp.calls == [("search", "x", "fact", 5)]


def test_a_huge_bad_value_gives_the_same_cut_message() -> None:
    args = {"query": ["x" * 1_000_000]}
    _, (res,) = in_process(Recording(), [("search_memories", args)])
    answer = asyncio.run(TOOL_CLASSES[0](backend=Recording())(None, **args))
    assert len(answer["error"]) == MAX_ERROR_CHARS
    assert res.content[0].text == f"Error executing tool search_memories: {answer['error']}"


def test_owner_binds_every_call_to_that_user(daemon: DaemonProcess) -> None:
    # `mcp` had no --owner: the model saw every user's facts, and could forget them.
    with daemon.client() as c:
        [alice] = c.remember("Alice's locker code is 4711", subjects=[], owner="alice")
        [bob] = c.remember("Bob's locker code is 0815", subjects=[], owner="bob")
        c.remember("The locker room closes at nine", subjects=[], owner="bob", shared=True)
        c.remember("Locker keys hang by the door", subjects=[])  # unscoped
    _, (found, recalled, forget_bob, forget_alice, stored) = session_run(
        ["--config", str(daemon.config_path), "--owner", "alice"], [
            ("search_memories", {"query": "locker code", "limit": 10}),
            ("recall", {"query": "locker", "limit": 10}),
            ("forget_memory", {"memory_id": bob.id}),
            ("forget_memory", {"memory_id": alice.id}),
            ("store_memory", {"content": "Alice's bike lock code is 1234"}),
        ])
    for hits in (found.structured_content["result"], recalled.structured_content["result"]):
        contents = {h["content"] for h in hits}
        assert "Bob's locker code is 0815" not in contents
        assert {"The locker room closes at nine", "Locker keys hang by the door"} <= contents
    assert "Alice's locker code is 4711" in {h["content"] for h in found.structured_content["result"]}
    assert forget_bob.structured_content == {"success": False, "id": bob.id}  # as for an unknown id
    assert forget_alice.structured_content == {"success": True, "id": alice.id}
    with daemon.client() as c:
        assert c.get(bob.id) is not None and c.get(alice.id) is None
        assert c.get(stored.structured_content["id"]).owner == "alice"  # a fact stored as hers


@pytest.mark.parametrize(("owner", "says"), [
    ("", "owner must be a string of 1 to 200 characters"),  # empty: not an owner the store takes
    ("x" * 201, "owner must be a string of 1 to 200 characters"),  # over the store's 200 characters
    # a byte that is not UTF-8 (b"al\xffice": Python reads it as a lone surrogate): was served
    # "as user 'al\udcffice'", every fact stored then refused as "not valid Unicode"
    ("al\udcffice", "owner is not valid Unicode: a lone surrogate at character 2"),
])
def test_a_bad_owner_is_a_clear_error_exit(daemon: DaemonProcess, owner: str, says: str) -> None:
    done = run_cli(daemon, "mcp", "--owner", owner)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"error: {says}" in done.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _post(url: str, headers: dict[str, str]) -> int:
    """The status of an MCP initialize POST with ``headers``."""
    import urllib.error
    import urllib.request

    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "0"}}})
    request = urllib.request.Request(url, body.encode(), method="POST", headers={
        "content-type": "application/json", "accept": "application/json, text/event-stream", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _wait_for_port(port: int, proc: Any, deadline: float = 60.0) -> None:
    import socket
    import time

    end = time.monotonic() + deadline
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stderr.read()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("the MCP HTTP server did not listen")


def test_http_answers_only_requests_with_the_owners_token(tmp_path: Path) -> None:
    """--http served every local user (and, but for the SDK's Host check, any web page) on
    127.0.0.1 with no credential, while the daemon's own socket is 0600."""
    import subprocess

    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    cfg, port, token_file = DaemonProcess(tmp_path), _free_port(), tmp_path / "private" / "token"
    token_file.parent.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "mcp", "--http", "--port", str(port),
                             "--config", str(cfg.config_path), "--data-dir", str(tmp_path / "local"),
                             "--token-file", str(token_file)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_port(port, proc)
        token = token_file.read_text().strip()
        assert len(token) >= 32 and token_file.stat().st_mode & 0o777 == 0o600  # only its owner reads it
        url = f"http://127.0.0.1:{port}/mcp"
        for headers in ({},  # no credential: was served
                        {"Authorization": "Bearer " + "x" * len(token)},  # a guess
                        {"Authorization": token}):  # the token without the scheme
            assert _post(url, headers) == 401, headers
        assert _post(url, {"Authorization": f"Bearer {token}"}) == 200

        async def go() -> tuple[Any, Any]:
            client = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30)
            async with client, streamable_http_client(url, http_client=client) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                stored = await session.call_tool("store_memory", {"content": "The spare key is under the pot"})
                return stored, await session.call_tool("search_memories", {"query": "spare key"})
        stored, found = asyncio.run(go())
        assert found.structured_content["result"][0]["id"] == stored.structured_content["id"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.parametrize(("mode", "content", "says"), [
    (0o644, "a-token-long-enough-1234", "read by other users"),  # a token others can read is no secret
    (0o600, "short", "holds no token"),  # too short to be a secret
    (0o600, "two words here, long enough", "holds no token"),
])
def test_http_refuses_a_token_file_that_keeps_no_secret(tmp_path: Path, mode: int, content: str, says: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    token_file.chmod(mode)
    cfg = DaemonProcess(tmp_path)
    out = run_cli(cfg, "mcp", "--http", "--port", str(_free_port()), "--token-file", str(token_file))
    assert out.returncode == 2 and says in out.stderr, out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_http_refuses_a_token_file_another_user_owns(tmp_path: Path) -> None:
    """Whoever owns the file chose the token: run as root (who reads any 0600 file),
    --token-file /tmp/x, planted first by another user, served them."""
    token_file = tmp_path / "token"
    token_file.write_text("the-other-users-chosen-token\n")
    token_file.chmod(0o600)
    os.chown(token_file, 65534, 65534)
    cfg = DaemonProcess(tmp_path)
    out = run_cli(cfg, "mcp", "--http", "--port", str(_free_port()), "--token-file", str(token_file))
    assert out.returncode == 2 and "belongs to another user" in out.stderr, out.stderr


def test_two_servers_making_the_token_at_once_share_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file was made empty and then written: a second server starting in between
    read it half-written and stopped with 'holds no token: delete it for a new one'."""
    from reachy_memory.daemon import http_auth as _http_auth

    path, second = tmp_path / "token", []
    fdopen = os.fdopen

    def meanwhile(*args: Any, **kwargs: Any) -> Any:  # the first server is between creating and writing
        if not second:
            second.append(None)
            second[0] = _http_auth.http_token(path)
        return fdopen(*args, **kwargs)

    monkeypatch.setattr(os, "fdopen", meanwhile)
    first = _http_auth.http_token(path)
    assert first == second[0] == path.read_text().strip() and len(first) >= 32
    assert [p.name for p in tmp_path.iterdir()] == ["token"]  # no scratch file left


def test_bearer_auth_lets_through_only_the_token_and_the_lifespan() -> None:
    """A websocket scope reached the SDK's app with no token at all (uvicorn here speaks
    websockets; Starlette had no such route yet); the scheme is case-insensitive (RFC 9110)."""
    from reachy_memory.daemon.http_auth import BearerAuth

    token = "t" * 43
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    async def call(kind: str, authorization: bytes | None) -> list[Any]:
        sent: list[Any] = []

        async def receive() -> Any:
            return {"type": "websocket.connect"}

        async def send(message: Any) -> None:
            sent.append(message)

        headers = [(b"authorization", authorization)] if authorization is not None else []
        await BearerAuth(app, token)({"type": kind, "headers": headers}, receive, send)
        return sent

    async def go() -> None:
        for kind in ("websocket", "http"):
            for value in (None, b"Bearer x", token.encode()):
                reached.clear()
                assert await call(kind, value) and reached == [], (kind, value)
        assert (await call("websocket", None))[0]["type"] == "websocket.close"
        for value in (b"Bearer " + token.encode(), b"bearer " + token.encode(), b"BEARER  " + token.encode()):
            reached.clear()
            assert await call("http", value) == [] and reached == ["http"], value
        reached.clear()
        assert await call("lifespan", None) == [] and reached == ["lifespan"]
    asyncio.run(go())


def test_http_on_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    """uvicorn said 'ERROR: [Errno 98] ...' and exited 3 ('not found'), after 'serving'
    had been printed and the token file made."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port, token_file = taken.getsockname()[1], tmp_path / "token"
        out = run_cli(DaemonProcess(tmp_path), "mcp", "--http", "--port", str(port), "--token-file", str(token_file))
    assert out.returncode == 2 and f"127.0.0.1:{port}" in out.stderr and "--port" in out.stderr, out.stderr
    assert "serving" not in out.stderr and "Traceback" not in out.stderr and not token_file.exists()


def test_a_token_file_without_http_is_a_usage_error(tmp_path: Path) -> None:
    # it was ignored: a reader could think stdio was guarded by it too
    out = run_cli(DaemonProcess(tmp_path), "mcp", "--token-file", str(tmp_path / "token"))
    assert out.returncode == 2 and "--token-file is for --http" in out.stderr, out.stderr
    assert not (tmp_path / "token").exists()


def test_tool_descriptions_state_the_configured_retention(tmp_path: Path) -> None:
    """The listed tools said "kept 30 days" whatever ``memory.conversation_ttl_days`` was."""
    for sub in ("d", "client", "none", "local"):
        (tmp_path / sub).mkdir()

    def listed(args: list[str]) -> dict[str, Any]:
        tools, _ = session_run(args, [])
        return {t.name: {"description": t.description, "input_schema": t.input_schema} for t in tools.tools}

    with DaemonProcess(tmp_path / "d", memory={"conversation_ttl_days": 7}, embedding={"enabled": False}) as d:
        client = DaemonProcess(tmp_path / "client")  # this config says 30 days: the daemon's 7 are said
        on_daemon = listed(["--config", str(client.config_path), "--endpoint", d.endpoint])
    assert "kept 7 days" in on_daemon["store_memory"]["description"] and "30 days" not in json.dumps(on_daemon)
    assert "(7 days)" in on_daemon["store_memory"]["input_schema"]["properties"]["memory_type"]["description"]
    assert "kept 7 days" in on_daemon["search_memories"]["description"]
    nobody = DaemonProcess(tmp_path / "none", memory={"conversation_ttl_days": 3})  # no daemon yet: this config's
    assert "kept 3 days" in listed(["--config", str(nobody.config_path)])["store_memory"]["description"]
    local = DaemonProcess(tmp_path / "local", memory={"conversation_ttl_days": 0.5})
    in_process = listed(["--config", str(local.config_path), "--data-dir", str(tmp_path / "local" / "data")])
    assert "kept 12 hours" in in_process["search_memories"]["description"]


def test_every_tool_answers_in_text_and_structured_content(tmp_path: Path) -> None:
    """A voice model reads the text: an empty search had no text content at all."""
    cfg = DaemonProcess(tmp_path)
    _, results = session_run(["--config", str(cfg.config_path), "--data-dir", str(tmp_path / "local")], [
        ("search_memories", {"query": "anything"}),
        ("recall", {"query": "anything", "about": "Sarah"}),
        ("memory_context", {}),
        ("remember", {"content": "Sarah is allergic to peanuts", "subjects": ["Sarah"]}),
        ("store_memory", {"content": "The spare key is under the pot", "memory_type": "context"}),
        ("search_memories", {"query": "spare key"}),
        ("memory_context", {"message": "What is Sarah allergic to?"}),
        ("forget_memory", {"memory_id": "not-an-id"}),
    ])
    empty, nobody, blank, remembered, stored, found, context, unknown = results
    for res in results:
        assert not res.is_error and res.structured_content is not None
        assert [c.type for c in res.content] == ["text"] and res.content[0].text.strip()
    assert empty.structured_content == {"result": []}
    assert empty.content[0].text == "Nothing relevant is remembered: say so instead of guessing."
    assert nobody.content[0].text == "Nothing relevant is remembered about Sarah: say so instead of guessing."
    assert blank.content[0].text.startswith("Nothing is remembered yet")
    assert remembered.content[0].text.startswith("Remembered 1 fact:\n- Sarah is allergic to peanuts (id ")
    assert stored.content[0].text.startswith("Stored as a context (id ")
    assert found.content[0].text.startswith("1 memory found, most relevant first:\n- [context] The spare key is")
    assert "Sarah is allergic to peanuts" in context.content[0].text == context.structured_content["text"]
    assert context.structured_content["tokens"] > 0 and context.structured_content["people"] == ["Sarah"]
    assert unknown.content[0].text.startswith("No memory has the id not-an-id")


class Long(Recording):
    """A backend whose searches find ``n`` memories of ``chars`` characters each."""

    def __init__(self, n: int, chars: int) -> None:
        super().__init__()
        self.n, self.chars = n, chars

    async def search(self, query: str, memory_type: str | None, limit: int) -> list[Any]:
        from datetime import UTC, datetime

        from reachy_memory.model import Memory, MemoryType, SearchResult
        return [SearchResult(Memory(f"id{i}", f"{i} " + "y" * self.chars, MemoryType.FACT, datetime.now(UTC)), 0.5)
                for i in range(min(limit, self.n))]


def test_results_are_capped_for_a_voice_model() -> None:
    from reachy_memory.integrations.tools import MAX_CONTENT_CHARS, MAX_RESULT_CHARS

    _, (one_long,) = in_process(Long(1, 100_000), [("search_memories", {"query": "x"})])
    _, (many,) = in_process(Long(50, 400), [("search_memories", {"query": "x", "limit": 50})])
    [hit] = one_long.structured_content["result"]
    assert len(hit["content"]) == MAX_CONTENT_CHARS and hit["content"].endswith("(100002 characters in all)")
    hits = many.structured_content["result"]
    assert 1 < len(hits) < 50 and len(json.dumps(hits, separators=(",", ":"))) <= MAX_RESULT_CHARS
    assert [h["id"] for h in hits] == [f"id{i}" for i in range(len(hits))]  # the best ones, in order
    assert len(many.content[0].text) < MAX_RESULT_CHARS


def test_optional_parameters_are_typed_nullable_and_the_dispatchers_key_only_in_the_app() -> None:
    tools, (refused,) = in_process(Recording(), [("search_memories", {"query": "x", "tool_manager": None})])
    for tool in tools.tools:
        schema = tool.input_schema
        assert schema["additionalProperties"] is False
        for name, prop in schema["properties"].items():
            assert ("null" in prop["type"]) == (name not in schema["required"]), (tool.name, name)
    assert refused.is_error and "unknown argument 'tool_manager'" in refused.content[0].text
    in_app = Recording()
    answer = asyncio.run(TOOL_CLASSES[0](backend=in_app)(None, query="x", tool_manager=object()))
    assert answer == {"query": "x", "results": [], "count": 0, "message": "Nothing relevant is remembered."}


def test_the_conversation_start_prompt_gives_the_context_block(tmp_path: Path) -> None:
    async def go() -> tuple[Any, Any]:
        env = {"PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))}
        cfg = DaemonProcess(tmp_path)
        params = StdioServerParameters(command=sys.executable, args=[
            "-m", "reachy_memory.cli", "mcp", "--config", str(cfg.config_path), "--data-dir", str(tmp_path / "d")],
            env=env)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            await session.call_tool("remember", {"content": "John plays chess on Sundays", "subjects": ["John"]})
            return await session.list_prompts(), await session.get_prompt("conversation_start", {})
    prompts, got = asyncio.run(go())
    assert [p.name for p in prompts.prompts] == ["conversation_start"]
    [message] = got.messages
    assert message.content.text.startswith("What you remember (use it naturally, do not recite it):\n")
    assert "John plays chess on Sundays" in message.content.text
