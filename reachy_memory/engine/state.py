"""The in-memory state of a store: records, indexes, context window.  No I/O.

:class:`MemoryState` changes only through :meth:`MemoryState.apply` (one
journal operation, see :mod:`._records`), so replaying a journal and serving
live writes run the same code.  It never touches a file: the store journals an
operation first (``Core.commit``, :mod:`.core`) and then applies it here.

Threads: the engine thread is the only writer (under the store's lock).
Three values are read without a lock from any thread: ``window_view`` and
``context_view`` (immutable values whose references are swapped; the context
view once per applied frame, so a reader never sees a set_context half done)
and ``records`` / ``by_slot`` lengths for stats.

Slots: a memory's row in the vector and lexical indexes.  A freed slot is
reused (lowest first), except while a :class:`Frozen` view is held for a
background snapshot: then the free slots inside the view's rows and the slots
freed meanwhile are quarantined until :meth:`thaw`, so no row of the frozen
view is written while the snapshot writer reads it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from reachy_memory.config import MAX_TTL_SECONDS, Config
from reachy_memory.engine.filters import FieldIndex
from reachy_memory.engine.lexical_index import LexicalIndex, Tokenizer, index_state
from reachy_memory.engine.records import MUTABLE_FIELDS, Record, decode, encode
from reachy_memory.engine.vector_index import ITEM_BYTES, VECTOR_FORMAT, VectorIndex
from reachy_memory.errors import CorruptionError, ValidationError
from reachy_memory.model import MAX_TIME, MemoryType
from reachy_memory.people.registry import PersonRegistry

GROUP = {t.value: i for i, t in enumerate(MemoryType)}  # one vector graph per memory type
_TURN = MemoryType.CONVERSATION.value
BULK = 256  # a run of this many deletions is applied by MemoryState.delete_many
_ID, _SLOT = operator.attrgetter("id"), operator.attrgetter("slot")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


@dataclass(frozen=True)
class Frozen:
    """The state at one instant, for a snapshot written in the background.

    ``records`` is a shallow copy of the record table (records are immutable but for
    a ``ttl`` op's expiries, see :meth:`MemoryState.retime`: ``expires`` holds them
    by slot as they were, and the snapshot writes those),
    ``vectors`` the vector matrix rows ``[0, rows)`` (never written while the
    view is held: see the module docstring), ``window`` a copy.
    """

    records: tuple[Record, ...]
    vectors: memoryview
    alive: np.ndarray
    expires: np.ndarray  # by slot, a copy: the records' expiries when frozen (inf: none)
    window: tuple[tuple[Any, ...], ...]
    lexical: dict[str, Any] | None
    people: list[dict[str, Any]]


class MemoryState:
    """Records, the vector, lexical and field indexes, and the context window."""

    def __init__(self, config: Config, dim: int, current_key: str | None, model_key: str | None) -> None:
        cfg = config.search
        self.records: dict[str, Record] = {}
        self.by_slot: dict[int, Record] = {}
        self._free: list[int] = []
        self._quarantine: list[int] | None = None  # freed while frozen: reused after thaw
        self._holds = 0  # frozen views held (a background compaction and a backup may overlap)
        self.next_slot = 0
        self.fields = FieldIndex()
        self.lexical = LexicalIndex(previous_weight=cfg.previous_turn_weight)
        self.vectors = VectorIndex(dim, m=cfg.hnsw_m, ef_construction=cfg.hnsw_ef_construction,
                                   ef_search=cfg.hnsw_ef_search, exact_threshold=cfg.exact_threshold,
                                   exact_below=cfg.exact_below)
        self._window: deque[tuple[Any, ...]] = deque(maxlen=2 * config.memory.context_window_size)
        self.window_view: tuple[tuple[Any, ...], ...] = ()
        self.context_view: dict[str, tuple[Record, ...]] = {}
        self._context_next = self.context_view  # engine thread: the view being built (== context_view between frames)
        self._in_frame = False  # engine thread: apply_all is applying a frame
        self._last_turn: Record | None = None  # the newest conversation turn (see last_turn)
        self._turn_gone = False  # the newest turn was deleted: last_turn finds the next at its next read
        self.current_key = current_key  # the vector space of the embedder in use
        self.model_key = model_key  # the vector space the journal last declared
        self.people = PersonRegistry()
        # People-aware indexes (slots): hidden (superseded), by subject, by owner, shared; note names.
        self.hidden: set[int] = set()
        self.by_subject: dict[str, set[int]] = {}
        self.by_owner: dict[str | None, set[int]] = {}
        self.shared: set[int] = set()
        self.names: dict[str, str] = {}  # casefolded note name or alias -> memory id
        self._expires = np.zeros(0, np.float64)  # by slot: when the memory expires (inf: never, or free)
        self._kind = np.zeros(0, np.int8)  # by slot: GROUP of the memory's type
        self._expiry_version = 0  # changes after every change to _expires (see expired_counts)
        self._expired_seen: tuple[int, float, float, dict[str, int]] | None = None  # expired_counts' last answer
        self._ghosts: list[Record] = []  # deleted by delete_many, slots not yet reusable (see bury)
        self.on_put: Callable[[Record], None] | None = None  # told of each memory put (dedupe.Told.add)

    # -- the one way in ------------------------------------------------------------------

    def apply_all(self, ops: list[Any]) -> None:
        """Apply journal operations in order; a run of at least ``BULK`` deletions (a
        mass expiry) is applied at once by :meth:`delete_many`, with the same result."""
        self._in_frame = True  # readers see the context view before the frame or after it
        try:
            ids = _all_deletions(ops)
            if ids is not None:  # a sweep's frame: no per-op loop in Python
                self._delete_run(ids)
                return
            run: list[Any] = []
            for op in ops:
                if isinstance(op, list | tuple) and len(op) == 2 and op[0] == "del":
                    run.append(op[1])
                    continue
                self._delete_run(run)
                run = []
                self.apply(op)
            self._delete_run(run)
        finally:
            self._in_frame = False
            self.context_view = self._context_next

    def _delete_run(self, ids: list[Any]) -> None:
        if len(ids) < BULK or set(map(type, ids)) != {str}:
            for memory_id in ids:  # one by one: a bad id is reported as a lone deletion's would be
                self.apply(["del", memory_id])
        else:
            turns = {i for i in ids if (rec := self.records.get(i)) is not None and rec.type == _TURN}
            self.delete_many(ids)
            self._forget_words(turns)

    def apply(self, op: list[Any]) -> None:
        """Apply one journal operation.  Raises CorruptionError for an unknown or
        malformed one (offset -1: the caller knows the file)."""
        if isinstance(op, dict):
            self._person_op(op)
            return
        kind = op[0] if isinstance(op, list | tuple) and op else None
        try:
            if kind == "put":
                self._put(decode(op[1]), op[2])
            elif kind == "del":
                self._forget(_memory_id(op[1]))
            elif kind == "expire":
                self.expire(_instant(op[1]))
            elif kind == "ttl":
                self.retime(op[1], _lifetime(op[2]))
            elif kind == "redate":
                self.redate(*redate_args(op[1:]))
            elif kind == "win":
                self._window.append(window_turn(op[1:]))
                self.window_view = tuple(self._window)
            elif kind == "winclr":
                self._window.clear()
                self.window_view = ()
            elif kind == "model":
                self.model_key = op[1]
            elif kind == "update":
                self._update(op[1], op[2])
            else:
                raise CorruptionError(f"unknown journal operation {kind!r}", path="", offset=-1)
        except (ValidationError, IndexError, TypeError) as exc:
            raise CorruptionError(f"malformed {kind!r} operation: {exc}", path="", offset=-1) from exc

    def _person_op(self, op: dict[str, Any]) -> None:
        try:
            self.people.apply(op)
        except ValidationError as exc:
            raise CorruptionError(f"malformed person operation: {exc}", path="", offset=-1) from exc

    def _update(self, memory_id: str, changes: dict[str, Any]) -> None:
        """Change fields that leave the text, type, times and vector alone (replay-safe:
        an update of a memory deleted since is a no-op)."""
        if not isinstance(changes, dict) or not set(changes) <= MUTABLE_FIELDS:
            raise ValidationError(f"update of fields {sorted(changes)} is not allowed", field="update")
        old = self.records.get(memory_id)
        if old is None:
            return
        self._replace(old, old.replace(**changes))
        if old.type == _TURN and old.superseded_at is None and changes.get("superseded_at") is not None:
            self._forget_words({memory_id})

    def _replace(self, old: Record, new: Record) -> None:
        """``new`` in the place of ``old`` (same slot, text and vector)."""
        self._unindex(old)
        if old.words != new.words:
            self.lexical.remove(old.slot, *old.words)
            self.lexical.add(new.slot, *new.words)
        self._place(new)
        if self.last_turn is old:
            self.last_turn = new

    def _forget(self, memory_id: str) -> None:
        """The ``del`` op: the memory goes, and with it every copy of its text."""
        rec = self.records.get(memory_id)
        self._delete(memory_id)
        if rec is not None and rec.type == _TURN:
            self._forget_words({memory_id})

    def _forget_words(self, turns: set[str]) -> None:
        """The turns that follow any of ``turns`` (deleted or superseded) lose their copy
        of its text (``previous_text``): forgotten or corrected words must not be found
        through the next turn.  A pass over the records (~6 ms at 100k), only when a
        turn is deleted or superseded; an expiry sweep keeps them (a follower expires
        at most ``NEIGHBOUR_SECONDS`` after the turn it follows)."""
        if not turns:
            return
        for rec in [r for r in self.records.values() if r.follows in turns and r.previous_text is not None]:
            self._replace(rec, rec.replace(previous_text=None))

    def _put(self, rec: Record, vector: bytes | None) -> None:
        replaced = self.records.get(rec.id)
        was_last = replaced is not None and replaced is self._last_turn
        if replaced is not None:
            # The id keeps its place in the table (the new record overwrites it below): table
            # order is write order, which breaks ties between turns of one time after a reload.
            self._delete(rec.id, keep_place=True)
        if self._ghosts and not self._free:
            self.bury(BULK)  # without idle time (in-process use), a deletion's slots come back here
        slot = heapq.heappop(self._free) if self._free else self.next_slot
        indexed = vector is not None and rec.vkey == self.current_key
        rec = rec.replace(slot=slot, vkey=rec.vkey if vector is not None else None)
        self._place(rec)
        if self.on_put is not None:
            self.on_put(rec)
        self.lexical.add(slot, *rec.words)
        if indexed and vector is not None:
            self.vectors.add(slot, np.frombuffer(vector, np.float32), GROUP[rec.type])
        # An imported, re-embedded or back-dated turn is not the newest; a rewritten one
        # (a vector added, links changed) keeps its place in the table, and so wins a tie
        # only if it held it (as _newest_turn, by table order, decides after a reload).
        if rec.type == MemoryType.CONVERSATION.value and (
                was_last or _not_older(rec, self.last_turn, rewritten=replaced is not None)):
            self.last_turn = rec

    def _share_links(self, rec: Record) -> None:
        """Point ``rec``'s link fields (not yet placed) at the strings of the turn it
        follows instead of copies: a reload decodes each string anew (~100 bytes a turn)."""
        before = self.records.get(rec.follows) if rec.follows is not None else None
        if before is not None:
            rec.follows = before.id
            if rec.previous_text == before.content:
                rec.previous_text = before.content

    def _place(self, rec: Record) -> None:
        self._share_links(rec)
        self.records[rec.id] = rec
        self.by_slot[rec.slot] = rec
        self.next_slot = max(self.next_slot, rec.slot + 1)
        if rec.slot >= len(self._expires):
            self._grow(rec.slot)
        self._expires[rec.slot] = np.inf if rec.expires is None else rec.expires
        self._kind[rec.slot] = GROUP[rec.type]
        self._expiry_version += 1
        self.fields.add(rec.slot, rec.type, rec.metadata)
        self._update_context_view(rec, add=True)
        if rec.hidden:
            self.hidden.add(rec.slot)
        for person in rec.subjects:
            self.by_subject.setdefault(person, set()).add(rec.slot)
        self.by_owner.setdefault(rec.owner, set()).add(rec.slot)
        if rec.shared:
            self.shared.add(rec.slot)
        for name in (rec.name, *rec.aliases):
            if name:
                self._hold_name(name.casefold(), rec)

    def _hold_name(self, label: str, rec: Record) -> None:
        """Index ``label`` (casefolded) as ``rec``'s, unless another record holding it
        expires later: two records hold one label only while the older note has expired
        unswept and a live one took the label over, and whichever is placed last (an
        ``update`` of the expired one, a reload's order) must not take it back."""
        holder = self.records.get(self.names.get(label, ""))
        if holder is None or holder.id == rec.id or _until(holder) <= _until(rec):
            self.names[label] = rec.id

    def _grow(self, slot: int) -> None:
        size = max(slot + 1, 2 * len(self._expires), 1024)
        self._expires = np.concatenate([self._expires, np.full(size - len(self._expires), np.inf)])
        self._kind = np.concatenate([self._kind, np.zeros(size - len(self._kind), np.int8)])

    def _unindex(self, rec: Record) -> None:
        """Take ``rec`` out of the field, context and people-aware indexes (not lexical, vectors)."""
        self.fields.remove(rec.slot, rec.type, rec.metadata)
        self._update_context_view(rec, add=False)
        self.hidden.discard(rec.slot)
        for person in rec.subjects:
            self.by_subject.get(person, set()).discard(rec.slot)
        self.by_owner.get(rec.owner, set()).discard(rec.slot)
        self.shared.discard(rec.slot)
        for name in (rec.name, *rec.aliases):
            if name and self.names.get(name.casefold()) == rec.id:
                del self.names[name.casefold()]

    def _delete(self, memory_id: str, *, keep_place: bool = False) -> None:
        """Remove ``memory_id`` from the indexes; with ``keep_place`` its entry in the
        record table stays, for the caller to overwrite at once (a re-put)."""
        rec = self.records.get(memory_id) if keep_place else self.records.pop(memory_id, None)
        if rec is None:
            return
        del self.by_slot[rec.slot]
        self._expires[rec.slot] = np.inf
        self._expiry_version += 1
        self._unindex(rec)
        self.lexical.remove(rec.slot, *rec.words)
        self.vectors.remove(rec.slot)
        self._release([rec.slot])
        if self._last_turn is rec:
            self._turn_gone = True

    def delete_many(self, ids: list[str]) -> None:
        """Delete the memories ``ids`` (unknown ones skipped) as :meth:`_delete` would one
        by one, in a fraction of the time (a mass deletion): the indexes hide them with
        array and set operations, and :meth:`bury` finishes at idle time what needs
        each record (metadata entries, postings); their slots are reused after that."""
        # map() keeps the per-record loops in C: at 66k records each pass counts.
        recs = list(filter(None, map(self.records.pop, ids, itertools.repeat(None))))
        self._drop(recs, np.fromiter(map(_SLOT, recs), np.int64, len(recs)))

    def expire(self, at: float) -> int:
        """Delete every memory expired at ``at`` (the ``expire`` op, written by a sweep);
        returns how many.  A replay deletes the same memories: the state at that point of
        the journal is the same, and expiry times are the records' own."""
        slots = self._due(at)
        recs = list(map(self.by_slot.__getitem__, slots.tolist()))
        if len(recs) < BULK:
            for rec in recs:
                self._delete(rec.id)
        else:
            deque(map(self.records.pop, map(_ID, recs)), maxlen=0)
            self._drop(recs, slots)
        return len(recs)

    def retime(self, memory_type: Any, ttl: float) -> None:
        """The ``ttl`` op: every memory of ``memory_type`` (only conversation turns have a
        lifetime from their creation) now expires ``ttl`` seconds after it was created.

        The one change made to placed records in place (see ``_records``): a copy of
        each costs ~17 us, 1.7 s of engine time at 100k turns.  No index but the
        per-slot expiry array holds the expiry, and a frozen view keeps a copy of that
        array (:attr:`Frozen.expires`): a snapshot written meanwhile (a background
        compaction's, a backup's) holds the expiries as they were when it was frozen,
        never a mix; a compaction's is brought up to date on replay, since this op
        follows the snapshot in the journal."""
        if memory_type != _TURN:
            raise ValidationError(f"a ttl applies to conversation turns, not {memory_type!r}", field="ttl")
        for rec in self.records.values():
            if rec.type == _TURN:
                rec.expires = _retimed(rec.created, ttl)
                self._expires[rec.slot] = rec.expires
        self._expiry_version += 1

    def redate(self, since: float, until: float, delta: float) -> int:
        """The ``redate`` op: every memory created in ``[since, until)`` gets ``created +
        delta`` and, when it expires, ``expires + delta`` (kept at or before ``MAX_TIME``);
        every window turn of that period its time moved the same way.  Returns how many
        memories moved.

        Each moved memory is a new record put in the old one's place (``_replace``: same
        slot, same place in the record table), so a frozen view never sees a moved one.
        The newest turn is then found again by a pass over the records, as a reload finds it.
        """
        moved = self._created_in(since, until)
        for rec in moved:
            expires = None if rec.expires is None else min(rec.expires + delta, MAX_TIME)
            self._replace(rec, rec.replace(created=rec.created + delta, expires=expires))
        self._redate_window(since, until, delta)
        if any(rec.type == _TURN for rec in moved):
            self._turn_gone = True  # the moved turns may now be newer, or older, than others
        return len(moved)

    def dated_in(self, since: float, until: float) -> tuple[int, int]:
        """How many memories and window turns :meth:`redate` would move."""
        return len(self._created_in(since, until)), sum(_dated_in(turn, since, until) for turn in self._window)

    def _created_in(self, since: float, until: float) -> list[Record]:
        return [rec for rec in self.records.values() if since <= rec.created < until]

    def _redate_window(self, since: float, until: float, delta: float) -> None:
        """The window turns with a time in ``[since, until)`` moved by ``delta``."""
        turns = [(*turn[:2], turn[2] + delta, *turn[3:]) if _dated_in(turn, since, until) else turn
                 for turn in self._window]
        self._window = deque(turns, maxlen=self._window.maxlen)
        self.window_view = tuple(self._window)

    def retime_plan(self, ttl: float, at: float) -> dict[str, int]:
        """What :meth:`retime` with ``ttl`` would change for the turns alive at ``at``
        (the expired ones are swept before it): how many, how many would expire
        earlier or later than now, and how many would then be expired at ``at``."""
        plan = {"turns": 0, "earlier": 0, "later": 0, "expire_now": 0}
        for rec in self.records.values():
            if rec.type == _TURN and not rec.expired(at):
                plan["turns"] += 1
                new, old = _retimed(rec.created, ttl), (math.inf if rec.expires is None else rec.expires)
                plan["earlier"] += new < old
                plan["later"] += new > old
                plan["expire_now"] += new <= at
        return plan

    def count_expired(self, at: float) -> int:
        """How many memories :meth:`expire` would delete at ``at``."""
        return len(self._due(at))

    def expired_counts(self, at: float) -> dict[str, int]:
        """How many memories of each type (every type a key) are expired at ``at`` but
        not yet swept: hidden from every reader, still in :attr:`records`.

        Any thread, no lock (the figures may be one write apart). Passes over the
        per-slot expiry array (~0.2 ms at 100k memories) only when a memory was
        written, deleted or retimed since the last answer, or ``at`` reached the next
        expiry after it (or went back before it): stats read often cost a comparison.
        """
        version, seen = self._expiry_version, self._expired_seen
        if seen is not None and seen[0] == version and seen[1] <= at < seen[2]:
            return dict(seen[3])
        expires, kinds = self._expires, self._kind  # each replaced whole when grown: one of each
        size = min(self.next_slot, len(expires), len(kinds))
        expires, kinds = expires[:size], kinds[:size]
        due = expires <= at
        by_kind = np.bincount(kinds[np.flatnonzero(due)], minlength=len(GROUP))
        counts = {kind: int(by_kind[code]) for kind, code in GROUP.items()}
        upcoming = float(np.min(expires, initial=math.inf, where=~due))  # the next expiry after ``at``
        self._expired_seen = (version, at, upcoming, counts)
        return dict(counts)

    def _due(self, at: float) -> np.ndarray:
        """Slots of the memories expired at ``at`` (one comparison over a per-slot array)."""
        return np.flatnonzero(self._expires[: self.next_slot] <= at)

    def _drop(self, recs: list[Record], slots: np.ndarray) -> None:
        """The bulk part of :meth:`delete_many`: ``recs`` (at ``slots``, already out of
        ``records``) leave every index; what needs each record waits for :meth:`bury`."""
        listed = slots.tolist()
        deque(map(self.by_slot.pop, listed), maxlen=0)
        self._expires[slots] = np.inf
        self._expiry_version += 1
        kinds = self._kind[slots]
        self.fields.hide(slots, {kind: slots[kinds == code] for kind, code in GROUP.items()})
        self.lexical.hide(slots)
        self.vectors.remove_many(slots)
        self._unindex_people(set(listed))
        self._ghosts.extend(recs)

    def _unindex_people(self, gone: set[int]) -> None:
        """The people-aware indexes, note names, context views and newest turn without
        the slots ``gone`` (their records already out of ``records``)."""
        for index in (self.hidden, self.shared, *self.by_owner.values(), *self.by_subject.values()):
            if not index.isdisjoint(gone):
                index.difference_update(index & gone if len(index) < len(gone) else gone)  # the smaller
        for name, memory_id in list(self.names.items()):  # notes are few: a pass over them
            if memory_id not in self.records:
                del self.names[name]
        changed = {key: kept for key, view in self._context_next.items()
                   if len(kept := tuple(r for r in view if r.id in self.records)) != len(view)}
        if changed:
            self._swap_context_view({**self._context_next, **changed})  # one swap, whatever the count
        if self._last_turn is not None and self._last_turn.id not in self.records:
            self._turn_gone = True

    def bury(self, budget: int) -> int:
        """Idle-time work left by :meth:`delete_many`: up to ``budget`` records' metadata
        entries and postings removed (their slots then reusable) and ``8 * budget``
        graph nodes marked deleted; returns how much is left."""
        batch = self._ghosts[-budget:] if budget > 0 else []
        del self._ghosts[len(self._ghosts) - len(batch):]
        for rec in batch:
            self.fields.bury(rec.slot, rec.metadata)
            self.lexical.bury(rec.slot, *rec.words)
        self._release([rec.slot for rec in batch])
        return len(self._ghosts) + self.vectors.settle(8 * budget)

    def expired_ids(self, at: float) -> list[str]:
        """Ids of the memories expired at ``at``."""
        return list(map(_ID, map(self.by_slot.__getitem__, self._due(at).tolist())))

    def _release(self, slots: list[int]) -> None:
        """Make freed ``slots`` reusable (after :meth:`thaw` while a frozen view is held)."""
        if self._quarantine is not None:
            self._quarantine.extend(slots)
            return
        if not slots:
            return
        self.vectors.clear_rows(slots)  # no view holds them: a forgotten vector leaves the next snapshot too
        if len(slots) == 1:
            heapq.heappush(self._free, slots[0])
        else:
            self._free.extend(slots)
            heapq.heapify(self._free)

    def _update_context_view(self, rec: Record, *, add: bool) -> None:
        """Swap in a new context view when ``rec`` is named context (copy-on-write)."""
        key = rec.metadata.get("context_key") if rec.type == MemoryType.CONTEXT.value else None
        if not isinstance(key, str):
            return
        kept = tuple(r for r in self._context_next.get(key, ()) if r.id != rec.id)
        self._swap_context_view({**self._context_next, key: (*kept, rec) if add else kept})

    def _swap_context_view(self, view: dict[str, tuple[Record, ...]]) -> None:
        """The next context view; published at once, or at the end of the frame being applied
        (a set_context is [del old, put new]: between the two a reader saw no value)."""
        self._context_next = view
        if not self._in_frame:
            self.context_view = view

    # -- snapshots -------------------------------------------------------------------------

    def load(self, snapshot: dict[str, Any]) -> None:
        """Fill an empty state from a snapshot dict (``_persistence.read_snapshot``)."""
        for op in snapshot.get("people", ()):
            self._person_op(op)
        try:
            self._window.extend(window_turn(turn) for turn in snapshot["window"])
        except ValidationError as exc:
            raise CorruptionError(f"bad context window in snapshot: {exc}", path="", offset=-1) from exc
        self.window_view = tuple(self._window)
        words_loaded = self.lexical.load_state(snapshot["lexical"])
        # no format: float32, written before bf16 (read_snapshot refused any other)
        dim, fmt = self.vectors.dim, snapshot.get("vector_format", "f32")
        vectors = snapshot["vectors"] if snapshot.get("dim") == dim else b""  # another model's space
        rows = len(vectors) // (ITEM_BYTES[fmt] * dim)
        alive, group = np.zeros(rows, bool), np.zeros(rows, np.int8)
        slots = slot_limit(snapshot)
        for obj in snapshot["records"]:
            rec = _decode_stored(obj)
            if not 0 <= rec.slot < slots:
                raise CorruptionError(f"record {rec.id[:64]!r} has slot {rec.slot}, outside the {slots} slots of "
                                      "its snapshot's lexical index", path="", offset=-1)
            self._place(rec)
            if rec.vkey is not None and rec.vkey == self.current_key and rec.slot < rows:
                alive[rec.slot] = True
                group[rec.slot] = GROUP[rec.type]
        self._free = sorted(set(range(self.next_slot)) - set(self.by_slot))
        if not words_loaded:  # indexed with another search.previous_turn_weight
            self.lexical = words_index(self.by_slot.values(), self.lexical.previous_weight)
        self.vectors.load_vectors(vectors, alive, group, fmt)
        self.last_turn = self._newest_turn()

    @property
    def last_turn(self) -> Record | None:
        """The newest conversation turn (the last of equals in insertion order), which
        the next turn is embedded with and follows.  When it is deleted, the newest
        remaining one, as a reload finds it: found at the next read, in one pass over
        the records (~10 ms at 100k), however many turns went since."""
        if self._turn_gone:
            self._last_turn, self._turn_gone = self._newest_turn(), False
        return self._last_turn

    @last_turn.setter
    def last_turn(self, rec: Record | None) -> None:
        self._last_turn, self._turn_gone = rec, False

    @property
    def known_last_turn(self) -> Record | None:
        """:attr:`last_turn` without the pass over the records (None when the newest
        turn was deleted since it was last found): any thread, changes nothing."""
        return None if self._turn_gone else self._last_turn

    def _newest_turn(self) -> Record | None:
        """The newest conversation turn, by a pass over every record."""
        newest = None
        for rec in self.records.values():
            if rec.type == MemoryType.CONVERSATION.value and _not_older(rec, newest):
                newest = rec
        return newest

    def freeze(self, *, with_lexical: bool = True) -> Frozen:
        """The state now, for a snapshot; until :meth:`thaw`, freed slots are not reused.

        Costs a shallow copy of the record table (records are immutable; see retime) and of the
        vector liveness and expiries by slot; the vector rows themselves are shared, not copied.
        """
        if with_lexical:
            self.bury(len(self._ghosts))  # the index's own snapshot must not hold unburied postings
        self._holds += 1
        if self._quarantine is None:
            self._quarantine = []
        vectors = self.vectors.vector_bytes()
        rows = len(vectors) // self.vectors.row_bytes
        self._hold_free_rows(rows)
        return Frozen(tuple(self.records.values()), vectors, self.vectors.alive[:rows].copy(),
                      self._expires[: self.next_slot].copy(), tuple(self._window),
                      self.lexical.state() if with_lexical else None, self.people.snapshot_ops())

    def _hold_free_rows(self, rows: int) -> None:
        """Quarantine the free slots inside a frozen view's vector rows: a store reusing
        one would write its row while the snapshot writer reads it, and the file's
        checksum would not cover what it wrote.  New memories go past the view."""
        inside = [slot for slot in self._free if slot < rows]
        if inside and self._quarantine is not None:
            self._quarantine.extend(inside)
            self._free = [slot for slot in self._free if slot >= rows]
            heapq.heapify(self._free)

    def thaw(self) -> None:
        """End a :meth:`freeze`: once no view is held, slots freed meanwhile become reusable."""
        self._holds = max(self._holds - 1, 0)
        if self._holds:
            return
        quarantined, self._quarantine = self._quarantine or [], None
        self._release(quarantined)

    # -- queries the store needs -------------------------------------------------------------

    def context_records(self, key: str) -> list[Record]:
        """The CONTEXT records stored under ``key``."""
        recs = (self.by_slot[s] for s in self.fields.slots_with("context_key", key))
        return [r for r in recs if r.type == MemoryType.CONTEXT.value]

    def previous_turns(self) -> dict[str, Record]:
        """Each conversation turn's preceding turn, in stored order (ties keep insertion order)."""
        turns = sorted((r for r in self.records.values() if r.type == MemoryType.CONVERSATION.value),
                       key=lambda r: r.created)
        return {after.id: before for before, after in itertools.pairwise(turns)}

    def scope_mask(self, owner: str | None = None, about: list[str] | None = None,
                   include_hidden: bool = False, named: set[int] | None = None) -> np.ndarray | None:
        """Slots a search may return: not superseded (unless ``include_hidden``), visible
        to ``owner`` (theirs, shared and unscoped ones), about one of the persons
        ``about`` (or among ``named``, the slots that name them in their metadata).
        None when nothing is restricted (the fast, unfiltered path)."""
        mask: np.ndarray | None = None
        if self.hidden and not include_hidden:
            mask = np.ones(self.next_slot, bool)
            mask[list(self.hidden)] = False
        if owner is not None:
            mask = _and(mask, self.by_owner.get(owner, set()) | self.by_owner.get(None, set()) | self.shared,
                        self.next_slot)
        if about is not None:
            slots: set[int] = set().union(named or (), *(self.by_subject.get(p, set()) for p in about))
            mask = _and(mask, slots, self.next_slot)
        return mask

    def foreign_vkey(self) -> str | None:
        """A vector space other than the current one that a stored vector comes from."""
        return next((r.vkey for r in self.records.values() if r.vkey not in (None, self.current_key)), None)


def snapshot_sections(frozen: Frozen, head: dict[str, Any],
                      lexical: dict[str, Any] | Callable[[], dict[str, Any]],
                      check: Callable[[], None] | None = None) -> Iterator[Any]:
    """The frames of a snapshot of ``frozen`` (``docs/FORMAT.md``, "Snapshot"), each
    produced when the writer reaches it; ``lexical`` is the index's state or what
    builds it (after the records are written and freed).  ``check`` is called every
    :data:`CHECK_EVERY` records while they are packed (what it raises stops the snapshot)."""
    from reachy_memory.storage.journal import (  # late: journal is I/O; the state only names frames
        Packed,
        RawBin,
        Stream,
        pack_gently,
    )

    yield {**head, "vector_format": VECTOR_FORMAT}  # the vector block's format goes with the block
    # Packed piece by piece: a background compaction must not hold the GIL for long;
    # rows are encoded as they are packed, so they are never all alive at once.
    records = frozen.records if check is None else checked(frozen.records, check)
    rows = Stream(len(frozen.records), (_snapshot_row(rec, frozen) for rec in records))
    yield Packed(pack_gently({"records": rows, "people": frozen.people}))
    yield RawBin(frozen.vectors)
    yield Packed(pack_gently({"lexical": lexical() if callable(lexical) else lexical}))
    yield {"window": [list(turn) for turn in frozen.window]}
    yield {"end": len(frozen.records)}


CHECK_EVERY = 256  # records between two calls of a snapshot's check (~1 ms of packing or tokenizing)


def checked(records: Iterable[Record], check: Callable[[], None]) -> Iterator[Record]:
    """``records``, calling ``check`` before the first and every :data:`CHECK_EVERY`-th
    (a backup abandoned when its store begins closing: ``check`` raises)."""
    for i, rec in enumerate(records):
        if i % CHECK_EVERY == 0:
            check()
        yield rec


def _snapshot_row(rec: Record, frozen: Frozen) -> dict[str, Any]:
    """A record as a snapshot stores it: its vector key only if its vector is in the
    view, its expiry as it was when the view was frozen (a ``ttl`` op may have set
    another in place since: :meth:`MemoryState.retime`)."""
    row, alive = encode(rec), frozen.alive
    indexed = rec.vkey is not None and rec.slot < len(alive) and bool(alive[rec.slot])
    row["vkey"] = rec.vkey if indexed else None
    expires = float(frozen.expires[rec.slot])
    row["expires"] = None if expires == math.inf else expires
    return row


def _retimed(created: float, ttl: float) -> float:
    """A turn's expiry under ``ttl``, kept inside the times a record may carry."""
    return min(created + ttl, MAX_TIME)


def _lifetime(value: Any) -> float:
    """A ``ttl`` op's seconds: a positive number up to the longest configurable TTL
    (:data:`~reachy_memory.config.MAX_TTL_SECONDS`), else ValidationError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TTL_SECONDS:
        raise ValidationError(f"a ttl must be a positive number of seconds up to {MAX_TTL_SECONDS:g}, got {value!r}",
                              field="ttl")
    return float(value)


def redate_args(values: Any) -> tuple[float, float, float]:
    """A ``redate`` op's ``since, until, delta``: finite numbers with ``0 <= since <= until``
    and both ends, moved by ``delta``, in ``[0, MAX_TIME]`` (every moved time stays one a
    record may carry), else ValidationError."""
    if len(values) != 3 or not all(map(_finite, values)):
        raise ValidationError(f"a redate is three finite numbers, not {values!r}", field="redate")
    since, until, delta = map(float, values)
    if not 0 <= since <= until <= MAX_TIME or not 0 <= since + delta <= until + delta <= MAX_TIME:
        raise ValidationError(f"a redate of [{since!r}, {until!r}) by {delta!r} leaves 1970..2200", field="redate")
    return since, until, delta


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _dated_in(turn: tuple[Any, ...], since: float, until: float) -> bool:
    """True when a window turn's time is in ``[since, until)`` (a turn without a
    number for its time, which no writer writes, is left alone)."""
    return len(turn) > 2 and _finite(turn[2]) and since <= turn[2] < until


def _until(rec: Record) -> float:
    """When ``rec`` expires (inf: never)."""
    return math.inf if rec.expires is None else rec.expires


def slot_limit(snapshot: dict[str, Any]) -> int:
    """How many slots a snapshot's records may use: its lexical ``doc_len`` has a length
    for each (every writer grows it past each record's slot).  A record's slot sizes
    arrays and a set at open: one slot of 2^31 in a few bytes of a crafted backup asked
    for gigabytes; now each slot costs the file its 4 bytes.  TypeError for a state
    without one (damage)."""
    return len(snapshot["lexical"]["doc_len"]) // 4


def window_turn(value: Any) -> tuple[str, str, float]:
    """A context window turn (role, content, finite time) from a snapshot or a ``win`` op,
    else ValidationError: a turn of another shape opened and then failed each reading
    of the window (IndexError, TypeError)."""
    if not (isinstance(value, list | tuple) and len(value) == 3 and type(value[0]) is str
            and type(value[1]) is str and _finite(value[2])):
        raise ValidationError(f"a context window turn is [role, text, time], not {str(value)[:100]}", field="window")
    return value[0], value[1], value[2]


def _memory_id(value: Any) -> str:
    """A deletion's id: a string (what every writer writes), else ValidationError."""
    if not isinstance(value, str):
        raise ValidationError(f"a memory id must be a string, not {type(value).__name__}", field="id")
    return value


def _instant(value: Any) -> float:
    """An ``expire`` op's time: a finite number of epoch seconds, else ValidationError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationError(f"an expiry time must be a finite number, not {value!r}", field="at")
    return float(value)


def _all_deletions(ops: list[Any]) -> list[Any] | None:
    """The ids of ``ops`` when every one is a ``del`` op (checked in C), else None."""
    if len(ops) < BULK:
        return None
    try:
        if set(map(len, ops)) == {2} and set(map(_FIRST, ops)) == {"del"}:
            return list(map(_SECOND, ops))
    except (TypeError, KeyError):  # a malformed op: the op-by-op path reports it
        pass
    return None


def _and(mask: np.ndarray | None, slots: set[int], size: int) -> np.ndarray:
    allowed = np.zeros(size, bool)
    if slots:
        allowed[list(slots)] = True
    return allowed if mask is None else mask & allowed


def words_state(records: Iterable[Record], previous_weight: float, tokenizer: Tokenizer) -> dict[str, Any]:
    """The lexical index state of ``records``, built from their texts (both fields)."""
    return index_state(((rec.slot, *rec.words) for rec in records), tokenizer, previous_weight)


def words_index(records: Iterable[Record], previous_weight: float) -> LexicalIndex:
    """A lexical index of ``records``, built from their texts (both fields)."""
    index = LexicalIndex(previous_weight=previous_weight)
    index.load_state(words_state(records, previous_weight, index.tokenizer))
    return index


def _decode_stored(obj: Any) -> Record:
    try:
        return decode(obj)
    except (ValidationError, TypeError) as exc:
        raise CorruptionError(f"bad record in snapshot: {exc}", path="", offset=-1) from exc


def _not_older(rec: Record, newest: Record | None, *, rewritten: bool = False) -> bool:
    """True when ``rec`` may be the newest conversation turn (ties: the later write wins,
    unless ``rec`` rewrites a stored turn: its first write already lost that tie)."""
    if newest is None or rec.id == newest.id:
        return True
    return rec.created > newest.created if rewritten else rec.created >= newest.created
