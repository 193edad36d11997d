"""Searches beside writes on a slow disk (an SD card's fsync), simulated. Loopback ipc only.

    python tools/bench_slow_disk.py                     # fsync +0 and +10 ms, 2 rounds
    python tools/bench_slow_disk.py --fsync-ms 0 25 --rounds 3
    python tools/bench_slow_disk.py --against ../other-checkout   # the same, that code's daemon in turn

A write's fsync runs on the daemon's sync thread (before the sync thread, on its engine
thread, where a search queued behind a write waited for it: ``--against`` an older
checkout shows that).  This VM's fdatasync takes ~0.1 ms; an SD card's takes
milliseconds to tens of them.  The daemon here is the real one, started with
``journal._os.fdatasync`` (the journal's syscall seam) wrapped to sleep the given
milliseconds first (the sleep, like the real call, releases the GIL: only the thread
calling it waits).  For each delay, alternated over rounds, it prints search latency
through the client (one search every 70 ms) alone, while another process stores a
turn every 200 ms (a lively conversation), and while it stores flat out; then the
store latency itself.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from reachy_memory import MemoryClient, load_config  # noqa: E402
from tools._bench import percentiles, questions, row  # noqa: E402
from tools.bench_daemon import _wait_ping, prepare, stop, wait_for_graphs  # noqa: E402

_SERVE = """
import os, sys, time
import reachy_memory.storage.journal as journal
delay, real = float(sys.argv[1]) / 1000, os.fdatasync
def slow(fd):
    time.sleep(delay)
    real(fd)
journal._os.fdatasync = slow
from reachy_memory.cli import main
sys.exit(main(["serve", "--config", sys.argv[2]]))
"""


def start(config_path: Path, fsync_ms: float, root: Path = ROOT) -> subprocess.Popen[bytes]:
    """The daemon of the checkout at ``root``, every journal fdatasync delayed by ``fsync_ms``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    # cwd: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    return subprocess.Popen([sys.executable, "-c", _SERVE, str(fsync_ms), str(config_path)], env=env, cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _storer(config_path: str, pause: float, stop_at: float) -> None:
    """Store a conversation turn every ``pause`` seconds (0: flat out) until ``stop_at``."""
    n = 0
    with MemoryClient(config=load_config(config_path), timeout=30) as c:
        while time.time() < stop_at:
            c.store(f"a turn said while searching, number {n}", "conversation")
            n += 1
            time.sleep(pause)


def searches(c: MemoryClient, count: int, offset: int) -> list[float]:
    """Seconds of ``count`` distinct searches, one every 70 ms."""
    qs, samples = questions(), []
    for i in range(count):
        time.sleep(0.07)
        t = time.perf_counter()
        c.search(f"{qs[(offset + i) % len(qs)]} {offset + i}")
        samples.append(time.perf_counter() - t)
    return samples


def searches_beside(config_path: Path, c: MemoryClient, pause: float, count: int, offset: int) -> list[float]:
    """:func:`searches` while another process stores a turn every ``pause`` seconds."""
    proc = mp.Process(target=_storer, args=(str(config_path), pause, time.time() + 3600), daemon=True)
    proc.start()
    try:
        time.sleep(1.0)  # the storer connected and writing
        return searches(c, count, offset)
    finally:
        proc.terminate()
        proc.join()


def stores(c: MemoryClient, count: int, offset: int) -> list[float]:
    samples = []
    for i in range(count):
        t = time.perf_counter()
        c.store(f"a turn to time, number {offset + i}", "conversation")
        samples.append(time.perf_counter() - t)
    return samples


CASES = ("search alone", "search, a store every 200 ms beside", "search, stores flat out beside", "store")


def one_round(config_path: Path, fsync_ms: float, count: int, offset: int,
              root: Path = ROOT) -> dict[str, list[float]]:
    proc = start(config_path, fsync_ms, root)
    try:
        with MemoryClient(config=load_config(config_path), timeout=60) as c:
            _wait_ping(c)
            wait_for_graphs(c)
            return dict(zip(CASES, (searches(c, count, offset),
                                    searches_beside(config_path, c, 0.2, count, offset + count),
                                    searches_beside(config_path, c, 0.0, count, offset + 2 * count),
                                    stores(c, count, offset)), strict=True))
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=10_000)
    parser.add_argument("--fsync-ms", type=float, nargs="+", default=[0.0, 10.0],
                        help="delays added to every journal fdatasync, alternated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--count", type=int, default=150, help="samples per case and round")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT", help="another checkout's daemon, in turn")
    args = parser.parse_args()
    systems = {"": ROOT} | ({f" [{args.against.name}]": args.against.resolve()} if args.against else {})
    samples: dict[tuple[str, float, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="rm-slow-disk-") as tmp:
        config_path = prepare(Path(tmp), args.memories)
        offset = 0
        for r in range(args.rounds):
            for label, root in systems.items():
                for ms in args.fsync_ms:
                    print(f"  round {r + 1}/{args.rounds}, fsync +{ms:g} ms{label}", file=sys.stderr, flush=True)
                    for case, got in one_round(config_path, ms, args.count, offset, root).items():
                        samples.setdefault((label, ms, case), []).extend(got)
                    offset += 3 * args.count
    for case in CASES:
        for label in systems:
            for ms in args.fsync_ms:
                print(row(f"{case}, fsync +{ms:g} ms{label}", percentiles(samples[label, ms, case])))
    print(f"({args.rounds} rounds alternated, {args.count} samples per case and round, "
          f"{args.memories} memories; the rounds' samples pooled)")


if __name__ == "__main__":
    main()
