"""What a purge costs: forget reaching every file, at 1k and 10k memories (or ``--memories``).

Builds a store of N memories (LoCoMo dialogue lines, random unit vectors from a cheap
stand-in embedder), reopens it with the default durability (``fsync: always``), then,
several runs each: forgets 10 memories while a probe thread takes the store lock every
millisecond (its longest wait is the engine's longest pause) and a writer stores a
memory and reads the window every 2 ms, and waits until the purge is done.  Reports:

* ``clean_s``: from the last forget's acknowledgment until the purge is done (every file
  of the data directory checked to hold none of the forgotten texts): the promise is 10 s;
  it includes ``PURGE_DELAY`` (1 s), the wait for more forgets to purge together;
* ``purge_s``: the purge itself (record, set-aside files, compactions, the last step);
* the longest lock wait and the writer's p99 / max meanwhile.

    .venv/bin/python -m tools.bench_purge --memories 1000 10000 --runs 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from reachy_memory import MemoryStore
from tools._bench import percentiles
from tools.bench_compaction import RandomEmbedder, build, loaded


def on_disk(directory: Path, needles: list[bytes]) -> list[str]:
    """The files under ``directory`` that hold one of ``needles``."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                data = (Path(root) / name).read_bytes()
            except FileNotFoundError:
                continue
            if any(n in data for n in needles):
                found.append(name)
    return found


def baseline(store: MemoryStore, seconds: float = 2.0) -> dict[str, float]:
    """The probe's longest wait and the writer's latencies with no purge (the writer's own fsyncs)."""
    with loaded(store, warmup=seconds) as (waits, lat):
        pass
    w, s = percentiles(waits), percentiles(lat)
    return {"lock_wait_max_ms": w["max"], "store_p99_ms": s["p99"], "store_max_ms": s["max"]}


def one_run(store: MemoryStore, rng: random.Random) -> dict[str, Any]:
    built = [m.id for m in store.export_page(limit=100_000)[0] if not m.content.startswith("written during")]
    ids = rng.sample(built, 10)  # not the writer's: "... compaction 5" is in "... compaction 51"
    texts = [store.get(i).content.encode() for i in ids]
    with loaded(store) as (waits, lat):
        purges = store.stats()["purge"]["purges"]
        for memory_id in ids:
            store.forget(memory_id)
        acknowledged = time.perf_counter()
        while store.stats()["purge"]["purges"] == purges and time.perf_counter() - acknowledged < 120:
            time.sleep(0.01)
        clean = time.perf_counter() - acknowledged
    left = on_disk(store.path, texts)
    last = store.stats()["purge"]["last"]
    w, s = percentiles(waits), percentiles(lat)
    return {"clean_s": clean, "purge_s": last["seconds"], "compactions": last["compactions"], "left": left,
            "lock_wait_max_ms": w["max"], "store_p99_ms": s["p99"], "store_max_ms": s["max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(7)
    for count in args.memories:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = build(Path(tmp) / "data", count)
            cfg = cfg.replace("memory", fsync="always", compact_journal_bytes=32 << 20)
            with MemoryStore(config=cfg, embedder=RandomEmbedder()) as store:
                base = baseline(store)
                print(f"  {count:,} without a purge: longest lock wait {base['lock_wait_max_ms']:.1f} ms, "
                      f"store+window p99/max {base['store_p99_ms']:.1f}/{base['store_max_ms']:.1f} ms", flush=True)
                results = []
                for run in range(args.runs):
                    r = one_run(store, rng)
                    results.append(r)
                    print(f"  {count:,} run {run + 1}: clean after {r['clean_s']:.2f} s (purge {r['purge_s']:.2f} s, "
                          f"{r['compactions']} compactions), longest lock wait {r['lock_wait_max_ms']:.1f} ms, "
                          f"store+window p99/max {r['store_p99_ms']:.1f}/{r['store_max_ms']:.1f} ms"
                          + (f", STILL ON DISK in {r['left']}" if r["left"] else ""), flush=True)
            print(f"{count:,} memories, medians of {args.runs} runs: "
                  + ", ".join(f"{k} {statistics.median(r[k] for r in results):.2f}"
                              for k in ("clean_s", "purge_s", "lock_wait_max_ms", "store_p99_ms", "store_max_ms")),
                  flush=True)


if __name__ == "__main__":
    main()
