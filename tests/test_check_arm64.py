"""tools/check_arm64.sh (the robot's install and a named subset of the tests, in an emulated
arm64 Debian root) takes minutes and root: here, what can rot unseen without running it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "check_arm64.sh"


def named_tests() -> list[str]:
    body = re.search(r"^TESTS=\((.*?)^\)", SCRIPT.read_text(), re.MULTILINE | re.DOTALL)
    assert body is not None, "no TESTS=( ... ) in tools/check_arm64.sh"
    return re.findall(r'"([^"]+)"', body.group(1))


def test_the_scripts_parse() -> None:
    for script in (SCRIPT, ROOT / "tools" / "ci_arm64.sh", ROOT / "tools" / "bench.sh"):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr


def test_every_test_it_names_exists() -> None:
    # a renamed test would make the emulated run fail after its 10-minute install, or worse,
    # run nothing of what it promises
    names = named_tests()
    assert len(names) >= 10
    for name in names:
        path, _, function = name.partition("::")
        source = (ROOT / path).read_text()
        assert not function or re.search(rf"^(async )?def {re.escape(function)}\(", source, re.MULTILINE), name


def test_it_covers_what_the_robot_needs_checked() -> None:
    names = " ".join(named_tests())
    for part in ("test_fp32_parity", "test_int8_is_the_default", "test_vector_index.py", "test_journal.py",
                 "test_power_cut.py", "test_store.py", "test_server.py", "test_bridge.py", "test_mcp.py"):
        assert part in names, part
