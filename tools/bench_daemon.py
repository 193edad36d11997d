"""Daemon benchmark and load test (issue: the daemon). Loopback ipc only.

    python tools/bench_daemon.py                 # 10k memories, 3-minute load test
    python tools/bench_daemon.py --minutes 1     # shorter load test
    python tools/bench_daemon.py --minutes 0     # latency figures only
    python tools/bench_daemon.py --minutes 1 --busy-core   # latencies again with one core kept busy
    python tools/bench_daemon.py --minutes 0 --import-stall 3000  # searches during a bulk import's indexing
    python tools/bench_daemon.py --minutes 2 --heap-trim 0   # the load test without the daemon's heap trims
    python tools/bench_daemon.py --backfill 2000  # only: searches while 2000 memories stored model-less get vectors

Prints: cold start (launch to READY=1 and to the first answered search) with
10k memories, daemon RSS, end-to-end latencies through MemoryClient (search
and store include embedding with the configured model, int8 by default), cheap-op round trips alone
and while 4 other clients search flat out, then a load test of 8 clients with
mixed ops: errors, throughput and the RSS trend (resident and peak).  With
``--busy-core`` the end-to-end latencies are measured a second time while
another process keeps one of the cores busy (the robot's CPU is never idle).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from reachy_memory import MemoryClient, MemoryStore, load_config  # noqa: E402
from tools._bench import memory_mb, percentiles, questions, row, sentences  # noqa: E402


def prepare(tmp: Path, n: int, heap_trim: float | None = None) -> Path:
    config_path = tmp / "config.yaml"
    server: dict[str, object] = {"endpoint": f"ipc://{tmp}/run/memory.sock"}
    if heap_trim is not None:
        server["heap_trim_seconds"] = heap_trim
    settings = {"memory": {"path": str(tmp / "data")}, "server": server}
    config_path.write_text(yaml.safe_dump(settings))
    config = load_config(config_path)
    texts = sentences(n, seed=1)
    with MemoryStore(config=config) as store:
        for i in range(0, n, 500):
            store.store_batch([{"content": t, "memory_type": ("conversation", "fact")[j % 2],
                                "metadata": {"speaker": f"user{j % 4}"}} for j, t in enumerate(texts[i : i + 500])])
            print(f"\r  storing {min(i + 500, n)}/{n}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return config_path


def start(config_path: Path, notify: str | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if notify:
        env["NOTIFY_SOCKET"] = notify
    # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    return subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "serve", "--config", str(config_path)],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def cold_start(config_path: Path, tmp: Path) -> None:
    ready, first = [], []
    for i in range(3):
        path = str(tmp / f"notify{i}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(120)
        t0 = time.perf_counter()
        proc = start(config_path, path)
        while b"READY=1" not in sock.recv(4096):
            pass
        ready.append(time.perf_counter() - t0)
        with MemoryClient(config=load_config(config_path), timeout=30) as c:
            c.search("what did we talk about yesterday", where={"speaker": "user1"})
        first.append(time.perf_counter() - t0)
        stop(proc)
        sock.close()
    for name, values in (("launch to READY=1", ready), ("launch to first filtered search", first)):
        print(f"cold start, {name:<36} median {np.median(values):.3f} s  {[round(x, 3) for x in values]}")


def rss_of(pid: int) -> float:
    return memory_mb(pid)[0]


def _spin(stop_at: float) -> None:
    while time.time() < stop_at:  # pure Python: one core, no native thread pool
        pass


def busy_core(seconds: float) -> mp.Process:
    """A process keeping one core busy for ``seconds`` (started, not joined)."""
    proc = mp.Process(target=_spin, args=(time.time() + seconds,), daemon=True)
    proc.start()
    return proc


def wait_for_graphs(c: MemoryClient, limit: float = 120.0) -> None:
    """Wait until the daemon's idle time has put every vector into its graphs (a store
    written in-process leaves them pending), so the latencies are the steady state."""
    start, small = time.monotonic(), load_config().search.exact_below // 2  # no graph below: exact search
    while ((index := c.stats()["store"]["index"])["pending"] > 0 and index["vectors"] > small
           and time.monotonic() - start < limit):
        time.sleep(0.5)
    print(f"vector index: {index['vectors']} vectors, {index['graph_elements']} in graphs, {index['pending']} "
          f"pending (waited {time.monotonic() - start:.1f} s)")


def latency(c: MemoryClient, repeat: int, label: str = "") -> None:
    qs = questions()
    counter = iter(range(10**9))

    def query() -> str:
        n = next(counter)
        return f"{qs[n % len(qs)]} {n}"

    memory = c.store("a memory to fetch", "fact")
    cases = {
        "search e2e, short query (incl. embedding)": lambda: c.search(f"What does my wife like? {next(counter)}"),
        "search e2e, LoCoMo question (incl. embedding)": lambda: c.search(query()),
        "search e2e, memory_type=fact": lambda: c.search(query(), "fact"),
        "store e2e (incl. embedding, fsync=always)": lambda: c.store(f"note {next(counter)}", "conversation"),
        "ping": c.ping,
        "get_context_window": c.get_context_window,
        "get": lambda: c.get(memory.id),
    }
    for name, fn in cases.items():
        print(row(name + label, measure(fn, repeat)))
    ops = c.stats()["ops"]  # the daemon's own split of its latest 2,048 requests per op
    for op in ("search", "store"):
        stages = ", ".join(f"{k} {v:.3f}" for k, v in ops[op].get("stages_p50_ms", {}).items())
        print(f"  inside the daemon, {op}: p50 {ops[op]['p50_ms']:.3f} ms = {stages} ms (p50 of each){label}")


def import_stall(c: MemoryClient, n: int) -> None:
    """Search latency while the daemon puts ``n`` freshly imported vectors into its
    graphs (at idle time, and a step per search while too many wait): a search every
    70 ms, so the engine has idle time between them, until nothing is pending."""
    texts = sentences(n, seed=5)
    for i in range(0, n, 250):
        c.store_batch([{"content": t, "memory_type": "fact"} for t in texts[i : i + 250]])
    started = time.monotonic()
    samples = _searches_while(c, lambda s: s["store"]["index"]["pending"] > 0)
    print(row(f"search e2e while {n} imported vectors enter the graphs", percentiles(samples)) +
          f"  ({len(samples)} searches, {time.monotonic() - started:.1f} s)")


def backfill(tmp: Path, n: int) -> None:
    """A store of ``n`` memories written without a model (a daemon run before 'model
    fetch'), served by a daemon with the model: search latency every 70 ms while it
    embeds them in idle time, then the same searches once it is done."""
    config_path = prepare(tmp, 0)
    texts = sentences(n, seed=7)
    with MemoryStore(config=load_config(config_path), embedder=None) as store:
        for i in range(0, n, 500):
            store.store_batch([{"content": t, "memory_type": ("conversation", "fact")[j % 2]}
                               for j, t in enumerate(texts[i : i + 500])])
    proc = start(config_path)
    try:
        with MemoryClient(config=load_config(config_path), timeout=60) as c:
            _wait_ping(c)
            started, during = time.monotonic(), _searches_while(c, lambda s: s["store"]["unembedded"] > 0, least=1)
            took = time.monotonic() - started
            print(row(f"search e2e while {n} memories get vectors", percentiles(during)) +
                  f"  ({len(during)} searches; all embedded in {took:.1f} s, {n / took:.0f} memories/s)")
            after = _searches_while(c, lambda s: False)
            print(row("search e2e after, same pace", percentiles(after)) + f"  ({len(after)} searches)")
    finally:
        stop(proc)


def _searches_while(c: MemoryClient, busy: Callable[[dict[str, Any]], bool], least: int = 30) -> list[float]:
    """Seconds of one search every 70 ms while ``busy(stats)`` (at least ``least`` searches, at most 120 s)."""
    qs, samples = questions(), []  # type: list[str], list[float]
    started = time.monotonic()
    while (busy(c.stats()) or len(samples) < least) and time.monotonic() - started < 120:
        time.sleep(0.07)
        t = time.perf_counter()
        c.search(f"{qs[len(samples) % len(qs)]} {len(samples)}")
        samples.append(time.perf_counter() - t)
    return samples


def _wait_ping(c: MemoryClient) -> None:
    while True:
        try:
            c.ping(timeout=1)
            return
        except Exception:
            time.sleep(0.1)


def measure(fn: Callable[[], object], repeat: int) -> dict[str, float]:
    """Percentiles of ``repeat`` calls, median over 3 runs."""
    per_run = []
    for _ in range(3):
        samples = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        per_run.append(percentiles(samples))
    return {k: float(np.median([r[k] for r in per_run])) for k in per_run[0]}


def _searcher(config_path: str, stop_at: float, out: mp.Queue) -> None:
    qs = questions()
    n = errors = 0
    with MemoryClient(config=load_config(config_path), timeout=10) as c:
        while time.time() < stop_at:
            try:
                c.search(f"{random.choice(qs)} {n}")
            except Exception:
                errors += 1
            n += 1
    out.put((n, errors))


def cheap_under_load(config_path: Path, repeat: int) -> None:
    out: mp.Queue = mp.Queue()
    stop_at = time.time() + 60
    procs = [mp.Process(target=_searcher, args=(str(config_path), stop_at, out)) for _ in range(4)]
    for p in procs:
        p.start()
    time.sleep(2)
    with MemoryClient(config=load_config(config_path), timeout=10) as c:
        for name, fn in (("ping while 4 clients search flat out", c.ping),
                         ("get_context_window while 4 clients search", c.get_context_window)):
            print(row(name, measure(fn, repeat)))
    for p in procs:
        p.terminate()
        p.join()


def _mixed(config_path: str, k: int, stop_at: float, out: mp.Queue) -> None:
    rng = random.Random(k)
    qs = questions()
    counts = {"ops": 0, "errors": 0}
    ids: list[str] = []
    with MemoryClient(config=load_config(config_path), timeout=10) as c:
        while time.time() < stop_at:
            roll = rng.random()
            try:
                if roll < 0.45:
                    c.search(rng.choice(qs), limit=5)
                elif roll < 0.65:
                    ids.append(c.store(f"client {k} says {rng.choice(qs)}", "conversation", {"k": k}).id)
                    if len(ids) > 100:  # a steady data size, so the RSS trend shows leaks, not data
                        c.forget(ids.pop(0))
                elif roll < 0.75 and ids:
                    c.forget(ids.pop(rng.randrange(len(ids))))
                elif roll < 0.85:
                    c.add_to_context_window("user", f"turn {counts['ops']}")
                elif roll < 0.9:
                    c.set_context(f"topic{k}", f"topic {counts['ops']}")
                else:
                    c.ping()
            except Exception:
                counts["errors"] += 1
            counts["ops"] += 1
    out.put(counts)


def rss_parts(pid: int) -> dict[str, float]:
    """Resident MB by kind of mapping: the C heap (brk), other anonymous memory
    (malloc's mappings and arenas, Python's arenas, the vector matrix, hnswlib),
    and files (code, the page cache of mapped files)."""
    parts = {"heap": 0.0, "anonymous": 0.0, "files": 0.0}
    kind = "anonymous"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's first line
            name = fields[5] if len(fields) > 5 else ""
            kind = "heap" if name == "[heap]" else "files" if name.startswith("/") else "anonymous"
        elif fields and fields[0] == "Rss:":
            parts[kind] += int(fields[1]) / 1024
    return parts


REST_AFTER_LOAD = 30.0  # seconds


def load_test(config_path: Path, pid: int, minutes: float, stats: Callable[[], dict[str, Any]]) -> None:
    before, count = rss_parts(pid), stats()["store"]["memories"]
    out: mp.Queue = mp.Queue()
    stop_at = time.time() + minutes * 60
    procs = [mp.Process(target=_mixed, args=(str(config_path), k, stop_at, out)) for k in range(8)]
    for p in procs:
        p.start()
    samples: list[tuple[float, float]] = []
    next_line = time.time() + 60
    while time.time() < stop_at:
        samples.append((time.time(), rss_of(pid)))
        if time.time() >= next_line:  # the trend with its parts, and the compactions so far
            next_line += 60
            parts, gen = rss_parts(pid), stats()["store"]["generation"]
            print(f"  minute {round((time.time() - stop_at) / 60 + minutes):>3}: RSS {sum(parts.values()):.0f} MB ("
                  + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()) + f"), snapshot generation {gen}", flush=True)
        time.sleep(5)
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    ops, errors = sum(r["ops"] for r in results), sum(r["errors"] for r in results)
    half = samples[len(samples) // 2 :]
    slope = np.polyfit([t - half[0][0] for t, _ in half], [m for _, m in half], 1)[0] * 60 if len(half) > 2 else 0.0
    print(f"load test: 8 clients, mixed ops, {minutes:g} min: {ops} ops ({ops / (minutes * 60):.0f}/s), "
          f"{errors} errors")
    print(f"daemon RSS during the load test: start {samples[0][1]:.0f} MB, max {max(m for _, m in samples):.0f} MB, "
          f"end {samples[-1][1]:.0f} MB, trend over the second half {slope:+.2f} MB/min; "
          f"peak since start {memory_mb(pid)[1]:.0f} MB")
    after = rss_parts(pid)
    now = stats()
    print(f"  what it added: {now['store']['memories'] - count:+d} memories; resident " +
          ", ".join(f"{k} {before[k]:.0f} -> {after[k]:.0f} MB" for k in before))
    print(f"  the daemon's heap trims (the last 100): {now.get('heap_trims')}")
    time.sleep(REST_AFTER_LOAD)
    print(f"daemon RSS {REST_AFTER_LOAD:.0f} s after the load: {rss_of(pid):.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=10_000)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--import-stall", type=int, default=0, metavar="N",
                        help="also measure searches while N imported vectors enter the graphs")
    parser.add_argument("--heap-trim", type=float, metavar="SECONDS",
                        help="the daemon's server.heap_trim_seconds (default: the config's; 0: no trims)")
    parser.add_argument("--busy-core", action="store_true", help="measure latencies again with one core busy")
    parser.add_argument("--backfill", type=int, default=0, metavar="N",
                        help="only measure searches while N memories stored without a model get vectors")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rm-daemon-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if args.backfill:
            backfill(tmp, args.backfill)
            return
        config_path = prepare(tmp, args.memories, args.heap_trim)
        cold_start(config_path, tmp)
        proc = start(config_path)
        try:
            with MemoryClient(config=load_config(config_path), timeout=60) as c:
                _wait_ping(c)
                wait_for_graphs(c)
                latency(c, args.repeat)
                if args.import_stall:
                    import_stall(c, args.import_stall)
                if args.busy_core:
                    spinner = busy_core(3600)
                    try:
                        latency(c, args.repeat, ", one core busy")
                    finally:
                        spinner.terminate()
            print(f"daemon RSS with the default model and {args.memories} memories: {rss_of(proc.pid):.0f} MB")
            cheap_under_load(config_path, args.repeat)
            if args.minutes > 0:
                with MemoryClient(config=load_config(config_path), timeout=60) as c:
                    load_test(config_path, proc.pid, args.minutes, c.stats)
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
