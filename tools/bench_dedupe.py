"""The write cost of the restatement check (a stored fact or context memory compared
with its nearest kept memories) at 10k and 100k memories.

    python tools/bench_dedupe.py              # 10k and 100k
    python tools/bench_dedupe.py --quick      # 10k only
    python tools/bench_dedupe.py --sizes 50000 --repeat 400
    python tools/bench_dedupe.py --model-vectors   # the model's vectors of the texts, not random ones
    python tools/bench_dedupe.py --fill-cache /tmp/rm-fills   # fill each size once, copy it for later runs

A store is filled with N memories (a third each type, random unit vectors: the engine
measured alone, as in tools/bench_engine.py; hnswlib's worst case, or with
``--model-vectors`` the model's vectors of the texts, embedded before timing), closed
(its graphs built and cached) and opened again, as a daemon finds it.  Then, per size:

* ``check``: :func:`reachy_memory.engine.dedupe.restatement` alone (the vector search a
  write makes when the word filter, :class:`~reachy_memory.engine.dedupe.Told`, lets it)
  for a new fact (no copy found: the common case) and for a restated one (found at once);
* ``store``: ``store(fact)`` with ``memory.dedupe`` on and off, alternated in one
  process (fsync never: the disk's noise is not the check's), and their difference; with
  the daemon's idle-time upkeep between writes (untimed), and in a burst without it.

Prints p50/p90/p99 in milliseconds, the median of 3 runs of each percentile.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tools.bench_engine as engine_bench
from reachy_memory import MemoryStore
from reachy_memory.engine import dedupe
from reachy_memory.engine.records import Record
from tools._bench import percentiles, row, runs, sentences
from tools.bench_engine import config, fill

TARGET_MS = 0.5  # added per store, at 10k and 100k memories
# Random vectors of the stores timed: a seed of their own each time a store is opened.  With the
# fill's seed (as before 2026-11-28) each "new" fact had the vector of a stored memory and of
# each earlier session's write, cosine 1: up to 5 neighbours of the same owner read by the rule.
_SEEDS = itertools.count(1000)


def opened(path: Path, **memory: Any) -> MemoryStore:
    """The store at ``path`` with its cached graphs adopted (a daemon at steady state)."""
    embedder = engine_bench.Precomputed(next(_SEEDS)) if engine_bench.EMBEDDER is engine_bench.Precomputed \
        else engine_bench.EMBEDDER()
    store = MemoryStore(config=config(path, fsync="never", **memory), embedder=embedder)
    adopt = getattr(store._state.vectors, "_adopt_loaded", None)
    if adopt is not None:
        adopt(wait=True)
    while store.maintain(save_cache=False):  # idle time's work after an open (the check's word filter)
        pass
    return store


def bench_check(store: MemoryStore, n: int, repeat: int) -> None:
    """The check alone, on records that are not written."""
    state, entity = store._state, store.config.search.entity_fields
    texts = sentences(200, seed=21)
    fresh = itertools.cycle([(Record(f"new{i}", t, "fact", time.time(), None, {}), v)
                             for i, (t, v) in enumerate(zip(texts, store.embedder.embed(texts), strict=True))])
    facts = [r for r in itertools.islice(state.records.values(), 0, 3000) if r.type == "fact"][:200]
    told = itertools.cycle([(Record(f"again{i}", r.content.upper(), "fact", time.time(), None, dict(r.metadata)),
                             state.vectors.unit_rows(np.array([r.slot]))[0]) for i, r in enumerate(facts)])

    found = [0, 0]

    def check(source: Any) -> None:
        rec, vec = next(source)
        found[0] += dedupe.restatement(rec, vec, state.vectors, state.by_slot, entity, time.time()) is not None
        found[1] += 1

    print(row(f"check {n // 1000}k, a new fact", runs(lambda: check(fresh), repeat)))
    print(f"  copies found (none exist): {found[0]} of {found[1]}")
    found[:] = [0, 0]
    print(row(f"check {n // 1000}k, a fact told again", runs(lambda: check(told), repeat)))
    print(f"  copies found: {found[0]} of {found[1]}")


def bench_store(path: Path, n: int, repeat: int) -> None:
    """store(fact) with the check on and off, alternated: the added cost is their difference.
    ``idle``: the daemon's idle-time upkeep runs between writes (untimed), as between its
    requests, so new vectors join the graph; ``burst``: writes back to back, the vectors
    waiting for the graph piling up (the check compares each write with them exactly)."""
    texts = itertools.cycle(f"{t} {i}" for i, t in enumerate(sentences(repeat * 16, seed=33)))
    for mode in ("idle", "burst"):
        stats: dict[str, dict[str, float]] = {}
        for on in (True, False, True, False):
            with opened(path, dedupe=on) as store:
                got = _timed_stores(store, texts, repeat, idle=mode == "idle")
            key = "on" if on else "off"
            stats[key] = got if key not in stats else {k: min(v, got[k]) for k, v in stats[key].items()}
        for key in ("off", "on"):
            print(row(f"store(fact) {n // 1000}k {mode}, dedupe {key}", stats[key]))
        added = stats["on"]["p50"] - stats["off"]["p50"]
        print(f"added by the check at {n // 1000}k ({mode}): p50 {added:+.3f} ms (target < {TARGET_MS} ms)")


def _timed_stores(store: MemoryStore, texts: Iterator[str], repeat: int, *, idle: bool) -> dict[str, float]:
    """Percentiles (ms) of ``repeat`` stores, 3 runs, the median of each percentile;
    with ``idle``, ``maintain()`` until it has nothing left between two stores (untimed)."""
    per_run = []
    for _ in range(3):
        samples = []
        for _ in range(repeat):
            while idle and store.maintain(save_cache=False):
                pass
            start = time.perf_counter()
            store.store(next(texts), "fact")
            samples.append(time.perf_counter() - start)
        per_run.append(percentiles(samples))
    return {k: float(np.median([r[k] for r in per_run])) for k in per_run[0]}


def filled(path: Path, n: int, cache: Path | None, model_vectors: bool) -> None:
    """A store of ``n`` memories at ``path``: filled, or copied from ``cache`` (filled there first)."""
    if cache is None:
        fill(path, n)
        return
    kept = cache / f"s{n}{'-model' if model_vectors else ''}"
    if not (kept / "done").exists():
        shutil.rmtree(kept, ignore_errors=True)
        fill(kept, n)
        (kept / "done").touch()
    shutil.copytree(kept, path, ignore=shutil.ignore_patterns("done", "LOCK"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k only")
    parser.add_argument("--sizes", type=int, nargs="*", help="memory counts (default 10000 100000)")
    parser.add_argument("--repeat", type=int, default=300, help="calls per run")
    parser.add_argument("--check-only", action="store_true", help="the check alone, no store() timing")
    parser.add_argument("--model-vectors", action="store_true", help="the model's vectors of the texts")
    parser.add_argument("--fill-cache", type=Path, help="keep each filled store here and copy it (100k: ~8 min saved)")
    args = parser.parse_args()
    if args.model_vectors:
        engine_bench.EMBEDDER = engine_bench.ModelVectors
    sizes = args.sizes or ([10_000] if args.quick else [10_000, 100_000])
    with tempfile.TemporaryDirectory(prefix="rm-dedupe-") as tmp:
        for n in sizes:
            path = Path(tmp) / f"s{n}"
            filled(path, n, args.fill_cache, args.model_vectors)
            with opened(path) as store:
                bench_check(store, n, args.repeat)
            if not args.check_only:
                bench_store(path, n, args.repeat)


if __name__ == "__main__":
    main()
