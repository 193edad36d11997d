"""What the daemon adds to a search over the same search in-process, side by side in one run.

    python tools/bench_overhead.py                      # 3,000 memories, 5 rounds of 80 calls per case each way
    python tools/bench_overhead.py --memories 6000 --rounds 3
    python tools/bench_overhead.py --also ../main       # and a daemon of main's code: before/after in one run

One store of LoCoMo dev turns (then synthetic dialogue lines up to ``--memories``) is
written once and copied: one copy is opened in this process (``MemoryStore.search``),
the other is served by a daemon (``reachy-memory serve``, loopback ipc) and searched
through ``MemoryClient.search``.  Every vector is in its graph on both sides before
timing starts.  Each round times a block of searches on each side, the side that goes
first alternating, so that this VM's drifting speed falls on both alike.  Printed:
p50/p99 per side (the median over rounds of each round's percentile) and the
difference (the daemon's overhead), for

* a fresh query each time (the embedding included, as a robot's question);
* a query seen before (its vector from the embedder's cache: what is left is all
  that is not the embedding);
* a fresh query after ``--gap-ms`` of quiet (a robot asks now and then: threads
  asleep, caches cold, on both sides);
* the embedding alone in-process (``MemoryStore.embed_query``), and a ``ping``
  round trip (the transport's floor);

then the daemon's own split of its search time (``stats``: wait, embed, engine).
"""

from __future__ import annotations

import argparse
import os
import shutil
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
from tools._bench import dialogue_lines, percentiles, questions, sentences  # noqa: E402
from tools.bench_daemon import _wait_ping, stop, wait_for_graphs  # noqa: E402

SETTLE = 0.3  # seconds between blocks: what a daemon does after its block (upkeep) falls outside the next one


def write_store(tmp: Path, n: int) -> Path:
    """A data directory of ``n`` memories (LoCoMo turns first), every vector in its graph."""
    texts = (dialogue_lines() + sentences(n, seed=1))[:n]
    config = _config(tmp, "build")
    with MemoryStore(config=load_config(config)) as store:
        for i in range(0, n, 500):
            store.store_batch([{"content": t, "memory_type": ("conversation", "fact")[j % 2],
                                "metadata": {"speaker": f"user{j % 4}"}} for j, t in enumerate(texts[i : i + 500])])
            print(f"\r  storing {min(i + 500, n)}/{n}", end="", file=sys.stderr, flush=True)
        while store.maintain(budget=512):
            pass
    print(file=sys.stderr)
    return tmp / "build"


def serve(config: Path, root: Path) -> subprocess.Popen[bytes]:
    """A daemon of the checkout at ``root`` (its code, this interpreter) serving ``config``."""
    env = {**os.environ, "PYTHONPATH": str(root)}  # cwd too: `python -m` puts it first on sys.path
    return subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "serve", "--config", str(config)],
                            env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _config(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.yaml"
    settings = {"memory": {"path": str(tmp / name)}, "server": {"endpoint": f"ipc://{tmp}/run/{name}.sock"}}
    path.write_text(yaml.safe_dump(settings))
    return path


def summary(rounds: list[list[float]]) -> dict[str, float]:
    """Median over rounds of each round's p50 and p99 (ms)."""
    per = [percentiles(r) for r in rounds]
    return {k: float(np.median([p[k] for p in per])) for k in ("p50", "p99")}


def timed_after(fn: Callable[[str], Any], queries: list[str], gap: float) -> list[float]:
    """Seconds of ``fn(q)`` for each query, each after ``gap`` seconds of quiet."""
    out = []
    for q in queries:
        time.sleep(gap)
        t = time.perf_counter()
        fn(q)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=80, help="calls per side per round and case")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="quiet before each search of the paced case")
    parser.add_argument("--also", type=Path, metavar="CHECKOUT",
                        help="a second daemon, from another checkout's code (e.g. main's worktree): before/after "
                             "in one run, on the same data")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rm-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        built = write_store(tmp, args.memories)
        roots = {"daemon": ROOT} | ({f"daemon of {args.also.name}": args.also.resolve()} if args.also else {})
        for name in ("local", *roots):
            shutil.copytree(built, tmp / name)
            _config(tmp, name)
        procs = [serve(tmp / f"{name}.yaml", root) for name, root in roots.items()]
        try:
            with MemoryStore(config=load_config(tmp / "local.yaml")) as store:
                clients = {name: MemoryClient(config=load_config(tmp / f"{name}.yaml"), timeout=60) for name in roots}
                try:
                    results, stages = measure(store, clients, args)
                finally:
                    for c in clients.values():
                        c.close()
        finally:
            for proc in procs:
                stop(proc)
    report(results, stages, args)


def measure(store: MemoryStore, clients: dict[str, MemoryClient], args: argparse.Namespace,
            ) -> tuple[dict[str, dict[str, list[list[float]]]], dict[str, Any]]:
    """Seconds per call of each case on each side, a list per round; and each daemon's search stages."""
    qs, n, gap = questions(), args.per_round, args.gap_ms / 1000
    seen = qs[:n]
    for c in clients.values():
        _wait_ping(c)
        wait_for_graphs(c)
    for q in seen:  # every side's embedder cache holds these
        store.search(q)
        for c in clients.values():
            c.search(q)

    def fresh(tag: str) -> Callable[[int, str], list[str]]:  # never seen by any side's cache
        return lambda r, side: [f"{qs[(r * n + i) % len(qs)]} {tag}{r}-{i} {side}" for i in range(n)]

    def again(r: int, side: str) -> list[str]:
        return seen

    # case -> (the queries of a round for a side, seconds of quiet before each call, {side: call})
    served = {name: c.search for name, c in clients.items()}
    cases: dict[str, tuple[Callable[[int, str], list[str]], float, dict[str, Callable[[str], Any]]]] = {
        "search, fresh query (embedding included)": (fresh("f"), 0.0, {"in-process": store.search} | served),
        "search, cached query vector (no embedding)": (again, 0.0, {"in-process": store.search} | served),
        f"search, fresh query, one every {args.gap_ms:g} ms": (fresh("p"), gap, {"in-process": store.search} | served),
        "embedding alone (embed_query, fresh query)": (fresh("e"), 0.0, {"in-process": store.embed_query}),
        "ping round trip": (again, 0.0, {name: (lambda q, c=c: c.ping()) for name, c in clients.items()}),
    }
    results: dict[str, dict[str, list[list[float]]]] = {}
    for r in range(args.rounds):
        for case, (make, pause, sides) in cases.items():
            order = list(sides)
            order = order[r % len(order):] + order[: r % len(order)]  # who goes first turns round by round
            for side in order:
                time.sleep(SETTLE)
                results.setdefault(case, {}).setdefault(side, []).append(timed_after(sides[side], make(r, side), pause))
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return results, {name: c.stats()["ops"]["search"] for name, c in clients.items()}


def report(results: dict[str, dict[str, list[list[float]]]], stages: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{args.memories:,} memories, {args.rounds} rounds x {args.per_round} calls per side and case "
          "(median over rounds of each percentile, ms):\n")
    print(f"| {'case':<44} | side | p50 / p99 | minus in-process, p50 / p99 |")
    print(f"|{'-' * 46}|---|---|---|")
    for case, sides in results.items():
        got = {side: summary(rounds) for side, rounds in sides.items()}
        local = got.get("in-process")
        for side, s in got.items():
            diff = (f"{s['p50'] - local['p50']:+.2f} / {s['p99'] - local['p99']:+.2f}"
                    if local and s is not local else "")
            print(f"| {case:<44} | {side} | {s['p50']:.2f} / {s['p99']:.2f} | {diff} |")
    for name, st in stages.items():
        split = ", ".join(f"{k} {v:.3f}" for k, v in st.get("stages_p50_ms", {}).items())
        print(f"\ninside the {name}, search (all of the above): p50 {st['p50_ms']:.3f} ms = {split} (p50 of each)")


if __name__ == "__main__":
    main()
