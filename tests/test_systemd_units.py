"""The systemd units verify cleanly and keep an exposure of 2.5 or lower."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from reachy_memory.config import load_config
from reachy_memory.daemon import server

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_verify_and_are_hardened() -> None:
    done = subprocess.run(["bash", str(ROOT / "tools" / "check_units.sh")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # every service rated (exposure 2.5 or lower, else check_units.sh failed): the MCP endpoint's
    # loopback TCP rates 1.5 ("OK"), the others 0.7 ("SAFE")
    assert done.stdout.count("Overall exposure level") == len(list((ROOT / "systemd").glob("*.service"))) == 3


def test_unit_declares_notify_watchdog_and_restart() -> None:
    unit = (ROOT / "systemd" / "reachy-memory.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "StateDirectory=", "RuntimeDirectory=",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RestrictAddressFamilies=AF_UNIX", "MemoryMax="):
        assert line in unit, line
    timer = (ROOT / "systemd" / "reachy-memory-backup.timer").read_text()
    assert "OnCalendar=daily" in timer and "Persistent=true" in timer


def test_stop_timeout_exceeds_the_daemons_shutdown_budget() -> None:
    """systemd SIGKILLs a daemon still stopping after TimeoutStopSec (mid-compaction on
    close): the unit must allow the daemon's whole stop, server.STOP_BUDGET_SECONDS, which
    must count the drain of the config the unit runs (config/default.yaml, installed)."""
    unit = (ROOT / "systemd" / "reachy-memory.service").read_text()
    [timeout] = re.findall(r"^TimeoutStopSec=(\d+)s?$", unit, re.MULTILINE)
    drain = load_config(ROOT / "config" / "default.yaml").server.drain_seconds
    assert drain + server.STOP_WORKERS_SECONDS + server.STOP_CLOSE_SECONDS <= server.STOP_BUDGET_SECONDS
    assert int(timeout) > server.STOP_BUDGET_SECONDS


def test_mcp_unit_serves_loopback_beside_the_daemon_with_a_token_file() -> None:
    """The conversation app registers this endpoint (docs/ROBOT.md): loopback only, a token
    that survives restarts (the app's environment holds it), the daemon's socket."""
    unit = (ROOT / "systemd" / "reachy-memory-mcp.service").read_text()
    [start] = re.findall(r"^ExecStart=(.*)$", unit, re.MULTILINE)
    assert start.split()[1:5] == ["mcp", "--http", "--port", "8766"]
    assert "--token-file /var/lib/reachy-memory-mcp/token" in start and "StateDirectory=reachy-memory-mcp" in unit
    for line in ("After=reachy-memory.service", "Wants=reachy-memory.service", "IPAddressDeny=any",
                 "IPAddressAllow=localhost", "RestrictAddressFamilies=AF_UNIX AF_INET", "User=reachy",
                 "Environment=REACHY_MEMORY_ENDPOINT=ipc:///run/reachy-memory/memory.sock", "Restart=on-failure"):
        assert line in unit, line
