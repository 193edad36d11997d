"""How long compaction and a backup pause the engine, at 100k memories.

Builds a store of ``--memories`` memories (LoCoMo dialogue lines, with random
unit vectors from a cheap stand-in embedder: the embedder is not what is
measured), then, several runs each:

* **synchronous** compaction (``store.compact()``, what every compaction was
  before): the whole snapshot is written under the store lock;
* **background** compaction (what the store does on its own now): a probe
  thread takes and releases the store lock every millisecond and records how
  long it waited, while a writer thread stores memories and reads the context
  window; we report the longest lock wait (the pause), the two locked steps
  (freeze, finish) and the writer's latencies during the compaction;
* a **backup** taken on a thread of its own (as the daemon's background thread
  takes it), with the same probe and writer.

    .venv/bin/python tools/bench_compaction.py --memories 100000 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from reachy_memory import Config, MemoryStore
from tools._bench import dialogue_lines, percentiles, rss_mb


class RandomEmbedder:
    """Unit vectors from a seeded generator: costs microseconds, not milliseconds."""

    dim = 384

    def __init__(self) -> None:
        self._rng = np.random.default_rng(7)

    def embed(self, texts: list[str]) -> np.ndarray:
        vectors = self._rng.standard_normal((len(texts), self.dim)).astype(np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def build(path: Path, count: int) -> Config:
    cfg = Config().replace("memory", path=str(path), compact_journal_bytes=1 << 33, fsync="never",
                           max_batch=1000)
    lines = dialogue_lines()
    with MemoryStore(config=cfg, embedder=RandomEmbedder()) as store:
        for start in range(0, count, 1000):
            store.store_batch([{"content": f"{lines[i % len(lines)]} ({i})", "memory_type": "fact"}
                               for i in range(start, min(start + 1000, count))])
            if start % 20_000 == 0:
                print(f"  built {start + 1000:,} / {count:,}", flush=True)
    return cfg


def timed_method(store: Any, name: str, sink: list[float]) -> None:
    """Record the duration of each call of ``store.<name>``."""
    original = getattr(store, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(store, name, wrapper)


def probe(store: MemoryStore, stop: threading.Event, waits: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        with store._lock:
            pass
        waits.append(time.perf_counter() - start)
        time.sleep(0.001)


def writer(store: MemoryStore, stop: threading.Event, lat: list[float]) -> None:
    n = 0
    while not stop.is_set():
        start = time.perf_counter()
        store.store(f"written during compaction {n}")
        store.get_context_window()
        lat.append(time.perf_counter() - start)
        n += 1
        time.sleep(0.002)


@contextlib.contextmanager
def loaded(store: MemoryStore, warmup: float = 0.2) -> Iterator[tuple[list[float], list[float]]]:
    """The probe and the writer run against ``store`` for the block (started ``warmup``
    seconds before it); yields their lists: the lock waits and the writer's latencies,
    complete once the block has ended."""
    waits: list[float] = []
    lat: list[float] = []
    stop = threading.Event()
    threads = [threading.Thread(target=probe, args=(store, stop, waits)),
               threading.Thread(target=writer, args=(store, stop, lat))]
    for t in threads:
        t.start()
    time.sleep(warmup)
    try:
        yield waits, lat
    finally:
        stop.set()
        for t in threads:
            t.join()


def under_load(store: MemoryStore, job: Any) -> dict[str, float]:
    """Run ``job()`` while the probe and the writer run; the lock waits and the writer's
    latencies meanwhile, and the job's wall time."""
    with loaded(store) as (waits, lat):
        start = time.perf_counter()
        job()
        total = time.perf_counter() - start
    w, s = percentiles(waits), percentiles(lat)
    return {"total_s": total, "lock_wait_max_ms": w["max"], "lock_wait_p99_ms": w["p99"],
            "store_p50_ms": s["p50"], "store_p99_ms": s["p99"], "store_max_ms": s["max"], "stores": s["n"]}


def background_run(store: MemoryStore) -> dict[str, float]:
    freeze: list[float] = []
    finish: list[float] = []
    timed_method(store._storage, "_begin_compaction", freeze)
    timed_method(store._storage, "_finish_compaction", finish)

    def job() -> None:
        with store._lock:
            store._storage.compact_in_background()
        store._storage.wait()

    result = under_load(store, job)
    for name in ("_begin_compaction", "_finish_compaction"):
        delattr(store._storage, name)
    return result | {"freeze_ms": freeze[0] * 1000, "finish_ms": finish[0] * 1000}


def backup_run(store: MemoryStore, dest: Path) -> dict[str, float]:
    """A backup taken beside the probe and the writer threads, as the daemon's background
    thread takes it (a failure raises: it is not timed)."""
    return under_load(store, lambda: store.backup(dest))


def report(label: str, r: dict[str, float]) -> None:
    print(f"  {label}: total {r['total_s']:.2f} s, longest lock wait {r['lock_wait_max_ms']:.1f} ms, "
          f"store+window p50/p99/max {r['store_p50_ms']:.1f}/{r['store_p99_ms']:.1f}/"
          f"{r['store_max_ms']:.1f} ms over {r['stores']:.0f} writes", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building a store of {args.memories:,} memories ...", flush=True)
        cfg = build(Path(tmp) / "data", args.memories)
        with MemoryStore(config=cfg, embedder=RandomEmbedder()) as store:
            print(f"open: RSS {rss_mb():.0f} MB", flush=True)
            sync = []
            for run in range(args.runs):
                start = time.perf_counter()
                store.compact()
                sync.append(time.perf_counter() - start)
                print(f"  synchronous run {run + 1}: {sync[-1] * 1000:.0f} ms under the lock", flush=True)
            results = []
            for run in range(args.runs):
                results.append(background_run(store))
                r = results[-1]
                report(f"background compaction run {run + 1} (freeze {r['freeze_ms']:.1f} ms, finish "
                       f"{r['finish_ms']:.1f} ms)", r)
            backups = []
            for run in range(args.runs):
                backups.append(backup_run(store, Path(tmp) / "backup.rms"))
                report(f"backup run {run + 1}", backups[-1])
            print(f"\n{args.memories:,} memories, medians of {args.runs} runs:")
            print(f"  synchronous compaction (the old pause): {statistics.median(sync) * 1000:.0f} ms")
            for key in ("freeze_ms", "finish_ms", "lock_wait_max_ms", "store_p99_ms", "store_max_ms", "total_s"):
                print(f"  background {key}: {statistics.median(r[key] for r in results):.2f}")
            for key in ("lock_wait_max_ms", "store_p99_ms", "store_max_ms", "total_s"):
                print(f"  backup {key}: {statistics.median(r[key] for r in backups):.2f}")

if __name__ == "__main__":
    main()
