"""What the daemon adds to a search over the same search in-process, side by side in one run.

    python tools/bench_overhead.py                      # 3,000 memories, 5 rounds of 80 calls per case each way
    python tools/bench_overhead.py --memories 6000 --rounds 3

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
import shutil
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
from tools.bench_daemon import _wait_ping, start, stop, wait_for_graphs  # noqa: E402


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


# (in-process call, daemon call, the queries of a round for a side, seconds of quiet before each call)
Case = tuple[Callable[[str], Any] | None, Callable[[str], Any] | None, Callable[[int, str], list[str]], float]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=80, help="searches per side per round and case")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="quiet before each search of the paced case")
    args = parser.parse_args()
    qs, n, gap = questions(), args.per_round, args.gap_ms / 1000
    with tempfile.TemporaryDirectory(prefix="rm-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        built = write_store(tmp, args.memories)
        for name in ("local", "served"):
            shutil.copytree(built, tmp / name)
            _config(tmp, name)
        proc = start(tmp / "served.yaml")
        results: dict[str, dict[str, list[list[float]]]] = {}
        try:
            with MemoryStore(config=load_config(tmp / "local.yaml")) as store, \
                    MemoryClient(config=load_config(tmp / "served.yaml"), timeout=60) as client:
                _wait_ping(client)
                wait_for_graphs(client)
                seen = qs[:n]
                for q in seen:  # both embedders' caches hold these
                    store.search(q)
                    client.search(q)

                def fresh(tag: str) -> Callable[[int, str], list[str]]:  # never seen by either side's cache
                    return lambda r, side: [f"{qs[(r * n + i) % len(qs)]} {tag}{r}-{i} {side}" for i in range(n)]

                cases: dict[str, Case] = {
                    "search, fresh query (embedding included)": (store.search, client.search, fresh("f"), 0.0),
                    "search, cached query vector (no embedding)": (store.search, client.search, lambda r, s: seen, 0.0),
                    f"search, fresh query, one every {args.gap_ms:g} ms": (
                        store.search, client.search, fresh("p"), gap),
                    "embedding alone (embed_query, fresh query)": (store.embed_query, None, fresh("e"), 0.0),
                    "ping round trip": (None, lambda q: client.ping(), lambda r, s: seen, 0.0),
                }
                for r in range(args.rounds):
                    for case, (local, served, make, pause) in cases.items():
                        sides = [("in-process", local), ("daemon", served)]
                        for side, fn in (sides if r % 2 == 0 else sides[::-1]):  # who goes first alternates
                            if fn is not None:
                                results.setdefault(case, {}).setdefault(side, []).append(
                                    timed_after(fn, make(r, side), pause))
                    print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
                stages = client.stats()["ops"]["search"]
        finally:
            stop(proc)
    print(f"\n{args.memories:,} memories, {args.rounds} rounds x {n} calls per side and case "
          "(median over rounds of each percentile, ms):\n")
    print(f"| {'case':<44} | in-process p50 / p99 | daemon p50 / p99 | daemon - in-process p50 / p99 |")
    print(f"|{'-' * 46}|---|---|---|")
    for case, sides in results.items():
        got = {side: summary(rounds) for side, rounds in sides.items()}
        cells = [f"{got[s]['p50']:.2f} / {got[s]['p99']:.2f}" if s in got else "" for s in ("in-process", "daemon")]
        local, served = got.get("in-process"), got.get("daemon")
        diff = (f"{served['p50'] - local['p50']:+.2f} / {served['p99'] - local['p99']:+.2f}"
                if local and served else "")
        print(f"| {case:<44} | {cells[0]} | {cells[1]} | {diff} |")
    split = ", ".join(f"{k} {v:.3f}" for k, v in stages.get("stages_p50_ms", {}).items())
    print(f"\ninside the daemon, search (all of the above): p50 {stages['p50_ms']:.3f} ms = {split} (p50 of each)")


if __name__ == "__main__":
    main()
