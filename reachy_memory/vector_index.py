"""Cosine k-NN over memory vectors: an hnswlib graph plus an exact numpy path.

The vectors themselves (a float32 matrix indexed by slot) are the truth and
are persisted in the msgpack snapshot; the hnswlib graph is only a cache that
makes start-up fast.  It is saved next to a checksum and verified on load, and
rebuilt from the vectors when missing, stale or corrupt.

hnswlib traps designed around here (and never surfaced to callers):

* ``knn_query`` raises when it finds fewer than k live elements: k is capped
  at the live count and any RuntimeError falls back to the exact path;
* its Python filter callback is slow: small filtered candidate sets are searched
  exactly with numpy, large ones by over-fetching from the graph and
  post-filtering;
* it is not safe with concurrent writes: the store calls it from one thread;
* ``save_index`` truncates in place: we save to a temp file and rename;
* insertion costs ~0.2 ms a vector: new vectors wait in a *pending* set that is
  searched exactly and inserted in batches (:meth:`flush`, or
  :meth:`maintain` at idle time), and below ``exact_below`` vectors the graph
  is not used at all, because one matrix-vector product is faster there.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import hnswlib
import numpy as np

from .errors import StorageError
from .journal import fsync_dir, pack, unpack

log = logging.getLogger(__name__)


class VectorIndex:
    """Slots -> unit vectors with approximate and exact cosine search."""

    def __init__(self, dim: int, *, m: int = 16, ef_construction: int = 200,
                 ef_search: int = 96, exact_threshold: int = 2048, exact_below: int = 20_000) -> None:
        self.dim = dim
        self._m, self._efc, self._ef = m, ef_construction, ef_search
        self.exact_threshold = exact_threshold
        self.exact_below = exact_below
        self.vectors = np.zeros((0, dim), np.float32)
        self.alive = np.zeros(0, bool)
        self.in_graph = np.zeros(0, bool)
        self.pending: set[int] = set()
        self.count = 0
        self._graph = self._new_graph(1024)
        self._loader: threading.Thread | None = None
        self._loaded: hnswlib.Index | None = None
        self._touched: set[int] = set()  # slots changed while a cached graph loads

    def _new_graph(self, capacity: int) -> hnswlib.Index:
        graph = hnswlib.Index(space="ip", dim=self.dim)
        graph.init_index(max_elements=capacity, ef_construction=self._efc, M=self._m)
        graph.set_ef(self._ef)
        graph.set_num_threads(1)
        return graph

    def _grow(self, slot: int) -> None:
        if slot < len(self.alive):
            return
        size = max(slot + 1, len(self.alive) * 2, 1024)
        vectors = np.zeros((size, self.dim), np.float32)
        vectors[: len(self.vectors)] = self.vectors
        alive = np.zeros(size, bool)
        alive[: len(self.alive)] = self.alive
        in_graph = np.zeros(size, bool)
        in_graph[: len(self.in_graph)] = self.in_graph
        self.vectors, self.alive, self.in_graph = vectors, alive, in_graph

    def add(self, slot: int, vector: np.ndarray) -> None:
        """Insert (or replace) the vector of ``slot``."""
        self._grow(slot)
        self.vectors[slot] = vector
        if not self.alive[slot]:
            self.count += 1
        self.alive[slot] = True
        if self._loader is not None:
            self._touched.add(slot)
        if self.in_graph[slot]:  # a changed vector: the graph node must not stay stale
            self._graph.mark_deleted(slot)
            self.in_graph[slot] = False
        self.pending.add(slot)

    def remove(self, slot: int) -> None:
        """Drop ``slot`` from results (a graph node stays, marked deleted)."""
        if slot < len(self.alive) and self.alive[slot]:
            self.alive[slot] = False
            self.count -= 1
            self.pending.discard(slot)
            if self._loader is not None:
                self._touched.add(slot)
            if self.in_graph[slot]:
                self._graph.mark_deleted(slot)
                self.in_graph[slot] = False

    def flush(self, limit: int | None = None) -> int:
        """Insert up to ``limit`` pending vectors into the graph; returns how many."""
        self._adopt_loaded(wait=limit is None)
        if not self.pending:
            return 0
        batch = np.fromiter(self.pending, np.int64, len(self.pending))
        batch = np.sort(batch)[:limit]
        if self._graph.get_max_elements() < len(self.alive):
            self._graph.resize_index(len(self.alive))
        # Re-adding a deleted label un-deletes it and updates it in place
        # (allow_replace_deleted stays off: its label bookkeeping breaks reuse).
        self._graph.add_items(self.vectors[batch], batch)
        self.in_graph[batch] = True
        self.pending.difference_update(batch.tolist())
        return len(batch)

    def maintain(self, budget: int = 256) -> int:
        """Idle-time work: insert a batch of pending vectors once the graph is needed."""
        if self.count <= self.exact_below // 2:
            return 0
        if not self._adopt_loaded(wait=False):
            return 0  # a cached graph is still loading: inserting now would be wasted
        return self.flush(budget)

    def search(self, query: np.ndarray, k: int, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` (slots, cosine similarities), best first, within ``mask``."""
        if self.count == 0 or k <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        graph_ready = self._adopt_loaded(wait=False) and len(self.pending) <= self.exact_threshold
        if mask is None:
            if self.count <= self.exact_below or not graph_ready:
                return self._scan(query, self.alive, k)
            return self._graph_search(query, min(k, self.count), None)
        allowed = np.zeros(len(self.alive), bool)
        n = min(len(mask), len(self.alive))
        allowed[:n] = mask[:n] & self.alive[:n]
        n_allowed = int(np.count_nonzero(allowed))
        if n_allowed <= self.exact_threshold:
            return self.exact(query, np.flatnonzero(allowed), k)
        # One matrix-vector product beats over-fetching from the graph unless
        # the filter keeps most of the index.
        if self.count <= self.exact_below or not graph_ready or n_allowed < self.count // 2:
            return self._scan(query, allowed, k)
        return self._graph_search(query, k, allowed, n_allowed)

    def _scan(self, query: np.ndarray, allowed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact search by one matrix-vector product over every slot (fast below ~20k)."""
        top = len(allowed) if not allowed.any() else int(np.flatnonzero(allowed)[-1]) + 1
        sims = self.vectors[:top] @ query
        sims[~allowed[:top]] = -np.inf
        k = min(k, int(np.count_nonzero(allowed[:top])))
        best = np.argpartition(-sims, k - 1)[:k] if k < top else np.arange(top)
        best = best[np.argsort(-sims[best], kind="stable")]
        best = best[np.isfinite(sims[best])]
        return best.astype(np.int64), sims[best].astype(np.float32)

    def _graph_search(self, query: np.ndarray, k: int, allowed: np.ndarray | None,
                      n_allowed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        labels, sims = self._graph_only(query, k, allowed, n_allowed)
        if not self.pending:
            return labels, sims
        extra = np.fromiter(self.pending, np.int64, len(self.pending))
        if allowed is not None:
            extra = extra[allowed[extra]]
        more_l, more_s = self.exact(query, extra, k)
        labels, sims = np.concatenate([labels, more_l]), np.concatenate([sims, more_s])
        order = np.argsort(-sims, kind="stable")[:k]
        return labels[order], sims[order]

    def _graph_only(self, query: np.ndarray, k: int, allowed: np.ndarray | None,
                    n_allowed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        graph_count = int(np.count_nonzero(self.in_graph))
        if graph_count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        k = min(k, graph_count)
        fetch = k if allowed is None else min(self.count, int(k * self.count / n_allowed * 2) + 10)
        try:
            self._graph.set_ef(max(self._ef, fetch))
            labels, dist = self._graph.knn_query(query.reshape(1, -1), k=fetch)
        except RuntimeError:
            candidates = np.flatnonzero(self.in_graph if allowed is None else allowed & self.in_graph)
            return self.exact(query, candidates, k)
        labels, sims = labels[0].astype(np.int64), 1.0 - dist[0]
        if allowed is not None:
            keep = allowed[labels]
            labels, sims = labels[keep], sims[keep]
            if len(labels) < k:
                return self.exact(query, np.flatnonzero(allowed & self.in_graph), k)
        return labels[:k], sims[:k].astype(np.float32)

    def exact(self, query: np.ndarray, slots: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top ``k`` among ``slots`` by dot product (cosine for unit vectors)."""
        if len(slots) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        sims = self.vectors[slots] @ query
        if len(slots) > k:
            top = np.argpartition(-sims, k - 1)[:k]
            slots, sims = slots[top], sims[top]
        order = np.argsort(-sims, kind="stable")
        return slots[order], sims[order]

    def similarity(self, query: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Cosine similarity of ``query`` to each of ``slots`` (0 for vector-less slots)."""
        inside = slots < len(self.alive)
        out = np.zeros(len(slots), np.float32)
        ok = slots[inside]
        out[inside] = np.where(self.alive[ok], self.vectors[ok] @ query, 0.0)
        return out

    # -- persistence of the graph cache --------------------------------------------

    def save_graph(self, path: Path, tag: str) -> None:
        """Save the graph to ``path`` atomically with a checksum sidecar."""
        if self.count <= self.exact_below // 2:
            return  # the graph is not used at this size: nothing worth caching
        self._adopt_loaded(wait=True)
        self._graph.set_num_threads(os.cpu_count() or 1)
        self.flush()
        self._graph.set_num_threads(1)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self._graph.save_index(str(tmp))
            crc = zlib.crc32(tmp.read_bytes())
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            meta = {"tag": tag, "crc": crc, "count": self.count}
            _write_meta(path, meta)
            fsync_dir(path.parent)
        except (OSError, RuntimeError) as exc:
            tmp.unlink(missing_ok=True)
            log.warning("could not save the vector graph cache %s: %s", path, exc)

    def load_graph(self, path: Path, tag: str) -> None:
        """Start loading the cached graph in the background if it matches ``tag``.

        Until it is adopted (see :meth:`_adopt_loaded`) searches are exact; a
        missing, stale or corrupt cache leaves every vector pending, and the
        graph is rebuilt in idle-time batches instead of blocking start-up.
        """
        meta = _read_meta(path)
        if meta is None or meta.get("tag") != tag or meta.get("count") != self.count:
            log.warning("vector graph cache %s missing or stale; it will be rebuilt in the background", path)
            return
        self._touched = set()
        self._loader = threading.Thread(target=self._load_file, args=(path, meta), name="graph-load", daemon=True)
        self._loader.start()

    def _load_file(self, path: Path, meta: dict[str, Any]) -> None:
        try:
            if zlib.crc32(path.read_bytes()) != meta.get("crc"):
                log.warning("vector graph cache %s fails its checksum; rebuilding in the background", path)
                return
            graph = hnswlib.Index(space="ip", dim=self.dim)
            graph.load_index(str(path), max_elements=max(len(self.alive), 1024))
            self._loaded = graph
        except (OSError, RuntimeError, MemoryError) as exc:
            log.warning("vector graph cache %s unreadable (%s); rebuilding in the background", path, exc)

    def _adopt_loaded(self, *, wait: bool) -> bool:
        """Take a background-loaded graph once it is ready; True when no load is pending."""
        loader = self._loader
        if loader is None:
            return True
        if loader.is_alive():
            if not wait:
                return False
            loader.join()
        self._loader = None
        graph, self._loaded = self._loaded, None
        if graph is not None and self._verify(graph):
            self._install(graph)
        self._touched = set()
        return True

    def _verify(self, graph: hnswlib.Index) -> bool:
        """The graph must hold every untouched live slot with our vector."""
        live = np.flatnonzero(self.alive)
        labels = np.asarray(graph.get_ids_list(), np.int64)
        stable = np.setdiff1d(live, np.fromiter(self._touched, np.int64, len(self._touched)))
        if len(labels) < len(stable) or not np.isin(stable, labels).all():
            return False
        sample = stable[:: max(1, len(stable) // 32)][:32]
        return not len(sample) or np.allclose(np.asarray(graph.get_items(sample), np.float32),
                                              self.vectors[sample], atol=1e-6)

    def _install(self, graph: hnswlib.Index) -> None:
        """Adopt ``graph``; slots changed during the load are re-inserted from pending."""
        graph.set_ef(self._ef)
        graph.set_num_threads(1)
        if graph.get_max_elements() < len(self.alive):
            graph.resize_index(len(self.alive))
        labels = set(graph.get_ids_list())
        for slot in self._touched & labels:
            try:
                graph.mark_deleted(slot)
            except RuntimeError:
                pass  # already marked deleted in the cached graph
        self._graph = graph
        self.in_graph = np.zeros(len(self.alive), bool)
        stable = [s for s in np.flatnonzero(self.alive).tolist() if s not in self._touched and s in labels]
        self.in_graph[stable] = True
        self.pending.difference_update(stable)

    def load_vectors(self, data: memoryview | bytes, alive: np.ndarray) -> None:
        """Restore the vector matrix (from a snapshot) and the live mask.

        ``data`` is used in place when writable (a view into the snapshot
        buffer): copying 150 MB would cost more than the rest of opening.
        """
        matrix = np.frombuffer(data, np.float32).reshape(-1, self.dim)
        self.vectors = matrix if matrix.flags.writeable else matrix.copy()
        self.alive = alive.copy()
        self.in_graph = np.zeros(len(alive), bool)
        self.pending = set(np.flatnonzero(alive).tolist())
        self.count = int(np.count_nonzero(alive))

    def vector_bytes(self) -> memoryview:
        """The vector matrix up to the highest used slot (a view, for the snapshot)."""
        live = np.flatnonzero(self.alive)
        top = int(live.max()) + 1 if len(live) else 0
        return memoryview(np.ascontiguousarray(self.vectors[:top]).reshape(-1).view(np.uint8))

    def stats(self) -> dict[str, Any]:
        """Counts for health and stats replies."""
        return {"vectors": self.count, "slots": len(self.alive), "graph_elements": self._graph.element_count,
                "pending": len(self.pending)}


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta")


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    try:
        _meta_path(path).write_bytes(pack(meta))
    except OSError as exc:
        raise StorageError(f"cannot write {path}.meta: {exc.strerror}", path=str(path)) from exc


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = unpack(_meta_path(path).read_bytes())
    except Exception:  # missing or damaged sidecar: the cache is simply unusable
        return None
    return meta if isinstance(meta, dict) else None
