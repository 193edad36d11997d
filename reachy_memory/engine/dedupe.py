"""Restated facts, the store's side: which kept memory a write restates (its nearest
neighbours of the same type, owner, sharing and persons, judged by the text rule of
:mod:`.restating`), the refresh that replaces the copy, the filter of kept words that
lets a write of new words skip the search, the ``dedupe`` plan for copies already kept,
and the collapse of copies in what a search shows.

A fact dated relative to its telling ("today", "tomorrow", "last week") is the same only
when told again within :data:`RELATIVE_SECONDS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from reachy_memory.engine.filters import validate_metadata
from reachy_memory.engine.lexical_index import LexicalIndex
from reachy_memory.engine.records import Record
from reachy_memory.engine.restating import Decision, decide, normalized, read, relative
from reachy_memory.engine.state import GROUP, MemoryState
from reachy_memory.engine.vector_index import VectorIndex, nearest
from reachy_memory.errors import ValidationError
from reachy_memory.model import MemoryType, SearchResult, to_datetime, to_epoch

if TYPE_CHECKING:
    from reachy_memory.engine.ports import Engine


#: A fact dated relative to its telling is only restated within this many seconds.
RELATIVE_SECONDS = 3600.0

# -- the store's side: which memories may be the same, the refresh, the read-side collapse ---------

#: The memory types a write may merge into a kept memory (conversation turns are events: all kept).
KINDS = frozenset({MemoryType.FACT.value, MemoryType.CONTEXT.value})
#: How many nearest memories of the type a write compares itself with (hnswlib, or the exact scan);
#: when all are close and none is the same (other users' copies), 4x more, up to MAX_NEIGHBOURS.
NEIGHBOURS = 8
MAX_NEIGHBOURS = 128
#: Without a vector: the memories holding a write's rarest word are compared with it when there
#: are at most this many, else this many of those whose words cover the most of the write's.
WORDED = 32
#: Neighbours less similar than this are not read: two texts equal once normalized had a
#: cosine of 0.80 at least (a filler before a three-word fact), rule 2 needs restating.THRESHOLD.
FLOOR = 0.6
#: The hnswlib search breadth of that query: a near-identical vector is found with a small one.
NEIGHBOUR_EF = 32
COUNT_KEY = "confirmations"  # metadata of a kept memory: how many times it was told again
TIME_KEY = "confirmed_at"  # and when it was told last (ISO 8601, UTC)
_IDENTITY_KEYS = ("context_key",)  # set_context's key: its memories are replaced by key, never merged


def mergeable(rec: Record) -> bool:
    """Whether ``rec`` may take part in a merge: a fact or a context memory that is no
    named note, archive or ``set_context`` value."""
    return (rec.type in KINDS and rec.name is None and rec.covers_until is None
            and not any(key in rec.metadata for key in _IDENTITY_KEYS))


def compatible(kept: Record, new: Record, entity_keys: Sequence[str]) -> bool:
    """Whether ``kept`` and ``new`` could be the same memory whatever their texts: both
    mergeable, ``kept`` live (not superseded), the same type, owner, sharing, subjects,
    expiry (none for a fact; a context memory's day), and the same person or speaker in
    their metadata (``search.entity_fields``)."""
    return (mergeable(kept) and mergeable(new) and not kept.hidden and kept.type == new.type
            and kept.owner == new.owner and kept.shared == new.shared and kept.expires == new.expires
            and set(kept.subjects) == set(new.subjects)
            and all(_entity(kept.metadata.get(k)) == _entity(new.metadata.get(k)) for k in entity_keys))


def same(kept: Record, new: Record, similarity: float | None, entity_keys: Sequence[str]) -> Decision:
    """Whether ``new`` restates ``kept`` (:func:`compatible`, then :func:`decide`); a fact
    dated relative to its telling is the same only within :data:`RELATIVE_SECONDS` of
    the last time ``kept`` was told."""
    if not compatible(kept, new, entity_keys):
        return Decision(False, "another owner, type, person or kind of memory")
    decision = decide(new.content, kept.content, similarity)
    if decision.same and (relative(new.content) or relative(kept.content)) \
            and abs(new.created - last_told(kept)) > RELATIVE_SECONDS:
        return Decision(False, "dated relative to its telling, told at another time")
    return decision


def restatement(new: Record, vector: np.ndarray | None, vectors: VectorIndex, by_slot: Mapping[int, Record],
                entity_keys: Sequence[str], now: float) -> tuple[Record, str] | None:
    """The kept memory ``new`` restates and why, among the :data:`NEIGHBOURS` nearest
    memories of its type (:func:`.vector_index.nearest`: its hnswlib graph and the vectors
    waiting for it, or the type's rows in a small store); None when there is none or
    ``new`` has no vector (lexical-only: a write is never merged)."""
    if vector is None or not mergeable(new) or vectors.count == 0:
        return None
    k = NEIGHBOURS
    while True:
        slots, sims = nearest(vectors, vector, k, GROUP[new.type], ef=max(NEIGHBOUR_EF, k))
        for slot, sim in zip(slots.tolist(), sims.tolist(), strict=True):
            kept = by_slot.get(slot)
            if sim >= FLOOR and kept is not None and not kept.expired(now):
                decision = same(kept, new, sim, entity_keys)
                if decision.same:
                    return kept, decision.reason
        # All k close but none the same (other users' or persons' copies of the sentence): look further.
        if len(slots) < k or sims[-1] < FLOOR or k >= MAX_NEIGHBOURS:
            return None
        k *= 4


def worded_restatement(new: Record, lexical: LexicalIndex, by_slot: Mapping[int, Record],
                       entity_keys: Sequence[str], now: float, b: float) -> tuple[Record, str] | None:
    """:func:`restatement` for a write without a vector (lexical-only mode, or the model
    failed): the same text once normalized (rule 1 only), among the memories holding the
    rarest of its words that normalizing keeps (a memory of the same normalized text
    holds it too), or when even that word is common, the memories whose words cover the
    most of its own (one BM25 query; the first 16 x :data:`WORDED`)."""
    if not mergeable(new):
        return None
    terms = set(lexical.tokenizer.terms(new.content)) & set(lexical.tokenizer.terms(normalized(new.content)))
    if not terms:
        return None
    held = {term: lexical.held_by(term) for term in terms}
    rarest = min(terms, key=lambda term: (held[term], term))
    if held[rarest] <= WORDED:
        slots = lexical.holders(rarest)
    else:  # the best covering first; another owner's or type's are passed over without reading them
        found, relevance = lexical.scores(new.content, None, b)
        slots = found[np.argsort(-relevance, kind="stable")[:WORDED * 16]]
    for slot in slots.tolist():
        kept = by_slot.get(slot)
        if kept is not None and not kept.expired(now):
            decision = same(kept, new, None, entity_keys)
            if decision.same:
                return kept, decision.reason
    return None


#: Bits of :class:`Told` (1 MB).  Two bits a key: at 66k fact and context memories (a 100k store) a
#: write of new words is taken for a possible copy once in ~4,000.
TOLD_BITS = 1 << 23
#: A store holding up to this many memories builds :class:`Told` as it opens (~5 ms); a bigger one at idle time.
TOLD_AT_OPEN = 256


class Told:
    """The content words (and type) of every kept fact and context memory, as a Bloom
    filter: a write whose own are not there restates none of them, since both ways of
    being the same need the same content words (:func:`_words_key`), so its check skips
    the vector search (an hnswlib query and the cache lines it evicts: most of the
    check's cost on a big store).  Complete once :meth:`build` (idle time) has added the
    memories kept when it began, each memory put meanwhile or since being added as it is
    put (:meth:`add`, from the state; a memory's text and type never change).  Until then
    :meth:`may_hold` says yes (the check searches, as without it).  Deleted memories stay
    in it: a later write of their words is searched for nothing.  Engine thread."""

    def __init__(self) -> None:
        self._bits = np.zeros(TOLD_BITS // 8, np.uint8)
        self._todo: list[Record] | None = None  # the memories kept when the build began
        self._done = 0  # of those, how many are added
        self.complete = False

    def add(self, rec: Record) -> None:
        """Hold ``rec``'s key (a fact or context memory's; others are never merged)."""
        if rec.type in KINDS:
            for bit in _told_bits(rec):
                self._bits[bit >> 3] |= 1 << (bit & 7)

    def may_hold(self, rec: Record) -> bool:
        """False only when no memory kept has ``rec``'s type and content words."""
        return not self.complete or all(self._bits[bit >> 3] >> (bit & 7) & 1 for bit in _told_bits(rec))

    def build(self, records: Iterable[Record], budget: int) -> int:
        """Add up to ``budget`` of the memories kept when the build began (``records``,
        read at the first call); returns how many (0: complete)."""
        if self.complete:
            return 0
        if self._todo is None:
            self._todo = [rec for rec in records if rec.type in KINDS]
        step = self._todo[self._done : self._done + budget]
        for rec in step:
            self.add(rec)
        self._done += len(step)
        if self._done >= len(self._todo):
            self._todo, self.complete = None, True
        return max(len(step), 1)


def _told_bits(rec: Record) -> tuple[int, int]:
    """Two bits of :class:`Told` for ``rec``'s type and content words (any order)."""
    key = hash((rec.type, tuple(sorted(read(rec.content).content))))
    return key & (TOLD_BITS - 1), (key >> 32) & (TOLD_BITS - 1)


@dataclass(frozen=True)
class Limits:
    """What a write's check reads of the configuration."""

    entity_keys: tuple[str, ...]  # search.entity_fields: metadata naming who a memory is about
    max_bytes: int  # memory.max_metadata_bytes
    max_keys: int  # memory.max_metadata_keys
    bm25_b: float  # search.bm25_b: the check without a vector is one BM25 query


def fold(puts: list[list[Any]], ids: list[str], state: MemoryState, limits: Limits,
         now: float, words: Told | None = None) -> tuple[list[list[Any]], list[list[Any]]]:
    """A write's ``put`` ops without the restatements: (the puts kept, the ``update`` ops
    refreshing the memories they restate).  A put restates a kept memory
    (:func:`restatement`, or :func:`worded_restatement` without a vector) or one put before
    it in the same write; ``ids`` (the write's answer, an id per item) then names the
    memory kept instead.  Conversation turns and other memories :func:`mergeable` refuses
    pass unchanged.  With ``words`` (:class:`Told`), a put whose content words no kept
    memory has is not searched for.  Engine thread, under the lock."""
    kept_puts: list[list[Any]] = []
    # this write's puts that may be restated, by their content words (only those can be the same)
    seen: dict[tuple[Any, ...], list[tuple[Record, np.ndarray | None, list[Any]]]] = {}
    told: dict[str, tuple[Record, dict[str, Any], int, float]] = {}  # kept id -> (record, metadata, times, last)
    renamed: dict[str, str] = {}  # a restatement's id -> the memory kept for it
    for op in puts:
        new = Record(**op[1])
        vector = np.frombuffer(op[2], np.float32) if op[2] is not None else None
        if not mergeable(new):
            kept_puts.append(op)
            continue
        bucket = seen.setdefault(_words_key(new), []) if len(puts) > 1 else []  # one write: nothing before it
        earlier = next((put for rec, vec, put in bucket
                        if same(rec, new, _dot(vec, vector), limits.entity_keys).same), None)
        found = None
        if earlier is None and vector is not None:
            if words is None or words.may_hold(new):
                found = restatement(new, vector, state.vectors, state.by_slot, limits.entity_keys, now)
        elif earlier is None:
            found = worded_restatement(new, state.lexical, state.by_slot, limits.entity_keys, now, limits.bm25_b)
        if earlier is not None:
            earlier[1] = _told_again(earlier[1], new, limits)
            renamed[new.id] = earlier[1]["id"]
        elif found is not None:
            kept = found[0]
            _, metadata, times, at = told.get(kept.id, (kept, {}, 0, new.created))
            told[kept.id] = (kept, metadata | new.metadata, times + 1, max(at, new.created))
            renamed[new.id] = kept.id
        else:
            kept_puts.append(op)
            bucket.append((new, vector, op))
    updates = [["update", kept.id, refreshed(kept, metadata, at, told=times, max_bytes=limits.max_bytes,
                                             max_keys=limits.max_keys)]
               for kept, metadata, times, at in told.values()]
    ids[:] = [renamed.get(memory_id, memory_id) for memory_id in ids]
    return kept_puts, updates


def _told_again(row: dict[str, Any], new: Record, limits: Limits) -> dict[str, Any]:
    """``row`` (a put of this write) refreshed by ``new``, a restatement of it in the same write."""
    rec = Record(**row)
    fields = refreshed(rec, new.metadata, new.created, max_bytes=limits.max_bytes, max_keys=limits.max_keys)
    return row | {"metadata": fields["metadata"]}


def _words_key(rec: Record) -> tuple[Any, ...]:
    """What two memories that may be the same share: type, owner and content words (any order)."""
    return rec.type, rec.owner, tuple(sorted(read(rec.content).content))


def _dot(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    return float(a @ b) if a is not None and b is not None else None


def refreshed(kept: Record, metadata: Mapping[str, Any], at: float, *, told: int = 1,
              max_bytes: int, max_keys: int) -> dict[str, Any]:
    """The fields of an ``update`` op refreshing ``kept``, told ``told`` more times (the
    last at ``at``), with ``metadata`` merged over its own (the newer value wins): its
    metadata (with :data:`COUNT_KEY` and :data:`TIME_KEY`) and its decay clock.  Metadata
    over the limits keeps the kept memory's own, with the count and time when they fit."""
    marks = {COUNT_KEY: _count(kept) + told, TIME_KEY: to_datetime(at).isoformat()}
    for candidate in ({**kept.metadata, **metadata, **marks}, {**kept.metadata, **marks}):
        try:
            merged = validate_metadata(candidate, max_bytes=max_bytes, max_keys=max_keys)
            break
        except ValidationError:  # TooLargeError too
            continue
    else:
        merged = dict(kept.metadata)
    return {"metadata": merged, "last_access": max(at, kept.last_access or kept.created), "confidence": 1.0}


def last_told(rec: Record) -> float:
    """When ``rec`` was told last: its :data:`TIME_KEY`, else its creation."""
    value = rec.metadata.get(TIME_KEY)
    if isinstance(value, str):
        try:
            return max(rec.created, to_epoch(datetime.fromisoformat(value)) or rec.created)
        except ValueError:
            pass
    return rec.created


def collapse_key(content: str, memory_type: str) -> str | None:
    """What two search hits share when they show the same thing: the normalized text of a
    fact or context memory; None for a conversation turn (an event: "ok" twice is two)."""
    return normalized(content) if memory_type in KINDS else None


def unique_hits(hits: Sequence[SearchResult]) -> list[SearchResult]:
    """``hits`` with one for each normalized text of a fact or context memory (the
    first: the caller's best), as a search shows them (``context_for`` joins two)."""
    shown: set[str] = set()
    out = []
    for hit in hits:
        key = collapse_key(hit.memory.content, hit.memory.memory_type.value)
        if key is None or key not in shown:
            out.append(hit)
        if key is not None:
            shown.add(key)
    return out


def _entity(value: Any) -> Any:
    return " ".join(value.casefold().split()) if isinstance(value, str) else value


# -- merging the copies a store already holds (``reachy-memory dedupe``) -----------------------------


@dataclass(frozen=True)
class Merge:
    """One memory kept and the copies of it that go (each with the rule's reason)."""

    kept: Record
    copies: tuple[tuple[Record, str], ...]

    def to_dict(self) -> dict[str, Any]:
        """The report entry of this merge (texts cut at :data:`SHOWN_CHARS`, the first
        :data:`SHOWN_COPIES` copies listed, ``copies_count`` all of them)."""
        return {"kept": self.kept.id, "content": self.kept.content[:SHOWN_CHARS], "type": self.kept.type,
                "owner": self.kept.owner, "copies_count": len(self.copies),
                "copies": [{"id": rec.id, "content": rec.content[:SHOWN_CHARS], "reason": why}
                           for rec, why in self.copies[:SHOWN_COPIES]]}


def plan(records: Iterable[Record], vectors: VectorIndex, entity_keys: Sequence[str], now: float) -> list[Merge]:
    """The merges that leave one memory for each set of copies among ``records`` (live,
    mergeable ones; read under the store lock): the oldest of a set is kept, each later
    one is a copy when :func:`same` says so against a memory kept before it.  Only
    memories with the same content words are compared (a dict of them: linear in the
    records, but for sets of near-identical memories).  One pass (:func:`run` makes it
    in steps)."""
    live = _live(records, now)
    by_id = {rec.id: rec for rec in live}
    planner = _Planner(entity_keys, now)
    planner.feed(live, vectors, by_id.get)
    return planner.merges(0, len(planner.found), by_id.get)


def _live(records: Iterable[Record], now: float) -> list[Record]:
    """The memories :func:`plan` reads, oldest first."""
    return sorted((r for r in records if _plannable(r, now)), key=lambda r: (r.created, r.id))


def _plannable(rec: Record, now: float) -> bool:
    return mergeable(rec) and not rec.hidden and not rec.expired(now)


class _Planner:
    """:func:`plan`'s pass, fed the memories oldest first, in as many steps as wanted:
    each memory (as ``current`` returns it then, None when gone) compared with the ones
    kept before it with its content words."""

    def __init__(self, entity_keys: Sequence[str], now: float) -> None:
        self._entity_keys = entity_keys
        self._now = now
        self._kept_by: dict[tuple[Any, ...], list[str]] = {}  # content words -> ids kept, oldest first
        self._copies: dict[str, list[tuple[str, str]]] = {}  # kept id -> (copy id, reason)
        self.found: list[str] = []  # the kept ids with copies, in the order the first was found

    def feed(self, records: Sequence[Record], vectors: VectorIndex,
             current: Callable[[str], Record | None]) -> None:
        for rec in records:
            bucket = self._kept_by.setdefault(_words_key(rec), [])
            for kept_id in bucket:
                kept = current(kept_id)
                if kept is None:  # forgotten since it was kept (a step ago)
                    continue
                decision = same(kept, rec, _cosine(vectors, kept, rec), self._entity_keys)
                if decision.same:
                    if kept_id not in self._copies:
                        self.found.append(kept_id)
                    self._copies.setdefault(kept_id, []).append((rec.id, decision.reason))
                    break
            else:
                bucket.append(rec.id)

    def merges(self, start: int, stop: int, current: Callable[[str], Record | None]) -> list[Merge]:
        """The merges of ``found[start:stop]`` with their memories as ``current`` returns
        them: a memory gone since, or changed so that a plan would no longer merge it
        (superseded, another owner, sharing or persons: :func:`compatible`), leaves its
        merge, or the copy, out (their texts never change: the rule's answer stands)."""
        out = []
        for kept_id in self.found[start:stop]:
            kept = current(kept_id)
            if kept is None or not _plannable(kept, self._now):
                continue
            copies = tuple((rec, why) for copy_id, why in self._copies[kept_id]
                           if (rec := current(copy_id)) is not None and _plannable(rec, self._now)
                           and compatible(kept, rec, self._entity_keys))
            if copies:
                out.append(Merge(kept, copies))
        return out


def merge_ops(merge: Merge, superseded_by: Mapping[str, list[Record]], *, max_bytes: int,
              max_keys: int) -> list[list[Any]]:
    """The journal ops of one :class:`Merge`: the kept memory refreshed as if each copy
    had been written after it (metadata merged oldest first, counts added, confirmed if
    any was), the copies deleted, and the memories a copy superseded pointed at the kept
    one (``superseded_by``: the records that name each id as their ``superseded_by``)."""
    kept, metadata = merge.kept, dict[str, Any]()
    for rec, _ in merge.copies:
        metadata |= {k: v for k, v in rec.metadata.items() if k not in (COUNT_KEY, TIME_KEY)}
    told = sum(1 + _count(rec) for rec, _ in merge.copies)
    at = max(last_told(rec) for rec, _ in merge.copies)
    fields = refreshed(kept, metadata, at, told=told, max_bytes=max_bytes, max_keys=max_keys)
    fields["last_access"] = max([fields["last_access"], *(r.last_access or r.created for r, _ in merge.copies)])
    if not kept.protected and any(rec.protected for rec, _ in merge.copies):
        fields["protected"] = True
    ops: list[list[Any]] = [["update", kept.id, fields]]
    for rec, _ in merge.copies:
        ops += [["update", old.id, {"superseded_by": kept.id}] for old in superseded_by.get(rec.id, ())]
        ops.append(["del", rec.id])
    return ops


MERGES_PER_FRAME = 256  # merges journaled together: an interrupted run keeps whole merges, a rerun does the rest
PLAN_STEP = 2000  # memories compared a step of a run (~0.1 s under the store lock); other requests go in between
# A pause between two steps: the store lock is not fair, and a thread waiting for it would
# not get it before this one takes it again (a search waited for the whole run).
STEP_PAUSE = 0.001
REPORTED = 200  # merges listed in a report (all are counted)
SHOWN_COPIES = 20  # copies listed for each (all are counted)
SHOWN_CHARS = 200  # of each text: a report stays small whatever the memories hold


def run(engine: Engine, *, dry_run: bool = False) -> dict[str, Any]:
    """Merge the copies among the stored fact and context memories (:func:`plan`), or with
    ``dry_run`` only say what would be merged.  Returns ``kept`` (memories that had
    copies), ``merged`` (copies deleted, or to be), ``dry_run`` and ``merges`` (the first
    :data:`REPORTED`: each kept memory with its copies and the rule's reason).  Every
    change goes through the journal, :data:`MERGES_PER_FRAME` merges a frame.  Holds the
    store lock a step at a time (:data:`PLAN_STEP` memories compared, ~50 us each, or a
    frame of merges), so a search or a write goes in between; on a store nothing else
    changes meanwhile the result is :func:`plan`'s.  A memory forgotten or no longer
    mergeable meanwhile is left out; one written meanwhile is not read (its write checked it)."""
    engine.require_open()
    limits = engine.dedupe_limits()
    now = time.time()
    with engine.lock:
        live = [rec.id for rec in _live(engine.state.records.values(), now)]
    planner = _Planner(limits.entity_keys, now)
    for start in range(0, len(live), PLAN_STEP):
        with engine.lock:
            state = engine.state
            step = [rec for memory_id in live[start : start + PLAN_STEP]
                    if (rec := state.records.get(memory_id)) is not None and _plannable(rec, now)]
            planner.feed(step, state.vectors, state.records.get)
        time.sleep(STEP_PAUSE)
    merges: list[Merge] = []
    for start in range(0, len(planner.found), MERGES_PER_FRAME):
        with engine.lock:
            records = engine.state.records
            frame = planner.merges(start, start + MERGES_PER_FRAME, records.get)
            merges += frame
            if frame and not dry_run:
                superseded_by: dict[str, list[Record]] = {}
                for rec in records.values():
                    if rec.superseded_by is not None:
                        superseded_by.setdefault(rec.superseded_by, []).append(rec)
                engine.commit([op for merge in frame
                               for op in merge_ops(merge, superseded_by, max_bytes=limits.max_bytes,
                                                   max_keys=limits.max_keys)])
        time.sleep(STEP_PAUSE)
    return {"dry_run": dry_run, "kept": len(merges), "merged": sum(len(m.copies) for m in merges),
            "merges": [m.to_dict() for m in merges[:REPORTED]]}


def _count(rec: Record) -> int:
    count = rec.metadata.get(COUNT_KEY)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


def _cosine(vectors: VectorIndex, a: Record, b: Record) -> float | None:
    """The cosine of two stored memories' vectors (None when either has none)."""
    if a.vkey is None or b.vkey is None:
        return None
    rows = vectors.unit_rows(np.array([a.slot, b.slot], np.int64))
    if not rows[0].any() or not rows[1].any():
        return None
    return float(rows[0] @ rows[1])
