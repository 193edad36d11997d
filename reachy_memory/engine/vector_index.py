"""Cosine k-NN over memory vectors: hnswlib graphs plus an exact numpy path.

The vectors (a matrix indexed by slot) are the truth and are persisted in the
msgpack snapshot; the hnswlib graphs are only a cache that makes search at scale
fast.  The matrix keeps each component as bfloat16 (the upper 16 bits of its
float32, rounded to nearest even): half the memory and snapshot bytes of float32,
widened back exactly by a shift; each component within 2^-8 of its float32
(relatively), so a cosine moves by ~1e-4 typically and 2^-8 at worst
(:func:`to_bf16`).  hnswlib keeps a float32 copy of every vector in its graphs
anyway, and at 10k memories the bf16 matrix saved the daemon 8 MB of RSS.

Each *group* (the store uses one per memory type) has its own graph, so a
search restricted to a type walks only that type's graph instead of
over-fetching from a shared one.

hnswlib traps designed around here (and never surfaced to callers):

* ``knn_query`` raises when it finds fewer than k live elements: k is capped
  and any RuntimeError falls back to the exact path;
* its Python filter callback is slow: small filtered candidate sets are
  searched exactly with numpy, larger ones by over-fetching and post-filtering;
* it is not safe with concurrent writes: the store calls it from one thread;
* ``save_index`` truncates in place: we save to a temp file and rename;
* insertion costs ~0.2 ms a vector: new vectors wait in a *pending* set that is
  searched exactly and inserted in batches (:meth:`maintain` at idle time; a
  write's check, :func:`nearest`, reads float32 copies of them, :class:`_Waiting`);
  below ``exact_below`` vectors no graph is used at all, because one
  matrix-vector product is faster there.

Cached graphs are verified (checksum, sampled vectors) and loaded in a
background thread; until then search is exact.  The cache lists each graph's
nodes with a fingerprint of the vector each holds, so a cache older than the
store (saved at the last clean close, or by :meth:`VectorIndex.cache_step` in
idle time once a group's graph changed enough, then a crash or a power cut) is
reused: nodes whose slot still holds that vector are kept, the others marked
deleted, and only the vectors the cache lacks are inserted in idle-time
batches (a group whose graph keeps too little to pay for the updates in place
it implies, as after a reindex, is built afresh instead).  A missing or corrupt
cache (or one from before fingerprints, unless it matches the snapshot exactly)
leaves every vector pending, so the graphs are rebuilt in idle-time batches
instead of blocking start-up.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import hnswlib
import numpy as np

from reachy_memory._threads import big_buffer, release_pages
from reachy_memory.errors import StorageError
from reachy_memory.storage.journal import fsync_dir, pack, unpack, write_atomic

log = logging.getLogger(__name__)
_NONE = (np.zeros(0, np.int64), np.zeros(0, np.float32))
_NO_ROWS = np.zeros((0, 0), np.uint16)
GATHER_ROWS = 1024  # rows per step of an exact search's gather (1.5 MB at 384 dimensions)
# Vectors a search inserts into the graphs when too many wait and no idle time comes:
# 256 (before) held that search 50-170 ms on this VM; 16 cost 4-8 ms.
SEARCH_CATCH_UP = 16
LOAD_STEP = 4 << 20  # bytes copied from the snapshot buffer before that part is given back
VECTOR_FORMAT = "bf16"  # the snapshot's vector block as written now (``vector_format`` in its head)
ITEM_BYTES = {"bf16": 2, "f32": 4}  # bytes a component in each readable format (absent: "f32", before bf16)
# bfloat16 keeps 8 significant bits: a stored component is within 2^-8 of its float32, relatively
BF16_TOLERANCE = 2.0**-8
PRINT_ROWS = 1024  # rows fingerprinted a step (3 MB of temporaries; the GIL is given back between steps)
# Re-adding a slot whose node a graph holds (deleted) updates it in place, repairing its
# neighbourhood: 6-17x the time of an insertion (384 dimensions, this VM).  A cached graph
# is adopted only when it keeps more than this many nodes for each such update it implies.
UPDATE_COST = 8
# A group's graph is saved again in idle time (:meth:`VectorIndex.cache_step`) once this
# share of its nodes (and at least CACHE_MIN_CHANGES) changed since its cached copy: after a
# crash only what changed since is inserted again (~0.5 ms a node at 10k, 2 ms at 100k
# here), and a save costs ~2.4 us a node on the engine thread (80 ms for a 33k graph).
CACHE_SHARE = 20
CACHE_MIN_CHANGES = 256
CACHE_RETRY_SECONDS = 600.0  # after a failed save (a full disk, a read-only data dir)
CRC_STEP = 1 << 20  # bytes of a saved graph read back a step to checksum it
# Pending vectors kept as float32 copies for the write-time check (:class:`_Waiting`): 3 MB at 384 dimensions.
WAITING_ROWS = 2048


def fingerprints(bits: np.ndarray) -> np.ndarray:
    """A 64-bit fingerprint of each bfloat16 row of ``bits`` (n, dim): the sum of its
    64-bit words (four components each, or one when ``dim`` is not a multiple of 4)
    times fixed odd 64-bit weights, wrapping.  Rows that differ in one component
    never share one (a 16-bit difference shifted by at most 48 bits, times an odd
    weight, is never 0 mod 2^64); rows that differ more, by chance only (~2^-64).
    That is what tells a cached graph node from a slot reused by another vector.
    100k rows of 384: 16-22 ms here (per component, as first written: 0.6 s)."""
    rows = np.ascontiguousarray(bits, np.uint16)
    words = rows.view(np.uint64) if rows.shape[1] % 4 == 0 else rows.astype(np.uint64)
    return (words * _print_weights(words.shape[1])).sum(axis=1, dtype=np.uint64)


def _print_weights(dim: int) -> np.ndarray:
    """``dim`` odd weights from SplitMix64: fixed by arithmetic, not by a random generator
    whose stream a numpy release may change (the fingerprints are saved with the cache)."""
    z = (np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def to_bf16(vectors: np.ndarray) -> np.ndarray:
    """``vectors`` (finite float32) as bfloat16 bits (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(vectors, np.float32).view(np.uint32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)


def widen(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 ``bits`` as float32 (exactly), written into ``out`` (uint32, same shape)
    when given: two vectorised passes, where numpy's float16 cast took 10x as long."""
    wide = np.empty(bits.shape, np.uint32) if out is None else out
    np.copyto(wide, bits)
    np.left_shift(wide, 16, out=wide)
    return wide.view(np.float32)


def _make_room(graph: hnswlib.Index, more: int) -> None:
    """Room in ``graph`` for ``more`` new nodes, doubling as it fills: a graph holds
    only its own group's nodes (marked-deleted ones included), and every place costs
    ~46 bytes in hnswlib even unused (a mutex, a level, a visited mark), so sizing
    each group's graph to every slot cost 2 MB at 10k memories and 20 MB at 100k."""
    needed = graph.element_count + more
    if graph.get_max_elements() < needed:
        graph.resize_index(max(2 * needed, 1024))


def _rows(mapping: mmap.mmap, rows: int, dim: int) -> np.ndarray:
    """The first ``rows`` bfloat16 rows of ``mapping`` as a writable (rows, dim) uint16 view."""
    return np.frombuffer(mapping, np.uint16, rows * dim).reshape(rows, dim)


class RowDots:
    """Products of bf16 rows with a query through reused buffers, ``GATHER_ROWS`` rows at a
    time: no allocation the size of the gather (with the daemon's fixed mmap threshold each
    would be a fresh mapping, page-faulted row by row), and the rows stay in cache for their
    product (20,000 of 100k rows: 6.6 -> 3.8 ms).  Owned by one thread (the engine's)."""

    def __init__(self, dim: int) -> None:
        self._bits = np.empty((GATHER_ROWS, dim), np.uint16)  # gathered bits
        self._wide = np.empty((GATHER_ROWS, dim), np.uint32)  # the same rows widened

    def gather(self, matrix: np.ndarray, slots: np.ndarray, query: np.ndarray) -> np.ndarray:
        """``matrix[slots] @ query`` (widened)."""
        sims = np.empty(len(slots), np.float32)
        for start in range(0, len(slots), GATHER_ROWS):
            part = slots[start : start + GATHER_ROWS]
            # mode="clip": with the default "raise" numpy gathers into a temporary first
            bits = np.take(matrix, part, axis=0, out=self._bits[: len(part)], mode="clip")
            self._dot(bits, query, sims[start : start + len(part)])
        return sims

    def scan(self, matrix: np.ndarray, top: int, query: np.ndarray) -> np.ndarray:
        """``matrix[0:top] @ query`` (widened)."""
        sims = np.empty(top, np.float32)
        for start in range(0, top, GATHER_ROWS):
            stop = min(top, start + GATHER_ROWS)
            self._dot(matrix[start:stop], query, sims[start:stop])
        return sims

    def _dot(self, bits: np.ndarray, query: np.ndarray, out: np.ndarray) -> None:
        np.matmul(widen(bits, self._wide[: len(bits)]), query, out=out)


class VectorIndex:
    """Slots -> unit vectors, grouped, with approximate and exact cosine search."""

    def __init__(self, dim: int, *, m: int = 16, ef_construction: int = 200, ef_search: int = 96,
                 exact_threshold: int = 2048, exact_below: int = 8192) -> None:
        self.dim = dim
        self._m, self._efc, self._ef = m, ef_construction, ef_search
        self.exact_threshold = exact_threshold
        self.exact_below = exact_below
        self.matrix = np.zeros((0, dim), np.uint16)  # bf16 rows of ``_map`` (engine thread; snapshots hold views)
        self._map: mmap.mmap | None = None
        self.alive = np.zeros(0, bool)
        self.in_graph = np.zeros(0, bool)
        self.group = np.zeros(0, np.int8)
        self.pending: set[int] = set()
        self.count = 0
        self._graphs: dict[int, hnswlib.Index] = {}
        self._in_graph_count: dict[int, int] = {}  # live slots per group graph (kept, not recounted)
        self._loader: threading.Thread | None = None
        self._loaded: dict[int, _Loaded] = {}  # group -> a graph read by the loader thread
        self._touched: set[int] = set()  # slots changed while cached graphs load
        self._unmarked: set[int] = set()  # dead slots still live in their graph (see remove_many)
        # Engine thread: nodes added or marked deleted in each group's graph since that graph
        # was last cached (the work a crash would leave to redo), and the cache's meta as
        # last read or written, into which an idle-time save of one group is merged.
        self._changed: dict[int, int] = {}
        self._cache_meta: dict[str, Any] | None = None
        self._cache_failed_at = -CACHE_RETRY_SECONDS
        self._version = 0  # bumped by every change of the vectors (invalidates the scan memo)
        self._snapshot_version: int | None = None  # _version right after load_vectors (see load_graph)
        self._memo: tuple[int, np.ndarray, np.ndarray] | None = None  # (version, query, sims) of the last scan
        self._dots = RowDots(dim)  # (engine thread only)
        self._waiting = _Waiting(dim)  # float32 copies of the pending vectors (engine thread only)

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
        self._resize_rows(size)
        self.alive, self.in_graph, self.group = (_extend(a, size) for a in (self.alive, self.in_graph, self.group))

    def _resize_rows(self, rows: int) -> None:
        """Grow the vector matrix to ``rows`` rows (new rows zero).  Its mapping is
        resized in place, the kernel moving the pages, so growing never holds two
        copies (a 10k-memory daemon's peak RSS was 17 MB higher for one copy at its
        first store after opening); it is copied only when a view of the old rows
        is still held (a background snapshot writing them), or where the system
        cannot resize a mapping (no mremap: macOS).  Raises MemoryError with the
        matrix unchanged."""
        used, nbytes, mapping = len(self.matrix), rows * self.row_bytes, self._map
        if mapping is not None:
            self.matrix = _NO_ROWS  # our own view: a mapping with views cannot be resized
            try:
                mapping.resize(nbytes)
                used = rows
            except (BufferError, SystemError):  # a view held; SystemError: no mremap here
                pass
            except OSError as exc:
                raise MemoryError(f"cannot grow the vector matrix to {rows} rows: {exc.strerror}") from exc
            finally:
                self.matrix = _rows(mapping, used, self.dim)
            if used == rows:
                return
        fresh = big_buffer(nbytes)
        matrix = _rows(fresh, rows, self.dim)
        matrix[:used] = self.matrix
        self._map, self.matrix = fresh, matrix

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the matrix (and of the snapshot's vector block)."""
        return self.dim * ITEM_BYTES[VECTOR_FORMAT]

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The stored vectors of ``slots`` (in range) as float32 rows (a copy)."""
        return widen(self.matrix[slots])

    # -- changes -----------------------------------------------------------------------

    def add(self, slot: int, vector: np.ndarray, group: int = 0) -> None:
        """Insert (or replace) the vector of ``slot`` in ``group``."""
        self._grow(slot)
        self._unlink(slot)
        self._version += 1
        self.matrix[slot] = to_bf16(vector)
        if not self.alive[slot]:
            self.count += 1
        self.alive[slot] = True
        self.group[slot] = group
        self.pending.add(slot)
        self._waiting.put(slot, group, widen(self.matrix[slot]))

    def remove(self, slot: int) -> None:
        """Drop ``slot`` from results (a graph node stays, marked deleted)."""
        if slot < len(self.alive) and self.alive[slot]:
            self._version += 1
            self._unlink(slot)
            self.alive[slot] = False
            self.count -= 1
            self.pending.discard(slot)
            self._waiting.drop([slot])

    def clear_rows(self, slots: list[int]) -> None:
        """Zero the rows of freed ``slots`` (no frozen view holds them): a snapshot writes
        every row up to the highest live slot, and a dead row must not keep the vector of
        a forgotten memory."""
        inside = [s for s in slots if s < len(self.matrix)]
        if inside:
            self._version += 1
            self.matrix[inside] = 0

    def remove_many(self, slots: np.ndarray) -> None:
        """Drop ``slots`` from results at once (a mass expiry).  Their graph nodes are
        marked deleted later (:meth:`settle`, at idle time): marking costs ~1 us a node
        in hnswlib, and until then every search filters the graphs by liveness."""
        slots = slots[slots < len(self.alive)]
        slots = slots[self.alive[slots]]
        if not len(slots):
            return
        self._version += 1
        self.alive[slots] = False
        self.count -= len(slots)
        listed = slots.tolist()
        self.pending.difference_update(listed)
        self._waiting.drop(listed)
        if self._loader is not None:
            self._touched.update(listed)
        self._unmarked.update(slots[self.in_graph[slots]].tolist())

    def settle(self, budget: int | None = None) -> int:
        """Mark up to ``budget`` (None: all) nodes of :meth:`remove_many` deleted in
        their graphs; returns how many are left to mark."""
        for _ in range(len(self._unmarked) if budget is None else min(budget, len(self._unmarked))):
            self._unlink(self._unmarked.pop())
        return len(self._unmarked)

    def _unlink(self, slot: int) -> None:
        """Take ``slot`` out of its graph (the node must not keep a stale vector)."""
        if self._loader is not None:
            self._touched.add(slot)
        self._unmarked.discard(slot)
        if self.in_graph[slot]:
            group = int(self.group[slot])
            self._graphs[group].mark_deleted(slot)
            self._in_graph_count[group] -= 1
            self._changed[group] = self._changed.get(group, 0) + 1
            self.in_graph[slot] = False

    def flush(self, limit: int | None = None) -> int:
        """Insert up to ``limit`` pending vectors into their graphs; returns how many."""
        self._adopt_loaded(wait=limit is None)
        if not self.pending:
            return 0
        batch = np.sort(np.fromiter(self.pending, np.int64, len(self.pending)))[:limit]
        for group in np.unique(self.group[batch]).tolist():
            slots = batch[self.group[batch] == group]
            graph = self._graphs.get(group) or self._graphs.setdefault(group, self._new_graph(1024))
            _make_room(graph, len(slots))
            # Re-adding a deleted label un-deletes it and updates it in place
            # (allow_replace_deleted stays off: its label bookkeeping breaks reuse).
            graph.add_items(self.rows(slots), slots)
            self._in_graph_count[group] = self._in_graph_count.get(group, 0) + len(slots)
            self._changed[group] = self._changed.get(group, 0) + len(slots)
        self.in_graph[batch] = True
        done = batch.tolist()
        self.pending.difference_update(done)
        self._waiting.drop(done)
        return len(batch)

    def maintain(self, budget: int = 256) -> int:
        """Idle-time work: insert a batch of pending vectors once graphs are needed."""
        if self.count <= self.exact_below // 2 or not self._adopt_loaded(wait=False):
            return 0
        return self.flush(budget)

    # -- search ------------------------------------------------------------------------

    def search(self, query: np.ndarray, k: int, mask: np.ndarray | None = None,
               groups: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` (slots, cosine similarities), best first, within ``mask``.

        ``groups`` names the groups ``mask`` can match (None: any), so the
        search walks only their graphs.
        """
        if self.count == 0 or k <= 0:
            return _NONE
        allowed = self.alive
        if mask is not None:
            allowed = np.zeros(len(self.alive), bool)
            n = min(len(mask), len(self.alive))
            allowed[:n] = mask[:n] & self.alive[:n]
        n_allowed = self.count if mask is None else int(np.count_nonzero(allowed))
        if n_allowed <= self.exact_threshold:
            return self.exact(query, np.flatnonzero(allowed), k)
        loaded = self._adopt_loaded(wait=False)
        if loaded and self.count > self.exact_below and len(self.pending) > self.exact_threshold:
            self.flush(SEARCH_CATCH_UP)  # catch up a small step at a time when no idle time does it
        ready = loaded and len(self.pending) <= self.exact_threshold
        if self.count <= self.exact_below or not ready:
            return self._scan(query, allowed, k)
        if mask is not None and groups is None and n_allowed * 4 < self.count:
            # A filter across every group keeping under a quarter of the index:
            # gathering those rows costs less than over-fetching from each graph.
            return self.exact(query, np.flatnonzero(allowed), k)
        # Nodes of a mass expiry not yet marked deleted are filtered out like a mask.
        return self._graph_search(query, k, None if mask is None and not self._unmarked else allowed, groups)

    def _scan(self, query: np.ndarray, allowed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact search by one matrix-vector product over every slot (fast below ~8k)."""
        live = np.flatnonzero(allowed)
        if len(live) == 0:
            return _NONE
        top = int(live[-1]) + 1
        sims = self._similarities(query, top)
        sims[~allowed[:top]] = -np.inf
        k = min(k, len(live))
        best = np.argpartition(-sims, k - 1)[:k] if k < top else np.arange(top)
        best = best[np.argsort(-sims[best], kind="stable")]
        best = best[np.isfinite(sims[best])]
        return best.astype(np.int64), sims[best].astype(np.float32)

    def _similarities(self, query: np.ndarray, top: int) -> np.ndarray:
        """``vectors[:top] @ query`` (a copy the caller may change).  Memoised for the last
        query: one prompt's searches of several memory types scan the matrix once."""
        memo = self._memo
        if memo is not None and memo[0] == self._version and len(memo[2]) >= top and np.array_equal(memo[1], query):
            return memo[2][:top].copy()
        live = np.flatnonzero(self.alive)
        sims = self._dots.scan(self.matrix, max(top, int(live[-1]) + 1 if len(live) else 0), query)
        self._memo = (self._version, query.copy(), sims)
        return sims[:top].copy()

    def _graph_search(self, query: np.ndarray, k: int, allowed: np.ndarray | None,
                      groups: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._graph_only(query, k, g, allowed) for g in (groups or list(self._graphs)) if g in self._graphs]
        if self.pending:
            extra = np.fromiter(self.pending, np.int64, len(self.pending))
            if allowed is not None:
                extra = extra[allowed[extra]]
            parts.append(self.exact(query, extra, k))
        if not parts:
            return _NONE
        labels, sims = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        order = np.argsort(-sims, kind="stable")[:k]
        return labels[order], sims[order]

    def _graph_only(self, query: np.ndarray, k: int, group: int, allowed: np.ndarray | None,
                    ef: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` of one group's graph, over-fetching when a filter drops results."""
        n_members = self._in_graph_count.get(group, 0)
        n_allowed = n_members
        if allowed is not None:  # the only case that needs a pass over every slot
            n_allowed = int(np.count_nonzero(allowed & self.in_graph & (self.group == group)))
        if n_allowed == 0:
            return _NONE
        if n_allowed <= self.exact_threshold:
            return self.exact(query, self._members(group, allowed), k)
        fetch = min(n_members, k if allowed is None else int(k * n_members / n_allowed * 1.5) + 10)
        graph = self._graphs[group]
        try:
            graph.set_ef(max(ef or self._ef, fetch))
            labels, dist = graph.knn_query(query.reshape(1, -1), k=fetch)
        except RuntimeError:
            return self.exact(query, self._members(group, allowed), k)
        labels, sims = labels[0].astype(np.int64), (1.0 - dist[0]).astype(np.float32)
        if allowed is not None:
            keep = allowed[labels]
            labels, sims = labels[keep], sims[keep]
            if len(labels) < min(k, n_allowed):
                return self.exact(query, self._members(group, allowed), k)
        return labels[:k], sims[:k]

    def _members(self, group: int, allowed: np.ndarray | None) -> np.ndarray:
        """Slots in ``group``'s graph (and ``allowed``)."""
        members = self.in_graph & (self.group == group)
        return np.flatnonzero(members if allowed is None else members & allowed)

    def exact(self, query: np.ndarray, slots: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top ``k`` among ``slots`` by dot product (cosine for unit vectors)."""
        if len(slots) == 0:
            return _NONE
        sims = self._dots.gather(self.matrix, slots, query)
        if len(slots) > k:
            top = np.argpartition(-sims, k - 1)[:k]
            slots, sims = slots[top], sims[top]
        order = np.argsort(-sims, kind="stable")
        return slots[order], sims[order]

    def unit_rows(self, slots: np.ndarray) -> np.ndarray:
        """The stored unit vectors of ``slots``; a zero row for a slot without one."""
        out = np.zeros((len(slots), self.dim), np.float32)
        ok = slots < len(self.alive)
        ok[ok] = self.alive[slots[ok]]
        out[ok] = self.rows(slots[ok])
        return out

    def similarity(self, query: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Cosine similarity of ``query`` to each of ``slots`` (0 for vector-less slots)."""
        inside = slots < len(self.alive)
        out = np.zeros(len(slots), np.float32)
        ok = slots[inside]
        out[inside] = np.where(self.alive[ok], self.rows(ok) @ query, 0.0)
        return out

    # -- persistence of the graph cache --------------------------------------------

    def save_graph(self, path: Path, tag: str, *, force: bool = False) -> None:
        """Save every group's graph next to ``path`` atomically, with checksums.

        Pending vectors are inserted first; when there are many and not
        ``force`` (a compaction while serving), saving is skipped rather than
        stalling the caller for seconds.
        """
        if self.count <= self.exact_below // 2:
            return  # no graph is used at this size: nothing worth caching
        if len(self.pending) > 4 * self.exact_threshold and not force:
            # Inserting them now would stall the caller for seconds; idle-time
            # maintenance (or searches) will, and a later compaction caches them.
            return
        self._adopt_loaded(wait=True)
        self.settle()  # a saved graph must not hold dead nodes as live
        for graph in self._graphs.values():
            graph.set_num_threads(os.cpu_count() or 1)
        self.flush()
        meta: dict[str, Any] = {"tag": tag, "count": self.count, "dim": self.dim, "groups": {}, "nodes": {}}
        try:
            for group, graph in self._graphs.items():
                graph.set_num_threads(1)
                meta = self._with_group(meta, path, tag, group, durable=True)
            _write_meta(path, meta)
            fsync_dir(path.parent)
        except (OSError, RuntimeError, StorageError) as exc:
            log.warning("could not save the vector graph cache %s: %s", path, exc)
            return
        self._cache_meta, self._changed = meta, dict.fromkeys(self._graphs, 0)

    def cache_step(self, path: Path, tag: str, now: float) -> int:
        """Idle time: save the graph of the group that changed most since its cached copy,
        when that is at least ``1 / CACHE_SHARE`` of its nodes (and ``CACHE_MIN_CHANGES``),
        so a crash or a power cut (a robot switched off, never closed cleanly) leaves
        only that much to insert again at the next open.  One group a call, the others
        keep their entries in the cache's meta: each group's graph file and node list
        stand on their own.  Nothing waits to be inserted or marked when it saves, so
        the graph's live nodes are exactly its listed ones.  Not fsynced: a graph or
        meta lost to a power cut fails its checksum and that group is rebuilt, as
        without the save.  Returns the nodes saved (0: none due, or a save failed:
        logged, and tried again ``CACHE_RETRY_SECONDS`` after ``now``, monotonic)."""
        group = self._cache_due(now)
        if group is None:
            return 0
        try:
            meta = self._with_group(self._cache_meta or {}, path, tag, group, durable=False)
            _write_meta(path, meta)
        except (OSError, RuntimeError, StorageError) as exc:
            log.warning("could not save the vector graph cache %s (trying again in %.0f s): %s",
                        path, CACHE_RETRY_SECONDS, exc)
            self._cache_failed_at = now
            return 0
        self._cache_meta, self._changed[group] = meta, 0
        return self._in_graph_count.get(group, 0)

    def _with_group(self, meta: dict[str, Any], path: Path, tag: str, group: int, *, durable: bool) -> dict[str, Any]:
        """``group``'s graph saved next to ``path``; returns a copy of ``meta`` (the
        cache's sidecar) naming it, with its checksum and node list, and the other
        groups' entries as they were."""
        crc = _save_one(self._graphs[group], _group_path(path, group), durable=durable)
        return {**meta, "tag": tag, "count": self.count, "dim": self.dim,
                "groups": {**meta.get("groups", {}), group: crc},
                "nodes": {**meta.get("nodes", {}), group: self._node_prints(group)}}

    def _cache_due(self, now: float) -> int | None:
        """The group whose graph :meth:`cache_step` should save now, if any."""
        settled = self._loader is None and not self.pending and not self._unmarked
        if not settled or self.count <= self.exact_below // 2 or now - self._cache_failed_at < CACHE_RETRY_SECONDS:
            return None
        due = {group: changed for group, changed in self._changed.items() if group in self._graphs
               and changed >= max(CACHE_MIN_CHANGES, self._in_graph_count.get(group, 0) // CACHE_SHARE)}
        return max(due, key=due.__getitem__) if due else None

    def load_graph(self, path: Path, tag: str) -> None:
        """Start loading cached graphs in the background: a cache that lists its nodes'
        fingerprints and has our dimension whatever its age (the nodes still right are
        kept), any other only if it matches ``tag`` (model included) and the vector count
        and no vector changed since :meth:`load_vectors` (nothing tells which nodes a
        journal's replay changed).  The store calls it after that replay: a slot changed
        while the cache loads is never kept, and the replay's slots (idle time may have
        cached their nodes since the snapshot) would all have counted as changed.
        hnswlib loads a graph of another dimension without a word, and inserting into it
        overwrites its nodes' labels and links (a model of another size, then a crash)."""
        meta = _read_meta(path)
        exact = meta is not None and meta.get("tag") == tag and meta.get("count") == self.count \
            and self._version == self._snapshot_version
        listed = meta is not None and "nodes" in meta and meta.get("dim") == self.dim
        if not (exact or listed):
            log.warning("vector graph cache %s missing or stale; it will be rebuilt in the background", path)
            return
        self._touched = set()
        self._cache_meta = meta if listed else None  # an idle-time save merges its group into it
        self._loader = threading.Thread(target=self._load_files, args=(path, meta), name="graph-load", daemon=True)
        self._loader.start()

    def _load_files(self, path: Path, meta: dict[str, Any]) -> None:
        """Loader thread: read each group's graph and find the nodes it may keep.  A
        group whose graph or node list fails is left out (rebuilt), the others kept:
        groups are saved one at a time in idle time, so one may be newer than the meta
        that names it (a crash between the two renames)."""
        loaded = {}
        for group, crc in meta.get("groups", {}).items():
            graph = self._load_one(_group_path(path, group), crc)  # _read_meta keeps numbered groups only
            if graph is None:
                continue
            if "nodes" not in meta:  # a cache from before node lists, matching the snapshot
                loaded[group] = _Loaded(graph, _labels(graph), None, None)
                continue
            listed = _listed(meta["nodes"], group)
            if listed is None:
                log.warning("vector graph cache %s lists group %s's nodes wrongly; rebuilding it in the background",
                            path, group)
                continue
            loaded[group] = _Loaded(graph, _labels(graph), listed[0], self._still_right(*listed))
        self._loaded = loaded

    def _node_prints(self, group: int) -> list[bytes | int]:
        """[slots, fingerprints, CRC-32 of both] of the live nodes of ``group``'s graph
        (after settle: its only live nodes), as the cache's meta lists them."""
        slots = np.flatnonzero(self.in_graph & (self.group == group))
        prints = np.concatenate([fingerprints(self.matrix[slots[i : i + PRINT_ROWS]])
                                 for i in range(0, len(slots), PRINT_ROWS)] or [np.zeros(0, np.uint64)])
        listed = [slots.astype("<i8").tobytes(), prints.astype("<u8").tobytes()]
        return [*listed, _list_crc(*listed)]

    def _still_right(self, slots: np.ndarray, prints: np.ndarray) -> np.ndarray:
        """Loader thread: the listed nodes whose slot still holds the vector the node
        holds.  The engine may change slots meanwhile: every slot it changes is in
        ``_touched``, which :meth:`_kept` leaves out, so a slot read mid-change is
        never kept."""
        kept = []
        for start in range(0, len(slots), PRINT_ROWS):
            part, matrix = slots[start : start + PRINT_ROWS], self.matrix  # one view a step: it may be swapped
            inside = part < len(matrix)
            same = np.zeros(len(part), bool)
            same[inside] = fingerprints(matrix[part[inside]]) == prints[start : start + PRINT_ROWS][inside]
            kept.append(part[same])
        return np.concatenate(kept) if kept else np.zeros(0, np.int64)

    def _load_one(self, path: Path, crc: int) -> hnswlib.Index | None:
        try:
            with open(path, "rb") as fh:  # in pieces: a whole graph of 33k is 55 MB of RSS for nothing
                right = _crc(fh) == crc
            if not right:
                log.warning("vector graph cache %s fails its checksum; rebuilding in the background", path)
                return None
            graph = hnswlib.Index(space="ip", dim=self.dim)
            graph.load_index(str(path), max_elements=0)  # as saved: flush makes room when needed
            return graph
        except (OSError, RuntimeError, MemoryError) as exc:
            log.warning("vector graph cache %s unreadable (%s); rebuilding in the background", path, exc)
            return None

    def _adopt_loaded(self, *, wait: bool) -> bool:
        """Take background-loaded graphs once ready; True when no load is pending."""
        loader = self._loader
        if loader is None:
            return True
        if loader.is_alive():
            if not wait:
                return False
            loader.join()
        self._loader = None
        loaded, self._loaded = self._loaded, {}
        kept = {group: self._kept(group, one.right) for group, one in loaded.items()}
        if loaded and all(self._verify(one, kept[group]) for group, one in loaded.items()):
            for group, one in loaded.items():
                if self._worth_keeping(group, one.labels, kept[group]):
                    self._install(group, one, kept[group])
        self._touched = set()
        return True

    def _worth_keeping(self, group: int, labels: np.ndarray, kept: np.ndarray) -> bool:
        """Whether adopting ``group``'s cached graph, keeping ``kept``, saves idle work
        over building it afresh: the group's live slots the graph holds a node for but
        does not keep (a changed vector; every slot after a reindex) would be updated in
        place, ``UPDATE_COST`` insertions each.  A graph keeping nothing never is."""
        live = np.flatnonzero(self.alive & (self.group == group))
        updates = np.count_nonzero(np.isin(np.setdiff1d(live, kept), labels))
        return len(kept) > UPDATE_COST * int(updates)

    def _kept(self, group: int, right: np.ndarray | None) -> np.ndarray:
        """The nodes of ``group``'s cached graph to keep: those the loader found right
        (None: a cache matching the snapshot, every live slot of the group), live in
        that group now and unchanged since the load began."""
        if right is None:
            candidates = np.flatnonzero(self.alive & (self.group == group))
        else:
            inside = right[right < len(self.alive)]
            candidates = inside[self.alive[inside] & (self.group[inside] == group)]
        return np.setdiff1d(candidates, np.fromiter(self._touched, np.int64, len(self._touched)))

    def _verify(self, loaded: _Loaded, kept: np.ndarray) -> bool:
        """The graph must hold every node to keep, with our vector (a sample is compared)."""
        graph, labels = loaded.graph, loaded.labels
        if len(labels) < len(kept) or not np.isin(kept, labels).all():
            return False
        sample = kept[:: max(1, len(kept) // 32)][:32]
        # a graph cached before vectors were kept as bf16 holds their float32: as good
        return not len(sample) or np.allclose(np.asarray(graph.get_items(sample), np.float32),
                                              self.rows(sample), rtol=0, atol=BF16_TOLERANCE)

    def _install(self, group: int, loaded: _Loaded, kept: np.ndarray) -> None:
        """Adopt a loaded graph keeping the nodes ``kept``; its other live nodes are
        marked deleted (their slots changed, went, or moved group), and the live slots
        it lacks stay pending, to be inserted."""
        graph = loaded.graph
        graph.set_ef(self._ef)
        graph.set_num_threads(1)
        if loaded.listed is not None:  # the nodes live when it was saved (the others are marked already)
            stale = np.setdiff1d(loaded.listed, kept).tolist()
        else:
            stale = sorted(self._touched & set(loaded.labels.tolist()))
        for slot in stale:
            with contextlib.suppress(RuntimeError):  # already marked deleted in the cached graph
                graph.mark_deleted(slot)
        self._graphs[group] = graph
        self._in_graph_count[group] = len(kept)
        self._changed[group] = len(stale)  # the cached file still holds them live
        self.in_graph[kept] = True
        self.pending.difference_update(kept.tolist())
        self._waiting.reset()  # rebuilt from the rows still pending when next needed

    def load_vectors(self, data: memoryview | bytes, alive: np.ndarray, group: np.ndarray, fmt: str) -> None:
        """Restore the vector matrix (from a snapshot's block in format ``fmt``, a key of
        ``ITEM_BYTES``; float32 blocks are rounded to bf16), live mask and groups.

        ``data`` (a view into the snapshot file's buffer) is copied into the
        matrix's own mapping a few MB at a time, each part of the buffer given
        back once copied: the matrix can then grow in place, the rest of the
        snapshot buffer is freed after opening, and RSS never holds it twice.
        100k memories: +28 ms to an open of ~1.9 s.
        """
        data, item = memoryview(data).cast("B"), ITEM_BYTES[fmt]
        rows = len(data) // (item * self.dim)
        self._map = big_buffer(rows * self.row_bytes)
        self.matrix = _rows(self._map, rows, self.dim)
        flat = self.matrix.reshape(-1)
        step = LOAD_STEP // item  # components a step
        for start in range(0, rows * self.dim, step):
            part = data[start * item : min(start + step, rows * self.dim) * item]
            chunk = np.frombuffer(part, np.uint16 if fmt == "bf16" else np.float32)
            flat[start : start + len(chunk)] = chunk if fmt == "bf16" else to_bf16(chunk)
            release_pages(part)  # the snapshot's copy: RSS never holds the matrix twice
        self.alive, self.group = alive.copy(), group.copy()
        self.matrix[np.flatnonzero(~alive)] = 0  # stale rows of dead slots (a forgotten memory's vector)
        self._version += 1
        self.in_graph = np.zeros(len(alive), bool)
        self._in_graph_count = {}
        self._unmarked = set()
        self._changed, self._cache_meta = {}, None
        self.pending = set(np.flatnonzero(alive).tolist())
        self._waiting.reset()
        self._snapshot_version = self._version
        self.count = int(np.count_nonzero(alive))

    def vector_bytes(self) -> memoryview:
        """The matrix up to the highest used slot (a view, for the snapshot; format
        ``VECTOR_FORMAT``)."""
        live = np.flatnonzero(self.alive)
        top = int(live.max()) + 1 if len(live) else 0
        return np.ascontiguousarray(self.matrix[:top]).reshape(-1).view(np.uint8).data

    def stats(self) -> dict[str, Any]:
        """Counts for health and stats replies."""
        return {"vectors": self.count, "slots": len(self.alive), "pending": len(self.pending),
                "unmarked": len(self._unmarked),
                "graph_elements": sum(g.element_count for g in self._graphs.values())}


def forget_cache(index: VectorIndex, path: Path) -> None:
    """Remove the graph cache of ``index`` at ``path`` (its graphs may hold forgotten
    memories' vectors): every graph is saved again at the next idle-time cache step or
    close, without them (:func:`_scrub_deleted`).  Failures are logged."""
    for file in [path, _meta_path(path), *path.parent.glob(f"{path.name}.[0-9]*")]:
        try:
            file.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove the graph cache file %s: %s", file, exc.strerror)
    index._cache_meta = None
    index._changed = {group: max(CACHE_MIN_CHANGES, index._in_graph_count.get(group, 0)) for group in index._graphs}


def nearest(index: VectorIndex, query: np.ndarray, k: int, group: int, *,
            ef: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top ``k`` (slots, cosine similarities) of one group of ``index``, best first, changing
    nothing (no catch-up insertion as :meth:`VectorIndex.search` makes): the group's graph,
    searched with ``ef`` (default ``search.hnsw_ef_search``), and its pending vectors exactly;
    the group's rows exactly while there is no graph (below ``exact_below``, or its cached
    graph still loading).  For a check on the write path, whose cost must not grow with the
    vectors waiting for idle time."""
    if index.count == 0 or k <= 0:
        return _NONE
    if index.count <= index.exact_below or not index._adopt_loaded(wait=False) or group not in index._graphs:
        return index.exact(query, np.flatnonzero(index.alive & (index.group == group)), k)
    parts = [index._graph_only(query, k, group, index.alive if index._unmarked else None, ef)]
    if index.pending:
        parts.append(index._waiting.nearest(index, query, k, group))
    labels, sims = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    order = np.argsort(-sims, kind="stable")[:k]
    return labels[order], sims[order]


class _Waiting:
    """Float32 copies of the pending vectors, contiguous by group, for :func:`nearest`: a
    write's check compares its vector with those of its group waiting for the graph in one
    matrix-vector product, where gathering and widening their bf16 rows from the matrix
    cost 0.2 ms at 100k memories and 300 waiting (a burst of writes piles them up until
    idle time inserts them).  The copies are the matrix rows widened: the same cosines as
    :meth:`VectorIndex.exact`.

    Kept up to date by the index's changes (:meth:`put` on ``add``, :meth:`drop` when a
    vector leaves the pending set).  *Incomplete* (empty) after a load or a reset, and past
    :data:`WAITING_ROWS` vectors: :meth:`nearest` then rebuilds it from the rows once the
    pending set fits again (one gather, which that check made anyway), else gathers them.
    Engine thread only."""

    def __init__(self, dim: int) -> None:
        self._dim = dim
        self._rows: dict[int, np.ndarray] = {}  # group -> float32 rows (capacity >= its count)
        self._slots: dict[int, np.ndarray] = {}  # group -> the slot of each row (same capacity)
        self._count: dict[int, int] = {}  # group -> rows in use
        self._where: dict[int, tuple[int, int]] = {}  # slot -> (group, row)
        self.complete = True  # holds every pending vector

    def put(self, slot: int, group: int, row: np.ndarray) -> None:
        """Hold ``row`` (float32) as the pending vector of ``slot`` (replacing its old one)."""
        self.drop([slot])
        if not self.complete:
            return
        if len(self._where) >= WAITING_ROWS:
            self.reset()
            return
        n = self._count.get(group, 0)
        rows = self._rows.get(group)
        if rows is None or n == len(rows):
            size = max(64, 2 * n)
            self._rows[group] = np.concatenate([rows[:n], np.empty((size - n, self._dim), np.float32)]) \
                if rows is not None else np.empty((size, self._dim), np.float32)
            slots = self._slots.get(group)
            self._slots[group] = np.concatenate([slots[:n], np.empty(size - n, np.int64)]) \
                if slots is not None else np.empty(size, np.int64)
        self._rows[group][n], self._slots[group][n] = row, slot
        self._where[slot] = (group, n)
        self._count[group] = n + 1

    def drop(self, slots: list[int]) -> None:
        """Forget the vectors of ``slots`` (inserted into their graph, or gone); the last
        row of a group takes the place of each."""
        if not self._where:
            return
        if len(slots) > len(self._where):  # a mass expiry: look up the few held, not every slot
            gone = set(slots)
            slots = [slot for slot in self._where if slot in gone]
        for slot in slots:
            found = self._where.pop(slot, None)
            if found is None:
                continue
            group, row = found
            last = self._count[group] = self._count[group] - 1
            if not last:  # give the memory back once a group's rows are all inserted
                del self._rows[group], self._slots[group], self._count[group]
            elif row != last:
                rows, held = self._rows[group], self._slots[group]
                rows[row], held[row] = rows[last], held[last]
                self._where[int(held[row])] = (group, row)

    def reset(self) -> None:
        """Hold nothing, incomplete (a load, or past :data:`WAITING_ROWS`)."""
        self._rows, self._slots, self._count, self._where = {}, {}, {}, {}
        self.complete = False

    def nearest(self, index: VectorIndex, query: np.ndarray, k: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` (slots, cosines) of ``group``'s pending vectors in ``index``, best first."""
        if not self.complete and len(index.pending) <= WAITING_ROWS:
            self._rebuild(index)
        if not self.complete:
            waiting = np.fromiter(index.pending, np.int64, len(index.pending))
            return index.exact(query, waiting[index.group[waiting] == group], k)
        n = self._count.get(group, 0)
        if not n:
            return _NONE
        slots, sims = self._slots[group][:n], self._rows[group][:n] @ query
        if n > k:
            top = np.argpartition(-sims, k - 1)[:k]
            slots, sims = slots[top], sims[top]
        order = np.argsort(-sims, kind="stable")
        return slots[order], sims[order]

    def _rebuild(self, index: VectorIndex) -> None:
        """Hold every pending vector of ``index`` again, read from its rows."""
        slots = np.sort(np.fromiter(index.pending, np.int64, len(index.pending)))
        groups = index.group[slots]
        self.reset()
        for group in np.unique(groups).tolist():
            mine = slots[groups == group]
            self._rows[group], self._slots[group], self._count[group] = index.rows(mine), mine, len(mine)
            self._where.update((slot, (group, row)) for row, slot in enumerate(mine.tolist()))
        self.complete = True


class _Loaded(NamedTuple):
    """A cached graph as the loader thread read it."""

    graph: hnswlib.Index
    labels: np.ndarray  # every node's label, deleted ones too (read once, on the loader thread)
    listed: np.ndarray | None  # the nodes live when it was saved (None: a cache without that list)
    right: np.ndarray | None  # of those, the ones whose slot held the same vector at the load


def _labels(graph: hnswlib.Index) -> np.ndarray:
    return np.asarray(graph.get_ids_list(), np.int64)


def _listed(nodes: Any, group: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(slots, fingerprints) of ``group``'s node list in a cache meta; None when missing,
    malformed or failing its checksum (the graph is then not reused: the list is what
    tells its right nodes and which to mark deleted, and a slot damaged in it left the
    node of a forgotten memory live)."""
    try:
        raw_slots, raw_prints, crc = nodes[group]
        if _list_crc(raw_slots, raw_prints) != crc:
            return None
        slots = np.frombuffer(raw_slots, "<i8").astype(np.int64)
        prints = np.frombuffer(raw_prints, "<u8")
    except (TypeError, ValueError, IndexError, KeyError):
        return None
    if len(slots) != len(prints) or (len(slots) and slots.min() < 0):
        return None
    return slots, prints


def _list_crc(slots: bytes, prints: bytes) -> int:
    """The CRC-32 of a node list (its slots' bytes, then its fingerprints')."""
    return zlib.crc32(prints, zlib.crc32(slots))


def _extend(array: np.ndarray, size: int) -> np.ndarray:
    grown = np.zeros(size, array.dtype)
    grown[: len(array)] = array
    return grown


def _group_path(path: Path, group: int) -> Path:
    return path.with_name(f"{path.name}.{group}")


def _save_one(graph: hnswlib.Index, path: Path, *, durable: bool = True) -> int:
    """Save one graph atomically (fsynced first when ``durable``); returns its checksum,
    read back in ``CRC_STEP`` pieces (not the whole file at once: 55 MB for a graph of 33k)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        graph.save_index(str(tmp))
        # hnswlib writes through a std::ofstream it never checks: a full disk leaves a short
        # file and no error (it was checksummed as it was and renamed over the good graph)
        if _written_short(graph, tmp):
            raise OSError(errno.ENOSPC, "the graph was written short (the disk is full?)", str(tmp))
        _scrub_deleted(tmp, graph.dim)
        os.chmod(tmp, 0o600)  # hnswlib creates it with the umask's mode; the data dir's files are private
        with open(tmp, "rb") as fh:
            crc = _crc(fh)
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        return crc
    finally:
        tmp.unlink(missing_ok=True)


_HNSW_HEAD = struct.Struct("<QQQQQQiIQQQdQ")  # hnswlib's saveIndex header (96 bytes)
_HNSW_DELETED = 0x01  # hnswlib's DELETE_MARK, in the third byte of a node's level-0 link header


def _scrub_deleted(path: Path, dim: int) -> int:
    """Zero the vector of every node marked deleted in the hnswlib file ``path`` (in
    place; returns how many): hnswlib keeps a deleted node's vector, and a cache saved
    after a forget must not hold the forgotten memory's.  A deleted node stays in the
    graph as a router, with a zero vector (far from every query).  A file of another
    layout is left as it is."""
    with open(path, "r+b") as fh:
        head = fh.read(_HNSW_HEAD.size)
        if len(head) < _HNSW_HEAD.size:
            return 0
        off_links, _, count, per, _, off_data, *_ = _HNSW_HEAD.unpack(head)
        if not count or per <= 0 or off_data + 4 * dim > per or off_links + 4 > per:
            return 0
        nodes = np.memmap(fh, np.uint8, "r+", _HNSW_HEAD.size, (count, per))
        deleted = np.flatnonzero(nodes[:, off_links + 2] & _HNSW_DELETED)
        if len(deleted):
            nodes[deleted, off_data : off_data + 4 * dim] = 0
            nodes.flush()
        del nodes
        return len(deleted)


def _written_short(graph: hnswlib.Index, path: Path) -> bool:
    """Whether ``path``, where ``graph`` was just saved, is shorter than the graph: exactly, by
    hnswlib's own ``index_file_size`` (0.8); with Chroma's build of hnswlib (the aarch64 wheel,
    pyproject.toml), which has none, against the least its file can hold: the header, the
    level-0 block it announces and one link-list size per element (a cut inside the last
    link lists slips through there; loading such a file fails and the graph is rebuilt)."""
    size = os.path.getsize(path)
    exact = getattr(graph, "index_file_size", None)
    if exact is not None:
        return bool(size != exact())
    with open(path, "rb") as fh:
        head = fh.read(_HNSW_HEAD.size)
    if len(head) < _HNSW_HEAD.size:
        return True
    count, per_element = _HNSW_HEAD.unpack(head)[2:4]
    return size < _HNSW_HEAD.size + count * (per_element + 4)


def _crc(fh: BinaryIO) -> int:
    """The CRC-32 of what is left in ``fh``, read ``CRC_STEP`` bytes at a time."""
    crc = 0
    while piece := fh.read(CRC_STEP):
        crc = zlib.crc32(piece, crc)
    return crc


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta")


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    write_atomic(_meta_path(path), [pack(meta)], durable=False)  # 0600; a cache: no fsync needed


def _read_meta(path: Path) -> dict[str, Any] | None:
    """The cache's meta; None when missing, damaged or of another shape.  It has no
    checksum of its own, and one that decoded to another shape (its groups or node lists
    not maps) raised out of an idle save, or in the loader thread, losing every group:
    an entry not named by a group number is left out, the others kept."""
    try:
        meta = unpack(_meta_path(path).read_bytes())
    except Exception:  # missing or damaged sidecar: the cache is simply unusable
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("groups", {}), dict) \
            or not isinstance(meta.get("nodes", {}), dict):
        return None
    meta["groups"] = {group: crc for group, crc in meta.get("groups", {}).items() if type(group) is int}
    return meta
