"""The systemd units verify cleanly and keep an exposure of 2.5 or lower."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_verify_and_are_hardened() -> None:
    done = subprocess.run(["bash", str(ROOT / "tools" / "check_units.sh")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SAFE") == 2


def test_unit_declares_notify_watchdog_and_restart() -> None:
    unit = (ROOT / "systemd" / "reachy-memory.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "StateDirectory=", "RuntimeDirectory=",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RestrictAddressFamilies=AF_UNIX", "MemoryMax="):
        assert line in unit, line
    timer = (ROOT / "systemd" / "reachy-memory-backup.timer").read_text()
    assert "OnCalendar=daily" in timer and "Persistent=true" in timer
