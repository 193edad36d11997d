"""The in-process memory engine: :class:`MemoryStore`.

Every change goes through one funnel, :meth:`MemoryStore._commit`: the
operations are appended to the journal (durable per ``memory.fsync``) and only
then applied to the in-memory state and indexes.  Opening a store replays the
same operations over the last snapshot, so what was acknowledged is what comes
back.

The data directory's files and the generation rules between them are in
:mod:`reachy_memory._persistence`; ``docs/FORMAT.md`` is the contract.

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
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from . import _persistence as files
from . import _ranking as ranking
from . import journal as jr
from ._filters import FieldIndex, validate_metadata
from ._persistence import GRAPH_FILE, JOURNAL_FILE, SNAPSHOT_FILE, read_snapshot
from ._temporal import temporal_bonus
from ._threads import pin_native_threads
from .config import Config
from .errors import (
    ClosedError,
    CorruptionError,
    ModelError,
    ModelMismatchError,
    ReachyMemoryError,
    ReadOnlyError,
    TooLargeError,
    ValidationError,
)
from .lexical_index import LexicalIndex
from .model import Expiry, Memory, MemoryType, SearchResult, check_time, resolve_timezone, to_datetime, to_epoch
from .vector_index import VectorIndex

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_EMBEDDER", "GRAPH_FILE", "JOURNAL_FILE", "SNAPSHOT_FILE", "Embedder", "MemoryStore",
           "read_snapshot"]
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
    """A validated, embedded write, ready to be committed.

    ``texts`` are what was embedded for each op; :meth:`MemoryStore.commit`
    re-embeds an op whose previous-turn text changed between prepare (embed
    thread) and commit (engine thread).
    """

    ops: list[list[Any]]
    ids: list[str]
    texts: list[str | None]


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
                 embedder: Any = DEFAULT_EMBEDDER, reindex: bool = False, recover: bool = False) -> None:
        self._config = config or Config()
        self.path = Path(path).expanduser() if path is not None else self._config.data_dir
        self._closed = True
        self._lock = threading.RLock()
        pin_native_threads(self._config.search.blas_threads)
        files.secure_dir(self.path)
        self._dir_lock = jr.DirLock(self.path)
        self._dir_lock.acquire()
        try:
            files.tighten_files(self.path)
            self._open(embedder, reindex, recover)
        except BaseException:
            self._dir_lock.release()
            raise
        self._closed = False
        if recover:
            self._compact(full=True)  # a fresh snapshot of the rebuilt state (see verify --repair)

    # -- opening ---------------------------------------------------------------------

    def _open(self, embedder: Any, reindex: bool, recover: bool = False) -> None:
        mem = self._config.memory
        self._tz = resolve_timezone(mem.timezone)  # temporal words in queries are read in this zone
        self._expiry = Expiry(mem.conversation_ttl_days, self._tz)
        base = files.recovery_base(self.path) if recover else None
        snapshot = base.snapshot if base is not None else self._read_snapshot()
        stored_key = snapshot.get("model") if snapshot and not reindex else None  # reindex: the configured model
        self._embedder = self._resolve_embedder(embedder, stored_key)
        self.embedder_error: str | None = getattr(self, "_embedder_error", None)
        self._records: dict[str, _Rec] = {}
        self._by_slot: dict[int, _Rec] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._fields = FieldIndex()
        self._lexical = LexicalIndex()
        self._window: deque[list[Any]] = deque(maxlen=2 * mem.context_window_size)
        # Read views for the cheap reads (get_context_window, get_context, stats): immutable
        # values whose references the writer swaps under the store lock; readers take no
        # lock, so a compaction, a backup or a search never makes them wait.
        self._window_view: tuple[tuple[Any, ...], ...] = ()
        self._context_view: dict[str, tuple[_Rec, ...]] = {}
        self._generation = 0
        self._model_key: str | None = None
        self._last_turn: _Rec | None = None
        self._model_key = snapshot.get("model") if snapshot else (_first_vkey(base.ops) if base else None)
        self._current_key = embedder_key(self._embedder) if self._embedder is not None else self._model_key
        self._load_snapshot(snapshot, _first_dim(base.ops) if base else None)
        if base is not None:  # rebuild: the previous generation's ops, then the current journal
            for op in base.ops:
                self._apply(op)
            self._generation = base.generation + 1
        self._journal = jr.Journal(self.path / JOURNAL_FILE, mem.fsync, mem.fsync_batch_window_ms)
        try:
            self._replay(self._journal.open({"kind": "journal", "generation": self._generation}))
            self._check_model(reindex)
        except BaseException:
            self._journal.close()
            raise
        self._adopt_model()

    def _resolve_embedder(self, embedder: Any, stored_key: str | None) -> Any:
        if embedder is not DEFAULT_EMBEDDER:
            return embedder
        if not self._config.embedding.enabled:
            return None
        from .embedding import load_embedder  # late: the model is optional at import time

        try:
            return load_embedder(self._precision_of_store(stored_key), data_dir=self.path)
        except ModelError as exc:
            self._embedder_error = str(exc)
            log.warning("embedding model unavailable, search runs lexical-only: %s", exc)
            return None

    def _precision_of_store(self, stored_key: str | None) -> Config:
        """The config to load the model with: a store whose vectors come from the same
        weights in the other precision keeps that precision (a store written before int8
        became the default opens instead of refusing), with a warning naming the fix."""
        parts = (stored_key or "").split("/")
        configured = self._config.embedding.precision
        if len(parts) == 4 and parts[2] in ("fp32", "int8") and parts[2] != configured:
            log.warning("this store's vectors are %s; using %s (run 'reachy-memory reindex' with "
                        "embedding.precision: %s to switch)", parts[2], parts[2], configured)
            return self._config.replace("embedding", precision=parts[2])
        return self._config

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

    def _load_snapshot(self, snapshot: dict[str, Any] | None, dim_hint: int | None = None) -> None:
        dim = self._embedder.dim if self._embedder is not None else (snapshot or {}).get("dim") or dim_hint or 384
        cfg = self._config.search
        self._vectors = VectorIndex(dim, m=cfg.hnsw_m, ef_construction=cfg.hnsw_ef_construction,
                                    ef_search=cfg.hnsw_ef_search, exact_threshold=cfg.exact_threshold,
                                    exact_below=cfg.exact_below)
        if snapshot is None:
            return
        self._generation = snapshot["generation"]
        self._window.extend(snapshot["window"])
        self._window_view = tuple(tuple(turn) for turn in self._window)
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
        self._update_context_view(rec, add=True)

    def _update_context_view(self, rec: _Rec, *, add: bool) -> None:
        """Swap in a new context view when ``rec`` is named context (copy-on-write)."""
        key = rec.metadata.get("context_key") if rec.type == MemoryType.CONTEXT.value else None
        if not isinstance(key, str):
            return
        kept = tuple(r for r in self._context_view.get(key, ()) if r.id != rec.id)
        self._context_view = {**self._context_view, key: (*kept, rec) if add else kept}

    def _graph_tag(self) -> str:
        return f"{self._generation}:{self._current_key}"

    def _load_graph(self) -> None:
        if self._vectors.count <= self._vectors.exact_below // 2:
            return  # searched exactly at this size; vectors wait as pending
        self._vectors.load_graph(self.path / GRAPH_FILE, self._graph_tag())

    def _replay(self, result: jr.ReadResult) -> None:
        """Apply the journal's ops, after checking that it follows the snapshot.

        Raises CorruptionError (nothing changed on disk) for a journal newer
        than the snapshot: the snapshot is missing or was replaced.
        """
        generation = files.journal_generation(result)
        if generation is not None and generation < self._generation:
            # A compaction made the snapshot durable and died before retiring
            # the journal: every op in it is in the snapshot.  Move it, never rewrite it.
            log.warning("journal generation %s is older than snapshot %s: already folded in, kept as %s",
                        generation, self._generation, files.PREV_JOURNAL_FILE)
            self._journal.close()
            files.retire_journal(self.path)
            self._open_journal()
            return
        if generation != self._generation:
            raise CorruptionError(
                f"{self._journal.path}: journal generation {generation} is newer than the snapshot's "
                f"{self._generation} (the snapshot is missing or was replaced); nothing was changed. "
                "Run 'reachy-memory verify --repair' to rebuild from the previous generation kept on disk",
                path=str(self._journal.path), offset=0)
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
                self._compact_quietly()

    def _compact_quietly(self) -> None:
        """Auto-compaction: a failure is logged, never raised, because the write that
        triggered it is already durable in the journal (which keeps growing)."""
        try:
            self._compact()
        except ReachyMemoryError as exc:
            log.warning("compaction failed, the journal keeps every change: %s", exc)

    def _apply(self, op: list[Any]) -> None:
        kind = op[0]
        if kind == "put":
            self._apply_put(_Rec(*op[1]), op[2])
        elif kind == "del":
            self._apply_del(op[1])
        elif kind == "win":
            self._window.append(op[1:])
            self._window_view = tuple(tuple(turn) for turn in self._window)
        elif kind == "winclr":
            self._window.clear()
            self._window_view = ()
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
        self._update_context_view(rec, add=False)
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
        texts = self._embedding_texts(recs, self._last_turn)
        vectors = self._embed_records(recs, texts)
        ops = [["put", rec.row(), vec] for rec, vec in zip(recs, vectors, strict=True)]
        return _Prepared(ops, out_ids, [t if v is not None else None for t, v in zip(texts, vectors, strict=True)])

    def commit(self, prepared: _Prepared) -> list[Memory]:
        """Make a prepared write durable and visible; returns the memories."""
        self._require_open()
        with self._lock:
            fresh = [(op, text) for op, text in zip(prepared.ops, prepared.texts, strict=True)
                     if not self._is_duplicate(op[1])]
            if fresh:
                self._commit(self._with_current_context(fresh))
            return [self._records[i].memory() for i in prepared.ids]

    def _with_current_context(self, fresh: list[tuple[list[Any], str | None]]) -> list[list[Any]]:
        """The ops, each conversation turn re-embedded if the turn before it is not the
        one prepare saw (another write committed in between).  Engine thread only."""
        recs = [_Rec(*op[1]) for op, _ in fresh]
        texts = self._embedding_texts(recs, self._last_turn)
        stale = [i for i, (op, seen) in enumerate(fresh) if seen is not None and texts[i] != seen]
        vectors = self._embed([texts[i] for i in stale]) if stale else None
        ops = [op for op, _ in fresh]
        for n, i in enumerate(stale):
            ops[i] = ["put", ops[i][1], vectors[n].astype(np.float32).tobytes() if vectors is not None else None]
        return ops

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
        return content, mtype.value, metadata, memory_id, check_time(item.get("created_at"), "created_at")

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

    def _embed_records(self, recs: list[_Rec], texts: list[str]) -> list[bytes | None]:
        if self._embedder is None or not recs:
            return [None] * len(recs)
        vectors = self._embed(texts)
        if vectors is None:
            return [None] * len(recs)
        for rec in recs:
            rec.vkey = self._current_key
        return [np.ascontiguousarray(v, np.float32).tobytes() for v in vectors]

    def _embedding_texts(self, recs: list[_Rec], previous: _Rec | None) -> list[str]:
        """Each new record's text to embed (``previous``: the last turn stored before them)."""
        texts = []
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
            slots, scores = self._rank(query, qvec, mask, limit, mode, mtype, at)
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
              now: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Candidate slots and their fused scores (unordered); see :mod:`._ranking`.
        With ``now``, a hybrid search adds ``search.temporal_boost`` to memories created
        inside the window the query's time words name (:mod:`._temporal`)."""
        cfg = self._config.search
        groups = [_GROUP[mtype]] if mtype is not None else None
        slots, scores = ranking.rank(query, qvec, mask, limit, mode, groups,
                                     indexes=ranking.Indexes(self._vectors, self._lexical, self._fields), cfg=cfg)
        if mode == "hybrid" and cfg.temporal_boost and now is not None and len(slots):
            created = np.fromiter((self._by_slot[int(s)].created for s in slots), np.float64, len(slots))
            scores = np.minimum(scores + temporal_bonus(query, created, now, cfg.temporal_boost, self._tz), 1.0)
        return slots, scores

    # -- context window and named context ---------------------------------------------

    def add_to_context_window(self, role: str, content: str) -> None:
        """Append a turn to the persisted window (the last N turns, 2N messages)."""
        self._require_open()
        if not isinstance(role, str) or not 0 < len(role.strip()) <= 64:
            raise ValidationError("role must be a non-empty string of at most 64 characters", field="role")
        self._commit([["win", role, self._validate_text(content, "content"), time.time()]])

    def get_context_window(self) -> list[dict[str, Any]]:
        """The recent messages, oldest first: dicts with role, content, timestamp.
        Takes no lock (reads the window view)."""
        self._require_open()
        return [{"role": r, "content": c, "timestamp": to_datetime(t).isoformat()} for r, c, t in self._window_view]

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
        live = [r for r in self._context_view.get(key, ()) if not r.expired(at)]  # no lock: the view
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
        """:meth:`compact` without the open check (it also runs while opening).

        Order (crash analysis in docs/FORMAT.md): keep the current snapshot as
        the previous one, write the new snapshot durably, retire the journal,
        start a fresh one.  A crash at any step leaves a state open recovers.
        """
        with self._lock:
            self._require_writable()
            files.write_next_journal(self.path, self._generation + 1)
            files.write_snapshot_keeping_previous(self.path, self._snapshot_frames(self._generation + 1))
            self._generation += 1  # from here the snapshot on disk is the new generation
            self._journal.close()
            try:
                files.switch_journals(self.path)
                self._open_journal()
            except ReachyMemoryError as exc:
                self._journal.failure = f"compaction could not switch journals ({exc}); reopen the store"
                raise
            self._vectors.save_graph(self.path / GRAPH_FILE, self._graph_tag(), force=full)
            files.tighten_files(self.path)

    def _open_journal(self) -> None:
        """Open ``journal.rmj`` (created for the current generation when absent)."""
        mem = self._config.memory
        self._journal = jr.Journal(self.path / JOURNAL_FILE, mem.fsync, mem.fsync_batch_window_ms)
        self._journal.open({"kind": "journal", "generation": self._generation})

    def _require_writable(self) -> None:
        if self._journal.failure is not None:
            raise ReadOnlyError(f"the store is read-only: {self._journal.failure}", path=str(self._journal.path))

    def _snapshot_frames(self, generation: int) -> Iterable[Any]:
        rows = []
        for rec in self._records.values():
            row = rec.row()
            indexed = rec.vkey == self._current_key and bool(self._vectors.alive[rec.slot : rec.slot + 1].any())
            row[7] = rec.vkey if indexed else None
            rows.append(row)
        head = {"kind": "snapshot", "generation": generation, "model": self._current_key or self._model_key,
                "dim": self._vectors.dim, "created": time.time()}
        yield head
        yield {"records": rows}
        yield jr.RawBin(self._vectors.vector_bytes())
        yield {"lexical": self._lexical.state()}
        yield {"window": list(self._window)}
        yield {"end": len(rows)}

    def backup(self, dest: str | Path, *, force: bool = False) -> dict[str, Any]:
        """Write a consistent snapshot of the whole store to the file ``dest`` (fsynced),
        or to a timestamped file inside ``dest`` when it is a directory.

        Raises ValidationError (nothing written) for a target inside the data
        directory, a symlink, a missing directory, or an existing file that is
        not a backup (unless ``force``).
        """
        self._require_open()
        with self._lock:
            target = files.backup_target(dest, self.path, force=force)
            size = jr.write_snapshot(target, self._snapshot_frames(self._generation))
            return {"path": str(target), "bytes": size, "memories": len(self._records)}

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
        """Counts, sizes and the embedder's state.  Takes no lock (a compaction or a
        search never makes it wait); the figures may be one write apart."""
        self._require_open()
        for _ in range(3):
            try:
                return self._stats_now()
            except RuntimeError:  # a dict grew while we read it (a new type or graph): read again
                continue
        with self._lock:
            return self._stats_now()

    def _stats_now(self) -> dict[str, Any]:
        by_type = {t.value: 0 for t in MemoryType} | self._fields.type_counts()
        return {
            "memories": len(self._records), "by_type": by_type,
            "context_window": len(self._window_view), "generation": self._generation,
            "journal_bytes": self._journal.size, "snapshot_bytes": _size(self.path / SNAPSHOT_FILE),
            "model": self._current_key, "embedder": "ready" if self._embedder is not None else "unavailable",
            "embedder_error": self.embedder_error, "index": self._vectors.stats(),
            "read_only": self._journal.failure, "lexical_terms": len(self._lexical._postings),
        }

    @property
    def read_only(self) -> str | None:
        """Why the store refuses writes (an fsync failed), or None; cleared by reopening."""
        return self._journal.failure

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


def _first_vkey(ops: list[list[Any]]) -> str | None:
    """The vector space named by the first stored memory in ``ops`` (a rebuild with no snapshot)."""
    return next((op[1][7] for op in ops if op[0] == "put" and op[1][7] is not None), None)


def _first_dim(ops: list[list[Any]]) -> int | None:
    """The dimension of the first stored vector in ``ops`` (a rebuild with no snapshot)."""
    return next((len(op[2]) // 4 for op in ops if op[0] == "put" and op[2]), None)


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
