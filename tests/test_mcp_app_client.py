"""``reachy-memory mcp --http`` driven by an mcp 1.x client exactly as the conversation app
drives a configured MCP server (``tools/_app_mcp_client.py``: a fresh connection per call,
the bearer token from the environment's file, tools namespaced ``<alias>__<tool>``).

The client runs in its own venv (``tools/_venv.sh`` makes it: the project's mcp is 2.x);
$REACHY_MEMORY_MCP1_PYTHON names its python.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_util import ROOT, DaemonProcess

MCP1 = os.environ.get("REACHY_MEMORY_MCP1_PYTHON") or str(ROOT / ".venv-mcp1" / "bin" / "python")
if not Path(MCP1).exists() and os.environ.get("CI") != "true":
    pytest.skip("no mcp 1.x client venv (tools/_venv.sh makes it)", allow_module_level=True)
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # the app's rule for an alias and a tool name


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A daemon, and ``mcp --http`` on it; (its URL, its token file)."""
    tmp = tmp_path_factory.mktemp("mcp-app")
    with DaemonProcess(tmp) as daemon:
        port, token = _free_port(), tmp / "token"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "mcp", "--http", "--port", str(port),
                                 "--config", str(daemon.config_path), "--token-file", str(token)],
                                env=env, stderr=subprocess.PIPE, text=True)
        try:
            import time

            deadline = time.monotonic() + 60
            while not token.exists() or not _listening(port):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port}/mcp", token
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def app_calls(served: tuple[str, Path], calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    url, token = served
    done = subprocess.run([MCP1, str(ROOT / "tools" / "_app_mcp_client.py"), url, str(token), "calls",
                           json.dumps(calls)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_the_apps_client_flow_lists_and_calls_every_tool(served: tuple[str, Path]) -> None:
    out = app_calls(served, [
        ("search_memories", {"query": "what does Lena like?"}),
        ("remember", {"content": "Lena likes sailing", "subjects": ["Lena"]}),
        ("store_memory", {"content": "The boat is at the marina today", "memory_type": "context"}),
        ("search_memories", {"query": "what does Lena like?"}),
        ("recall", {"query": "what does she like?", "about": "Lena"}),
        ("memory_context", {"message": "Shall we go sailing with Lena?"}),
        ("forget_memory", {"memory_id": "not-an-id"}),
        ("search_memories", {"query": "x", "owner": "bob"}),
    ])
    names = [t["name"] for t in out["tools"]]
    assert names == ["search_memories", "store_memory", "forget_memory", "remember", "recall", "memory_context",
                     "forget_person", "pause_remembering", "resume_remembering"]
    assert all(NAME.match(f"reachy_memory__{n}") for n in names)  # `mcp-servers add reachy_memory ...`
    empty, remembered, stored, found, recalled, context, forgot, refused = out["results"]
    for res in out["results"][:-1]:
        assert not res["is_error"] and res["text"] and res["structured"] is not None, res
    assert empty["text"].startswith("Nothing relevant is remembered") and empty["structured"] == {"result": []}
    assert remembered["structured"]["count"] == 1
    assert found["structured"]["result"][0]["content"] == "Lena likes sailing" and "Lena likes sailing" in found["text"]
    assert recalled["structured"]["result"][0]["about"] == ["Lena"]
    assert "Lena likes sailing" in context["text"] and stored["structured"]["type"] == "context"
    assert forgot["structured"] == {"success": False, "id": "not-an-id"}
    assert refused["is_error"] and "unknown argument 'owner'" in refused["text"]


def test_a_wrong_token_is_refused(served: tuple[str, Path], tmp_path: Path) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("x" * 43)
    done = subprocess.run([MCP1, str(ROOT / "tools" / "_app_mcp_client.py"), served[0], str(wrong), "calls", "[]"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "401" in done.stderr
