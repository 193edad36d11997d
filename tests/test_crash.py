"""kill -9 at random moments never loses an acknowledged write."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reachy_memory import Config, MemoryStore

WRITER = Path(__file__).with_name("_crash_writer.py")
ROOT = Path(__file__).resolve().parents[1]


def _run_and_kill(data: Path, start: int, rng: random.Random, policy: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, str(WRITER), str(data), str(start), policy], stdout=subprocess.PIPE,
                             text=True, env=env)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "READY"
    acked: list[str] = []
    deadline = time.monotonic() + rng.uniform(0.05, 0.6)
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        acked.append(line.strip())
    child.send_signal(signal.SIGKILL)
    # Whatever was printed before the kill was acknowledged too.
    acked.extend(line.strip() for line in child.stdout if line.strip())
    child.wait(timeout=10)
    return acked


@pytest.mark.parametrize(
    "policy",
    [
        "always",  # fsync before every acknowledgement
        "batch",  # group commit: writes reach the OS at once, so a process crash loses nothing either
    ],
)
def test_sigkill_loses_no_acknowledged_write(tmp_path: Path, policy: str) -> None:
    rng = random.Random(1234)
    data = tmp_path / "data"
    acked: list[str] = []
    for round_no in range(6):
        acked += _run_and_kill(data, round_no * 100_000, rng, policy)
        with MemoryStore(config=Config().replace("memory", path=str(data)), embedder=None) as store:
            stored = [i for i in acked if not i.startswith("FORGOT ")]
            forgotten = [i.removeprefix("FORGOT ") for i in acked if i.startswith("FORGOT ")]
            missing = [i for i in stored if store.get(i) is None]
            assert not missing, f"round {round_no}: {len(missing)} acknowledged ids lost"
            back = [i for i in forgotten if store.get(i) is not None]
            assert not back, f"round {round_no}: {len(back)} acknowledged forgets undone"
    assert len(acked) > 100 and any(i.startswith("FORGOT ") for i in acked)  # writes and forgets ran
