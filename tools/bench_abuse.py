"""The daemon under abuse: its memory and its cheap ops, with a real daemon and model.

Cases (issue 8), each against a fresh daemon process (ipc, loopback only):

* ``bomb``: searches whose ``where`` is a 125,000-way ``$or`` (868 KB);
* ``greedy``: a client sends 120 searches (limit 1000, long memories) and never reads;
* ``long``: 1,000 memories of 16,000 characters;
* ``load``: 4 clients searching flat out.

During each case a probe client times ``ping``, ``get`` and ``get_context_window``
(p50/p99/max); the daemon's RSS (VmRSS) and peak (VmHWM) are read from /proc
before and after.  Compare with the unit's ``MemoryMax``.

    .venv/bin/python -m tools.bench_abuse            # all cases
    .venv/bin/python -m tools.bench_abuse --case load
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from reachy_memory import ReachyMemoryError
from tests.daemon_util import DaemonProcess, never_reading_dealer
from tools._bench import dialogue_lines, memory_mb, percentiles, questions


def probe(d: DaemonProcess, stop: threading.Event, out: dict[str, list[float]], memory_id: str) -> None:
    calls = {"ping": lambda c: c.ping(), "get": lambda c: c.get(memory_id),
             "get_context_window": lambda c: c.get_context_window()}
    with d.client(timeout=60) as c:
        while not stop.is_set():
            for name, call in calls.items():
                start = time.perf_counter()
                with contextlib.suppress(ReachyMemoryError):  # a refused probe still took its time
                    call(c)
                out[name].append(time.perf_counter() - start)
            time.sleep(0.005)


def seed(d: DaemonProcess) -> str:
    lines = dialogue_lines()
    with d.client(timeout=120) as c:
        c.store_batch([{"content": line, "memory_type": "conversation"} for line in lines[:500]], timeout=120)
        for i in range(5):
            c.add_to_context_window("user", lines[i])
        return str(c.store("The charger is in the hallway").id)


def case_bomb(d: DaemonProcess) -> None:
    where = {"$or": [{"n": i} for i in range(125_000)]}
    with d.client(timeout=60) as c:
        for _ in range(5):
            try:
                c.search("robots", where=where)
            except ReachyMemoryError as exc:
                last = exc
        print(f"    bomb answered: {type(last).__name__}: {str(last)[:80]}")


def case_greedy(d: DaemonProcess) -> None:
    with d.client(timeout=120) as c:
        c.store_batch([{"content": f"long memory {i} " + "about robots and gardens " * 600} for i in range(60)],
                      timeout=120)
    ctx = zmq.Context()
    sock = never_reading_dealer(ctx, d.endpoint)
    for i in range(120):
        sock.send(msgpack.packb({"v": 1, "id": i, "op": "search",
                                 "args": {"query": "robots", "limit": 1000, "min_score": 0}}))
    time.sleep(5)
    sock.close(linger=0)
    ctx.term()


def case_long(d: DaemonProcess) -> None:
    with d.client(timeout=300) as c:
        for start in range(0, 1000, 50):
            c.store_batch([{"content": f"long note {i} " + "the garden robot waters the plants " * 450}
                           for i in range(start, start + 50)], timeout=300)


def case_load(d: DaemonProcess, seconds: float = 20.0) -> None:
    qs = questions()
    stop = time.monotonic() + seconds

    def searcher(offset: int) -> None:
        with d.client(timeout=60) as c:
            n = offset
            while time.monotonic() < stop:
                c.search(qs[n % len(qs)])
                n += 4

    threads = [threading.Thread(target=searcher, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


CASES = {"bomb": case_bomb, "greedy": case_greedy, "long": case_long, "load": case_load}


def run_case(name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, DaemonProcess(Path(tmp), server={"log_level": "WARNING"}) as d:
        assert d.proc is not None
        memory_id = seed(d)
        before = memory_mb(d.proc.pid)
        samples: dict[str, list[float]] = {"ping": [], "get": [], "get_context_window": []}
        stop = threading.Event()
        thread = threading.Thread(target=probe, args=(d, stop, samples, memory_id))
        thread.start()
        start = time.perf_counter()
        CASES[name](d)
        took = time.perf_counter() - start
        stop.set()
        thread.join()
        after = memory_mb(d.proc.pid)
        with d.client() as c:
            dropped = c.stats()["replies_dropped"]
    return {"case": name, "seconds": took, "rss_before": before[0], "rss_after": after[0], "peak": after[1],
            "dropped": dropped, **{k: percentiles(v) for k, v in samples.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=list(CASES), action="append")
    args = parser.parse_args()
    for name in args.case or list(CASES):
        r = run_case(name)
        print(f"{name}: {r['seconds']:.1f} s, RSS {r['rss_before']:.0f} -> {r['rss_after']:.0f} MB "
              f"(peak {r['peak']:.0f} MB), replies dropped {r['dropped']}", flush=True)
        for op in ("ping", "get", "get_context_window"):
            if op in r:
                p = r[op]
                print(f"    {op:<20} p50 {p['p50']:.2f} ms  p99 {p['p99']:.2f} ms  max {p['max']:.2f} ms  "
                      f"(n={p['n']})", flush=True)


if __name__ == "__main__":
    main()
