"""Issue 9's control-loop benchmark: a 50 Hz Reachy Mini head loop on the simulated
robot, with and without memory traffic through ``MemoryBridge``, with the memory
daemon idle and under search+store load.

Starts the reachy-mini daemon in mockup simulation and a reachy-memory daemon with
the robot settings (``config/robot.yaml``; both on loopback), preloads memories,
connects ``ReachyMini`` and runs each scenario for ``--seconds``, ``--runs`` times
(interleaved, so drift on a shared machine hits all of them alike):

* ``plain``: the loop moves the head (``set_target``) every tick, no memory;
* ``bridge``: the same, and every tick it reads ``bridge.latest()``, records a
  turn every 10 ticks and starts a search every 25 (idle daemon otherwise);
* ``plain+load`` / ``bridge+load``: as above while another process runs 3
  searching threads and 1 storing thread against the memory daemon.

Tick delay is how late a tick starts after its 20 ms slot; a tick is missed when
it starts a whole period late.  Target (issue 9): ``bridge+load`` p99 within 1 ms
of ``plain+load``, 0 missed ticks.  Needs the robot extra.

    .venv/bin/python -m tools.bench_control_loop --seconds 10 --runs 3
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from reachy_mini import ReachyMini
from reachy_mini.utils import create_head_pose

from reachy_memory import MemoryClient
from reachy_memory.integrations.reachy_mini import MemoryBridge
from tests.daemon_util import ROOT, DaemonProcess
from tools._bench import memory_mb, percentiles
from tools._reachy_sim import SimDaemon

TICK = 0.02
MODES = ("plain", "bridge", "plain+load", "bridge+load")


def loop(mini: Any, bridge: MemoryBridge | None, seconds: float) -> list[float]:
    """Run the 50 Hz loop; returns each tick's start delay in seconds."""
    delays: list[float] = []
    start = time.monotonic()
    ticks = 0
    while (now := time.monotonic()) - start < seconds:
        slot = start + ticks * TICK
        if now < slot:
            time.sleep(slot - now)
        delays.append(max(time.monotonic() - slot, 0.0))
        mini.set_target(head=create_head_pose(yaw=10 * math.sin(ticks / 10), degrees=True))
        if bridge is not None:
            bridge.latest()
            if ticks % 10 == 0:
                bridge.record_turn("user", f"bench turn {ticks} about the garden and the cat")
            if ticks % 25 == 0:
                bridge.search("what did we say about the garden", limit=3)
        ticks += 1
    return delays


def load(endpoint: str, config_path: str, stop: Any) -> None:
    """3 searching threads and 1 storing thread until ``stop`` is set (own process)."""
    from reachy_memory import load_config

    config = load_config(Path(config_path))

    def searcher(i: int) -> None:
        with MemoryClient(endpoint, config=config, timeout=30) as c:
            while not stop.is_set():
                c.search(f"what do I know about topic {i} and music", limit=10)

    def storer() -> None:
        with MemoryClient(endpoint, config=config, timeout=30) as c:
            n = 0
            while not stop.is_set():
                c.store(f"load note {n}: the user mentioned topic {n % 97} again", "conversation")
                n += 1

    threads = [threading.Thread(target=searcher, args=(i,)) for i in range(3)] + [threading.Thread(target=storer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def scenario(mini: Any, memory: DaemonProcess, mode: str, seconds: float) -> list[float]:
    stop = multiprocessing.Event()
    loader = None
    if mode.endswith("+load"):
        loader = multiprocessing.Process(target=load, args=(memory.endpoint, str(memory.config_path), stop))
        loader.start()
        time.sleep(1.0)  # let the load reach steady state
    try:
        if mode.startswith("plain"):
            return loop(mini, None, seconds)
        with MemoryBridge(memory.endpoint, config=memory.config, refresh_interval=0.1) as bridge:
            return loop(mini, bridge, seconds)
    finally:
        stop.set()
        if loader is not None:
            loader.join(timeout=60)


def preload(memory: DaemonProcess, count: int) -> None:
    with memory.client(timeout=300) as c:
        for start in range(0, count, 500):
            c.store_batch(
                [
                    {"content": f"preloaded memory {i}: a note about topic {i % 97} and the day", "memory_type": "fact"}
                    for i in range(start, min(count, start + 500))
                ]
            )


def summary(name: str, per_run: list[list[float]]) -> str:
    stats = [percentiles(d) for d in per_run]
    missed = sum(int(sum(x >= TICK for x in d)) for d in per_run)
    ticks = sum(len(d) for d in per_run)
    med = {k: float(np.median([s[k] for s in stats])) for k in ("p50", "p99", "max")}
    return (
        f"  {name:<12} ticks {ticks:>6}  missed {missed:>3}  delay p50 {med['p50']:.2f} ms  "
        f"p99 {med['p99']:.2f} ms (worst run {max(s['p99'] for s in stats):.2f})  max {med['max']:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--memories", type=int, default=3000, help="preloaded before the runs")
    args = parser.parse_args()
    robot = yaml.safe_load((ROOT / "config" / "robot.yaml").read_text())
    results: dict[str, list[list[float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp, SimDaemon(Path(tmp) / "sim.log") as sim:
        (Path(tmp) / "memory").mkdir()
        memory = DaemonProcess(Path(tmp) / "memory", **robot).start()
        try:
            preload(memory, args.memories)
            with ReachyMini(
                host="127.0.0.1", port=sim.port, media_backend="no_media", connection_mode="localhost_only"
            ) as mini:
                for r in range(args.runs):
                    for mode in MODES:
                        results[mode].append(scenario(mini, memory, mode, args.seconds))
                        print(f"run {r + 1}" + summary(mode, results[mode][-1:]), flush=True)
            assert memory.proc is not None
            rss, peak = memory_mb(memory.proc.pid)
        finally:
            memory.stop()
    print(
        f"\n50 Hz for {args.seconds:g} s x {args.runs} runs, {args.memories} memories preloaded, "
        "robot.yaml settings (median of runs):"
    )
    for mode in MODES:
        print(summary(mode, results[mode]))
    gap = np.median([percentiles(d)["p99"] for d in results["bridge+load"]]) - np.median(
        [percentiles(d)["p99"] for d in results["plain+load"]]
    )
    print(f"\nmemory daemon RSS at the end {rss:.0f} MB, peak {peak:.0f} MB (the unit's MemoryMax is 512M)")
    print(f"bridge+load p99 minus plain+load p99: {gap:+.2f} ms (target: within 1 ms, 0 missed)")


if __name__ == "__main__":
    main()
