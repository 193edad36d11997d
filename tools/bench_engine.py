"""Engine benchmark (issue: core engine): embedding excluded, precomputed unit vectors.

    python tools/bench_engine.py            # 10k and 100k
    python tools/bench_engine.py --quick    # 10k only
    python tools/bench_engine.py --model-vectors  # the model's vectors of the texts, not random ones
    python tools/bench_engine.py --cleanup-only [--against OTHER_CHECKOUT]
                                            # the 100k expiry sweep, alternating with other code
    python tools/bench_engine.py --crash-reopen [--never-closed] [--against OTHER_CHECKOUT]
                                            # reopening after a crash: until the graph serves again
    python tools/bench_engine.py --cache-step --memories N
                                            # the pause of an idle-time graph cache save, per group
    python tools/bench_engine.py --search [--memories 6000] [--against OTHER_CHECKOUT]
                                            # in-process search cost on LoCoMo turns, alternating with other code

Prints store/search latency percentiles (median of 3 runs), open time,
cleanup time, vector recall@10 against exact search and RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reachy_memory import Config, MemoryStore
from reachy_memory.engine.store import GRAPH_FILE
from tools._bench import dialogue_lines, questions, row, rss_mb, runs, sentences

ROOT = Path(__file__).resolve().parents[1]  # this checkout


class Precomputed:
    """An 'embedder' returning random unit vectors: the engine is measured alone."""

    dim = 384

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def embed(self, texts: list[str]) -> np.ndarray:
        v = self._rng.standard_normal((len(texts), self.dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


class ModelVectors:
    """The real model's vectors of the synthetic texts: random unit vectors are
    hnswlib's worst case (no structure to walk), so ``--model-vectors`` measures the
    engine on the kind of vectors it holds on the robot.  Query vectors are computed
    before timing, as with :class:`Precomputed`: embedding stays excluded."""

    def __init__(self) -> None:
        from reachy_memory import load_config, load_embedder

        self._model = load_embedder(load_config())
        self.dim, self.identity = self._model.dim, self._model.identity

    def embed(self, texts: list[str]) -> np.ndarray:
        return self._model.embed(texts)


EMBEDDER: type[Precomputed] | type[ModelVectors] = Precomputed  # main() sets it from --model-vectors


def config(path: Path, **memory: object) -> Config:
    return Config().replace("memory", path=str(path), **memory).replace("embedding", neighbour_context=False)


def fill(path: Path, n: int) -> None:
    texts = sentences(n)
    types = ["conversation", "fact", "context"]
    with MemoryStore(config=config(path, fsync="never"), embedder=EMBEDDER()) as store:
        for start in range(0, n, 1000):
            store.store_batch([{"content": t, "memory_type": types[(start + i) % 3],
                                "metadata": {"speaker": f"user{(start + i) % 5}", "n": start + i}}
                               for i, t in enumerate(texts[start : start + 1000])])
            print(f"\r  filling {min(start + 1000, n)}/{n}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def bench_search(store: MemoryStore, label: str, repeat: int) -> None:
    emb = Precomputed(7) if EMBEDDER is Precomputed else store.embedder
    queries = [(q, emb.embed([q])[0]) for q in sentences(200, seed=9)]
    cursor = iter(range(10**9))

    def one(**kw: Any) -> None:
        q, v = queries[next(cursor) % len(queries)]
        store.search_vector(" ".join(q.split()[:5]), v, min_score=0, limit=5, **kw)

    print(row(f"search {label} unfiltered (hybrid)", runs(one, repeat)))
    print(row(f"search {label} memory_type=fact", runs(lambda: one(memory_type="fact"), repeat)))
    print(row(f"search {label} where speaker=user1", runs(lambda: one(where={"speaker": "user1"}), repeat)))
    print(row(f"search {label} where n<500 (small set, exact)", runs(lambda: one(where={"n": {"$lt": 500}}), repeat)))
    print(f"vector recall@10 of the store's graphs vs exact, these queries: {graph_recall(store, queries):.4f}")


def graph_recall(store: MemoryStore, queries: list[tuple[str, np.ndarray]], k: int = 10) -> float:
    """Recall@k of the store's vector search (graphs at this size) against exact search."""
    vectors = store._state.vectors
    live = np.flatnonzero(vectors.alive)
    hits = sum(len(set(vectors.search(v, k)[0].tolist()) & set(vectors.exact(v, live, k)[0].tolist()))
               for _, v in queries)
    return hits / (k * len(queries))


def bench_store(path: Path, repeat: int) -> None:
    texts = sentences(repeat * 3, seed=3)
    counter = iter(range(10**9))
    it = (f"{texts[i % len(texts)]} {i}" for i in counter)
    with MemoryStore(config=config(path, fsync="always"), embedder=Precomputed()) as store:
        print(row("store fsync=always", runs(lambda: store.store(next(it), "conversation", {"speaker": "a"}), repeat)))
    with MemoryStore(config=config(path, fsync="batch"), embedder=Precomputed()) as store:
        print(row("store fsync=batch", runs(lambda: store.store(next(it), "conversation"), repeat)))


def open_time(path: Path, n_runs: int = 3) -> list[float]:
    out = []
    for _ in range(n_runs):
        code = ("import time,sys; t=time.perf_counter(); sys.path.insert(0, %r)\n"
                "from tools.bench_engine import %s as E, config; from reachy_memory import MemoryStore\n"
                "e=E(); t0=time.perf_counter(); s=MemoryStore(config=config(%r), embedder=e); "
                "t1=time.perf_counter(); print(t1-t0, len(s)); s._dir_lock.release()")
        root = str(ROOT)
        done = subprocess.run([sys.executable, "-c", code % (root, EMBEDDER.__name__, str(path))],
                              capture_output=True, text=True, check=True)
        out.append(float(done.stdout.split()[0]))
    return out


_SWEEP = """
import sys, time
sys.path.insert(0, ROOT)
from tools.bench_engine import Precomputed, config
from reachy_memory import MemoryStore
store = MemoryStore(config=config(PATH), embedder=Precomputed())
vectors = store._state.vectors
if hasattr(vectors, "_adopt_loaded"):
    vectors._adopt_loaded(wait=True)  # the daemon at steady state: cached graphs in place
time.sleep(0.3)
query = Precomputed(5).embed(["q"])[0]
t0 = time.perf_counter()
deleted = store.cleanup_expired(now=time.time() + 40 * 86400)
sweep = time.perf_counter() - t0
t0 = time.perf_counter()
hits = store.search_vector("words", query, limit=5, min_score=0)
first = time.perf_counter() - t0
left = getattr(store._state, "bury", lambda budget: 0)  # older code leaves no idle-time work
t0, steps = time.perf_counter(), 0
while steps < 100000 and store.maintain() + left(0):
    steps += 1
idle = time.perf_counter() - t0
print(deleted, sweep, first, idle, steps, len(hits))
store.close()
"""


def _alternating(source: Path, against: Path | None, rounds: int, *scripts: str) -> Iterator[tuple[str, str]]:
    """(checkout, what the last of ``scripts`` printed) for each round and checkout in
    turn: the scripts run one after the other, each in a fresh process, on a fresh copy
    of ``source`` (ROOT and PATH filled in)."""
    roots = {"this": ROOT} | ({"against": against.resolve()} if against else {})
    for r in range(rounds):
        for name, root in roots.items():
            work = source.with_name(f"{source.name}-{name}-{r}")
            shutil.copytree(source, work)
            for script in scripts:
                out = subprocess.run([sys.executable, "-c", _filled_in(script, root, work)],
                                     capture_output=True, text=True, check=True).stdout
            shutil.rmtree(work)
            yield name, out


def _filled_in(script: str, root: Path, path: Path) -> str:
    """``script`` with ROOT (the checkout to import) and PATH (the store) as literals."""
    return script.replace("ROOT", repr(str(root))).replace("PATH", repr(str(path)))


def bench_cleanup(n: int, rounds: int, tmp: Path, against: Path | None) -> None:
    """The expiry sweep at ``n`` memories (two thirds expire), each round in a fresh
    process on a fresh copy, alternating with the code of ``against`` when given."""
    source = tmp / "sweep-source"
    fill(source, n)
    with MemoryStore(config=config(source), embedder=Precomputed()):
        pass  # a snapshot and a graph cache, as a daemon that has run a while has
    times: dict[str, list[list[float]]] = {}
    for name, out in _alternating(source, against, rounds, _SWEEP):
        deleted, *figures = out.split()
        times.setdefault(name, []).append([float(x) for x in figures[:3]])
        print(f"\r  {name}: {deleted} expired, sweep {1000 * times[name][-1][0]:.0f} ms",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for name, rows in times.items():
        sweep, first, idle = (np.array(col) * 1000 for col in zip(*rows, strict=True))
        print(f"{name:8s} cleanup_expired of {deleted} at {n // 1000}k: median {np.median(sweep):6.1f} ms "
              f"(min {sweep.min():.1f}, max {sweep.max():.1f}); first search after "
              f"{np.median(first):.2f} ms; idle-time index work {np.median(idle):.0f} ms in all")


_CRASH = """
import os, sys
sys.path.insert(0, ROOT)
from tools.bench_engine import Precomputed, config
from reachy_memory import MemoryStore
store = MemoryStore(config=config(PATH), embedder=Precomputed(3))
while IDLE and store.maintain():  # --never-closed: a quiet spell first, the graphs built from scratch
    pass
for half in range(2):  # a background compaction between (the daemon makes one per 32 MB of journal)
    store.store_batch([{"content": f"written after the last close {half} {i}"} for i in range(NEW // 2)])
    if not half:
        with store._lock:
            store._storage.compact_in_background()
        store._storage.wait()
for memory in store.export_page(None, GONE)[0]:
    store.forget(memory.id)
os._exit(0)  # a power cut: no close, so the graph cache on disk is the last close's (or idle time's)
"""

_REOPEN = """
import sys, time
sys.path.insert(0, ROOT)
from tools.bench_engine import Precomputed, config
from reachy_memory import MemoryStore
t0 = time.perf_counter()
store = MemoryStore(config=config(PATH), embedder=Precomputed())
opened = time.perf_counter() - t0
vectors = store._state.vectors
vectors._adopt_loaded(wait=True)
adopted, pending = time.perf_counter() - t0, len(vectors.pending)
t1 = time.perf_counter()
while store.maintain(budget=8):  # the daemon's idle-time steps, back to back
    pass
print(opened, adopted, time.perf_counter() - t1, pending, vectors.count)
store.close()
"""


def bench_crash_reopen(n: int, rounds: int, tmp: Path, against: Path | None, never_closed: bool = False) -> None:
    """Reopening ``n`` memories after a crash that followed a clean close (1% written,
    a background compaction, and 0.2% forgotten since): the time until the cached graph is in place, the vectors
    left to insert then, and the idle-time work until the graphs hold every vector
    (searches are exact until then).  Each round reopens a fresh copy in a fresh
    process, alternating with the code of ``against`` when given.  ``never_closed``:
    a store that never closed cleanly (no graph cache), whose graphs were built in a
    quiet spell before those writes, by each checkout's own code, then the crash."""
    source = tmp / "crash-source"
    fill(source, n)
    with MemoryStore(config=config(source), embedder=Precomputed()):
        pass  # the last clean close: a snapshot and a graph cache
    if never_closed:
        for cached in source.glob(f"{GRAPH_FILE}*"):
            cached.unlink()
    crash = _CRASH.replace("NEW", str(n // 100)).replace("GONE", str(n // 500)).replace("IDLE", str(never_closed))
    if not never_closed:  # the same crashed store for both checkouts
        subprocess.run([sys.executable, "-c", _filled_in(crash, ROOT, source)], check=True)
    times: dict[str, list[list[float]]] = {}
    for name, out in _alternating(source, against, rounds, *([crash] if never_closed else []), _REOPEN):
        times.setdefault(name, []).append([float(x) for x in out.split()])
        print(f"\r  {name}: {times[name][-1][3]:.0f} vectors left at adoption", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for name, rows in times.items():
        opened, adopted, idle, pending, count = (np.array(col) for col in zip(*rows, strict=True))
        print(f"{name:8s} reopen after a crash at {n // 1000}k: open {np.median(opened):.2f} s, graph cache in "
              f"place {np.median(adopted):.2f} s, {np.median(pending):.0f} of {np.median(count):.0f} vectors "
              f"left to insert, idle-time work until the graphs hold all {np.median(idle):.1f} s "
              f"(min {idle.min():.1f}, max {idle.max():.1f})")


_SEARCHES = """
import statistics, sys, time
sys.path.insert(0, ROOT)
import numpy as np
from reachy_memory import Config, MemoryStore
from tools._bench import questions

class Precomputed:
    dim = 384
    def __init__(self): self._rng = np.random.default_rng(7)
    def embed(self, texts):
        v = self._rng.standard_normal((len(texts), self.dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

cfg = Config().replace("memory", path=PATH).replace("embedding", neighbour_context=False)
store = MemoryStore(config=cfg, embedder=Precomputed())
while store.maintain(4096): pass
emb = Precomputed()
qs = [(q, emb.embed([q])[0]) for q in questions()[:300]]
cases = {
    "search() hybrid (check, embed, rank)": lambda q, v: store.search(q, limit=5, min_score=0),
    "search_vector hybrid": lambda q, v: store.search_vector(q, v, limit=5, min_score=0),
    "search_vector where speaker=user1": lambda q, v: store.search_vector(q, v, limit=5, min_score=0,
                                                                         where={"speaker": "user1"}),
    "search() lexical": lambda q, v: store.search(q, limit=5, min_score=0, mode="lexical"),
    "malformed where refused": lambda q, v: store.search(q, where={"$bad": 1}),
}
out = []
for name, fn in cases.items():
    for q, v in qs[:30]:
        try: fn(q, v)
        except Exception: pass
    samples = []
    for q, v in qs:
        t = time.perf_counter()
        try: fn(q, v)
        except Exception: pass
        samples.append(time.perf_counter() - t)
    out.append(f"{name}\\t{statistics.median(samples) * 1e3:.4f}")
store.close()
print("\\n".join(out))
"""


def bench_search_pipeline(n: int, rounds: int, tmp: Path, against: Path | None) -> None:
    """In-process search latency (median over 300 LoCoMo questions, embedding excluded:
    random query vectors) on ``n`` LoCoMo turns, each round in a fresh process on a fresh
    copy, alternating with the code of ``against`` when given; medians over the rounds."""
    source = tmp / "search"
    lines = dialogue_lines()
    lines = (lines * (n // max(len(lines), 1) + 1))[:n]
    with MemoryStore(config=config(source, fsync="never"), embedder=Precomputed()) as store:
        for start in range(0, n, 1000):
            store.store_batch([{"content": t, "memory_type": "conversation",
                                "metadata": {"speaker": f"user{(start + i) % 5}", "n": start + i}}
                               for i, t in enumerate(lines[start : start + 1000])])
    got: dict[str, dict[str, list[float]]] = {}
    for name, out in _alternating(source, against, rounds, _SEARCHES):
        for line in out.strip().splitlines():
            case, ms = line.split("\t")
            got.setdefault(case, {}).setdefault(name, []).append(float(ms))
    print(f"in-process search on {n} LoCoMo turns, p50 ms (median of {rounds} rounds, embedding excluded)")
    for case, by in got.items():
        this = statistics.median(by["this"])
        other = statistics.median(by["against"]) if "against" in by else None
        versus = f"  against {other:8.4f}  ratio this/against {this / other:5.3f}" if other else ""
        print(f"  {case:<40} this {this:8.4f}{versus}")


def bench_cache_step(n: int, rounds: int, tmp: Path) -> None:
    """The engine-thread pause of an idle-time graph cache save at ``n`` memories: each
    memory type's graph saved ``rounds`` times (each made due by hand), and the longest
    gap another thread saw meanwhile (the save holds the GIL: the daemon's I/O thread
    waits as long)."""
    source = tmp / "cache-step"
    fill(source, n)
    with MemoryStore(config=config(source), embedder=Precomputed()) as store:
        vectors = store._state.vectors
        vectors._adopt_loaded(wait=True)
        while store.maintain(save_cache=False):
            pass
        took: dict[int, list[float]] = {}  # nodes of the graph saved -> seconds of each save
        gaps: dict[int, list[float]] = {}  # the same -> the ticker's longest gap during each
        for _ in range(rounds):
            for group in vectors._graphs:
                vectors._changed = {group: n}
                with _longest_gap() as gap:
                    t0 = time.perf_counter()
                    saved = store.maintain()
                    took.setdefault(saved, []).append(time.perf_counter() - t0)
                gaps.setdefault(saved, []).append(gap[0])
    for nodes in sorted(took):
        took_ms, gaps_ms = np.array(took[nodes]) * 1000, np.array(gaps[nodes]) * 1000
        print(f"cache step at {n // 1000}k, a graph of {nodes} nodes: median {np.median(took_ms):.1f} ms "
              f"(max {took_ms.max():.1f}); longest gap of a 1 ms ticker thread meanwhile "
              f"{np.median(gaps_ms):.1f} ms (max {gaps_ms.max():.1f})")


@contextlib.contextmanager
def _longest_gap() -> Iterator[list[float]]:
    """A thread that sleeps 1 ms at a time while the block runs; yields [its longest gap]."""
    gap, done = [0.0], threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gap[0], last = max(gap[0], now - last), now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    try:
        yield gap
    finally:
        done.set()
        ticker.join()


def recall_real(k: int = 10) -> tuple[float, int]:
    """Recall@10 of the graph vs exact on real MiniLM embeddings of LoCoMo turns."""
    from reachy_memory import load_config, load_embedder

    texts, queries = dialogue_lines(), questions()
    emb = load_embedder(load_config())
    from reachy_memory.engine.vector_index import VectorIndex

    texts += [s.strip() for t in list(texts) for s in t.split(". ") if len(s) > 20]
    texts += [f"{a} {b}" for a, b in itertools.pairwise(texts)]
    texts = list(dict.fromkeys(texts))
    vi = VectorIndex(384, exact_below=0)  # force the hnswlib graph
    for slot, v in enumerate(emb.embed(texts)):
        vi.add(slot, v)
    vi.flush()  # everything into the graph: measure the graph, not the exact pending path
    hits = 0
    qv = emb.embed(queries)
    for q in qv:
        approx = set(vi.search(q, k)[0].tolist())
        hits += len(approx & set(vi.exact(q, np.flatnonzero(vi.alive), k)[0].tolist()))
    return hits / (k * len(qv)), len(texts)


def bench_size(n: int, repeat: int, tmp: Path) -> None:
    path = tmp / f"s{n}"
    print(f"\n== {n} memories ==")
    t0 = time.perf_counter()
    fill(path, n)
    print(f"fill (batches of 1000, fsync=never)              {time.perf_counter() - t0:8.1f} s")
    times = open_time(path)
    print(f"open from disk (3 runs)                          median {np.median(times):.3f} s  "
          f"all {[round(t, 3) for t in times]}")
    gc.collect()
    before = rss_mb()
    with MemoryStore(config=config(path), embedder=EMBEDDER()) as store:
        print(f"RSS of this process with the store open         {rss_mb():8.1f} MB (was {before:.1f} MB before)")
        bench_search(store, f"@{n // 1000}k", repeat)
        far = time.time() + 40 * 86400  # conversations (a third) and contexts expire
        t0 = time.perf_counter()
        store.cleanup_expired(now=time.time())  # nothing expired: the common hourly case
        print(f"cleanup_expired, nothing expired                 {1000 * (time.perf_counter() - t0):8.1f} ms")
        t0 = time.perf_counter()
        deleted = store.cleanup_expired(now=far)
        print(f"cleanup_expired, {deleted} expired                   {1000 * (time.perf_counter() - t0):8.1f} ms")
    bench_store(tmp / f"w{n}", repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k only")
    parser.add_argument("--model-vectors", action="store_true",
                        help="the real model's vectors of the texts (embedded while filling) instead of random ones")
    parser.add_argument("--repeat", type=int, default=500)
    parser.add_argument("--cleanup-only", action="store_true", help="only the 100k expiry sweep")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --cleanup-only and --crash-reopen")
    parser.add_argument("--crash-reopen", action="store_true", help="only the reopening after a crash")
    parser.add_argument("--cache-step", action="store_true", help="the pause of an idle-time graph cache save")
    parser.add_argument("--never-closed", action="store_true",
                        help="--crash-reopen of a store never closed cleanly (no graph cache but idle time's)")
    parser.add_argument("--memories", type=int, help="store size: --crash-reopen and --cache-step 100k, --search 6000")
    parser.add_argument("--against", type=Path,
                        help="another checkout to alternate with (--cleanup-only, --crash-reopen, --search)")
    parser.add_argument("--search", action="store_true", help="only in-process search latency (see --memories)")
    args = parser.parse_args()
    global EMBEDDER
    EMBEDDER = ModelVectors if args.model_vectors else Precomputed
    print(f"vectors: {'the model' if args.model_vectors else 'random unit vectors'}")
    tmp = Path(tempfile.mkdtemp(prefix="rm-bench-"))
    try:
        if args.cleanup_only:
            bench_cleanup(100_000, args.rounds, tmp, args.against)
            return
        if args.cache_step:
            bench_cache_step(args.memories or 100_000, args.rounds, tmp)
            return
        if args.search:
            bench_search_pipeline(args.memories or 6000, args.rounds, tmp, args.against)
            return
        if args.crash_reopen:
            bench_crash_reopen(args.memories or 100_000, args.rounds, tmp, args.against, args.never_closed)
            return
        for n in [10_000] if args.quick else [10_000, 100_000]:
            bench_size(n, args.repeat, tmp)
        try:
            recall, size = recall_real()
            print(f"\nvector recall@10 vs exact, real MiniLM embeddings of {size} LoCoMo turns: {recall:.4f}")
        except Exception as exc:  # the model is optional for this script
            print(f"\n(real-embedding recall skipped: {exc})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
