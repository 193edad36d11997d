"""One measured process of ``tools/bench_vs_spec.py`` (run by it, never by hand).

    python tools/_vs_spec_worker.py JOB.json      # prints one JSON result line

A job names a system and a phase.  ``load`` fills a data directory (not timed);
``measure`` opens that directory cold and times, in this order: start to the
first filtered search (imports, model and store included), single stores,
searches and searches filtered to facts, then reports peak RSS.  Systems:

* ``spec``: the spec's ``MemoryManager`` design (000, "Memory Manager"): ChromaDB
  ``PersistentClient`` + ``SentenceTransformer`` on CPU torch, one ``encode`` per
  store and per search, exactly as the spec's code does.  Runs in the spec's
  own environment (``.bench/spec-venv``), which has no reachy_memory.
* ``engine``: ``reachy_memory.MemoryStore`` in-process.
* ``daemon``: a ``reachy-memory serve`` child process driven by ``MemoryClient``;
  its RSS is the daemon's.

``chart`` draws the PNG from the results (matplotlib, spec environment).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any


class SpecDesign:
    """The spec's MemoryManager, synchronous (its async methods await nothing)."""

    def __init__(self, path: str, model_dir: str, threads: int) -> None:
        import chromadb
        import torch
        from sentence_transformers import SentenceTransformer, models

        torch.set_num_threads(threads)
        self._client = chromadb.PersistentClient(path=path)
        self._collection = self._client.get_or_create_collection(name="memories", metadata={"hnsw:space": "cosine"})
        # SentenceTransformer("all-MiniLM-L6-v2") from the same weights, offline: its
        # modules are BERT, mean pooling and normalisation.
        bert = models.Transformer(model_dir, max_seq_length=256)
        self._embedder = SentenceTransformer(modules=[bert, models.Pooling(384, "mean"), models.Normalize()],
                                             device="cpu")

    def store(self, content: str, memory_type: str) -> None:
        embedding = self._embedder.encode(content).tolist()
        self._collection.add(ids=[str(uuid.uuid4())], embeddings=[embedding], documents=[content],
                             metadatas=[{"type": memory_type, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S")}])

    def store_many(self, items: list[tuple[str, str]]) -> None:
        vectors = self._embedder.encode([c for c, _ in items], batch_size=64).tolist()
        for start in range(0, len(items), 1000):
            part = slice(start, start + 1000)
            self._collection.add(ids=[str(uuid.uuid4()) for _ in items[part]], embeddings=vectors[part],
                                 documents=[c for c, _ in items[part]],
                                 metadatas=[{"type": t, "created_at": "2026-01-01T00:00:00"} for _, t in items[part]])

    def search(self, query: str, memory_type: str | None = None) -> int:
        where = {"type": memory_type} if memory_type else None
        found = self._collection.query(query_embeddings=[self._embedder.encode(query).tolist()], n_results=5,
                                       where=where)
        return len(found["ids"][0])

    def close(self) -> None:
        pass


class _Reachy:
    """What the in-process store and the client share: the same calls."""

    _api: Any  # a MemoryStore or a MemoryClient

    def store(self, content: str, memory_type: str) -> None:
        self._api.store(content, memory_type)

    def store_many(self, items: list[tuple[str, str]]) -> None:
        for start in range(0, len(items), 500):
            self._api.store_batch([{"content": c, "memory_type": t} for c, t in items[start : start + 500]])

    def search(self, query: str, memory_type: str | None = None) -> int:
        return len(self._api.search(query, memory_type, limit=5))

    def close(self) -> None:
        self._api.close()


class Engine(_Reachy):
    """reachy-memory in-process."""

    def __init__(self, path: str, model_dir: str, threads: int) -> None:
        from reachy_memory import Config, MemoryStore

        config = Config().replace("memory", path=path, fsync="always").replace("embedding", threads=threads)
        self._api = MemoryStore(config=config)


class Daemon(_Reachy):
    """reachy-memory as a daemon process (``tests.daemon_util``), through the client."""

    def __init__(self, path: str, model_dir: str, threads: int) -> None:
        from tests.daemon_util import DaemonProcess

        # DaemonProcess keeps its data in <root>/data: the path the job names.
        self.daemon = DaemonProcess(Path(path).parent, memory={"fsync": "always"},
                                    embedding={"threads": threads}).start()
        assert self.daemon.proc is not None
        self.pid = self.daemon.proc.pid
        self._api = self.daemon.client(timeout=120)

    def close(self) -> None:
        super().close()
        self.daemon.stop()


SYSTEMS: dict[str, type[SpecDesign] | type[Engine] | type[Daemon]] = {"spec": SpecDesign, "engine": Engine,
                                                                      "daemon": Daemon}


def measure(job: dict[str, Any], started: float) -> dict[str, Any]:
    """The timed phase (see the module docs)."""
    system = SYSTEMS[job["system"]](job["data"], job["model_dir"], job["threads"])
    system.search(job["filtered"][0], "fact")
    cold = time.time() - started
    from tools._bench import memory_mb, timed_each  # the project root is on sys.path now

    def ms(fn: Any, args: list[Any]) -> list[float]:
        return [1000 * t for t in timed_each(fn, [(a,) for a in args])]

    out: dict[str, Any] = {"cold_start_s": cold, "store_ms": ms(lambda t: system.store(t, "fact"), job["new"]),
                           "search_ms": ms(system.search, job["queries"]),
                           "filtered_ms": ms(lambda q: system.search(q, "fact"), job["filtered"][1:])}
    out["hits"] = [system.search(q) for q in job["queries"][:3]]  # untimed: that each system finds something
    out["rss_mb"] = memory_mb(system.pid if isinstance(system, Daemon) else "self")[1]
    system.close()
    return out


def chart(results_path: str, png: str) -> None:
    """Grouped bars of the medians in ``results_path`` (what bench_vs_spec writes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = json.loads(Path(results_path).read_text())
    panels = [("search p50 (ms)", "search_p50"), ("search p99 (ms)", "search_p99"),
              ("filtered search p50 (ms)", "filtered_p50"), ("store p50 (ms)", "store_p50"),
              ("cold start (s)", "cold_start_s"), ("peak RSS (MB)", "rss_mb")]
    systems = list(table)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 3.4))
    for ax, (title, key) in zip(axes, panels, strict=True):
        values = [table[s][key] for s in systems]
        bars = ax.bar(range(len(systems)), values, color=["#999999", "#2a7fbf", "#57a35a"][: len(systems)])
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(systems)), systems, fontsize=7, rotation=20)
        ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize=7)
    fig.suptitle("spec design (ChromaDB + sentence-transformers) vs reachy-memory, lower is better", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    if sys.argv[1] == "chart":
        chart(sys.argv[2], sys.argv[3])
        return
    job = json.loads(Path(sys.argv[1]).read_text())
    if job.get("src"):
        sys.path.insert(0, job["src"])
    if job["phase"] == "load":
        system = SYSTEMS[job["system"]](job["data"], job["model_dir"], job["threads"])
        system.store_many([(t, ty) for t, ty in job["memories"]])
        system.close()
        print(json.dumps({"loaded": len(job["memories"])}))
        return
    print(json.dumps(measure(job, job["started"])))


if __name__ == "__main__":
    main()
