"""The in-process memory engine: :class:`MemoryStore`.

Every change goes through one funnel, :meth:`MemoryStore._commit`: the
operations are appended to the journal (durable per ``memory.fsync``) and only
then applied to the in-memory state and indexes.  Opening a store replays the
same operations over the last snapshot, so what was acknowledged is what comes
back.

The data directory's files and the generation rules between them are in
:mod:`reachy_memory.storage.files`; ``docs/FORMAT.md`` is the contract.

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
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reachy_memory._threads import gc_paused, pin_native_threads
from reachy_memory.config import Config
from reachy_memory.engine import ingest, ranking
from reachy_memory.engine.backfill import Backfill, lacking_vector
from reachy_memory.engine.records import Record, encode, first_dim, first_vkey
from reachy_memory.engine.state import GROUP, MemoryState, redate_args
from reachy_memory.engine.temporal import query_window, window_bonus
from reachy_memory.errors import (
    ClosedError,
    ModelError,
    ModelMismatchError,
    NotFoundError,
    ReachyMemoryError,
    ValidationError,
)
from reachy_memory.model import (
    SEARCH_LIMIT,
    SEARCH_MIN_SCORE,
    Expiry,
    Memory,
    MemoryType,
    SearchResult,
    merged_metadata,
    resolve_timezone,
    to_datetime,
    to_epoch,
)
from reachy_memory.people.ops import PeopleMixin
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr
from reachy_memory.storage import restore as swap
from reachy_memory.storage.files import GRAPH_FILE, JOURNAL_FILE, SNAPSHOT_FILE, read_snapshot
from reachy_memory.storage.generations import Storage

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_EMBEDDER", "GRAPH_FILE", "JOURNAL_FILE", "SNAPSHOT_FILE", "Embedder", "MemoryStore",
           "read_snapshot"]
TOUCH_FLUSH_SECONDS = 60.0  # decay clock refreshes are journaled at most this often (and on close)
BACKFILL_STEP_SECONDS = 0.004  # one idle step of embedding memories that lack a vector: like an index step
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


class MemoryStore(PeopleMixin):
    """Long-term memory: store, search, forget, expire; durable and crash-safe.

    ``MemoryStore(path, config=..., embedder=...)`` opens (or creates) the data
    directory ``path`` (default ``config.memory.path``) and takes its lock.
    ``embedder=None`` runs lexical-only; the default loads the configured model
    and falls back to lexical-only, with a warning, when it cannot.  Use it as a
    context manager or call :meth:`close`.

    Raises :class:`StoreLockedError` if another process has the directory,
    :class:`CorruptionError` for damaged files, :class:`ModelMismatchError` when
    the stored vectors come from another model (unless ``reindex=True``).

    Threads: the caller that holds ``_lock`` (the daemon's engine thread) owns
    the state and the journal; a background compaction thread owns only its
    frozen view and the snapshot file it writes (see :mod:`._storage`).
    :meth:`prepare`, :meth:`prepare_context` and :meth:`embed_query` run on any
    thread (the daemon's embed thread) and change nothing: they read the record
    table by single lookups only, never by iteration.
    """

    def __init__(self, path: str | Path | None = None, *, config: Config | None = None,
                 embedder: Any = DEFAULT_EMBEDDER, reindex: bool = False, recover: bool = False) -> None:
        self._config = config or Config()
        self.path = Path(path).expanduser() if path is not None else self._config.data_dir
        self._closed = True
        self._lock = threading.RLock()
        self._close_lock = threading.Lock()  # two threads closing at once: the second waits, then returns
        self._recent_subjects: dict[str | None, list[str]] = {}  # engine thread: persons of the last facts
        self._count_tokens = None
        self._touched: dict[str, float] = {}  # engine thread: decay clock refreshes not yet journaled
        self._touches_flushed = time.monotonic()
        self._backfill = Backfill()  # engine thread: memories waiting for a vector (see maintain)
        self._deferring: int | None = None  # the thread whose writes skip their fsync (deferred_durability)
        pin_native_threads(self._config.search.blas_threads)
        files.secure_dir(self.path)
        self._dir_lock = jr.DirLock(self.path)
        self._dir_lock.acquire()
        try:
            files.tighten_files(self.path)
            swap.settle(self.path)  # a restore cut short: finished, or its staged copy removed
            files.remove_unfinished_writes(self.path)  # temp files of writes a crash cut short
            with files.damage_is_corruption(self.path):
                self._open(embedder, reindex, recover)
        except BaseException:
            self._dir_lock.release()
            raise
        self._closed = False
        if recover:
            self._storage.compact(full=True)  # a fresh snapshot of the rebuilt state (see verify --repair)

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
        model_key = snapshot.get("model") if snapshot else (first_vkey(base.ops) if base else None)
        current_key = embedder_key(self._embedder) if self._embedder is not None else model_key
        dim = self._embedder.dim if self._embedder is not None else (
            (snapshot or {}).get("dim") or (first_dim(base.ops) if base else None) or 384)
        self._state = MemoryState(self._config, dim, current_key, model_key)
        self._storage = Storage(self.path, self._config, self._state, self._lock, snapshot)
        if snapshot is not None:
            self._state.load(snapshot)
        if base is not None:  # rebuild: the previous generation's ops, then the current journal
            self._storage.apply(base.ops)
            self._storage.rebuilt_from(base.generation)
        self._storage.open(rebuilding=base is not None)
        # After the replay: a slot written while the cache loads is never kept, and the
        # journal's writes since the snapshot (nodes idle time may have cached) are not that.
        self._load_graph()
        try:
            self._check_model(reindex)
        except BaseException:
            self._storage.journal.close()
            raise
        self._adopt_model()

    def _resolve_embedder(self, embedder: Any, stored_key: str | None) -> Any:
        if embedder is not DEFAULT_EMBEDDER:
            return embedder
        if not self._config.embedding.enabled:
            return None
        from reachy_memory.embedding.embedder import load_embedder  # late: the model is optional at import time

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
        if self._embedder is None or reindex:
            return
        other = self._state.foreign_vkey()
        if other is not None:
            key = self._state.current_key
            raise ModelMismatchError(
                f"this store's vectors were made by {other!r} but the configured model is {key!r}; "
                "run 'reachy-memory reindex' to re-embed, or configure the original model",
                stored=other, configured=key,
            )

    def _load_graph(self) -> None:
        vectors = self._state.vectors
        if vectors.count <= vectors.exact_below // 2:
            return  # searched exactly at this size; vectors wait as pending
        vectors.load_graph(self.path / GRAPH_FILE, self._storage.graph_tag())

    def adopt_embedder(self, embedder: Any) -> bool:
        """Start embedding with ``embedder`` in a store opened without a model (the model
        was fetched after the daemon started; load it with :meth:`model_config`): its
        memories are then embedded in idle time (see :meth:`maintain`).  Only for a store
        that never held a vector, whose index has the model's dimension and that declares
        no other model; otherwise returns False, changing nothing but ``embedder_error``
        (a restart opens the store with the model and checks its vectors as usual).
        Call it on the thread that owns the state (the daemon's engine thread)."""
        self._require_open()
        key = embedder_key(embedder)
        with self._lock:
            if self._embedder is not None:
                return False
            if embedder.dim != self._state.vectors.dim or self._state.model_key not in (None, key) or any(
                    r.vkey is not None for r in self._state.records.values()):
                self.embedder_error = (f"the model {key} is on disk, but this store holds vectors or declares "
                                       "another model: restart the daemon to use it")
                log.warning("%s", self.embedder_error)
                return False
            self._state.current_key = key  # first: a write prepared meanwhile gets no vector
            self._embedder, self.embedder_error, self._count_tokens = embedder, None, None  # the model's tokens
            log.info("embedding model loaded: %s", key)
            try:
                self._adopt_model()
            except ReachyMemoryError as exc:  # the backfill is planned: only the model op waits for the next open
                log.warning("could not journal the model now in use (%s); the next open does", exc)
            return True

    def model_config(self) -> Config:
        """The config to load this store's model with: the configured one, in the precision
        of the vectors the store declares (see :meth:`_precision_of_store`)."""
        return self._precision_of_store(self._state.model_key)

    def _adopt_model(self) -> None:
        """Queue the memories without a vector from the model in use, then journal that
        model as the store's (planned first: a failed write leaves nothing unqueued)."""
        key = self._state.current_key
        if self._embedder is None:
            return
        missing = self._backfill.plan(self._state.records.values(), key)
        if missing:
            log.warning("%d memories have no vector from %s: the daemon embeds them in idle time, oldest first "
                        "(MemoryStore.maintain(); 'reachy-memory reindex' does all at once)", missing, key)
        if key != self._state.model_key and self._state.foreign_vkey() is None:
            self._commit([["model", key]])

    # -- the mutation funnel -----------------------------------------------------------

    def _commit(self, ops: list[list[Any]], *, durable: bool = False) -> None:
        """Journal ``ops`` (durably per policy, or whatever the policy with
        ``durable``), then apply them to the state."""
        with self._lock:
            self._storage.append(ops, durable=durable, defer=self._deferring == threading.get_ident())
            self._storage.apply(ops)
            if self._embedder is not None:
                self._backfill.note(ops)  # written without a vector (the model failed): embedded later
            self._storage.maybe_compact()

    @contextlib.contextmanager
    def deferred_durability(self) -> Iterator[None]:
        """Inside, this thread's writes (with ``memory.fsync: always``) are journaled and
        applied without waiting for their fsync: readers see them at once, and nothing
        may say they are durable before :meth:`durability_mark`'s call has returned.
        The daemon's engine thread runs each request so, and hands the fsync (and the
        reply) to a thread of its own: a search never waits behind a write's fsync."""
        self._deferring = threading.get_ident()
        try:
            yield
        finally:
            self._deferring = None

    def durability_mark(self) -> Callable[[], None] | None:
        """What makes every write journaled so far durable (call it on any thread; it
        raises ReadOnlyError if the fsync fails, the store then refusing writes), or
        None when they are durable already."""
        with self._lock:
            return self._storage.durability_mark()

    # -- writing ---------------------------------------------------------------------

    def store(self, content: str, memory_type: MemoryType | str = MemoryType.FACT,
              metadata: dict[str, Any] | None = None, *, id: str | None = None, owner: str | None = None,
              shared: bool = False) -> Memory:
        """Store one memory and return it once it is durable.

        ``id`` (optional, client-chosen) makes the call idempotent: storing the
        same id, content, type, owner and sharing again returns the existing memory
        (the id with anything else of these is a ValidationError).  ``owner`` (a user
        of the robot) scopes it: ``search(owner=)`` of another user leaves it out,
        unless ``shared``.
        Raises ValidationError / TooLargeError for bad input (nothing stored).
        """
        return self.store_batch([{"content": content, "memory_type": memory_type,
                                  "metadata": metadata, "id": id, "owner": owner, "shared": shared}])[0]

    def store_batch(self, items: Iterable[Mapping[str, Any]]) -> list[Memory]:
        """Store several memories in one durable write: all of them or none.  Items are
        dicts of content, memory_type, metadata, id, created_at, owner, shared (all but
        content optional)."""
        return self.commit(self.prepare(items))

    def prepare(self, items: Iterable[Mapping[str, Any]], now: float | None = None, *,
                imported: bool = False) -> _Prepared:
        """Validate and embed ``items`` without changing anything (thread-safe); ``imported``:
        exported memories, their ids taken as earlier versions wrote them (``validate_item``).
        Raises ValidationError / TooLargeError."""
        self._require_open()
        rows = [ingest.validate_item(item, self._config, imported=imported or self._holds_id(item))
                for item in ingest.as_list(items, self._config.memory.max_batch)]
        created = time.time() if now is None else now
        recs, out_ids = ingest.new_records(rows, created, self._expiry, self._state.records)
        before = self._newest_turn_guess()
        recs = ingest.linked(recs, before)
        texts = ingest.embedding_texts(recs, before, self._config)
        vectors = self._embed_records(texts)
        key = self._state.current_key
        ops = [["put", encode(rec.replace(vkey=key if vec is not None else None)), vec]
               for rec, vec in zip(recs, vectors, strict=True)]
        return _Prepared(ops, out_ids, [t if v is not None else None for t, v in zip(texts, vectors, strict=True)])

    def _holds_id(self, item: Any) -> bool:
        """Whether a memory holds the id ``item`` names: one kept before ids' characters were
        checked (an older version, an import) is taken as it is, so that storing it again
        stays a retry (``check_duplicate``: that memory returned, another one refused); it is
        never written anew (forgotten meanwhile: ``_check_retries_still_stored``)."""
        memory_id = item.get("id") if isinstance(item, Mapping) else None
        return isinstance(memory_id, str) and memory_id in self._state.records

    def _newest_turn_guess(self) -> Record | None:
        """The turn a prepared write will follow, as far as prepare can tell: the state's
        newest turn when no other thread holds the lock, else the last one known without
        a scan (the daemon's embed thread must not iterate records the engine thread is
        changing, nor write the state).  Commit re-links and re-embeds if it guessed wrong."""
        if not self._lock.acquire(blocking=False):
            return self._state.known_last_turn
        try:
            return self._state.last_turn
        finally:
            self._lock.release()

    def commit(self, prepared: _Prepared, also: list[list[Any]] | None = None) -> list[Memory]:
        """Make a prepared write durable and visible, with the ops ``also`` in the same
        journal frame (all or none); returns the memories."""
        self._require_open()
        with self._lock:
            self._check_retries_still_stored(prepared)
            fresh = [(op, text) for op, text in zip(prepared.ops, prepared.texts, strict=True)
                     if not self._is_duplicate(op[1])]
            if fresh or also:
                self._commit(self._with_current_context(fresh) + (also or []))
            return [self._state.records[i].memory() for i in prepared.ids]

    def _check_retries_still_stored(self, prepared: _Prepared) -> None:
        """Raise NotFoundError, writing nothing, when a memory that prepare left out as
        already stored (a retry with its id) was forgotten or expired since."""
        writing = {op[1]["id"] for op in prepared.ops}
        gone = next((i for i in prepared.ids if i not in writing and i not in self._state.records), None)
        if gone is not None:
            raise NotFoundError(f"memory {gone!r} was forgotten while this write waited; nothing was "
                                "stored (send it again to store it anew)", memory_id=gone)

    def _with_current_context(self, fresh: list[tuple[list[Any], str | None]]) -> list[list[Any]]:
        """The ops, each conversation turn re-embedded if the turn before it is not the
        one prepare saw (another write committed in between).  Engine thread only."""
        recs = ingest.linked([Record(**op[1]) for op, _ in fresh], self._state.last_turn)
        texts = ingest.embedding_texts(recs, self._state.last_turn, self._config)
        stale = [i for i, (op, seen) in enumerate(fresh) if seen is not None and texts[i] != seen]
        vectors = self._embed([texts[i] for i in stale]) if stale else None
        ops = [["put", encode(rec), op[2]] for rec, (op, _) in zip(recs, fresh, strict=True)]
        for n, i in enumerate(stale):
            ops[i] = ["put", ops[i][1], vectors[n].astype(np.float32).tobytes() if vectors is not None else None]
        return ops

    def _is_duplicate(self, row: dict[str, Any]) -> bool:
        memory_id = row["id"]
        return ingest.check_duplicate(self._state.records.get(memory_id), memory_id, row["content"], row["type"],
                                      row.get("owner"), row.get("shared", False))

    def _embed_records(self, texts: list[str]) -> list[bytes | None]:
        if self._embedder is None or not texts:
            return [None] * len(texts)
        vectors = self._embed(texts)
        if vectors is None:
            return [None] * len(texts)
        return [np.ascontiguousarray(v, np.float32).tobytes() for v in vectors]

    def _embed(self, texts: list[str]) -> np.ndarray | None:
        """Embed or return None (logged): the store never fails for the model's sake."""
        try:
            vectors = np.asarray(self._embedder.embed(texts), np.float32)
        except Exception as exc:  # any embedder failure degrades to lexical-only
            log.warning("embedding failed, continuing lexical-only: %s", exc)
            return None
        dim = self._state.vectors.dim
        if vectors.shape != (len(texts), dim) or not np.isfinite(vectors).all():
            log.warning("embedder returned shape %s, expected (%d, %d); ignoring its vectors",
                        vectors.shape, len(texts), dim)
            return None
        return vectors

    def remember_fact(self, content: str, metadata: dict[str, Any] | None = None, *, id: str | None = None,
                      **fields: Any) -> Memory:
        """Store a permanent FACT.  Metadata as spec 000's keywords
        (``remember_fact("...", category="user_profile")``), or as a dict like the
        clients take, or both (keywords win); ``id`` is the memory's, as for :meth:`store`
        (it was read as a metadata keyword).  Raises ValidationError for bad input."""
        return self.store(content, MemoryType.FACT, merged_metadata(metadata, fields), id=id)

    def remember_conversation(self, content: str, metadata: dict[str, Any] | None = None, *,
                              id: str | None = None, **fields: Any) -> Memory:
        """Store a CONVERSATION memory (expires after the configured TTL); metadata and
        ``id`` as for :meth:`remember_fact`."""
        return self.store(content, MemoryType.CONVERSATION, merged_metadata(metadata, fields), id=id)

    def forget(self, memory_id: str) -> bool:
        """Delete a memory; False if there was none with that id."""
        self._require_open()
        ingest.check_str(memory_id, "id")
        with self._lock:
            if memory_id not in self._state.records:
                return False
            self._commit([["del", memory_id]])
            return True

    def cleanup_expired(self, now: datetime_or_float = None) -> int:
        """Delete every memory expired at ``now`` (default: now); returns the count."""
        self._require_open()
        at = _epoch(now)
        with self._lock, gc_paused():  # 66k records freed: no full collection midway
            due = self._state.count_expired(at)
            if due:  # one small op, whatever the count: the replay deletes the same set
                self._commit([["expire", at]])
        return due

    def apply_retention(self, *, dry_run: bool = False, max_deletions: int | None = None,
                        now: datetime_or_float = None) -> dict[str, Any]:
        """Give the conversation turns stored and alive at ``now`` the configured
        lifetime (``memory.conversation_ttl_days`` from their creation, as new turns
        get), and delete what is expired at ``now``.  A memory's expiry is otherwise
        fixed when it is written, so a changed TTL reaches stored turns only through
        this explicit call; a turn already expired stays gone, even with a longer TTL.

        Returns the configured days and the plan (``turns`` alive; how many expire
        ``earlier`` or ``later`` than before; ``expire_now``: expired with the new
        lifetime), ``applied``, and ``deleted`` (every expired memory swept).
        ``dry_run`` counts only.  A ``now`` before the clock counts as the clock (a turn
        expired in between must not come back).  Raises ValidationError, changing nothing, when the
        new lifetime would delete more than ``max_deletions`` turns (the consent of
        ``reachy-memory retention --apply`` without ``--yes``).

        One frame (sweep, ``ttl`` op, sweep), synced whatever ``memory.fsync`` says.
        The op sets expiries in place; a snapshot or backup being written meanwhile
        holds the ones of its frozen moment (``MemoryState.retime``).  A replay gives
        the same expiries whatever config the store is reopened with.
        """
        self._require_open()
        at = max(_epoch(now), time.time())  # a past ``now`` must not revive a turn expired since
        ttl = self._config.memory.conversation_ttl_days * 86400.0
        with self._lock, gc_paused():
            plan = self._state.retime_plan(ttl, at)
            if not dry_run and max_deletions is not None and plan["expire_now"] > max_deletions:
                raise ValidationError(f"the configured TTL would delete {plan['expire_now']} stored conversation "
                                      f"turns now, over the {max_deletions} allowed", field="max_deletions")
            applied = not dry_run and bool(plan["earlier"] or plan["later"])
            before = len(self._state.records)
            if applied:
                sweep = ["expire", at]  # before the ttl op too: a longer TTL must not revive an expired turn
                self._commit([sweep, ["ttl", MemoryType.CONVERSATION.value, ttl], sweep], durable=True)
            elif not dry_run and self._state.count_expired(at):
                self._commit([["expire", at]])
            deleted = before - len(self._state.records)
        return {"conversation_days": ttl / 86400.0, **plan, "applied": applied, "deleted": deleted}

    def latest_time(self) -> float:
        """The latest time a memory was created or a window turn added (epoch seconds;
        0.0 for an empty store)."""
        self._require_open()
        with self._lock:
            created = (rec.created for rec in self._state.records.values())
            return max(itertools.chain(created, (turn[2] for turn in self._state.window_view)), default=0.0)

    def redate(self, since: float, until: float, delta: float) -> int:
        """Move every memory created in ``[since, until)`` (epoch seconds) by ``delta``
        seconds, its expiry with it, and every window turn of that period: the memories
        written while the wall clock was wrong by ``-delta`` (the daemon calls it when NTP's
        first sync steps a stale clock).  One ``redate`` op, synced whatever
        ``memory.fsync`` says; a replay gives the same times, whatever the clock or config.
        Returns how many memories moved.  Raises ValidationError, writing nothing, for
        values that are not finite, ``since > until``, or times moved out of 1970..2200."""
        self._require_open()
        op = ["redate", *redate_args([since, until, delta])]
        with self._lock:
            moving, turns = self._state.dated_in(since, until)
            if moving or turns:
                self._commit([op], durable=True)
        return moving

    # -- reading ---------------------------------------------------------------------

    def get(self, memory_id: str, *, now: datetime_or_float = None) -> Memory | None:
        """The live memory with that id, or None (an expired memory is never returned)."""
        self._require_open()
        ingest.check_str(memory_id, "id")
        rec = self._state.records.get(memory_id)
        return rec.memory() if rec is not None and not rec.expired(_epoch(now)) else None

    def export_page(self, after: str | None = None, limit: int = 500) -> tuple[list[Memory], str | None]:
        """Live memories in id order after ``after``; returns (page, next cursor or None)."""
        self._require_open()
        if after is not None:
            ingest.check_str(after, "after")
        with self._lock:
            records = self._state.records
            ids = sorted(records)
            start = bisect.bisect_right(ids, after) if after is not None else 0
            page = ids[start : start + limit]
            now = time.time()
            memories = [records[i].memory() for i in page if not records[i].expired(now)]
        return memories, (page[-1] if start + limit < len(ids) and page else None)

    def __len__(self) -> int:
        """How many memories a reader can see now: an expired one not yet swept is
        left out, as ``get``, ``search`` and ``export_page`` leave it out."""
        return self._live_count(time.time())[0]

    def _live_count(self, at: float) -> tuple[int, dict[str, int]]:
        """(memories alive at ``at``, expired ones not yet swept by type). Lock-free."""
        expired = self._state.expired_counts(at)
        return max(0, len(self._state.records) - sum(expired.values())), expired

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               min_score: float = SEARCH_MIN_SCORE, where: dict[str, Any] | None = None, *,
               mode: str | None = None, now: datetime_or_float = None, about: str | None = None,
               owner: str | None = None, include_superseded: bool = False) -> list[SearchResult]:
        """Find memories by meaning and by words, best first.

        ``mode`` is "hybrid" (default from config), "vector" or "lexical"; with
        no usable model every mode runs lexical-only.  ``where`` takes the
        Chroma-style filters described in ``_filters``.  ``about`` keeps memories
        about that person ("my wife", "Sarah"; unfiltered when nobody matches);
        ``owner`` keeps that user's memories plus shared and unscoped ones;
        superseded memories are left out unless ``include_superseded``.
        Raises ValidationError for bad arguments.
        """
        self._require_open()
        mode = self.check_search_args(query, limit, min_score, mode)
        qvec = self.embed_query(query) if mode != "lexical" else None
        return self.search_vector(query, qvec, memory_type, limit, min_score, where, mode=mode, now=now,
                                  about=about, owner=owner, include_superseded=include_superseded)

    def check_search_args(self, query: Any, limit: Any, min_score: Any, mode: str | None) -> str:
        """Validate search arguments (before embedding the query); returns the mode.
        Raises ValidationError / TooLargeError."""
        return ingest.check_search(query, limit, min_score, mode, self._config)

    def embed_query(self, query: str) -> np.ndarray | None:
        """The query's vector, or None when no model is usable (thread-safe)."""
        if self._embedder is None:
            return None
        vectors = self._embed([query])
        return None if vectors is None else vectors[0]

    def search_vector(self, query: str, qvec: np.ndarray | None, memory_type: MemoryType | str | None = None,
                      limit: int = SEARCH_LIMIT, min_score: float = SEARCH_MIN_SCORE,
                      where: dict[str, Any] | None = None, *,
                      mode: str = "hybrid", now: datetime_or_float = None, about: str | None = None,
                      owner: str | None = None, include_superseded: bool = False) -> list[SearchResult]:
        """:meth:`search` with the query already embedded (``qvec`` may be None)."""
        self._require_open()
        mtype = MemoryType.parse(memory_type).value if memory_type is not None else None
        at = _epoch(now)
        if owner is not None:
            ingest.check_str(owner, "owner")
        with self._lock:
            about_ids = self._about_ids(about, owner)
            mask = _both(self._state.fields.mask(mtype, where),
                         self._state.scope_mask(owner, about_ids, include_superseded, self._named_slots(about_ids)))
            slots, scores = self._rank(query, qvec, mask, limit, mode, mtype, at)
            diversity = self._config.search.diversity if mode == "hybrid" else 0.0
            want = max(2 * limit, ranking.MMR_POOL) if diversity else limit
            hits: list[tuple[int, Record]] = []  # (position in slots, record): the best shown hits, by score
            for i in np.argsort(-scores, kind="stable"):
                if scores[i] < min_score:
                    break
                rec = self._state.by_slot[int(slots[i])]
                if not rec.expired(at) and (include_superseded or not self._decayed(rec, at)):
                    hits.append((int(i), rec))
                    if len(hits) == want:
                        break
            if diversity and len(hits) > 2:
                pos = np.array([i for i, _ in hits])
                vectors = self._state.vectors.unit_rows(slots[pos])
                hits = [hits[k] for k in ranking.mmr_order(scores[pos], vectors, diversity, limit)]
            results = []
            for i, rec in hits[:limit]:
                results.append(SearchResult(rec.memory(), float(scores[i]), self.subject_names(rec, owner)))
                self._touch(rec, at)
            return results

    def _rank(self, query: str, qvec: np.ndarray | None, mask: np.ndarray | None,
              limit: int, mode: str, mtype: str | None = None,
              now: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Candidate slots and their fused scores (unordered); see :mod:`._ranking`.
        With ``now``, a hybrid search adds ``search.temporal_boost`` to memories created
        inside the window the query's time words name (:mod:`._temporal`)."""
        cfg, state = self._config.search, self._state
        groups = [GROUP[mtype]] if mtype is not None else None

        def text(slot: int) -> str:  # for pseudo-relevance feedback; an expired hit lends nothing
            rec = state.by_slot[slot]
            return "" if now is not None and rec.expired(now) else rec.content

        slots, scores = ranking.rank(query, qvec, mask, limit, mode, groups, cfg=cfg,
                                     indexes=ranking.Indexes(state.vectors, state.lexical, state.fields, text))
        window = None
        if mode == "hybrid" and cfg.temporal_boost and now is not None and len(slots):
            window = query_window(query, now, self._tz)
        if window is not None:  # most queries name no time: no creation times gathered
            created = np.fromiter((state.by_slot[int(s)].created for s in slots), np.float64, len(slots))
            scores = np.minimum(scores + window_bonus(window, created, cfg.temporal_boost), 1.0)
        if mode == "hybrid" and cfg.neighbour_boost and len(slots) > 1:
            scores = self._with_neighbours(slots, scores)
        return slots, scores

    def _with_neighbours(self, slots: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """``scores`` plus the neighbour-turn prior over the best ``search.candidates``."""
        cfg = self._config.search
        pool = ranking.top_k(scores, cfg.candidates)
        recs = [self._state.by_slot[int(s)] for s in slots[pool]]
        bonus = ranking.neighbour_bonus(scores[pool], [r.id for r in recs], [r.follows for r in recs],
                                        cfg.neighbour_boost)
        out = scores.copy()
        out[pool] = np.minimum(out[pool] + bonus, 1.0)
        return out

    # -- context window and named context ---------------------------------------------

    def add_to_context_window(self, role: str, content: str) -> None:
        """Append a turn to the persisted window (the last N turns, 2N messages)."""
        self._require_open()
        self._commit([_window_op(_role(role), ingest.validate_text(content, "content", self._config))])

    def record_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                    owner: str | None = None, id: str | None = None) -> Memory:
        """A conversation turn, both appended to the context window and kept as a
        CONVERSATION memory (metadata ``role`` plus ``metadata``; ``owner``: the user
        whose turn it is, None: unscoped), in one durable write: never one without the
        other.  The window itself is not scoped.  ``id`` (optional, client-chosen) makes
        the call idempotent: the same id, role, content and owner again appends nothing
        and returns the memory kept the first time (the id with anything else of these
        is a ValidationError).  Raises ValidationError / TooLargeError (nothing written),
        NotFoundError when the id's memory was forgotten while the retry waited."""
        return self.commit_turn(role, self.prepare_turn(role, content, metadata, owner=owner, id=id))

    def prepare_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                     owner: str | None = None, id: str | None = None) -> _Prepared:
        """The validated, embedded write of :meth:`record_turn` (thread-safe)."""
        self._require_open()
        _role(role)  # before the embedding
        return self.prepare([{"content": content, "memory_type": MemoryType.CONVERSATION,
                              "metadata": merged_metadata(metadata, {"role": role}), "owner": owner, "id": id}])

    def commit_turn(self, role: str, prepared: _Prepared) -> Memory:
        """Commit a :meth:`prepare_turn` write and its window turn in one frame; a retry of
        a turn already kept (its id's memory: found by prepare, or committed since by the
        same request sent twice) commits nothing and returns that memory."""
        role = _role(role)
        with self._lock:
            kept = self._state.records.get(prepared.ids[0])
            if kept is not None and kept.metadata.get("role") != role:
                raise ValidationError(f"id {prepared.ids[0]!r} is already used by another memory", field="id")
            also = [_window_op(role, prepared.ops[0][1]["content"])] if kept is None and prepared.ops else []
            [memory] = self.commit(prepared, also=also)
            return memory

    def get_context_window(self) -> list[dict[str, Any]]:
        """The recent messages, oldest first: dicts with role, content, timestamp; those
        older than ``memory.context_window_max_age_minutes`` are left out (kept on disk
        until the window moves on).  Takes no lock (reads the window view)."""
        self._require_open()
        return [{"role": r, "content": c, "timestamp": to_datetime(t).isoformat()} for r, c, t in self._window_shown()]

    def _window_shown(self) -> list[tuple[Any, ...]]:
        """The window's turns not older than ``memory.context_window_max_age_minutes``."""
        max_age = self._config.memory.context_window_max_age_minutes * 60.0
        oldest = time.time() - max_age if max_age else -math.inf
        return [turn for turn in self._state.window_view if turn[2] >= oldest]

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
            raise ValidationError("context key must be a non-empty string of at most 256 characters",
                                         field="key")
        return self.prepare([{"content": value, "memory_type": MemoryType.CONTEXT,
                              "metadata": {"context_key": key}}])

    def commit_context(self, key: str, prepared: _Prepared) -> Memory:
        """Commit a :meth:`prepare_context` write, dropping the key's earlier values."""
        self._require_open()
        with self._lock:
            old = [["del", r.id] for r in self._state.context_records(key)]
            self._commit(old + prepared.ops)
            return self._state.records[prepared.ids[0]].memory()

    def get_context(self, key: str, *, now: datetime_or_float = None) -> str | None:
        """The live value of named context ``key``, or None."""
        self._require_open()
        ingest.check_str(key, "key")
        at = _epoch(now)
        live = [r for r in self._state.context_view.get(key, ()) if not r.expired(at)]  # no lock: the view
        return max(live, key=lambda r: r.created).content if live else None

    # -- maintenance -------------------------------------------------------------------

    def maintain(self, budget: int = 256, *, save_cache: bool = True) -> int:
        """Idle-time upkeep (the daemon calls it between requests): finishes a step of
        a mass expiry's index work (:meth:`MemoryState.bury`), inserts a batch of pending
        vectors into the graph, and journals the decay clock refreshes at most once a
        minute; with none of that left, embeds memories that have no vector (a few
        milliseconds' worth, see :mod:`._backfill`), and then, when ``save_cache``,
        saves one memory type's vector graph to the graph cache if enough of it changed
        since it was cached (a crash then leaves little to insert again; up to ~80 ms
        for a graph of 33k vectors: the daemon asks for it only after some quiet).
        Returns how much it did (vectors inserted, deletions buried, graph nodes marked,
        memories embedded, graph nodes saved): 0 when nothing is left, or nothing can
        be done yet."""
        self._require_open()
        with self._lock:
            if self._touched and time.monotonic() - self._touches_flushed > TOUCH_FLUSH_SECONDS:
                self._flush_touches()
            left = self._state.bury(0)  # how much deletion work waits (none is done by 0)
            buried = left - self._state.bury(budget)
            done = buried + self._state.vectors.maintain(budget)
            return done or self._backfill_step() or (self._cache_step() if save_cache else 0)

    def _cache_step(self) -> int:
        """Save one graph to the cache when it is due (:meth:`VectorIndex.cache_step`)."""
        if self._storage.closing:
            return 0  # the closing compaction saves them all
        return self._state.vectors.cache_step(self.path / GRAPH_FILE, self._storage.graph_tag(), time.monotonic())

    def _backfill_step(self, seconds: float = BACKFILL_STEP_SECONDS) -> int:
        """Embed queued memories one at a time for about ``seconds`` (at least one),
        committing their vectors in frames of ``COMMIT_EVERY``; returns how many it embedded.
        Nothing while the journal refuses writes (each vector would be thrown away)."""
        if self._embedder is None or self._storage.failure or not self._backfill.ready():
            return 0
        key, count = self._state.current_key, 0
        until = time.monotonic() + seconds
        while (rec := self._backfill.take(self._state.records, key)) is not None:
            vector = self._embed([self._stored_text(rec)])
            if vector is None:
                self._backfill.put_back(rec)  # the model failed (logged): paused, tried again later
                break
            self._backfill.hold(rec, vector[0].tobytes())
            count += 1
            if time.monotonic() >= until:
                break
        if self._backfill.due():
            self._commit_backfill(key)
        return count

    def _commit_backfill(self, key: str | None) -> None:
        ops = self._backfill.drain(self._state.records, key)
        if not ops:
            return
        try:
            self._commit(ops)
        except ReachyMemoryError:
            self._backfill.failed(ops)  # queued again (paused): not lost until the next open
            raise
        self._backfill.committed(ops)
        if not len(self._backfill):
            log.info("embedded the %d memories that had no vector", self._backfill.embedded)

    def _stored_text(self, rec: Record) -> str:
        """What is embedded for a stored memory: a turn with the turn it follows."""
        return ingest.context_text(rec, self._turn_before(rec), self._config)

    def _turn_before(self, rec: Record, pairwise: Mapping[str, Record] | None = None) -> Record | None:
        """The turn ``rec`` is embedded with: the one it ``follows`` (None if that is gone);
        for a turn stored before turns recorded it (``follows`` None), its entry in
        ``pairwise`` (:meth:`MemoryState.previous_turns`), when given.  Under the lock."""
        if rec.follows is not None:
            return self._state.records.get(rec.follows)
        return pairwise.get(rec.id) if pairwise is not None else None

    def _decayed(self, rec: Record, now: float) -> bool:
        decay = self._config.decay
        return decay.enabled and rec.decayed(now, decay.rate_per_day, decay.threshold)

    def _touch(self, rec: Record, now: float) -> None:
        """Retrieval refreshes a fact's decay clock (journaled later, in batches)."""
        if self._config.decay.enabled and rec.type == MemoryType.FACT.value and not rec.protected:
            self._touched[rec.id] = now

    def _flush_touches(self) -> None:
        """Journal the pending decay clock refreshes as one frame (engine thread, or
        close() on any thread: hence the lock)."""
        with self._lock:
            touched, self._touched = self._touched, {}
            self._touches_flushed = time.monotonic()
            ops = [["update", i, {"last_access": at, "confidence": 1.0}] for i, at in touched.items()
                   if i in self._state.records]
            if ops:
                self._commit(ops)

    def compact(self, *, full: bool = False) -> None:
        """Fold the journal into a fresh snapshot (atomic) and save the graph cache,
        on the calling thread (after any background compaction in flight).

        ``full`` (on close) also inserts every pending vector before caching the
        graphs, however long that takes.  Raises StorageError / StorageFullError
        (the journal keeps every change) or ReadOnlyError.
        """
        self._require_open()
        self._storage.wait()
        self._storage.compact(full)

    def backup(self, dest: str | Path, *, force: bool = False,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Write a consistent snapshot of the whole store to the file ``dest`` (fsynced),
        or to a timestamped file inside ``dest`` when it is a directory; ``progress`` is
        told the bytes written so far.  Any thread: the store lock is held only to
        freeze the state and to thaw it.

        Raises ValidationError (nothing written) for a target inside the data
        directory, a symlink, a missing directory, or an existing file that is
        not a backup (unless ``force``).
        """
        self._require_open()
        target = files.backup_target(dest, self.path, force=force)
        size, count = self._storage.backup(target, progress)
        return {"path": str(target), "bytes": size, "memories": count}

    def reindex(self, progress: Callable[[int, int], None] | None = None, batch: int = 64) -> int:
        """Re-embed every memory whose vector is not from the current model.

        Each batch is committed on its own, so an interrupted reindex resumes
        where it stopped. Returns how many memories were re-embedded.
        Raises ModelError when there is no usable model.
        """
        self._require_open()
        if self._embedder is None:
            raise ModelError("reindex needs an embedding model; run 'reachy-memory model fetch'")
        with self._lock:  # the records are read whole: no write may change them meanwhile
            key = self._state.current_key
            todo = lacking_vector(self._state.records.values(), key)
            previous = self._turns_followed(todo)
        for done in range(0, len(todo), batch):
            self._reembed(todo[done : done + batch], previous)
            if progress:
                progress(min(done + batch, len(todo)), len(todo))
        if self._state.model_key != key:
            self._commit([["model", key]])
        with self._lock:
            self._backfill.plan(self._state.records.values(), key)  # what is left: nothing, or written meanwhile
        return len(todo)

    def _turns_followed(self, recs: list[Record]) -> dict[str, Record | None]:
        """The turn each of ``recs`` is embedded with by a reindex: :meth:`_turn_before`, with
        the turn stored just before for a turn stored before turns recorded what they
        follow (the backfill has no such fallback).  Under the lock."""
        unlinked = any(r.follows is None and r.type == MemoryType.CONVERSATION.value for r in recs)
        pairwise = self._state.previous_turns() if unlinked else None  # sorts every turn: only when needed
        return {r.id: self._turn_before(r, pairwise) for r in recs}

    def _reembed(self, recs: list[Record], previous: Mapping[str, Record | None]) -> None:
        vectors = self._embed([ingest.context_text(r, previous.get(r.id), self._config) for r in recs])
        if vectors is None:
            raise ModelError("the embedding model failed during reindex; nothing was lost, run it again")
        key = self._state.current_key
        with self._lock:  # one forgotten or changed meanwhile is left as it now is (a rerun embeds a changed one)
            ops = [["put", encode(rec.replace(vkey=key)), vec.astype(np.float32).tobytes()]
                   for rec, vec in zip(recs, vectors, strict=True) if self._state.records.get(rec.id) is rec]
            if ops:
                self._commit(ops)

    def stats(self) -> dict[str, Any]:
        """Counts, sizes, the embedder's state and the conversation TTL.  Takes no lock (a compaction or a
        search never makes it wait); the figures may be one write apart.

        ``memories`` and ``by_type`` count what a reader can see (as ``len``);
        ``expired_unswept``, the expired memories the next sweep deletes (hidden from
        every reader, still held in memory and on disk until then)."""
        self._require_open()
        for _ in range(3):
            try:
                return self._stats_now()
            except RuntimeError:  # a dict grew while we read it (a new type or graph): read again
                continue
        with self._lock:
            return self._stats_now()

    def _stats_now(self) -> dict[str, Any]:
        state = self._state
        memories, expired = self._live_count(time.time())
        by_type = {t.value: 0 for t in MemoryType} | state.fields.type_counts()
        by_type = {kind: max(0, n - expired.get(kind, 0)) for kind, n in by_type.items()}
        return {
            "memories": memories, "by_type": by_type, "expired_unswept": sum(expired.values()),
            "context_window": len(self._window_shown()), "generation": self._storage.generation,
            "journal_bytes": self._storage.journal.size, "snapshot_bytes": _size(self.path / SNAPSHOT_FILE),
            "model": state.current_key, "embedder": "ready" if self._embedder is not None else "unavailable",
            "unembedded": len(self._backfill),
            "embedder_error": self.embedder_error, "index": state.vectors.stats(),
            "read_only": self._storage.failure, "lexical_terms": state.lexical.term_count,
            "compacting": self._storage.compacting is not None,
            "conversation_ttl_days": self._config.memory.conversation_ttl_days,  # what the LLM tools tell a model
        }

    @property
    def read_only(self) -> str | None:
        """Why the store refuses writes (an fsync failed), or None; cleared by reopening."""
        return self._storage.failure

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

    def begin_closing(self) -> None:
        """Ahead of :meth:`close` (a daemon stopping): start no background compaction or
        backup, and abandon a backup being written (its caller gets ClosedError, its
        target is untouched).  Writes and searches go on until :meth:`close`, which
        should follow soon: this cannot be undone, and without background compactions
        the journal only grows."""
        self._storage.begin_closing()

    def close(self) -> None:
        """Compact if the journal holds changes, flush, and release the lock; idempotent
        and safe while other threads use the store (a write in flight finishes first,
        later ones raise ClosedError).  Not from inside one of this store's own calls
        (a signal handler interrupting one): set a flag there and close after."""
        with self._close_lock:
            if self._closed:
                return
            try:
                if self._touched:
                    with contextlib.suppress(ReachyMemoryError):  # a refresh lost on a failing disk is harmless
                        self._flush_touches()
                self._storage.close()
            finally:
                self._closed = True
                self._dir_lock.release()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _role(role: Any) -> str:
    """A window turn's role, checked; ValidationError otherwise."""
    if not isinstance(role, str) or not 0 < len(role.strip()) <= 64:
        raise ValidationError("role must be a non-empty string of at most 64 characters", field="role")
    return role


def _window_op(role: str, content: str) -> list[Any]:
    """The journal op appending ``role: content`` to the window, now."""
    return ["win", role, content, time.time()]


def _both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """Two slot masks of possibly different lengths, ANDed (None: no restriction)."""
    if a is None or b is None:
        return b if a is None else a
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))) & np.pad(b, (0, n - len(b)))


def _epoch(now: Any) -> float:
    """``now`` (datetime, epoch or None for the current time) as epoch seconds."""
    at = to_epoch(now) if now is not None else None
    return time.time() if at is None else at


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
