"""SIGKILL storm through the daemon: acknowledged writes vs what is present after restart.

Each trial starts ``reachy-memory serve`` on a private ipc socket over the same
data directory, lets two clients store and forget as fast as they can (small
compaction threshold, so kills also land inside compactions), SIGKILLs the
daemon at a random moment, restarts it and checks that every acknowledged store
is present and every acknowledged forget is gone.  Prints progress per trial
and a summary.  Lexical-only by default (the model changes nothing on the
durability path and would slow each start); ``--model`` uses it.

    .venv/bin/python tools/bench_kill_storm.py --trials 30
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

from reachy_memory import MemoryClient, ReachyMemoryError, load_config


class Daemon:
    def __init__(self, tmp: Path, model: bool) -> None:
        self.endpoint = f"ipc://{tmp}/run/memory.sock"
        settings = {"memory": {"path": str(tmp / "data"), "compact_journal_bytes": 200_000},
                    "embedding": {"enabled": model}, "server": {"endpoint": self.endpoint, "log_level": "WARNING"}}
        self.config_path = tmp / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(settings))
        self.config = load_config(self.config_path)
        self.log = open(tmp / "daemon.log", "a")  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "serve", "--config",
                                      str(self.config_path)], stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 60
        with self.client(0.5) as c:
            while time.monotonic() < deadline:
                try:
                    c.ping()
                    return
                except ReachyMemoryError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"daemon exited {self.proc.returncode}") from None
                    time.sleep(0.05)
        raise RuntimeError("daemon did not start")

    def client(self, timeout: float = 5.0) -> MemoryClient:
        return MemoryClient(self.endpoint, config=self.config, timeout=timeout, retries=0)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def writer(daemon: Daemon, stop: threading.Event, stored: set[str], forgotten: set[str], lock: threading.Lock) -> None:
    """Store (client-chosen ids) and forget until the daemon dies; record only acknowledged ops."""
    mine: list[str] = []
    with daemon.client(2.0) as c:
        while not stop.is_set():
            victim = mine.pop(random.randrange(len(mine))) if mine and random.random() < 0.15 else None
            try:
                if victim is not None:
                    c.forget(victim)
                    with lock:
                        forgotten.add(victim)
                        stored.discard(victim)
                else:
                    memory_id = uuid.uuid4().hex
                    c.store(f"memory {memory_id[:6]} " + "x" * random.randrange(10, 400), id=memory_id)
                    with lock:
                        stored.add(memory_id)
                    mine.append(memory_id)
            except ReachyMemoryError:
                if victim is not None:  # a forget cut off by the kill: either outcome is allowed
                    with lock:
                        stored.discard(victim)
                return  # the daemon was killed: this op was never acknowledged


def trial(daemon: Daemon, stored: set[str], forgotten: set[str]) -> tuple[int, int, int]:
    """One kill; returns (acknowledged stores checked, lost stores, resurrected forgets)."""
    daemon.start()
    stop, lock = threading.Event(), threading.Lock()
    threads = [threading.Thread(target=writer, args=(daemon, stop, stored, forgotten, lock)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(random.uniform(0.3, 1.5))
    daemon.kill()
    stop.set()
    for t in threads:
        t.join(timeout=10)
    daemon.start()
    with daemon.client(10.0) as c:
        lost = sum(c.get(i) is None for i in stored)
        back = sum(c.get(i) is not None for i in forgotten)
    daemon.kill()
    return len(stored), lost, back


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--model", action="store_true", help="embed with the real model")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    random.seed(args.seed)
    stored: set[str] = set()
    forgotten: set[str] = set()
    lost_total = back_total = 0
    with tempfile.TemporaryDirectory(prefix="kill-storm-") as tmp:
        daemon = Daemon(Path(tmp), args.model)
        for n in range(1, args.trials + 1):
            acked, lost, back = trial(daemon, stored, forgotten)
            lost_total, back_total = lost_total + lost, back_total + back
            print(f"trial {n:>3}/{args.trials}: acknowledged stores alive {acked:>6}, forgets {len(forgotten):>5}, "
                  f"lost {lost}, forgotten-but-present {back}", flush=True)
    print(f"\n{args.trials} SIGKILLs: {len(stored)} acknowledged stores present of {len(stored)} expected "
          f"(lost {lost_total}); {len(forgotten)} acknowledged forgets (present again: {back_total})")
    return 0 if lost_total == back_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
