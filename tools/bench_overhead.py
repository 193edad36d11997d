"""What the daemon adds to a search over the same search in-process, side by side in one run.

    python tools/bench_overhead.py                      # 3,000 memories, 5 rounds of 80 searches each way
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


def block(fn: Callable[[str], Any], queries: list[str]) -> list[float]:
    """Seconds of ``fn(q)`` for each query in turn."""
    out = []
    for q in queries:
        t = time.perf_counter()
        fn(q)
        out.append(time.perf_counter() - t)
    return out


def summary(rounds: list[list[float]]) -> dict[str, float]:
    """Median over rounds of each round's p50 and p99 (ms)."""
    per = [percentiles(r) for r in rounds]
    return {k: float(np.median([p[k] for p in per])) for k in ("p50", "p99")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=80, help="searches per side per round and case")
    args = parser.parse_args()
    qs = questions()
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
                seen = [q for q in qs[: args.per_round]]
                for q in seen:  # both embedders' caches hold these
                    store.search(q)
                    client.search(q)
                cases: dict[str, tuple[Callable[[str], Any] | None, Callable[[str], Any] | None,
                                      Callable[[int], list[str]]]]
                cases = {
                    "search, fresh query (embedding included)": (
                        store.search, client.search,
                        lambda r: [f"{qs[(r * args.per_round + i) % len(qs)]} {r}-{i}" for i in range(args.per_round)]),
                    "search, cached query vector (no embedding)": (store.search, client.search, lambda r: seen),
                    "embedding alone (embed_query, fresh query)": (
                        store.embed_query, None, lambda r: [f"{qs[i % len(qs)]} e{r}-{i}" for i in range(args.per_round)]),
                    "ping round trip": (None, lambda q: client.ping(), lambda r: seen),
                }
                for r in range(args.rounds):
                    for case, (local, served, make) in cases.items():
                        queries = make(r)
                        sides = [("in-process", local), ("daemon", served)]
                        for side, fn in (sides if r % 2 == 0 else sides[::-1]):
                            if fn is not None:
                                results.setdefault(case, {}).setdefault(side, []).append(
                                    block(fn, [f"{q} {side}" if "fresh" in case else q for q in queries]))
                    print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
                stages = client.stats()["ops"]["search"]
        finally:
            stop(proc)
    print(f"\n{args.memories:,} memories, {args.rounds} rounds x {args.per_round} searches per side and case "
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
