"""The control-loop benchmark: a 50 Hz Reachy Mini head loop on the simulated robot, run
after run with and without memory traffic through ``MemoryBridge``, with the memory daemon
idle and under search+store load.

Starts the reachy-mini daemon in mockup simulation and a reachy-memory daemon with the
robot settings (``config/robot.yaml``; both on loopback), preloads memories, connects
``ReachyMini`` and, ``--runs`` times, runs each pair for ``--seconds``:

* ``plain``: the loop moves the head (``set_target``) every tick, no memory;
* ``bridge``: the same, and every tick it reads ``bridge.latest()``, records a turn every
  10 ticks and starts a search every 25 (polling each search's ``done()`` every tick);

first with the memory daemon otherwise idle, then under load (``--load-procs`` other
processes, each running 3 searching threads and 1 storing thread against it). Within a
pair the order alternates from run to run, so drift on a shared machine hits both alike.

Tick delay is how late a tick starts after its 20 ms slot; a tick is missed when it starts
a whole period late. Each run's line gives both sides' p99 and missed ticks, the gap, and
OK when the bridge's p99 is within 1 ms of the same load without memory calls and no tick
was missed. Also measured: the bridge calls' own time inside a tick (p99), how long a
search takes to reach the loop (its future done, seen at the next tick), and the CPU the
loop's process uses (every thread of it, not its children: the bridge's helper is one)
per second of loop, which does not depend on what else runs on the machine, and its
garbage collections (how many were full, the longest of any generation).

``--bridge thread`` runs the bridge's worker on a thread of the control process (the old
way) instead of its helper process. ``--daemon-cpu-max 'QUOTA PERIOD'`` (microseconds, as
cgroup v2's ``cpu.max``) puts the memory daemon in a CPU-limited cgroup (v2 where the cpu
controller is there, else v1's ``cpu.cfs_quota_us``; root needed), e.g. ``'1000 10000'``
(a tenth of a CPU, in 1 ms slices) makes an embedding take ~10x longer, as on the robot's
CM4; the embedding time it gives is printed.

Needs the robot and test extras: ``bash tools/bench.sh control_loop --seconds 10 --runs 3``
installs them (as ``tools/test.sh`` does) and runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

try:
    from reachy_mini import ReachyMini
    from reachy_mini.utils import create_head_pose

    from tests.daemon_util import ROOT, DaemonProcess
except ImportError as exc:  # pragma: no cover - a setup message, not a test
    raise SystemExit(f"{exc}: the robot and test extras are needed; "
                     "run it as `bash tools/bench.sh control_loop`") from None

from reachy_memory import MemoryClient
from reachy_memory.integrations.reachy_mini import MemoryBridge
from tools._bench import memory_mb, percentiles
from tools._reachy_sim import SimDaemon

TICK = 0.02
GAP_TARGET_MS = 1.0


class GcPauses:
    """The loop process's garbage collections while installed in ``gc.callbacks``: each
    one's generation and duration (seconds). A full collection walks every object of the
    process (ReachyMini's included), a pause the tick after it inherits."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._began))


def loop(mini: Any, bridge: MemoryBridge | None, seconds: float) -> dict[str, list[float]]:
    """Run the 50 Hz loop; each tick's start delay, the bridge calls' time in each tick,
    each search's time to reach the loop (seconds) and the loop process's collections."""
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        run = _loop(mini, bridge, seconds)
    finally:
        gc.callbacks.remove(pauses)
    run["gc_full"] = [d for gen, d in pauses.pauses if gen == 2]
    run["gc_all"] = [d for _, d in pauses.pauses]
    return run


def _loop(mini: Any, bridge: MemoryBridge | None, seconds: float) -> dict[str, list[float]]:
    delays: list[float] = []
    calls: list[float] = []
    searches: list[float] = []
    waiting: list[tuple[float, Any]] = []
    cpu = os.times()
    start = time.monotonic()
    ticks = 0
    while (now := time.monotonic()) - start < seconds:
        slot = start + ticks * TICK
        if now < slot:
            time.sleep(slot - now)
        delays.append(max(time.monotonic() - slot, 0.0))
        mini.set_target(head=create_head_pose(yaw=10 * math.sin(ticks / 10), degrees=True))
        if bridge is not None:
            began = time.perf_counter()
            bridge.latest()
            if ticks % 10 == 0:
                bridge.record_turn("user", f"bench turn {ticks} about the garden and the cat")
            if ticks % 25 == 0:
                waiting.append((time.monotonic(), bridge.search("what did we say about the garden", limit=3)))
            still = []
            for asked, future in waiting:
                if future.done():
                    searches.append(time.monotonic() - asked)
                else:
                    still.append((asked, future))
            waiting = still
            calls.append(time.perf_counter() - began)
        ticks += 1
    used = os.times()
    # the control process's CPU (every thread of it, not its children) per second of loop
    busy = (used.user - cpu.user + used.system - cpu.system) / (time.monotonic() - start)
    return {"delays": delays, "calls": calls, "searches": searches, "cpu": [busy]}


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
                c.store(f"load note {n} {os.getpid()}: the user mentioned topic {n % 97} again", "conversation")
                n += 1

    threads = [threading.Thread(target=searcher, args=(i,)) for i in range(3)] + [threading.Thread(target=storer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def loaded(memory: DaemonProcess, processes: int) -> Iterator[None]:
    """``processes`` load processes against the memory daemon for the block (none: idle)."""
    stop = multiprocessing.Event()
    loaders = [multiprocessing.Process(target=load, args=(memory.endpoint, str(memory.config_path), stop))
               for _ in range(processes)]
    for p in loaders:
        p.start()
    if loaders:
        time.sleep(1.0)  # let the load reach steady state
    try:
        yield
    finally:
        stop.set()
        for p in loaders:
            p.join(timeout=60)


def scenario(mini: Any, memory: DaemonProcess, with_bridge: bool, seconds: float, helper: bool) -> dict[str, Any]:
    if not with_bridge:
        return loop(mini, None, seconds)
    bridge = MemoryBridge(memory.endpoint, config=memory.config, refresh_interval=0.1, helper=helper).start()
    try:
        deadline = time.monotonic() + 60  # the worker is up (the helper imported, connected) before the loop
        while not bridge.latest().fetched_at and time.monotonic() < deadline:
            time.sleep(0.05)
        return loop(mini, bridge, seconds)
    finally:
        bridge.close()


def settle(pid: int, busy: float = 0.05, longest: float = 30.0) -> None:
    """Wait (up to ``longest`` seconds) until process ``pid`` uses less than ``busy`` of a core:
    after a loaded run the daemon keeps working for a while (the backlog, then idle upkeep:
    graph cache saves, heap trims), which would weigh on whichever scenario comes next."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    deadline = time.monotonic() + longest
    while time.monotonic() < deadline:
        before = cpu()
        time.sleep(0.5)
        if cpu() - before < busy * 0.5:
            return


def preload(memory: DaemonProcess, count: int) -> None:
    with memory.client(timeout=300) as c:
        for start in range(0, count, 500):
            c.store_batch(
                [
                    {"content": f"preloaded memory {i}: a note about topic {i % 97} and the day", "memory_type": "fact"}
                    for i in range(start, min(count, start + 500))
                ]
            )


def embed_ms(memory: DaemonProcess, n: int = 15) -> tuple[float, float]:
    """Median store and search round trips (ms) of new texts on the idle daemon: a store
    embeds one text (plus a journal write), a search one query."""
    stores, searches = [], []
    with memory.client(timeout=60) as c:
        for i in range(n):
            began = time.perf_counter()
            c.store(f"probe {i} {time.time()}: the weather in Brest on day {i}", "conversation")
            stores.append(time.perf_counter() - began)
            began = time.perf_counter()
            c.search(f"what was the weather on day {i} {time.time()}", limit=3)
            searches.append(time.perf_counter() - began)
    return 1000 * float(np.median(stores)), 1000 * float(np.median(searches))


@contextlib.contextmanager
def cpu_limited(pid: int, quota: str | None) -> Iterator[str]:
    """``pid`` (every thread of it) in a new cgroup with the CPU quota ``'QUOTA PERIOD'`` (µs)
    for the block; yields what was set up (nothing without a quota)."""
    if not quota:
        yield "no CPU quota"
        return
    quota_us, period_us = (int(x) for x in quota.split())
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        with contextlib.suppress(OSError):
            (v2 / "cgroup.subtree_control").write_text("+cpu")
        group, parent = v2 / f"reachy-bench-{pid}", v2
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota_us} {period_us}")
    else:
        parent = Path("/sys/fs/cgroup/cpu")
        group = parent / f"reachy-bench-{pid}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
    (group / "cgroup.procs").write_text(str(pid))
    try:
        yield f"cgroup {group}: {quota_us} µs of CPU per {period_us} µs"
    finally:
        with contextlib.suppress(OSError):
            (parent / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            group.rmdir()


def stats(run: dict[str, list[float]]) -> dict[str, float]:
    d = percentiles(run["delays"])
    out = {"p50": d["p50"], "p99": d["p99"], "max": d["max"], "ticks": len(run["delays"]),
           "missed": int(sum(x >= TICK for x in run["delays"])), "cpu_ms": 1000 * run["cpu"][0],
           "gc_full": len(run["gc_full"]), "gc_ms": 1000 * max(run["gc_all"], default=0.0)}
    if run["calls"]:
        out["calls_p99"] = percentiles(run["calls"])["p99"]
    if run["searches"]:
        s = percentiles(run["searches"])
        out["search_p50"], out["search_p99"] = s["p50"], s["p99"]
    return out


def report(r: int, load_name: str, plain: dict[str, float], bridge: dict[str, float]) -> bool:
    gap = bridge["p99"] - plain["p99"]
    ok = gap <= GAP_TARGET_MS and bridge["missed"] == 0 and plain["missed"] == 0
    extra = ""
    if "calls_p99" in bridge:
        extra = f"  calls in tick p99 {bridge['calls_p99']:.3f} ms"
    if "search_p50" in bridge:
        extra += f"  search reaches loop p50 {bridge['search_p50']:.0f} / p99 {bridge['search_p99']:.0f} ms"
    extra += f"  loop process CPU {plain['cpu_ms']:.0f} -> {bridge['cpu_ms']:.0f} ms/s"
    extra += (f"  full gc {plain['gc_full']} / {bridge['gc_full']}, longest gc {plain['gc_ms']:.1f} / "
              f"{bridge['gc_ms']:.1f} ms")
    print(f"run {r + 1} {load_name:<5} plain p99 {plain['p99']:5.2f} ms missed {plain['missed']:>2} | "
          f"bridge p99 {bridge['p99']:5.2f} ms missed {bridge['missed']:>2} | gap {gap:+.2f} ms "
          f"{'OK' if ok else 'OVER'}{extra}", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--memories", type=int, default=3000, help="preloaded before the runs")
    parser.add_argument("--load-procs", type=int, default=2, help="load processes in the loaded runs")
    parser.add_argument("--bridge", choices=("process", "thread"), default="process",
                        help="the bridge's worker: a helper process (default) or a thread of the loop's process")
    parser.add_argument("--no-idle", action="store_true", help="loaded runs only")
    parser.add_argument("--nice", type=int, default=0, metavar="N",
                        help="raise this benchmark (the loop, the robot's daemon, the load) by N nice levels, the "
                             "memory daemon by N-5 (its unit's Nice=5): other users of a shared machine weigh "
                             "less on both sides alike (root)")
    parser.add_argument("--daemon-cpu-max", metavar="'QUOTA PERIOD'",
                        help="CPU quota of the memory daemon in microseconds, e.g. '1000 10000' (root)")
    args = parser.parse_args()
    if args.nice:
        os.nice(-args.nice)
    robot = yaml.safe_load((ROOT / "config" / "robot.yaml").read_text())
    loads = ([] if args.no_idle else [("idle", 0)]) + [("load", args.load_procs)]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    verdicts: list[bool] = []
    with tempfile.TemporaryDirectory() as tmp, SimDaemon(Path(tmp) / "sim.log") as sim:
        (Path(tmp) / "memory").mkdir()
        memory = DaemonProcess(Path(tmp) / "memory", **robot).start()
        assert memory.proc is not None
        if args.nice:  # as on the robot: the memory daemon 5 below the apps (systemd/reachy-memory.service)
            for task in Path(f"/proc/{memory.proc.pid}/task").iterdir():  # Linux: a nice per thread
                os.setpriority(os.PRIO_PROCESS, int(task.name), os.getpriority(os.PRIO_PROCESS, 0) + 5)
        try:
            preload(memory, args.memories)
            with cpu_limited(memory.proc.pid, args.daemon_cpu_max) as limit, ReachyMini(
                host="127.0.0.1", port=sim.port, media_backend="no_media", connection_mode="localhost_only"
            ) as mini:
                store_ms, search_ms = embed_ms(memory)
                print(f"memory daemon: {limit}; one store {store_ms:.1f} ms, one search {search_ms:.1f} ms "
                      "(median round trips, idle)", flush=True)
                for r in range(args.runs):
                    for name, procs in loads:
                        pair = {}
                        for with_bridge in (False, True) if r % 2 == 0 else (True, False):
                            settle(memory.proc.pid)
                            with loaded(memory, procs):
                                pair[with_bridge] = stats(scenario(mini, memory, with_bridge, args.seconds,
                                                                   args.bridge == "process"))
                        results.setdefault((name, "plain"), []).append(pair[False])
                        results.setdefault((name, "bridge"), []).append(pair[True])
                        verdicts.append(report(r, name, pair[False], pair[True]))
            rss, peak = memory_mb(memory.proc.pid)
        finally:
            memory.stop()
    print(f"\n50 Hz for {args.seconds:g} s x {args.runs} runs, {args.memories} memories preloaded, robot.yaml, "
          f"bridge worker: {args.bridge}, load: {args.load_procs} process(es) x (3 searching + 1 storing), "
          f"nice -{args.nice}, median of runs:")
    for (name, mode), runs in results.items():
        med = {k: float(np.median([s[k] for s in runs])) for k in ("p50", "p99", "max", "cpu_ms")}
        print(f"  {name:<5} {mode:<7} ticks {sum(int(s['ticks']) for s in runs):>6}  missed "
              f"{sum(int(s['missed']) for s in runs):>3}  delay p50 {med['p50']:.2f}  p99 {med['p99']:.2f} "
              f"(worst run {max(s['p99'] for s in runs):.2f})  max {med['max']:.2f} ms  "
              f"loop process CPU {med['cpu_ms']:.0f} ms/s")
    print(f"\nmemory daemon RSS at the end {rss:.0f} MB, peak {peak:.0f} MB (the unit's MemoryMax is 512M)")
    print(f"every run within {GAP_TARGET_MS:g} ms p99 and 0 missed: {'yes' if all(verdicts) else 'NO'} "
          f"({sum(verdicts)}/{len(verdicts)} runs)")


if __name__ == "__main__":
    main()
