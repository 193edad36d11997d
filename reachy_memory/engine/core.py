"""The engine's core: :class:`Core`, the one implementation of :class:`~.ports.Engine`.

Every change goes through one funnel, :meth:`Core.commit`: the operations are
appended to the journal (durable per ``memory.fsync``) and only then applied to
the in-memory state and indexes.  Writes are prepared (validated, embedded) on any
thread by :meth:`Core.prepare` and made durable on the engine thread by
:meth:`Core.commit_prepared`.  Searches are checked once (:meth:`Core.check_search`) and ranked by :func:`.search.run`.

Owners (each piece of state has one):

* :class:`Core`: the state (:class:`~.state.MemoryState`: records, indexes, persons,
  context window), the storage (journal, snapshots: :class:`~reachy_memory.storage.generations.Storage`),
  the store lock, the embedder in use and its error, the backfill queue (memories
  owed a vector), the decay clock refreshes not yet journaled, the deferred-fsync
  thread and the closed flag.  Config, time zone and expiry rules are read-only.
* :mod:`.opening` builds a Core (the model adopted, the files read) and adopts a
  model fetched later; :class:`~.maintenance.Maintenance` owns the idle-time work
  and the reindex; :class:`~.session.Session` the context window and named context
  writes; :mod:`.retention` the expiry sweeps; the people components
  (:mod:`reachy_memory.people`) their own small caches (see their docs).

Threads: the caller that holds ``lock`` (the daemon's engine thread) owns the
state and the journal; :meth:`prepare` and :meth:`embed_query` run on any thread
and change nothing: they read the record table by single lookups only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import tzinfo
from pathlib import Path
from typing import Any

import numpy as np

from reachy_memory.config import Config
from reachy_memory.engine import dedupe, ingest, search
from reachy_memory.engine.backfill import Backfill
from reachy_memory.engine.household import Remembering
from reachy_memory.engine.ports import Prepared
from reachy_memory.engine.records import Record, encode
from reachy_memory.engine.search import SearchQuery
from reachy_memory.engine.state import MemoryState
from reachy_memory.errors import ClosedError, NotFoundError
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, Expiry, MemoryType, SearchResult, to_datetime
from reachy_memory.storage.files import SNAPSHOT_FILE
from reachy_memory.storage.generations import Storage

log = logging.getLogger(__name__)


class Core:
    """The state, the funnel that changes it, the embedder and the search entry (see the module doc)."""

    def __init__(self, path: Path, config: Config, tz: tzinfo, state: MemoryState, storage: Storage,
                 lock: threading.RLock, embedder: Any, embedder_error: str | None) -> None:
        self.path = path
        self._config = config
        self._tz = tz
        self.expiry = Expiry(config.memory.conversation_ttl_days, tz)
        self._state = state
        self.storage = storage
        self._lock = lock
        self._embedder = embedder
        self.embedder_error = embedder_error
        self.backfill = Backfill()  # engine thread: memories waiting for a vector (see Maintenance)
        self.touched: dict[str, float] = {}  # engine thread: decay clock refreshes not yet journaled
        self.touches_flushed = time.monotonic()
        self.closed = True  # until the store has finished opening
        self._deferring: int | None = None  # the thread whose writes skip their fsync (deferred_durability)
        self._held: list[Any] | None = None  # inside one_frame: the ops applied, journaled at its end
        self._undo: list[list[Any]] = []  # inside one_frame: what undoes each held op
        self.remembering = Remembering(2 * config.memory.context_window_size)  # the pause (in memory only)
        # The kept memories' content words (built at idle time), so that a write of new words skips the search.
        self.told = dedupe.Told() if config.memory.dedupe else None
        if self.told is not None and len(state.records) <= dedupe.TOLD_AT_OPEN:
            self.told.build(state.records.values(), dedupe.TOLD_AT_OPEN)
        state.on_put = self.told.add if self.told is not None else None

    # -- what the Engine port exposes ------------------------------------------------------

    @property
    def state(self) -> MemoryState:
        """The records, indexes, persons and window (changed only by :meth:`commit`)."""
        return self._state

    @property
    def lock(self) -> threading.RLock:
        """The store lock: held to change the state or iterate it."""
        return self._lock

    @property
    def config(self) -> Config:
        """The configuration the store was opened with."""
        return self._config

    @config.setter
    def config(self, value: Config) -> None:  # tests and tools/eval_locomo.py tune search knobs on an open store
        self._config = value

    @property
    def tz(self) -> tzinfo:
        """``memory.timezone``: temporal words and prompt dates are read in it."""
        return self._tz

    @property
    def embedder(self) -> Any:
        """The embedder in use, or None when running lexical-only."""
        return self._embedder

    def use_embedder(self, embedder: Any) -> None:
        """Start embedding with ``embedder`` (:func:`.opening.adopt_embedder` checked it)."""
        self._embedder, self.embedder_error = embedder, None

    def require_open(self) -> None:
        """Raise ClosedError once the store is closed."""
        if self.closed:
            raise ClosedError("this MemoryStore is closed")

    # -- the mutation funnel -----------------------------------------------------------

    def commit(self, ops: list[Any], *, durable: bool = False) -> None:
        """Journal ``ops`` (durably per policy, or whatever the policy with
        ``durable``), then apply them to the state.  While remembering is paused a frame
        writing a new memory or person is refused (RememberingPausedError), nothing written."""
        with self._lock:
            self.remembering.check(ops, self._state.records)
            if self._held is not None:  # inside one_frame: journaled with the rest at its end
                self._hold(ops)
                return
            self.storage.append(ops, durable=durable, defer=self._deferring == threading.get_ident())
            self.storage.apply(ops)
            if self._embedder is not None:
                self.backfill.note(ops)  # written without a vector (the model failed): embedded later
            self.storage.maybe_compact()

    @contextlib.contextmanager
    def one_frame(self) -> Iterator[None]:
        """Under the lock, every commit made inside is one journal frame: all or nothing.

        Each :meth:`commit` inside is applied at once (later steps see it: a person the
        first fact created, a fact the second one supersedes) and held; at the end the
        held ops are journaled as one frame.  When anything inside raises, or that write
        fails (a full disk: StorageFullError), every held op is undone in reverse order and
        the error is raised: nothing of it stays, in memory or on disk.  Nested: the
        outer frame holds the inner one's ops.  No compaction starts meanwhile (it would
        freeze ops not journaled yet).  Only ops that can be undone may be held: ``put``
        of a new memory, ``update``, ``person_put``."""
        with self._lock:
            if self._held is not None:
                yield
                return
            self._held, self._undo = [], []
            try:
                yield
                ops, self._held = self._held, None
                if ops:
                    self.storage.append(ops, defer=self._deferring == threading.get_ident())
            except BaseException:
                self._rewind()
                raise
            finally:
                self._held, self._undo = None, []
            if ops and self._embedder is not None:
                self.backfill.note(ops)
            self.storage.maybe_compact()

    def _hold(self, ops: list[Any]) -> None:
        """Inside :meth:`one_frame`: apply ``ops`` one by one, keeping each and what undoes it."""
        assert self._held is not None
        for op in ops:
            self._undo.append(self._inverse(op))
            self.storage.apply([op])
            self._held.append(op)

    def _inverse(self, op: Any) -> list[Any]:
        """The ops that undo ``op`` applied to the state as it is now."""
        state = self._state
        if isinstance(op, dict) and op.get("op") == "person_put":
            old = state.people.get(op["id"]) if state.people.is_live(op["id"]) else None
            return [old.to_op()] if old is not None else [{"op": "person_delete", "id": op["id"], "at": 0.0}]
        kind = op[0] if isinstance(op, list) and op else None
        if kind == "put" and op[1]["id"] not in state.records:
            return [["del", op[1]["id"]]]
        if kind == "update":
            rec = state.records.get(op[1])
            return [] if rec is None else [["update", op[1], {key: getattr(rec, key) for key in op[2]}]]
        raise ValueError(f"a {kind or op.get('op')!r} op cannot be undone: not allowed inside one_frame")

    def _rewind(self) -> None:
        """Undo the held ops, last first (the state as before :meth:`one_frame`)."""
        for undo in reversed(self._undo):
            self.storage.apply(undo)

    @contextlib.contextmanager
    def deferred_durability(self) -> Iterator[None]:
        """See :meth:`MemoryStore.deferred_durability`."""
        self._deferring = threading.get_ident()
        try:
            yield
        finally:
            self._deferring = None

    def durability_mark(self) -> Callable[[], None] | None:
        """See :meth:`MemoryStore.durability_mark`."""
        with self._lock:
            return self.storage.durability_mark()

    # -- embedding ---------------------------------------------------------------------

    def embed(self, texts: list[str]) -> np.ndarray | None:
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

    def embed_query(self, query: str) -> np.ndarray | None:
        """The query's vector, or None when no model is usable (thread-safe)."""
        if self._embedder is None:
            return None
        vectors = self.embed([query])
        return None if vectors is None else vectors[0]

    def _embed_records(self, texts: list[str]) -> list[bytes | None]:
        if self._embedder is None or not texts:
            return [None] * len(texts)
        vectors = self.embed(texts)
        if vectors is None:
            return [None] * len(texts)
        return [np.ascontiguousarray(v, np.float32).tobytes() for v in vectors]

    def stored_text(self, rec: Record) -> str:
        """What is embedded for a stored memory: a turn with the turn it follows."""
        return ingest.context_text(rec, self.turn_before(rec), self._config)

    def turn_before(self, rec: Record, pairwise: Mapping[str, Record] | None = None) -> Record | None:
        """The turn ``rec`` is embedded with: the one it ``follows`` (None if that is gone);
        for a turn stored before turns recorded it (``follows`` None), its entry in
        ``pairwise`` (:meth:`MemoryState.previous_turns`), when given.  Under the lock."""
        if rec.follows is not None:
            return self._state.records.get(rec.follows)
        return pairwise.get(rec.id) if pairwise is not None else None

    # -- decay -------------------------------------------------------------------------

    def decayed(self, rec: Record, now: float) -> bool:
        """Whether ``rec`` has decayed below ``decay.threshold`` at ``now`` (decay on)."""
        return search.decayed(rec, now, self._config)

    def flush_touches(self) -> None:
        """Journal the pending decay clock refreshes as one frame (engine thread, or
        close() on any thread: hence the lock)."""
        with self._lock:
            touched, self.touched = self.touched, {}
            self.touches_flushed = time.monotonic()
            ops = [["update", i, {"last_access": at, "confidence": 1.0}] for i, at in touched.items()
                   if i in self._state.records]
            if ops:
                self.commit(ops)

    # -- writes: prepare (any thread), commit (engine thread) ---------------------------

    def prepare(self, items: Iterable[Mapping[str, Any]], now: float | None = None, *,
                imported: bool = False) -> Prepared:
        """Validate and embed ``items`` without changing anything (thread-safe); ``imported``:
        exported memories, their ids taken as earlier versions wrote them (``validate_item``).
        Raises ValidationError / TooLargeError, RememberingPausedError while paused (before
        any embedding)."""
        self.require_open()
        self.remembering.refuse("the memory")
        rows = [ingest.validate_item(item, self._config, imported=imported or self._holds_id(item))
                for item in ingest.as_list(items, self._config.memory.max_batch)]
        created = time.time() if now is None else now
        recs, out_ids = ingest.new_records(rows, created, self.expiry, self._state.records)
        before = self._newest_turn_guess()
        recs = ingest.linked(recs, before)
        texts = ingest.embedding_texts(recs, before, self._config)
        vectors = self._embed_records(texts)
        key = self._state.current_key
        ops = [["put", encode(rec.replace(vkey=key if vec is not None else None)), vec]
               for rec, vec in zip(recs, vectors, strict=True)]
        return Prepared(ops, out_ids, [t if v is not None else None for t, v in zip(texts, vectors, strict=True)])

    def _holds_id(self, item: Any) -> bool:
        """Whether a memory holds the id ``item`` names: one kept before ids' characters were
        checked (an older version, an import) is taken as it is, so that storing it again
        stays a retry (``check_duplicate``: that memory returned, another one refused); it is
        never written anew (forgotten meanwhile: :meth:`check_retries_still_stored`)."""
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

    def commit_prepared(self, prepared: Prepared, also: list[list[Any]] | None = None) -> list[Any]:
        """Make a prepared write durable and visible, with the ops ``also`` in the same
        journal frame (all or none); returns the memories.  With ``memory.dedupe``, a fact
        or context memory restating one kept refreshes it instead (:func:`.dedupe.fold`):
        the kept memory is returned in its place."""
        self.require_open()
        with self._lock:
            self.check_retries_still_stored(prepared)
            fresh = [(op, text) for op, text in zip(prepared.ops, prepared.texts, strict=True)
                     if not self._is_duplicate(op[1])]
            ids, refreshes = list(prepared.ids), list[list[Any]]()
            if self._config.memory.dedupe and fresh:
                puts, refreshes = dedupe.fold([op for op, _ in fresh], ids, self._state, self.dedupe_limits(),
                                              time.time(), self.told)
                kept = {id(op) for op in puts}
                fresh = [(op, text) for op, text in fresh if id(op) in kept]
            if fresh or also or refreshes:
                self.commit(self._with_current_context(fresh) + refreshes + (also or []))
            return [self._state.records[i].memory() for i in ids]

    def dedupe_limits(self) -> dedupe.Limits:
        """What the restatement check reads of the configuration."""
        memory = self._config.memory
        return dedupe.Limits(tuple(self._config.search.entity_fields), memory.max_metadata_bytes,
                             memory.max_metadata_keys, self._config.search.bm25_b)

    def check_retries_still_stored(self, prepared: Prepared) -> None:
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
        vectors = self.embed([texts[i] for i in stale]) if stale else None
        ops = [["put", encode(rec), op[2]] for rec, (op, _) in zip(recs, fresh, strict=True)]
        for n, i in enumerate(stale):
            ops[i] = ["put", ops[i][1], vectors[n].astype(np.float32).tobytes() if vectors is not None else None]
        return ops

    def _is_duplicate(self, row: dict[str, Any]) -> bool:
        memory_id = row["id"]
        return ingest.check_duplicate(self._state.records.get(memory_id), memory_id, row["content"], row["type"],
                                      row.get("owner"), row.get("shared", False))

    # -- reads ---------------------------------------------------------------------------

    def check_search(self, query: Any, memory_type: Any = None, limit: Any = SEARCH_LIMIT,
                     min_score: Any = SEARCH_MIN_SCORE, where: Any = None, *, mode: Any = None, now: Any = None,
                     about: Any = None, owner: Any = None, include_superseded: Any = False) -> SearchQuery:
        """A search's arguments checked once, before anything is embedded (:func:`.search.check`)."""
        return search.check(self._config, query, memory_type, limit, min_score, where, mode=mode, now=now,
                            about=about, owner=owner, include_superseded=include_superseded)

    def search_checked(self, query: SearchQuery, qvec: np.ndarray | None) -> list[SearchResult]:
        """Run a checked search (:func:`.search.run`) and refresh the decay clock of the facts it returns."""
        self.require_open()
        at = time.time() if query.now is None else query.now
        with self._lock:
            results = search.run(query, qvec, self._state, self._config, self._tz, at)
            if self._config.decay.enabled:
                self.touched |= {r.memory.id: at for r in results if r.memory.memory_type is MemoryType.FACT
                                 and not r.memory.protected}  # journaled later, in batches
        return results

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               min_score: float = SEARCH_MIN_SCORE, where: dict[str, Any] | None = None, *, mode: str | None = None,
               now: Any = None, about: str | None = None, owner: str | None = None,
               include_superseded: bool = False) -> list[SearchResult]:
        """Check, embed (unless lexical), search: see :meth:`MemoryStore.search`."""
        self.require_open()
        q = self.check_search(query, memory_type, limit, min_score, where, mode=mode, now=now, about=about,
                              owner=owner, include_superseded=include_superseded)
        return self.search_checked(q, self.embed_query(q.text) if q.mode != "lexical" else None)

    def search_vector(self, query: str, qvec: np.ndarray | None, memory_type: MemoryType | str | None = None,
                      limit: int = SEARCH_LIMIT, min_score: float = SEARCH_MIN_SCORE,
                      where: dict[str, Any] | None = None, *, mode: str = "hybrid", now: Any = None,
                      about: str | None = None, owner: str | None = None,
                      include_superseded: bool = False) -> list[SearchResult]:
        """Check and search with the query already embedded (``qvec`` may be None)."""
        self.require_open()
        q = self.check_search(query, memory_type, limit, min_score, where, mode=mode, now=now, about=about,
                              owner=owner, include_superseded=include_superseded)
        return self.search_checked(q, qvec)

    def window_shown(self) -> list[tuple[Any, ...]]:
        """The window's turns not older than ``memory.context_window_max_age_minutes``, the
        turns said while paused (held in memory only) among them."""
        max_age = self._config.memory.context_window_max_age_minutes * 60.0
        oldest = time.time() - max_age if max_age else -math.inf
        return [turn for turn in self.remembering.window(self._state.window_view) if turn[2] >= oldest]

    def window(self) -> list[dict[str, Any]]:
        """The recent messages, oldest first (see :meth:`MemoryStore.get_context_window`)."""
        self.require_open()
        return [{"role": r, "content": c, "timestamp": to_datetime(t).isoformat()} for r, c, t in self.window_shown()]

    def stats(self) -> dict[str, Any]:
        """See :meth:`MemoryStore.stats`."""
        self.require_open()
        for _ in range(3):
            try:
                return self._stats_now()
            except RuntimeError:  # a dict grew while we read it (a new type or graph): read again
                continue
        with self._lock:
            return self._stats_now()

    def live_count(self, at: float) -> tuple[int, dict[str, int]]:
        """(memories alive at ``at``, expired ones not yet swept by type). Lock-free."""
        expired = self._state.expired_counts(at)
        return max(0, len(self._state.records) - sum(expired.values())), expired

    def _stats_now(self) -> dict[str, Any]:
        state = self._state
        memories, expired = self.live_count(time.time())
        by_type = {t.value: 0 for t in MemoryType} | state.fields.type_counts()
        by_type = {kind: max(0, n - expired.get(kind, 0)) for kind, n in by_type.items()}
        return {
            "memories": memories, "by_type": by_type, "expired_unswept": sum(expired.values()),
            "context_window": len(self.window_shown()), "generation": self.storage.generation,
            "journal_bytes": self.storage.journal.size, "snapshot_bytes": _size(self.path / SNAPSHOT_FILE),
            "model": state.current_key, "embedder": "ready" if self._embedder is not None else "unavailable",
            "unembedded": len(self.backfill),
            "embedder_error": self.embedder_error, "index": state.vectors.stats(),
            "read_only": self.storage.failure, "lexical_terms": state.lexical.term_count,
            "compacting": self.storage.compacting is not None,
            "conversation_ttl_days": self._config.memory.conversation_ttl_days,  # what the LLM tools tell a model
        }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
