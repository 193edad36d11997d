"""``reachy-memory mcp`` as a subprocess, driven by the official MCP SDK's stdio client."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_util import ROOT, DaemonProcess

if os.environ.get("CI") != "true":
    pytest.importorskip("mcp", reason="the mcp extra is not installed (pip install '.[mcp]')")
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


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
    assert list(by_name) == ["search_memories", "store_memory", "forget_memory", "remember", "recall"]
    assert by_name["search_memories"].input_schema["required"] == ["query"]
    assert by_name["forget_memory"].input_schema["required"] == ["memory_id"]
    assert not stored.is_error and stored.structured_content["type"] == "fact"
    hits = found.structured_content["result"]
    assert hits[0]["id"] == stored.structured_content["id"] and hits[0]["metadata"] == {"person": "Sarah"}
    assert bad.is_error and "conversation" in bad.content[0].text
    assert gone.structured_content == {"success": False, "id": "placeholder"}


def test_daemon_message_and_no_daemon(daemon: DaemonProcess, tmp_path: Path) -> None:
    _, (big,) = session_run(["--config", str(daemon.config_path)], [("store_memory", {"content": "x" * 20_000})])
    assert big.is_error and "TooLargeError" in big.content[0].text
    absent = DaemonProcess(tmp_path)
    _, (res,) = session_run(["--config", str(absent.config_path)], [("search_memories", {"query": "x"})])
    assert res.is_error and "reachy-memory serve" in res.content[0].text


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
