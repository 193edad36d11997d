"""The in-process memory engine's facade: :class:`MemoryStore`.

The store opens a data directory (:func:`.opening.open_core`), builds the engine's
collaborators around the :class:`~.core.Core` it gets, and delegates to them; it owns
only the directory lock and the close.  Every change goes through one funnel,
:meth:`.core.Core.commit`: the operations are appended to the journal (durable per
``memory.fsync``) and only then applied to the in-memory state and indexes.  Opening
a store replays the same operations over the last snapshot, so what was acknowledged
is what comes back.

Collaborators (see each module for what it owns): :class:`~.core.Core` (state,
funnel, embedder, write preparation, search entry), :class:`~.maintenance.Maintenance`
(idle-time work, reindex), :class:`~.session.Session` (context window, named
context), :mod:`.retention` (expiry, TTL, clock repairs), and the people components
:class:`~reachy_memory.people.persons.Persons`, :class:`~reachy_memory.people.facts.Facts`,
:class:`~reachy_memory.people.notes.Notes`, :class:`~reachy_memory.people.importer.Importer`
and :class:`~reachy_memory.people.context.Context`, which get the narrow
:class:`~.ports.Engine` interface only.

The data directory's files and the generation rules between them are in
:mod:`reachy_memory.storage.files`; ``docs/FORMAT.md`` is the contract.

Scores: ``SearchResult.score`` is in [0, 1]; see :mod:`.ranking`.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from reachy_memory._threads import pin_native_threads
from reachy_memory.config import Config
from reachy_memory.engine import dedupe, ingest, opening, retention
from reachy_memory.engine.backups import Backups
from reachy_memory.engine.context_text import RetrievedContext
from reachy_memory.engine.household import Household
from reachy_memory.engine.maintenance import Maintenance
from reachy_memory.engine.opening import DEFAULT_EMBEDDER, Embedder
from reachy_memory.engine.ports import Prepared
from reachy_memory.engine.records import Record
from reachy_memory.engine.search import SearchQuery
from reachy_memory.engine.session import Session
from reachy_memory.engine.state import MemoryState
from reachy_memory.errors import ReachyMemoryError
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, Memory, MemoryType, SearchResult, merged_metadata
from reachy_memory.people.context import Context
from reachy_memory.people.facts import Facts
from reachy_memory.people.importer import Importer, ImportPlan
from reachy_memory.people.notes import Notes
from reachy_memory.people.persons import Persons
from reachy_memory.people.registry import Person
from reachy_memory.people.subjects import subject_names
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr
from reachy_memory.storage import restore as swap
from reachy_memory.storage.files import GRAPH_FILE, JOURNAL_FILE, SNAPSHOT_FILE, read_snapshot
from reachy_memory.storage.generations import Storage

__all__ = ["DEFAULT_EMBEDDER", "GRAPH_FILE", "JOURNAL_FILE", "SNAPSHOT_FILE", "Embedder", "MemoryStore",
           "read_snapshot"]
datetime_or_float = Any  # a datetime (aware, or naive meaning UTC), epoch seconds, or None
_F = TypeVar("_F", bound=Callable[..., Any])

log = logging.getLogger(__name__)


def _doc(source: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give a delegating method the docstring of the component method it calls."""
    def give(method: _F) -> _F:
        method.__doc__ = source.__doc__
        return method
    return give


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

    Threads: the caller that holds the store lock (the daemon's engine thread) owns
    the state and the journal; a background compaction thread owns only its
    frozen view and the snapshot file it writes (see :mod:`reachy_memory.storage.generations`).
    :meth:`prepare`, :meth:`prepare_context` and :meth:`embed_query` run on any
    thread (the daemon's embed thread) and change nothing: they read the record
    table by single lookups only, never by iteration.
    """

    def __init__(self, path: str | Path | None = None, *, config: Config | None = None,
                 embedder: Any = DEFAULT_EMBEDDER, reindex: bool = False, recover: bool = False) -> None:
        config = config or Config()
        self.path = Path(path).expanduser() if path is not None else config.data_dir
        self._close_lock = threading.Lock()  # two threads closing at once: the second waits, then returns
        pin_native_threads(config.search.blas_threads)
        files.secure_dir(self.path)
        self._dir_lock = jr.DirLock(self.path)
        self._dir_lock.acquire()
        try:
            files.tighten_files(self.path)
            swap.settle(self.path)  # a restore cut short: finished, or its staged copy removed
            files.remove_unfinished_writes(self.path)  # temp files of writes a crash cut short
            with files.damage_is_corruption(self.path):
                core = opening.open_core(self.path, config, threading.RLock(), embedder, reindex, recover)
        except BaseException:
            self._dir_lock.release()
            raise
        self._core = core
        self._maintenance = Maintenance(core)
        self._session = Session(core)
        self._persons = Persons(core)
        self._facts = Facts(core)
        self._notes = Notes(core, self._facts.correct)
        self._importer = Importer(core)
        self._context = Context(core, self._persons)
        self._household = Household(core, core.remembering)
        self._backups = Backups(core, self.path)
        core.closed = False
        if recover:
            core.storage.compact(full=True)  # a fresh snapshot of the rebuilt state (see verify --repair)
        core.storage.opened(self._dir_lock)  # checked from now on; an older journal format migrated
        core.storage.purge.opened()  # what a forget left on disk goes within seconds (storage/purge.py)

    # -- the engine's parts, for tests and tools ------------------------------------------

    @property
    def _state(self) -> MemoryState:
        return self._core.state

    @property
    def _storage(self) -> Storage:
        return self._core.storage

    @property
    def _lock(self) -> threading.RLock:
        return self._core.lock

    @property
    def _config(self) -> Config:
        return self._core.config

    @_config.setter
    def _config(self, value: Config) -> None:  # tests and tools tune search knobs on an open store
        self._core.config = value

    @property
    def _closed(self) -> bool:
        return self._core.closed

    @_closed.setter
    def _closed(self, value: bool) -> None:
        self._core.closed = value

    # -- the model ---------------------------------------------------------------------

    @property
    def embedder(self) -> Any:
        """The embedder in use, or None when running lexical-only."""
        return self._core.embedder

    @property
    def embedder_error(self) -> str | None:
        """Why there is no embedder (the model failed to load), or None."""
        return self._core.embedder_error

    @embedder_error.setter
    def embedder_error(self, value: str | None) -> None:
        self._core.embedder_error = value

    def adopt_embedder(self, embedder: Any) -> bool:
        """Start embedding with ``embedder`` in a store opened without a model (the model
        was fetched after the daemon started; load it with :meth:`model_config`): its
        memories are then embedded in idle time (see :meth:`maintain`).  Only for a store
        that never held a vector, whose index has the model's dimension and that declares
        no other model; otherwise returns False, changing nothing but ``embedder_error``
        (a restart opens the store with the model and checks its vectors as usual).
        Call it on the thread that owns the state (the daemon's engine thread)."""
        return opening.adopt_embedder(self._core, embedder)

    def model_config(self) -> Config:
        """The config to load this store's model with: the configured one, in the precision
        of the vectors the store declares (see :func:`.opening.precision_of_store`)."""
        return opening.precision_of_store(self._core.config, self._core.state.model_key)

    # -- durability ----------------------------------------------------------------------

    @contextlib.contextmanager
    def deferred_durability(self) -> Iterator[None]:
        """Inside, this thread's writes (with ``memory.fsync: always``) are journaled and
        applied without waiting for their fsync: readers see them at once, and nothing
        may say they are durable before :meth:`durability_mark`'s call has returned.
        The daemon's engine thread runs each request so, and hands the fsync (and the
        reply) to a thread of its own: a search never waits behind a write's fsync."""
        with self._core.deferred_durability():
            yield

    def durability_mark(self) -> Callable[[], None] | None:
        """What makes every write journaled so far durable (call it on any thread; it
        raises ReadOnlyError if the fsync fails, the store then refusing writes), or
        None when they are durable already."""
        return self._core.durability_mark()

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
                imported: bool = False) -> Prepared:
        """Validate and embed ``items`` without changing anything (thread-safe); ``imported``:
        exported memories, their ids taken as earlier versions wrote them (``validate_item``).
        Raises ValidationError / TooLargeError."""
        return self._core.prepare(items, now, imported=imported)

    def commit(self, prepared: Prepared, also: list[list[Any]] | None = None) -> list[Memory]:
        """Make a prepared write durable and visible, with the ops ``also`` in the same
        journal frame (all or none); returns the memories.  Raises NotFoundError (nothing
        written) when a retry's memory was forgotten while it waited."""
        return self._core.commit_prepared(prepared, also)

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
        self._core.require_open()
        ingest.check_str(memory_id, "id")
        with self._core.lock:
            if memory_id not in self._core.state.records:
                return False
            self._core.commit([["del", memory_id]])
            return True

    # -- expiry and time -----------------------------------------------------------------

    def cleanup_expired(self, now: datetime_or_float = None) -> int:
        """Delete every memory expired at ``now`` (default: now); returns the count."""
        return retention.cleanup_expired(self._core, now)

    @_doc(retention.apply_retention)
    def apply_retention(self, *, dry_run: bool = False, max_deletions: int | None = None,
                        now: datetime_or_float = None) -> dict[str, Any]:
        return retention.apply_retention(self._core, dry_run=dry_run, max_deletions=max_deletions, now=now)

    def latest_time(self) -> float:
        """The latest time a memory was created or a window turn added (epoch seconds;
        0.0 for an empty store)."""
        return retention.latest_time(self._core)

    @_doc(retention.redate)
    def redate(self, since: float, until: float, delta: float) -> int:
        return retention.redate(self._core, since, until, delta)

    # -- reading ---------------------------------------------------------------------

    def get(self, memory_id: str, *, now: datetime_or_float = None) -> Memory | None:
        """The live memory with that id, or None (an expired memory is never returned)."""
        self._core.require_open()
        ingest.check_str(memory_id, "id")
        rec = self._core.state.records.get(memory_id)
        return rec.memory() if rec is not None and not rec.expired(retention.epoch(now)) else None

    def export_page(self, after: str | None = None, limit: int = 500) -> tuple[list[Memory], str | None]:
        """Live memories in id order after ``after``; returns (page, next cursor or None)."""
        self._core.require_open()
        if after is not None:
            ingest.check_str(after, "after")
        with self._core.lock:
            records = self._core.state.records
            ids = sorted(records)
            start = bisect.bisect_right(ids, after) if after is not None else 0
            page = ids[start : start + limit]
            now = time.time()
            memories = [records[i].memory() for i in page if not records[i].expired(now)]
        return memories, (page[-1] if start + limit < len(ids) and page else None)

    def __len__(self) -> int:
        """How many memories a reader can see now: an expired one not yet swept is
        left out, as ``get``, ``search`` and ``export_page`` leave it out."""
        return self._core.live_count(time.time())[0]

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               min_score: float = SEARCH_MIN_SCORE, where: dict[str, Any] | None = None, *,
               mode: str | None = None, now: datetime_or_float = None, about: str | None = None,
               owner: str | None = None, include_superseded: bool = False) -> list[SearchResult]:
        """Find memories by meaning and by words, best first.

        ``mode`` is "hybrid" (default from config), "vector" or "lexical"; with
        no usable model every mode runs lexical-only.  ``where`` takes the
        Chroma-style filters described in :mod:`.filters`.  ``about`` keeps memories
        about that person ("my wife", "Sarah"; unfiltered when nobody matches);
        ``owner`` keeps that user's memories plus shared and unscoped ones;
        superseded memories are left out unless ``include_superseded``.
        Raises ValidationError for bad arguments.
        """
        return self._core.search(query, memory_type, limit, min_score, where, mode=mode, now=now, about=about,
                                 owner=owner, include_superseded=include_superseded)

    def check_search(self, query: Any, memory_type: Any = None, limit: Any = SEARCH_LIMIT,
                     min_score: Any = SEARCH_MIN_SCORE, where: Any = None, *, mode: Any = None,
                     now: Any = None, about: Any = None, owner: Any = None,
                     include_superseded: Any = False) -> SearchQuery:
        """Every argument of :meth:`search`, checked once, before the query is embedded (any
        thread; the daemon's embed thread); run it with :meth:`search_checked`.
        Raises ValidationError / TooLargeError naming the first argument at fault."""
        return self._core.check_search(query, memory_type, limit, min_score, where, mode=mode, now=now,
                                       about=about, owner=owner, include_superseded=include_superseded)

    def search_checked(self, query: SearchQuery, qvec: np.ndarray | None) -> list[SearchResult]:
        """The results of a :meth:`check_search` query (``qvec``: its vector from :meth:`embed_query`,
        or None: lexical), as :meth:`search` returns them."""
        return self._core.search_checked(query, qvec)

    def embed_query(self, query: str) -> np.ndarray | None:
        """The query's vector, or None when no model is usable (thread-safe)."""
        return self._core.embed_query(query)

    def search_vector(self, query: str, qvec: np.ndarray | None, memory_type: MemoryType | str | None = None,
                      limit: int = SEARCH_LIMIT, min_score: float = SEARCH_MIN_SCORE,
                      where: dict[str, Any] | None = None, *,
                      mode: str = "hybrid", now: datetime_or_float = None, about: str | None = None,
                      owner: str | None = None, include_superseded: bool = False) -> list[SearchResult]:
        """:meth:`search` with the query already embedded (``qvec`` may be None)."""
        return self._core.search_vector(query, qvec, memory_type, limit, min_score, where, mode=mode, now=now,
                                        about=about, owner=owner, include_superseded=include_superseded)

    def subject_names(self, rec: Record, owner: str | None = None) -> tuple[str, ...]:
        """Display names of a memory's persons, as they are now; with ``owner``, only the
        persons that user knows (theirs and the household's)."""
        return subject_names(self._core.state.people, rec, owner)

    # -- context window and named context ---------------------------------------------

    @_doc(Session.add_to_context_window)
    def add_to_context_window(self, role: str, content: str) -> None:
        self._session.add_to_context_window(role, content)

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

    @_doc(Session.prepare_turn)
    def prepare_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                     owner: str | None = None, id: str | None = None) -> Prepared:
        return self._session.prepare_turn(role, content, metadata, owner=owner, id=id)

    @_doc(Session.commit_turn)
    def commit_turn(self, role: str, prepared: Prepared) -> Memory:
        return self._session.commit_turn(role, prepared)

    def get_context_window(self) -> list[dict[str, Any]]:
        """The recent messages, oldest first: dicts with role, content, timestamp; those
        older than ``memory.context_window_max_age_minutes`` are left out (kept on disk
        until the window moves on).  Takes no lock (reads the window view)."""
        return self._core.window()

    @_doc(Session.clear_context_window)
    def clear_context_window(self) -> None:
        self._session.clear_context_window()

    def set_context(self, key: str, value: str) -> Memory:
        """Set named session context (a CONTEXT memory), replacing the key's earlier value."""
        return self.commit_context(key, self.prepare_context(key, value))

    @_doc(Session.prepare_context)
    def prepare_context(self, key: str, value: str) -> Prepared:
        return self._session.prepare_context(key, value)

    @_doc(Session.commit_context)
    def commit_context(self, key: str, prepared: Prepared) -> Memory:
        return self._session.commit_context(key, prepared)

    @_doc(Session.get_context)
    def get_context(self, key: str, *, now: datetime_or_float = None) -> str | None:
        return self._session.get_context(key, now=now)

    # -- people (see reachy_memory.people) -------------------------------------------------

    @_doc(Persons.add_person)
    def add_person(self, name: str, relation: str | None = None, aliases: Sequence[str] = (),
                   owner: str | None = None, external_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> Person:
        return self._persons.add_person(name, relation, aliases, owner, external_id, metadata)

    @_doc(Persons.find_person)
    def find_person(self, reference: str, owner: str | None = None) -> Person | None:
        return self._persons.find_person(reference, owner)

    @_doc(Persons.person_by_external_id)
    def person_by_external_id(self, external_id: str) -> Person | None:
        return self._persons.person_by_external_id(external_id)

    @_doc(Persons.resolve_person)
    def resolve_person(self, reference: str, owner: str | None = None,
                       create: bool = True) -> tuple[Person | None, bool]:
        return self._persons.resolve_person(reference, owner, create)

    @_doc(Persons.people)
    def people(self, owner: str | None = None) -> list[Person]:
        return self._persons.people(owner)

    @_doc(Persons.person_redirects)
    def person_redirects(self) -> dict[str, str]:
        return self._persons.person_redirects()

    @_doc(Persons.update_person)
    def update_person(self, person_id: str, *, household: bool = False, **fields: Any) -> Person:
        return self._persons.update_person(person_id, household=household, **fields)

    @_doc(Persons.merge_people)
    def merge_people(self, keep: str, other: str) -> Person:
        return self._persons.merge_people(keep, other)

    @_doc(Persons.delete_person)
    def delete_person(self, person_id: str) -> bool:
        return self._persons.delete_person(person_id)

    @_doc(Facts.remember)
    def remember(self, content: str | None = None, facts: Sequence[Mapping[str, Any]] | None = None,
                 subjects: Sequence[str] | None = None, expires_in_days: float | None = None,
                 shared: bool = False, owner: str | None = None, name: str | None = None,
                 aliases: Sequence[str] = (), *, id: str | None = None) -> list[Memory]:
        return self._facts.remember(content, facts, subjects, expires_in_days, shared, owner, name, aliases, id=id)

    @_doc(Facts.recall)
    def recall(self, query: str, about: str | None = None, owner: str | None = None, limit: int = SEARCH_LIMIT,
               include_superseded: bool = False) -> list[SearchResult]:
        return self._facts.recall(query, about, owner, limit, include_superseded)

    @_doc(Facts.correct)
    def correct(self, memory_id: str, new_content: str) -> Memory:
        return self._facts.correct(memory_id, new_content)

    @_doc(Facts.confirm)
    def confirm(self, memory_id: str) -> Memory:
        return self._facts.confirm(memory_id)

    @_doc(Facts.supersede)
    def supersede(self, old_id: str, new_id: str) -> Memory:
        return self._facts.supersede(old_id, new_id)

    @_doc(Facts.history)
    def history(self, memory_id: str) -> list[Memory]:
        return self._facts.history(memory_id)

    @_doc(Notes.note)
    def note(self, name: str) -> Memory | None:
        return self._notes.note(name)

    @_doc(Notes.rename_note)
    def rename_note(self, name: str, new_name: str) -> Memory:
        return self._notes.rename_note(name, new_name)

    @_doc(Notes.alias_note)
    def alias_note(self, name: str, alias: str) -> Memory:
        return self._notes.alias_note(name, alias)

    @_doc(Notes.rewrite_note)
    def rewrite_note(self, name: str, content: str) -> Memory:
        return self._notes.rewrite_note(name, content)

    @_doc(Notes.remove_note)
    def remove_note(self, name: str) -> bool:
        return self._notes.remove_note(name)

    @_doc(Notes.archive_conversation)
    def archive_conversation(self, summary: str, until: Any = None, name: str | None = None,
                             owner: str | None = None) -> Memory:
        return self._notes.archive_conversation(summary, until, name, owner)

    @_doc(Importer.import_memories)
    def import_memories(self, memories: Sequence[Mapping[str, Any]], people: Sequence[Mapping[str, Any]] = (),
                        batch: int = 200) -> dict[str, int]:
        return self._importer.import_memories(memories, people, batch)

    @_doc(Importer.prepare_import)
    def prepare_import(self, memories: Sequence[Mapping[str, Any]],
                       people: Sequence[Mapping[str, Any]] = ()) -> ImportPlan:
        return self._importer.prepare_import(memories, people)

    @_doc(Importer.commit_import)
    def commit_import(self, prepared: ImportPlan) -> dict[str, Any]:
        return self._importer.commit_import(prepared)

    @_doc(Context.context_for)
    def context_for(self, message: str, owner: str | None = None, max_tokens: int = 800, max_memories: int = 10,
                    max_messages: int = 5, min_similarity: float = 0.3) -> RetrievedContext:
        return self._context.context_for(message, owner, max_tokens, max_memories, max_messages, min_similarity)

    # -- maintenance -------------------------------------------------------------------

    def dedupe(self, *, dry_run: bool = False) -> dict[str, Any]:
        """Merge the copies a store already holds: among the live fact and context memories,
        each set that restates one memory (the rule of writes, ``memory.dedupe``: same owner,
        type, persons and sharing; the same text but for case, punctuation and fillers, or
        the same words in order with near-identical embeddings) keeps its oldest memory,
        refreshed with the others' metadata and counts (``metadata.confirmations``), and
        loses the others; memories they superseded point at the kept one.  Through the
        journal, whole merges a frame.  ``dry_run`` changes nothing.  Returns ``kept``,
        ``merged`` (copies), ``dry_run`` and ``merges`` (the first 200, with the copies'
        ids, texts and the rule's reasons).  Named notes, archives, ``set_context`` values
        and conversation turns are never merged."""
        return dedupe.run(self._core, dry_run=dry_run)

    @_doc(Maintenance.maintain)
    def maintain(self, budget: int = 256, *, save_cache: bool = True) -> int:
        return self._maintenance.maintain(budget, save_cache=save_cache)

    def compact(self, *, full: bool = False) -> None:
        """Fold the journal into a fresh snapshot (atomic) and save the graph cache,
        on the calling thread (after any background compaction in flight).

        ``full`` (on close) also inserts every pending vector before caching the
        graphs, however long that takes.  Raises StorageError / StorageFullError
        (the journal keeps every change) or ReadOnlyError.
        """
        self._core.require_open()
        self._core.storage.wait()
        self._core.storage.compact(full)

    @_doc(Backups.backup)
    def backup(self, dest: str | Path, *, force: bool = False,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        return self._backups.backup(dest, force=force, progress=progress)

    @_doc(Backups.forgotten_in_backups)
    def forgotten_in_backups(self, ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        return self._backups.forgotten_in_backups(ids)

    @_doc(Backups.purge_backups)
    def purge_backups(self, paths: Iterable[str | Path] | None = None) -> list[dict[str, Any]]:
        return self._backups.purge_backups(paths)

    @_doc(Maintenance.reindex)
    def reindex(self, progress: Callable[[int, int], None] | None = None, batch: int = 64) -> int:
        return self._maintenance.reindex(progress, batch)

    # -- the household's controls (engine/household.py, docs/HOUSEHOLD.md) ---------------

    @_doc(Household.forget_person)
    def forget_person(self, reference: str, dry_run: bool = False) -> dict[str, Any]:
        return self._household.forget_person(reference, dry_run)

    @_doc(Household.about_person)
    def about_person(self, reference: str) -> dict[str, Any]:
        return self._household.about_person(reference)

    @_doc(Household.pause_remembering)
    def pause_remembering(self, minutes: float) -> dict[str, Any]:
        return self._household.pause_remembering(minutes)

    @_doc(Household.resume_remembering)
    def resume_remembering(self) -> dict[str, Any]:
        return self._household.resume_remembering()

    @_doc(Household.remembering_status)
    def remembering(self) -> dict[str, Any]:
        return self._household.remembering_status()

    def stats(self) -> dict[str, Any]:
        """Counts, sizes, the embedder's state and the conversation TTL.  Takes no lock (a compaction or a
        search never makes it wait); the figures may be one write apart.

        ``memories`` and ``by_type`` count what a reader can see (as ``len``);
        ``expired_unswept``, the expired memories the next sweep deletes (hidden from
        every reader, still held in memory and on disk until then); ``remembering``, the pause;
        ``purge``, forgetting's way to the disk (storage/purge.py)."""
        return self._core.stats() | {"remembering": self._core.remembering.status(),
                                     "purge": self._core.storage.purge.status()}

    @property
    def read_only(self) -> str | None:
        """Why the store refuses writes (a failed fsync, files taken away), or None; cleared by reopening."""
        return self._core.storage.failure

    @property
    def config(self) -> Config:
        """The configuration this store was opened with."""
        return self._core.config

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._core.closed

    def begin_closing(self) -> None:
        """Ahead of :meth:`close` (a daemon stopping): start no background compaction or
        backup, and abandon a backup being written (its caller gets ClosedError, its
        target is untouched).  Writes and searches go on until :meth:`close`, which
        should follow soon: this cannot be undone, and without background compactions
        the journal only grows."""
        self._core.storage.begin_closing()

    def close(self) -> None:
        """Compact if the journal holds changes, flush, and release the lock; idempotent
        and safe while other threads use the store (a write in flight finishes first,
        later ones raise ClosedError).  Not from inside one of this store's own calls
        (a signal handler interrupting one): set a flag there and close after."""
        with self._close_lock:
            if self._core.closed:
                return
            try:
                if self._core.touched:
                    with contextlib.suppress(ReachyMemoryError):  # a refresh lost on a failing disk is harmless
                        self._core.flush_touches()
                self._core.remembering.clear()  # the turns held while paused end with the process's store
                self._core.storage.close()
            finally:
                self._core.closed = True
                self._dir_lock.release()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
