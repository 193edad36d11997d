"""The in-process memory engine: :class:`MemoryStore`.

Every change goes through one funnel, :meth:`MemoryStore._commit`: the
operations are appended to the journal (durable per ``memory.fsync``) and only
then applied to the in-memory state and indexes.  Opening a store replays the
same operations over the last snapshot, so what was acknowledged is what comes
back.

Data directory::

    LOCK            flock held by the one process that has the store open
    snapshot.rms    msgpack frames: header, records, vectors, lexical index, context window
    journal.rmj     msgpack frames appended since that snapshot
    vectors.hnsw    hnswlib graph cache (+ .meta); rebuilt when missing or stale
    models/         built ONNX models (see ``embedding``)

Scores: ``SearchResult.score`` is in [0, 1].  Vector similarity is the cosine
similarity clipped at 0; lexical relevance is BM25 divided by the query's
ceiling (how much of the query a memory covers); hybrid is their weighted noisy-OR
``1 - (1 - cos)^(2w) (1 - lex)^(2(1 - w))`` with ``w = search.vector_weight``
(high when either signal is strong, so ``min_score`` means what it means for
plain cosine similarity), plus ``search.entity_boost`` when the query names the memory's speaker or person
(``search.entity_fields``), capped at 1.  ``min_score`` is compared with that
final score.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reachy_memory._temporal import temporal_bonus  # issue 12

from . import journal as jr
from ._filters import FieldIndex, validate_metadata
from .config import Config
from .errors import (
    ClosedError,
    CorruptionError,
    ModelError,
    ModelMismatchError,
    ReachyMemoryError,
    TooLargeError,
    ValidationError,
)
from .lexical_index import LexicalIndex
from .model import Expiry, Memory, MemoryType, SearchResult, resolve_timezone, to_datetime, to_epoch
from .vector_index import VectorIndex

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "snapshot.rms"
JOURNAL_FILE = "journal.rmj"
GRAPH_FILE = "vectors.hnsw"
_GROUP = {t.value: i for i, t in enumerate(MemoryType)}  # one vector graph per memory type
NEIGHBOUR_SECONDS = 600.0  # a previous turn older than this is not context any more
datetime_or_float = Any  # a datetime (aware, or naive meaning UTC), epoch seconds, or None


class Embedder(Protocol):
    """What the store needs from an embedding model."""

    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """(n, dim) float32, L2-normalised."""
        ...


class _Default:
    def __repr__(self) -> str:
        return "<default embedder>"


DEFAULT_EMBEDDER: Any = _Default()


def embedder_key(embedder: Any) -> str:
    """A string naming the vector space of ``embedder`` (model, weights, precision)."""
    identity = getattr(embedder, "identity", None)
    if isinstance(identity, Mapping):
        return "{name}/{sha256:.12}/{precision}/{dim}".format(**identity)
    return f"{type(embedder).__name__}/{embedder.dim}"


class _Rec:
    """A stored memory, in the compact form kept in RAM and on disk."""

    __slots__ = ("content", "created", "expires", "id", "metadata", "slot", "type", "vkey")

    def __init__(self, id: str, content: str, type: str, created: float, expires: float | None,
                 metadata: dict[str, Any], slot: int = -1, vkey: str | None = None) -> None:
        self.id, self.content, self.type = id, content, type
        self.created, self.expires, self.metadata = created, expires, metadata
        self.slot, self.vkey = slot, vkey

    def row(self) -> list[Any]:
        return [self.id, self.content, self.type, self.created, self.expires, self.metadata, self.slot, self.vkey]

    def expired(self, now: float) -> bool:
        return self.expires is not None and self.expires <= now

    def memory(self) -> Memory:
        return Memory(self.id, self.content, MemoryType(self.type), to_datetime(self.created),
                      dict(self.metadata), to_datetime(self.expires) if self.expires is not None else None)


@dataclass
class _Prepared:
    """A validated, embedded write, ready to be committed."""

    ops: list[list[Any]]
    ids: list[str]


class MemoryStore:
    """Long-term memory: store, search, forget, expire; durable and crash-safe.

    ``MemoryStore(path, config=..., embedder=...)`` opens (or creates) the data
    directory ``path`` (default ``config.memory.path``) and takes its lock.
    ``embedder=None`` runs lexical-only; the default loads the configured model
    and falls back to lexical-only, with a warning, when it cannot.  Use it as a
    context manager or call :meth:`close`.

    Raises :class:`StoreLockedError` if another process has the directory,
    :class:`CorruptionError` for damaged files, :class:`ModelMismatchError` when
    the stored vectors come from another model (unless ``reindex=True``).
    """

    def __init__(self, path: str | Path | None = None, *, config: Config | None = None,
                 embedder: Any = DEFAULT_EMBEDDER, reindex: bool = False) -> None:
        self._config = config or Config()
        self.path = Path(path).expanduser() if path is not None else self._config.data_dir
        self._closed = True
        self._lock = threading.RLock()
        self._make_dir()
        self._dir_lock = jr.DirLock(self.path)
        self._dir_lock.acquire()
        try:
            self._open(embedder, reindex)
        except BaseException:
            self._dir_lock.release()
            raise
        self._closed = False

    # -- opening ---------------------------------------------------------------------

    def _make_dir(self) -> None:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise jr.StorageError(f"cannot create data directory {self.path}: {exc.strerror}",
                                  path=str(self.path)) from exc

    def _open(self, embedder: Any, reindex: bool) -> None:
        mem = self._config.memory
        self._tz = resolve_timezone(mem.timezone)  # issue 12: temporal words are read in this zone
        self._expiry = Expiry(mem.conversation_ttl_days, self._tz)
        self._embedder = self._resolve_embedder(embedder)
        self.embedder_error: str | None = getattr(self, "_embedder_error", None)
        self._records: dict[str, _Rec] = {}
        self._by_slot: dict[int, _Rec] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._fields = FieldIndex()
        self._lexical = LexicalIndex()
        self._window: deque[list[Any]] = deque(maxlen=2 * mem.context_window_size)
        self._generation = 0
        self._model_key: str | None = None
        self._last_turn: _Rec | None = None
        snapshot = self._read_snapshot()
        self._model_key = snapshot.get("model") if snapshot else None
        self._current_key = embedder_key(self._embedder) if self._embedder is not None else self._model_key
        self._load_snapshot(snapshot)
        self._journal = jr.Journal(self.path / JOURNAL_FILE, mem.fsync, mem.fsync_batch_window_ms)
        try:
            self._replay(self._journal.open({"kind": "journal", "generation": self._generation}))
            self._check_model(reindex)
        except BaseException:
            self._journal.close()
            raise
        self._adopt_model()

    def _resolve_embedder(self, embedder: Any) -> Any:
        if embedder is not DEFAULT_EMBEDDER:
            return embedder
        if not self._config.embedding.enabled:
            return None
        from .embedding import load_embedder  # late: the model is optional at import time

        try:
            return load_embedder(self._config, data_dir=self.path)
        except ModelError as exc:
            self._embedder_error = str(exc)
            log.warning("embedding model unavailable, search runs lexical-only: %s", exc)
            return None

    def _read_snapshot(self) -> dict[str, Any] | None:
        path = self.path / SNAPSHOT_FILE
        return read_snapshot(path) if path.exists() else None

    def _check_model(self, reindex: bool) -> None:
        """Refuse to mix vector spaces: stored vectors must come from the configured model."""
        key = self._current_key
        if self._embedder is None or reindex:
            return
        other = next((r.vkey for r in self._records.values() if r.vkey not in (None, key)), None)
        if other is not None:
            raise ModelMismatchError(
                f"this store's vectors were made by {other!r} but the configured model is {key!r}; "
                "run 'reachy-memory reindex' to re-embed, or configure the original model",
                stored=other, configured=key,
            )

    def _load_snapshot(self, snapshot: dict[str, Any] | None) -> None:
        dim = self._embedder.dim if self._embedder is not None else (snapshot or {}).get("dim") or 384
        cfg = self._config.search
        self._vectors = VectorIndex(dim, m=cfg.hnsw_m, ef_construction=cfg.hnsw_ef_construction,
                                    ef_search=cfg.hnsw_ef_search, exact_threshold=cfg.exact_threshold,
                                    exact_below=cfg.exact_below)
        if snapshot is None:
            return
        self._generation = snapshot["generation"]
        self._window.extend(snapshot["window"])
        self._lexical.load_state(snapshot["lexical"])
        vectors = snapshot["vectors"] if snapshot.get("dim") == dim else b""  # another model's space
        vec_rows = len(vectors) // (4 * dim)
        alive = np.zeros(vec_rows, bool)
        group = np.zeros(vec_rows, np.int8)
        for row in snapshot["records"]:
            rec = _Rec(*row)
            self._place(rec, rec.slot)
            if rec.vkey is not None and rec.vkey == self._current_key and rec.slot < vec_rows:
                alive[rec.slot] = True
                group[rec.slot] = _GROUP[rec.type]
        self._free = sorted(set(range(self._next_slot)) - set(self._by_slot))
        self._vectors.load_vectors(vectors, alive, group)
        self._load_graph()

    def _place(self, rec: _Rec, slot: int) -> None:
        rec.slot = slot
        self._records[rec.id] = rec
        self._by_slot[slot] = rec
        self._next_slot = max(self._next_slot, slot + 1)
        self._fields.add(slot, rec.type, rec.metadata)

    def _graph_tag(self) -> str:
        return f"{self._generation}:{self._current_key}"

    def _load_graph(self) -> None:
        if self._vectors.count <= self._vectors.exact_below // 2:
            return  # searched exactly at this size; vectors wait as pending
        self._vectors.load_graph(self.path / GRAPH_FILE, self._graph_tag())

    def _replay(self, result: jr.ReadResult) -> None:
        head = result.frames[0] if result.frames else {}
        if head.get("generation") != self._generation:
            # A compaction wrote the snapshot but died before resetting the
            # journal: everything in it is already in the snapshot.
            log.warning("journal generation %s is older than snapshot %s; discarding it",
                        head.get("generation"), self._generation)
            self._journal.close()
            self._reset_journal()
            return
        for ops in result.frames[1:]:
            for op in ops:
                self._apply(op)

    def _adopt_model(self) -> None:
        key = self._current_key
        if self._embedder is None or key == self._model_key:
            return
        if not any(r.vkey is not None and r.vkey != key for r in self._records.values()):
            self._commit([["model", key]])
        missing = sum(1 for r in self._records.values() if r.vkey != key)
        if missing:
            log.warning("%d memories have no vector from %s; run 'reachy-memory reindex' to add them",
                        missing, key)

    # -- the mutation funnel -----------------------------------------------------------

    def _commit(self, ops: list[list[Any]]) -> None:
        """Journal ``ops`` (durably, per policy), then apply them to the state."""
        with self._lock:
            self._journal.append(ops)
            for op in ops:
                self._apply(op)
            if self._journal.size > self._config.memory.compact_journal_bytes:
                self._compact()

    def _apply(self, op: list[Any]) -> None:
        kind = op[0]
        if kind == "put":
            self._apply_put(_Rec(*op[1]), op[2])
        elif kind == "del":
            self._apply_del(op[1])
        elif kind == "win":
            self._window.append(op[1:])
        elif kind == "winclr":
            self._window.clear()
        elif kind == "model":
            self._model_key = op[1]
        else:
            raise CorruptionError(f"unknown journal operation {kind!r}", path=str(self._journal.path), offset=-1)

    def _apply_put(self, rec: _Rec, vector: bytes | None) -> None:
        if rec.id in self._records:
            self._apply_del(rec.id)
        slot = heapq.heappop(self._free) if self._free else self._next_slot
        self._place(rec, slot)
        self._lexical.add(slot, rec.content)
        if vector is None:
            rec.vkey = None
        elif rec.vkey == self._current_key:
            self._vectors.add(slot, np.frombuffer(vector, np.float32), _GROUP[rec.type])
        if rec.type == MemoryType.CONVERSATION.value:
            self._last_turn = rec

    def _apply_del(self, memory_id: str) -> None:
        rec = self._records.pop(memory_id, None)
        if rec is None:
            return
        del self._by_slot[rec.slot]
        self._fields.remove(rec.slot, rec.type, rec.metadata)
        self._lexical.remove(rec.slot, rec.content)
        self._vectors.remove(rec.slot)
        heapq.heappush(self._free, rec.slot)
        if self._last_turn is rec:
            self._last_turn = None

    # -- writing ---------------------------------------------------------------------

    def store(self, content: str, memory_type: MemoryType | str = MemoryType.FACT,
              metadata: dict[str, Any] | None = None, *, id: str | None = None) -> Memory:
        """Store one memory and return it once it is durable.

        ``id`` (optional, client-chosen) makes the call idempotent: storing the
        same id and content again returns the existing memory.
        Raises ValidationError / TooLargeError for bad input (nothing stored).
        """
        return self.store_batch([{"content": content, "memory_type": memory_type,
                                  "metadata": metadata, "id": id}])[0]

    def store_batch(self, items: Iterable[Mapping[str, Any]]) -> list[Memory]:
        """Store several memories in one durable write: all of them or none."""
        return self.commit(self.prepare(items))

    def prepare(self, items: Iterable[Mapping[str, Any]], now: float | None = None) -> _Prepared:
        """Validate and embed ``items`` without changing anything (thread-safe)."""
        self._require_open()
        rows = [self._validate_item(item) for item in _as_list(items, self._config.memory.max_batch)]
        created = time.time() if now is None else now
        recs, out_ids = self._new_records(rows, created)
        vectors = self._embed_records(recs)
        ops = [["put", rec.row(), vec] for rec, vec in zip(recs, vectors, strict=True)]
        return _Prepared(ops, out_ids)

    def commit(self, prepared: _Prepared) -> list[Memory]:
        """Make a prepared write durable and visible; returns the memories."""
        self._require_open()
        with self._lock:
            fresh = [op for op in prepared.ops if not self._is_duplicate(op[1])]
            if fresh:
                self._commit(fresh)
            return [self._records[i].memory() for i in prepared.ids]

    def _is_duplicate(self, row: list[Any]) -> bool:
        existing = self._records.get(row[0])
        if existing is None:
            return False
        if existing.content != row[1] or existing.type != row[2]:
            raise ValidationError(f"id {row[0]!r} is already used by another memory", field="id")
        return True

    def _validate_item(self, item: Mapping[str, Any]) -> tuple[str, str, dict[str, Any], str | None, float | None]:
        if not isinstance(item, Mapping):
            raise ValidationError("each item must be a dict with content, memory_type, metadata", field="items")
        unknown = set(item) - {"content", "memory_type", "metadata", "id", "created_at"}
        if unknown:
            raise ValidationError(f"unknown item keys: {sorted(unknown)}", field="items")
        content = self._validate_text(item.get("content"), "content")
        mtype = MemoryType.parse(item.get("memory_type", MemoryType.FACT))
        mem = self._config.memory
        metadata = validate_metadata(item.get("metadata"), max_bytes=mem.max_metadata_bytes,
                                     max_keys=mem.max_metadata_keys)
        memory_id = item.get("id")
        if memory_id is not None and (not isinstance(memory_id, str) or not 0 < len(memory_id) <= 128):
            raise ValidationError("id must be a non-empty string of at most 128 characters", field="id")
        created = item.get("created_at")
        return content, mtype.value, metadata, memory_id, to_epoch(created) if created is not None else None

    def _validate_text(self, text: Any, field: str) -> str:
        if not isinstance(text, str):
            raise ValidationError(f"{field} must be a string, got {type(text).__name__}", field=field)
        if not text.strip():
            raise ValidationError(f"{field} must not be empty or whitespace only", field=field)
        limit = self._config.memory.max_content_chars
        if len(text) > limit:
            raise TooLargeError(f"{field} is {len(text)} characters; the limit is {limit}",
                                field=field, size=len(text), limit=limit)
        return text

    def _new_records(self, rows: list[tuple[str, str, dict[str, Any], str | None, float | None]],
                     now: float) -> tuple[list[_Rec], list[str]]:
        """Records for validated rows; ``created_at`` (imports) defaults to ``now``."""
        recs: list[_Rec] = []
        ids: list[str] = []
        for content, mtype, metadata, memory_id, created_at in rows:
            created = now if created_at is None else created_at
            memory_id = memory_id or uuid.uuid4().hex
            ids.append(memory_id)
            existing = self._records.get(memory_id)
            if existing is not None:
                self._is_duplicate([memory_id, content, mtype])  # raises if the id is taken
                continue
            if memory_id in {r.id for r in recs}:
                continue
            expires = self._expiry.expires(MemoryType(mtype), created)
            recs.append(_Rec(memory_id, content, mtype, created, expires, metadata))
        return recs, ids

    def _embed_records(self, recs: list[_Rec]) -> list[bytes | None]:
        if self._embedder is None or not recs:
            return [None] * len(recs)
        texts = self._embedding_texts(recs)
        vectors = self._embed(texts)
        if vectors is None:
            return [None] * len(recs)
        for rec in recs:
            rec.vkey = self._current_key
        return [np.ascontiguousarray(v, np.float32).tobytes() for v in vectors]

    def _embedding_texts(self, recs: list[_Rec]) -> list[str]:
        """Each new record's text to embed (the turn before it is the last one stored)."""
        texts, previous = [], self._last_turn
        for rec in recs:
            texts.append(self._context_text(rec, previous))
            if rec.type == MemoryType.CONVERSATION.value:
                previous = rec
        return texts

    def _context_text(self, rec: _Rec, previous: _Rec | None) -> str:
        """What is embedded for ``rec``: a conversation turn carries the turn before it."""
        if (self._config.embedding.neighbour_context and rec.type == MemoryType.CONVERSATION.value
                and previous is not None and rec.created - previous.created <= NEIGHBOUR_SECONDS):
            return f"{previous.content}\n{rec.content}"
        return rec.content

    def _embed(self, texts: list[str]) -> np.ndarray | None:
        """Embed or return None (logged): the store never fails for the model's sake."""
        try:
            vectors = np.asarray(self._embedder.embed(texts), np.float32)
        except Exception as exc:  # any embedder failure degrades to lexical-only
            log.warning("embedding failed, continuing lexical-only: %s", exc)
            return None
        if vectors.shape != (len(texts), self._vectors.dim) or not np.isfinite(vectors).all():
            log.warning("embedder returned shape %s, expected (%d, %d); ignoring its vectors",
                        vectors.shape, len(texts), self._vectors.dim)
            return None
        return vectors

    def remember_fact(self, content: str, **metadata: Any) -> Memory:
        """Store a permanent FACT."""
        return self.store(content, MemoryType.FACT, metadata)

    def remember_conversation(self, content: str, **metadata: Any) -> Memory:
        """Store a CONVERSATION memory (expires after the configured TTL)."""
        return self.store(content, MemoryType.CONVERSATION, metadata)

    def forget(self, memory_id: str) -> bool:
        """Delete a memory; False if there was none with that id."""
        self._require_open()
        _check_str(memory_id, "id")
        with self._lock:
            if memory_id not in self._records:
                return False
            self._commit([["del", memory_id]])
            return True

    def cleanup_expired(self, now: datetime_or_float = None) -> int:
        """Delete every memory expired at ``now`` (default: now); returns the count."""
        self._require_open()
        at = _epoch(now)
        with self._lock:
            expired = [r.id for r in self._records.values() if r.expires is not None and r.expires <= at]
            for start in range(0, len(expired), 5000):
                self._commit([["del", i] for i in expired[start : start + 5000]])
        return len(expired)

    # -- reading ---------------------------------------------------------------------

    def get(self, memory_id: str, *, now: datetime_or_float = None) -> Memory | None:
        """The live memory with that id, or None (an expired memory is never returned)."""
        self._require_open()
        _check_str(memory_id, "id")
        rec = self._records.get(memory_id)
        at = _epoch(now)
        return rec.memory() if rec is not None and not rec.expired(at) else None

    def export_page(self, after: str | None = None, limit: int = 500) -> tuple[list[Memory], str | None]:
        """Live memories in id order after ``after``; returns (page, next cursor or None)."""
        self._require_open()
        with self._lock:
            ids = sorted(self._records)
            if after is not None:
                _check_str(after, "after")
            start = bisect.bisect_right(ids, after) if after is not None else 0
            page = ids[start : start + limit]
            now = time.time()
            memories = [self._records[i].memory() for i in page if not self._records[i].expired(now)]
        return memories, (page[-1] if start + limit < len(ids) and page else None)

    def __len__(self) -> int:
        return len(self._records)

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = 5,
               min_score: float = 0.3, where: dict[str, Any] | None = None, *,
               mode: str | None = None, now: datetime_or_float = None) -> list[SearchResult]:
        """Find memories by meaning and by words, best first.

        ``mode`` is "hybrid" (default from config), "vector" or "lexical"; with
        no usable model every mode runs lexical-only.  ``where`` takes the
        Chroma-style filters described in ``_filters``.  Raises ValidationError
        for bad arguments.
        """
        self._require_open()
        mode = self._check_search_args(query, limit, min_score, mode)
        qvec = self.embed_query(query) if mode != "lexical" else None
        return self.search_vector(query, qvec, memory_type, limit, min_score, where, mode=mode, now=now)

    def _check_search_args(self, query: Any, limit: Any, min_score: Any, mode: str | None) -> str:
        self._validate_text(query, "query")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ValidationError(f"limit must be an integer from 1 to 1000, got {limit!r}", field="limit")
        if isinstance(min_score, bool) or not isinstance(min_score, int | float) or not math.isfinite(min_score):
            raise ValidationError(f"min_score must be a number, got {min_score!r}", field="min_score")
        mode = mode or self._config.search.mode
        if mode not in ("hybrid", "vector", "lexical"):
            raise ValidationError(f"mode must be hybrid, vector or lexical, got {mode!r}", field="mode")
        return mode

    def embed_query(self, query: str) -> np.ndarray | None:
        """The query's vector, or None when no model is usable (thread-safe)."""
        if self._embedder is None:
            return None
        vectors = self._embed([query])
        return None if vectors is None else vectors[0]

    def search_vector(self, query: str, qvec: np.ndarray | None, memory_type: MemoryType | str | None = None,
                      limit: int = 5, min_score: float = 0.3, where: dict[str, Any] | None = None, *,
                      mode: str = "hybrid", now: datetime_or_float = None) -> list[SearchResult]:
        """:meth:`search` with the query already embedded (``qvec`` may be None)."""
        self._require_open()
        mtype = MemoryType.parse(memory_type).value if memory_type is not None else None
        at = _epoch(now)
        with self._lock:
            mask = self._fields.mask(mtype, where)
            slots, scores = self._rank(query, qvec, mask, limit, mode, mtype, at)  # issue 12: + at
            results = []
            for i in np.argsort(-scores, kind="stable"):
                if scores[i] < min_score:
                    break
                rec = self._by_slot[int(slots[i])]
                if not rec.expired(at):
                    results.append(SearchResult(rec.memory(), float(scores[i])))
                    if len(results) == limit:
                        break
            return results

    def _rank(self, query: str, qvec: np.ndarray | None, mask: np.ndarray | None,
              limit: int, mode: str, mtype: str | None = None,
              now: float | None = None) -> tuple[np.ndarray, np.ndarray]:  # issue 12: + now
        """Candidate slots and their fused scores (unordered)."""
        cfg = self._config.search
        n_cand = max(cfg.candidates, 4 * limit)
        vec_q = qvec if mode != "lexical" and self._vectors.count > 0 else None
        use_vec = vec_q is not None
        use_lex = mode != "vector" or not use_vec
        groups = [_GROUP[mtype]] if mtype is not None else None
        vec_slots = self._vectors.search(vec_q, n_cand, mask, groups)[0] if vec_q is not None else _EMPTY[0]
        lex_slots, lex_scores = self._lexical.scores(query, mask) if use_lex else _EMPTY
        lex_top = lex_slots[_top_k(lex_scores, n_cand)]
        slots = np.unique(np.concatenate([vec_slots, lex_top]))
        if len(slots) == 0:
            return _EMPTY
        cos = self._vectors.similarity(vec_q, slots) if vec_q is not None else np.zeros(len(slots), np.float32)
        bm25 = _lookup(lex_slots, lex_scores, slots)
        scores = fuse(np.maximum(cos, 0.0), bm25, cfg, use_vec=use_vec, use_lex=use_lex)
        if mode == "hybrid":
            scores = np.minimum(scores + self._entity_bonus(query, slots), 1.0)
        if mode == "hybrid" and cfg.temporal_boost and now is not None:  # issue 12: temporal prior
            created = np.fromiter((self._by_slot[int(s)].created for s in slots), np.float64, len(slots))
            scores = np.minimum(scores + temporal_bonus(query, created, now, cfg.temporal_boost, self._tz), 1.0)
        return slots, scores

    def _entity_bonus(self, query: str, slots: np.ndarray) -> np.ndarray:
        """``entity_boost`` for memories whose speaker/person the query names."""
        cfg = self._config.search
        bonus = np.zeros(len(slots))
        if not cfg.entity_boost or not cfg.entity_fields:
            return bonus
        words = set(_WORDS.findall(query.lower()))
        for key in cfg.entity_fields:
            for value, holders in self._fields.string_values(key).items():
                if value and set(_WORDS.findall(value.lower())) <= words:
                    bonus[np.isin(slots, np.fromiter(holders, np.int64, len(holders)))] = cfg.entity_boost
        return bonus

    # -- context window and named context ---------------------------------------------

    def add_to_context_window(self, role: str, content: str) -> None:
        """Append a turn to the persisted window (the last N turns, 2N messages)."""
        self._require_open()
        if not isinstance(role, str) or not 0 < len(role.strip()) <= 64:
            raise ValidationError("role must be a non-empty string of at most 64 characters", field="role")
        self._commit([["win", role, self._validate_text(content, "content"), time.time()]])

    def get_context_window(self) -> list[dict[str, Any]]:
        """The recent messages, oldest first: dicts with role, content, timestamp."""
        self._require_open()
        with self._lock:
            return [{"role": r, "content": c, "timestamp": to_datetime(t).isoformat()} for r, c, t in self._window]

    def clear_context_window(self) -> None:
        """Empty the window (a new session)."""
        self._require_open()
        self._commit([["winclr"]])

    def set_context(self, key: str, value: str) -> Memory:
        """Set named session context (a CONTEXT memory), replacing the key's earlier value."""
        return self.commit_context(key, self.prepare_context(key, value))

    def prepare_context(self, key: str, value: str) -> _Prepared:
        """The validated, embedded write of :meth:`set_context` (thread-safe)."""
        self._require_open()
        if not isinstance(key, str) or not 0 < len(key) <= 256:
            raise ValidationError("context key must be a non-empty string of at most 256 characters", field="key")
        return self.prepare([{"content": value, "memory_type": MemoryType.CONTEXT,
                              "metadata": {"context_key": key}}])

    def commit_context(self, key: str, prepared: _Prepared) -> Memory:
        """Commit a :meth:`prepare_context` write, dropping the key's earlier values."""
        self._require_open()
        with self._lock:
            old = [["del", r.id] for r in self._context_records(key)]
            self._commit(old + prepared.ops)
            return self._records[prepared.ids[0]].memory()

    def get_context(self, key: str, *, now: datetime_or_float = None) -> str | None:
        """The live value of named context ``key``, or None."""
        self._require_open()
        _check_str(key, "key")
        at = _epoch(now)
        with self._lock:
            live = [r for r in self._context_records(key) if not r.expired(at)]
        return max(live, key=lambda r: r.created).content if live else None

    def _context_records(self, key: str) -> list[_Rec]:
        slots = self._fields.slots_with("context_key", key)
        recs = (self._by_slot[s] for s in slots)
        return [r for r in recs if r.type == MemoryType.CONTEXT.value]

    # -- maintenance -------------------------------------------------------------------

    def maintain(self, budget: int = 256) -> int:
        """Idle-time upkeep (the daemon calls it between requests): inserts a
        batch of pending vectors into the graph; returns how many."""
        self._require_open()
        with self._lock:
            return self._vectors.maintain(budget)

    def compact(self, *, full: bool = False) -> None:
        """Fold the journal into a fresh snapshot (atomic) and save the graph cache.

        ``full`` (on close) also inserts every pending vector before caching the
        graphs, however long that takes.
        """
        self._require_open()
        self._compact(full)

    def _compact(self, full: bool = False) -> None:
        """:meth:`compact` without the open check (it also runs while opening)."""
        with self._lock:
            self._generation += 1
            jr.write_snapshot(self.path / SNAPSHOT_FILE, self._snapshot_frames())
            self._journal.close()
            self._reset_journal()
            self._vectors.save_graph(self.path / GRAPH_FILE, self._graph_tag(), force=full)

    def _reset_journal(self) -> None:
        path = self.path / JOURNAL_FILE
        head = {"kind": "journal", "generation": self._generation}
        jr.write_atomic(path, [jr.header(jr.JOURNAL), jr.encode_frame(head)])
        self._journal = jr.Journal(path, self._config.memory.fsync, self._config.memory.fsync_batch_window_ms)
        self._journal.open({})

    def _snapshot_frames(self) -> Iterable[Any]:
        rows = []
        for rec in self._records.values():
            row = rec.row()
            indexed = rec.vkey == self._current_key and bool(self._vectors.alive[rec.slot : rec.slot + 1].any())
            row[7] = rec.vkey if indexed else None
            rows.append(row)
        head = {"kind": "snapshot", "generation": self._generation, "model": self._current_key or self._model_key,
                "dim": self._vectors.dim, "created": time.time()}
        yield head
        yield {"records": rows}
        yield jr.RawBin(self._vectors.vector_bytes())
        yield {"lexical": self._lexical.state()}
        yield {"window": list(self._window)}
        yield {"end": len(rows)}

    def backup(self, dest: str | Path) -> dict[str, Any]:
        """Write a consistent snapshot of the whole store to the file ``dest`` (fsynced)."""
        self._require_open()
        with self._lock:
            size = jr.write_snapshot(Path(dest), self._snapshot_frames())
            return {"path": str(dest), "bytes": size, "memories": len(self._records)}

    def reindex(self, progress: Callable[[int, int], None] | None = None, batch: int = 64) -> int:
        """Re-embed every memory whose vector is not from the current model.

        Each batch is committed on its own, so an interrupted reindex resumes
        where it stopped. Returns how many memories were re-embedded.
        Raises ModelError when there is no usable model.
        """
        self._require_open()
        if self._embedder is None:
            raise ModelError("reindex needs an embedding model; run 'reachy-memory model fetch'")
        todo = sorted((r for r in self._records.values() if r.vkey != self._current_key), key=lambda r: r.created)
        previous = self._previous_turns()
        for done in range(0, len(todo), batch):
            self._reembed(todo[done : done + batch], previous)
            if progress:
                progress(min(done + batch, len(todo)), len(todo))
        if self._model_key != self._current_key:
            self._commit([["model", self._current_key]])
        return len(todo)

    def _previous_turns(self) -> dict[str, _Rec]:
        """Each conversation turn's preceding turn, in stored order (ties keep insertion order)."""
        turns = sorted((r for r in self._records.values() if r.type == MemoryType.CONVERSATION.value),
                       key=lambda r: r.created)
        return {after.id: before for before, after in itertools.pairwise(turns)}

    def _reembed(self, recs: list[_Rec], previous: dict[str, _Rec]) -> None:
        vectors = self._embed([self._context_text(r, previous.get(r.id)) for r in recs])
        if vectors is None:
            raise ModelError("the embedding model failed during reindex; nothing was lost, run it again")
        ops = []
        for rec, vec in zip(recs, vectors, strict=True):
            row = rec.row()
            row[7] = self._current_key
            ops.append(["put", row, vec.astype(np.float32).tobytes()])
        with self._lock:
            self._commit(ops)

    def stats(self) -> dict[str, Any]:
        """Counts, sizes and the embedder's state."""
        self._require_open()
        with self._lock:
            by_type = {t.value: 0 for t in MemoryType} | self._fields.type_counts()
            return {
                "memories": len(self._records), "by_type": by_type,
                "context_window": len(self._window), "generation": self._generation,
                "journal_bytes": self._journal.size, "snapshot_bytes": _size(self.path / SNAPSHOT_FILE),
                "model": self._current_key, "embedder": "ready" if self._embedder is not None else "unavailable",
                "embedder_error": self.embedder_error, "index": self._vectors.stats(),
                "lexical_terms": len(self._lexical._postings),
            }

    @property
    def embedder(self) -> Any:
        """The embedder in use, or None when running lexical-only."""
        return self._embedder

    @property
    def config(self) -> Config:
        """The configuration this store was opened with."""
        return self._config

    # -- lifecycle ---------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError("this MemoryStore is closed")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def close(self) -> None:
        """Compact if the journal holds changes, flush, and release the lock; idempotent."""
        if self._closed:
            return
        with self._lock:
            try:
                if self._journal.size > jr.HEADER_SIZE + 64:
                    self.compact(full=True)
                elif self._vectors.pending:  # an in-service compaction skipped the graph cache
                    self._vectors.save_graph(self.path / GRAPH_FILE, self._graph_tag(), force=True)
            except ReachyMemoryError as exc:
                log.warning("could not compact on close (the journal keeps every change): %s", exc)
            finally:
                self._journal.close()
                self._closed = True
                self._dir_lock.release()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_snapshot(path: Path) -> dict[str, Any]:
    """A snapshot or backup file as one dict: the header's keys plus ``records``,
    ``vectors`` (a view), ``lexical`` and ``window``.

    Raises CorruptionError for an incomplete or damaged file,
    FormatVersionError for a foreign one.
    """
    frames = jr.read_file(path, jr.SNAPSHOT, raw=frozenset({2})).frames
    sections = [frames[i] for i in (0, 1, 3, 4, 5)] if len(frames) == 6 else []
    if not sections or not all(isinstance(f, dict) for f in sections):
        raise CorruptionError(f"{path}: incomplete snapshot ({len(frames)} of 6 sections)", path=str(path), offset=0)
    head, recs, lexical, window, end = sections
    records = recs.get("records", [])
    if end.get("end") != len(records):
        raise CorruptionError(f"{path}: end marker counts {end.get('end')} memories, found {len(records)}",
                              path=str(path), offset=0)
    try:
        vectors = jr.raw_bin(frames[2])
    except ValueError as exc:
        raise CorruptionError(f"{path}: bad vector block", path=str(path), offset=0) from exc
    return {**head, "records": records, "vectors": vectors, "lexical": lexical.get("lexical", {}),
            "window": window.get("window", [])}


def fuse(cos: np.ndarray, lex: np.ndarray, cfg: Any, *, use_vec: bool, use_lex: bool) -> np.ndarray:
    """One score in [0, 1] from cosine and lexical coverage (see module docs).

    Hybrid is a weighted noisy-OR, ``1 - (1 - cos)^(2w) * (1 - lex)^(2(1 - w))``:
    a memory strong on either signal scores high, so ``min_score`` keeps the
    meaning it has for plain cosine similarity.
    """
    if not use_vec:
        return lex
    if not use_lex:
        return cos.astype(np.float64)
    w = cfg.vector_weight
    miss_v = (1.0 - np.clip(cos, 0.0, 0.999)) ** (2 * w)
    miss_l = (1.0 - np.clip(lex, 0.0, 0.999)) ** (2 * (1 - w))
    return 1.0 - miss_v * miss_l


_EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.float64))
_WORDS = re.compile(r"\w+")


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``scores`` (unordered)."""
    if len(scores) <= k:
        return np.arange(len(scores))
    return np.argpartition(-scores, k - 1)[:k]


def _lookup(keys: np.ndarray, values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``values`` at ``wanted`` keys (``keys`` sorted), 0 where absent."""
    out = np.zeros(len(wanted), np.float64)
    if len(keys) == 0:
        return out
    pos = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    hit = keys[pos] == wanted
    out[hit] = values[pos[hit]]
    return out


def _epoch(now: Any) -> float:
    """``now`` (datetime, epoch or None for the current time) as epoch seconds."""
    at = to_epoch(now) if now is not None else None
    return time.time() if at is None else at


def _check_str(value: Any, field: str) -> None:
    if not isinstance(value, str):
        raise ValidationError(f"{field} must be a string, got {type(value).__name__}", field=field)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _as_list(items: Iterable[Any], limit: int) -> list[Any]:
    if isinstance(items, str | bytes | Mapping):
        raise ValidationError("items must be a list of dicts", field="items")
    items = list(items)
    if not items:
        raise ValidationError("items must not be empty", field="items")
    if len(items) > limit:
        raise TooLargeError(f"{len(items)} items in one batch; the limit is {limit}",
                            field="items", size=len(items), limit=limit)
    return items
