"""The conversation app's MCP client flow, for tools/bench_mcp_http.py and tests/test_mcp_app_client.py.

Runs under an mcp 1.x client (the app requires ``mcp>=1.27.1``; its lock file has 1.28.1):
``tools/_venv.sh`` makes that venv beside the project's (whose mcp is 2.x). What the app's
``RemoteMcpToolClient`` does for every tool call (its ``mcp_client.py``, release 1.0.0 and the
generic MCP servers after it), in our words: a new ``httpx.AsyncClient`` with the bearer
header, no redirects and one timeout; ``streamable_http_client`` on it; a ``ClientSession``;
``initialize``; ``call_tool`` with the tool's timeout as ``read_timeout_seconds``; then
everything closed. Its discovery (``mcp-servers add``) lists the tools the same way.

    python _app_mcp_client.py URL TOKEN_FILE calls '[["search_memories", {"query": "x"}], ...]'
        -> one JSON line: {"tools": [{name, input_schema}], "results": [{is_error, text, structured}]}
    python _app_mcp_client.py URL TOKEN_FILE bench RUNS CALLS '["search_memories", {...}]'
        -> one JSON line: {"open_ms": [...], "fresh_ms": [...], "client_ms": [...]} (one median per run)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

REQUEST_TIMEOUT_S, TOOL_TIMEOUT_S = 10.0, 30.0  # the app's defaults for a configured MCP server


@asynccontextmanager
async def session(url: str, token: str) -> AsyncIterator[ClientSession]:
    """One connection as the app opens it for each call."""
    http_client = httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, follow_redirects=False,
                                    timeout=max(REQUEST_TIMEOUT_S, TOOL_TIMEOUT_S))
    async with http_client, streamable_http_client(url, http_client=http_client) as (read, write, _), \
            ClientSession(read, write) as s:
        await s.initialize()
        yield s


async def call(s: ClientSession, name: str, args: dict[str, Any]) -> Any:
    return await s.call_tool(name, arguments=args, read_timeout_seconds=timedelta(seconds=TOOL_TIMEOUT_S))


def shape(result: Any) -> dict[str, Any]:
    """What the app keeps of a result: the error flag, the text blocks joined, the structured content."""
    texts = [b.text for b in result.content if getattr(b, "type", None) == "text"]
    return {"is_error": bool(result.isError), "text": "\n\n".join(texts) if texts else None,
            "structured": result.structuredContent}


async def calls(url: str, token: str, todo: list[list[Any]]) -> dict[str, Any]:
    async with session(url, token) as s:  # discovery, as `mcp-servers add` does
        listed = await s.list_tools()
    results = []
    for name, args in todo:
        async with session(url, token) as s:  # a fresh connection per call, as the app calls
            results.append(shape(await call(s, name, args)))
    return {"tools": [{"name": t.name, "input_schema": t.inputSchema} for t in listed.tools], "results": results}


async def bench(url: str, token: str, runs: int, n: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Per run, the median of ``n`` calls on one open connection, of ``n`` fresh-connection
    calls (the app's way, everything included), and of ``n`` makings of the client alone
    (no request: the part no server can save)."""
    out: dict[str, list[float]] = {"open_ms": [], "fresh_ms": [], "client_ms": []}
    async with session(url, token) as s:
        for _ in range(3):
            await call(s, name, args)  # warm: the server's first calls
    for _ in range(runs):
        async with session(url, token) as s:
            out["open_ms"].append(await _median(n, lambda s=s: call(s, name, args)))

        async def fresh() -> None:
            async with session(url, token) as s:
                await call(s, name, args)

        async def client_only() -> None:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, follow_redirects=False,
                                         timeout=TOOL_TIMEOUT_S):
                pass

        out["fresh_ms"].append(await _median(n, fresh))
        out["client_ms"].append(await _median(n, client_only))
    return out


async def _median(n: int, make: Any) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await make()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


def main() -> None:
    url, token = sys.argv[1], open(sys.argv[2]).read().strip()  # noqa: SIM115 (read once)
    if sys.argv[3] == "calls":
        out = asyncio.run(calls(url, token, json.loads(sys.argv[4])))
    else:
        name, args = json.loads(sys.argv[6])
        out = asyncio.run(bench(url, token, int(sys.argv[4]), int(sys.argv[5]), name, args))
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
