"""What one MCP tool call costs the conversation app: a fresh connection per call (its way)
against one call on an open connection, over ``reachy-memory mcp --http`` on a real daemon.

The client is an mcp 1.x client in its own venv (``tools/_app_mcp_client.py``, run by
$REACHY_MEMORY_MCP1_PYTHON: ``tools/_venv.sh`` makes it), as the app's is. The daemon holds
``--memories`` facts (the real model); the call is ``search_memories``. Prints, over
``--runs`` runs of ``--calls`` calls each, the median of the per-run medians: an open-connection
call, a fresh-connection call (everything the app does: its HTTP client made, initialize,
the call, the closing), and the making of the app's HTTP client alone (``httpx.AsyncClient``
loads its CA bundle: the part no server can save).

    python -m tools.bench_mcp_http [--runs 5] [--calls 30] [--memories 200] [--server-path DIR]

``--server-path`` runs the server from another checkout (PYTHONPATH), to compare with a
version before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.daemon_util import DaemonProcess  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve(daemon: DaemonProcess, tmp: Path, server_path: Path) -> tuple[subprocess.Popen[str], str, Path]:
    port, token = _free_port(), tmp / "token"
    proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "mcp", "--http", "--port", str(port),
                             "--config", str(daemon.config_path), "--token-file", str(token)],
                            env={**os.environ, "PYTHONPATH": str(server_path)}, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if token.exists() and s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}/mcp", token
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the MCP server did not start")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--memories", type=int, default=200)
    parser.add_argument("--server-path", type=Path, default=ROOT)
    args = parser.parse_args()
    client = os.environ.get("REACHY_MEMORY_MCP1_PYTHON") or str(ROOT / ".venv-mcp1" / "bin" / "python")
    if not Path(client).exists():
        raise SystemExit(f"no mcp 1.x client at {client}: source tools/_venv.sh first")
    with tempfile.TemporaryDirectory() as tmp_dir, DaemonProcess(Path(tmp_dir)) as daemon:
        with daemon.client(timeout=120) as c:
            c.store_batch([{"content": f"Fact {i}: person {i % 17} likes hobby {i % 23} on day {i % 7}"}
                           for i in range(args.memories)])
        proc, url, token = _serve(daemon, Path(tmp_dir), args.server_path)
        try:
            call = json.dumps(["search_memories", {"query": "what does person 3 like?", "limit": 5}])
            done = subprocess.run([client, str(ROOT / "tools" / "_app_mcp_client.py"), url, str(token), "bench",
                                   str(args.runs), str(args.calls), call], capture_output=True, text=True,
                                  timeout=1800)
            if done.returncode != 0:
                raise SystemExit(done.stderr[-3000:])
            out = json.loads(done.stdout.splitlines()[-1])
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"server {args.server_path}; {args.runs} runs x {args.calls} calls; median of the per-run medians (ms)")
    print(f"open connection, one call      {med['open_ms']:7.2f}   runs: {out['open_ms']}")
    print(f"fresh connection + one call    {med['fresh_ms']:7.2f}   runs: {out['fresh_ms']}")
    print(f"  of which the client's httpx  {med['client_ms']:7.2f}   runs: {out['client_ms']}")
    print(f"fresh / open                   {med['fresh_ms'] / med['open_ms']:7.2f}x; without the client's own "
          f"making: {(med['fresh_ms'] - med['client_ms']) / med['open_ms']:.2f}x")


if __name__ == "__main__":
    main()
