"""People-aware memory on the store (issue 10): persons, subjects, supersession,
confirm/correct, scoping, named notes, archives and one-call prompt context.

:class:`PeopleMixin` is part of :class:`~reachy_memory.engine.store.MemoryStore`; it
uses the store's funnel (``_commit``), lock and state only.  Every change is
journaled as ops: persons as ``person_*`` dicts (``people.py``), memories as
``put`` and ``update`` (``_records.py``), a new person and the memory about it
in one frame, so a crash never leaves one without the other.

Supersession (automatic, when a FACT is remembered): the candidates are the
live, unprotected, unnamed facts in the same owner scope whose subjects are exactly the
new fact's, the ten closest by cosine; :func:`._supersession.decide` says
which of them the new fact replaces.  Lexical-only stores (no vectors) do not
supersede automatically: a wrong supersession hides a true fact, and the rule
was only measured with embeddings.  ``correct`` always supersedes.

Threads: like the rest of the store, writes run under the store lock (the
daemon's engine thread); ``_recent_subjects`` (the persons the last facts were
about, for "she likes ...") is owned by that thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import tzinfo
from typing import TYPE_CHECKING, Any

import numpy as np

from reachy_memory.engine import ingest
from reachy_memory.engine.context_text import (
    ContextItem,
    CountTokens,
    RetrievedContext,
    Turn,
    approximate_tokens,
    build_context,
    token_counter,
    tokenizer_path,
)
from reachy_memory.engine.mentions import extract_mentions, norm, parse_reference
from reachy_memory.engine.records import Record
from reachy_memory.engine.supersession import decide
from reachy_memory.errors import NotFoundError, ReachyMemoryError, ValidationError
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, Memory, MemoryType, SearchResult, check_unicode
from reachy_memory.people.registry import (
    Person,
    PersonRegistry,
    Resolution,
    check_metadata,
    check_owner_change,
    may_be_about,
    person_from_op,
    read_person_id,
    visible_to,
)

if TYPE_CHECKING:
    import threading

    from reachy_memory.config import Config
    from reachy_memory.engine.state import MemoryState
    from reachy_memory.engine.store import _Prepared

log = logging.getLogger(__name__)
# The metadata key spec 000's callers and the robot bridge name a memory's person with.
PERSON_FIELD = "person"

MAX_SUBJECTS = 16
MAX_NAME_CHARS = ingest.MAX_NAME_CHARS
MAX_ALIASES = 32
CANDIDATES = 10  # older facts checked for supersession per new fact
REPEAT_SECONDS = 3600.0  # a fact told again within this is the same telling (see _same_fact)
FACT_KEYS = frozenset({"content", "subjects", "name", "aliases", "shared", "expires_in_days", "metadata", "id"})
ARCHIVE_MARKER = 120  # characters of the summary kept in the window's marker


class PeopleMixin:
    """The people-aware operations of :class:`MemoryStore` (see the module doc)."""

    _state: MemoryState
    _lock: threading.RLock
    _config: Config
    _recent_subjects: dict[str | None, list[str]]
    _count_tokens: CountTokens | None
    _tz: tzinfo  # memory.timezone: the user's day

    # provided by MemoryStore (it comes first in the method resolution order)
    def _require_open(self) -> None:
        raise NotImplementedError

    def _decayed(self, rec: Record, now: float) -> bool:
        raise NotImplementedError

    def _commit(self, ops: list[Any]) -> None:
        raise NotImplementedError

    def _embed(self, texts: list[str]) -> np.ndarray | None:
        raise NotImplementedError

    def _stored_text(self, rec: Record) -> str:
        raise NotImplementedError

    def prepare(self, items: Iterable[Mapping[str, Any]], now: float | None = None, *,
                imported: bool = False) -> _Prepared:
        raise NotImplementedError

    def _check_retries_still_stored(self, prepared: _Prepared) -> None:
        raise NotImplementedError

    def embed_query(self, query: str) -> np.ndarray | None:
        raise NotImplementedError

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               min_score: float = SEARCH_MIN_SCORE, where: dict[str, Any] | None = None, *, mode: str | None = None,
               now: Any = None, about: str | None = None, owner: str | None = None,
               include_superseded: bool = False) -> list[SearchResult]:
        raise NotImplementedError

    def search_vector(self, query: str, qvec: np.ndarray | None, memory_type: MemoryType | str | None = None,
                      limit: int = SEARCH_LIMIT, min_score: float = SEARCH_MIN_SCORE,
                      where: dict[str, Any] | None = None, *,
                      mode: str = "hybrid", now: Any = None, about: str | None = None, owner: str | None = None,
                      include_superseded: bool = False) -> list[SearchResult]:
        raise NotImplementedError

    def get_context_window(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    @property
    def _people(self) -> PersonRegistry:
        return self._state.people

    # -- persons -------------------------------------------------------------------------

    def add_person(self, name: str, relation: str | None = None, aliases: Sequence[str] = (),
                   owner: str | None = None, external_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> Person:
        """Add a person (``name`` may be "" while only the relation is known).
        Raises ValidationError / TooLargeError."""
        self._require_open()
        with self._lock:
            return self._commit_person(self._people.add_person(name, relation, aliases, owner, external_id,
                                                               metadata))

    def find_person(self, reference: str, owner: str | None = None) -> Person | None:
        """The person a reference means ("my wife", "Sarah", "sarah", an id), or None."""
        self._require_open()
        with self._lock:  # the registry is read by iteration: not while another thread writes
            return self._people.find_person(_text(reference, "reference"), owner)

    def person_by_external_id(self, external_id: str) -> Person | None:
        """The person anchored to an outside identity (face or voice recognition), or the one
        a person anchored to it was merged into (``people.PersonRegistry.find_by_external_id``), or None."""
        self._require_open()
        with self._lock:
            return self._people.find_by_external_id(_text(external_id, "external_id"))

    def resolve_person(self, reference: str, owner: str | None = None,
                       create: bool = True) -> tuple[Person | None, bool]:
        """(person, created): the person a reference means, created when new (and ``create``)."""
        self._require_open()
        with self._lock:
            resolution = self._people.resolve_person(_text(reference, "reference"), owner, create)
            if resolution.op is not None:
                self._commit([resolution.op])
            return resolution.person, resolution.created

    def people(self, owner: str | None = None) -> list[Person]:
        """The persons ``owner`` knows (theirs and the household's); everyone for None."""
        self._require_open()
        with self._lock:
            return self._people.people(owner)

    def person_redirects(self) -> dict[str, str]:
        """Every person id merged away (``merge_people``) and the live person id it resolves
        to now: what an export carries (the kept person's ``merged_ids``), so that an app
        holding an old id finds the person after an import into another store."""
        self._require_open()
        with self._lock:
            return self._people.redirects()

    def update_person(self, person_id: str, *, household: bool = False, **fields: Any) -> Person:
        """Change a person's name, relation, aliases, external_id, metadata or owner.
        ``person_id`` is read as every person operation reads one (``people.read_person_id``:
        surrounding whitespace ignored); an id merged away names the person it was merged
        into (the returned person has the live id).  A new ``owner`` must keep every memory
        about the person about someone its owner sees (``people.check_owner_change``): the
        household's (None) always; a user's only when all those memories are that user's,
        else a ValidationError (``person_id``, ``owner``, ``memories``, ``other_owner``) and
        nothing changes.  ``household=True`` makes the person the household's, as
        ``owner=None`` does here (the clients and the daemon, where None means "not given",
        say it so); with an owner too it is a ValidationError (field "household").
        Raises NotFoundError, ValidationError."""
        fields = _household_owner(household, fields)
        self._require_open()
        with self._lock:
            plan = self._people.update_person(person_id, **fields)
            assert plan.person is not None
            if "owner" in fields:
                before = self._people.get(plan.person.id)
                assert before is not None  # update_person found it
                check_owner_change(before, plan.person.owner, self._memory_owners_about(before.id))
            return self._commit_person(plan)

    def _memory_owners_about(self, person_id: str) -> list[str | None]:
        """The owner of each stored memory whose subjects name ``person_id`` (or an id merged
        into it, as ``merge_people`` relinks them), from the subject index: no scan of the
        records.  Superseded and expired-but-not-swept memories count: they are still there."""
        ids = [person_id, *(old for old, kept in self._people.redirects().items() if kept == person_id)]
        slots = set().union(*(self._state.by_subject.get(i, set()) for i in ids))
        return [self._state.by_slot[slot].owner for slot in slots]

    def merge_people(self, keep: str, other: str) -> Person:
        """Merge ``other`` into ``keep``: aliases united, memories re-linked (ids read as
        ``people.read_person_id`` says; an id merged away names the person it was merged
        into). Merging again what is merged already (a retry) changes nothing and returns
        the person. ``keep`` must be seen by everyone who sees ``other`` (the same owner, or
        the household's): else a ValidationError naming both owners (``owner``,
        ``other_owner``), as its memories would name a person their owner cannot see.
        Raises NotFoundError, ValidationError."""
        self._require_open()
        with self._lock:
            plan = self._people.merge_people(keep, other)
            if plan.ops:
                self._commit([*plan.ops, *self._relink_ops(plan.relink)])
            return plan.person

    def delete_person(self, person_id: str) -> bool:
        """Forget a person (their memories stay, no longer linked); False if unknown.
        ``person_id`` is read as ``people.read_person_id`` says, and must be the person's
        own id: one merged away (``merge_people``) is a ValidationError whose message and
        ``merged_into`` name the live person (deleting it would forget that person, whom
        the caller may not mean). Raises ValidationError."""
        self._require_open()
        with self._lock:
            try:
                op = self._people.delete_person(person_id)
            except NotFoundError:
                return False
            self._commit([op, *self._relink_ops({op["id"]: None})])
            return True

    def _commit_person(self, resolution: Resolution) -> Person:
        if resolution.op is not None:
            self._commit([resolution.op])
        assert resolution.person is not None
        return resolution.person

    def _relink_ops(self, relink: Mapping[str, str | None]) -> list[list[Any]]:
        """``update`` ops moving every memory's subjects from the old ids to the new (None: drop)."""
        ops = []
        slots = set().union(*(self._state.by_subject.get(old, set()) for old in relink))
        for slot in sorted(slots):
            rec = self._state.by_slot[slot]
            subjects = _unique(relink.get(s, s) for s in rec.subjects)
            ops.append(["update", rec.id, {"subjects": [s for s in subjects if s is not None]}])
        return ops

    # -- remember / recall -----------------------------------------------------------------

    def remember(self, content: str | None = None, facts: Sequence[Mapping[str, Any]] | None = None,
                 subjects: Sequence[str] | None = None, expires_in_days: float | None = None,
                 shared: bool = False, owner: str | None = None, name: str | None = None,
                 aliases: Sequence[str] = (), *, id: str | None = None) -> list[Memory]:
        """Store one fact (``content``) or several (``facts``: dicts with content and
        optionally subjects, name, aliases, shared, expires_in_days, metadata, id).

        Each fact's ``subjects`` (references: "my wife", "Sarah", a person id) are
        resolved, or created as persons; without them (None) the persons the sentence
        names are found ("she" is the person of the previous fact); ``[]`` is a fact
        about nobody.  A fact's persons are ones everyone who sees it sees
        (``people.may_be_about``): ``owner``'s or the household's, and for an unscoped
        fact (``owner`` None, seen by every user) the household's only: names are found
        among those (else a new person of ``owner``'s, as ever), and a person id of
        another owner is a ValidationError naming the person and owner (``person_id``,
        ``owner``, ``other_owner``), nothing written.  An older fact
        the new one contradicts is superseded (kept, hidden by default).
        ``id`` (optional, client-chosen, :func:`~._ingest.check_id`; with ``facts`` each
        fact's own ``id``) makes it idempotent as :meth:`store` is: a fact whose id already
        holds it (same content, owner and sharing) is not written again, nor its persons or
        supersessions, and the memory kept first is returned (the id holding another memory:
        ValidationError, nothing written).
        Returns the stored memories. Raises ValidationError / TooLargeError, NotFoundError
        (nothing written) when a fact kept under its id was forgotten while the retry waited.
        """
        self._require_open()
        items = _fact_items(content, facts, subjects, expires_in_days, shared, name, aliases, id)
        # owner and sharing too: a retry is recognised (check_duplicate) by what its id's memory holds
        prepared = self.prepare([{"content": i["content"], "memory_type": MemoryType.FACT,
                                  "metadata": i.get("metadata"), "id": i.get("id"), "owner": owner,
                                  "shared": bool(i.get("shared"))} for i in items])
        with self._lock:
            # all or nothing: a refusal in fact 3 must not leave facts 1-2 stored
            self._check_retries_still_stored(prepared)
            kept = self._kept_facts(items, prepared.ids, owner)
            self._check_facts([item for item, i in zip(items, prepared.ids, strict=True) if i not in kept], owner)
            ops = {op[1]["id"]: op for op in prepared.ops}
            return [self._remembered(item, memory_id, ops, owner)
                    for item, memory_id in zip(items, prepared.ids, strict=True)]

    def _kept_facts(self, items: list[dict[str, Any]], ids: list[str], owner: str | None) -> set[str]:
        """The ids of ``items`` whose memory is already stored (a retry with client ids).
        Raises ValidationError when an id holds another memory."""
        return {memory_id for item, memory_id in zip(items, ids, strict=True)
                if ingest.check_duplicate(self._state.records.get(memory_id), memory_id, item["content"],
                                          MemoryType.FACT.value, owner, bool(item.get("shared")))}

    def _remembered(self, item: dict[str, Any], memory_id: str, ops: Mapping[str, list[Any]],
                    owner: str | None) -> Memory:
        """The memory of one fact: the one its id holds (a retry, or the same id given twice in
        the call), else the fact stored now."""
        kept = self._state.records.get(memory_id)
        return kept.memory() if kept is not None else self._remember_one(item, ops[memory_id], owner)

    def _check_facts(self, items: list[dict[str, Any]], owner: str | None) -> None:
        """Raise what storing ``items`` one by one would raise half-way: a subject that
        names no one person ``owner`` may see or one a fact of ``owner`` may not be about
        (``people.check_about``), a note name taken (by a memory or an earlier item)."""
        names: dict[str, str] = {}
        for item in items:
            for ref in item.get("subjects") or ():
                if self._people.check_subject(ref, owner):  # and as it will be resolved, with the name the fact gives
                    self._people.check_subject(_enriched(ref, item["content"]), owner)
            fields = self._name_fields(item.get("name"), item.get("aliases") or ())
            labels = {label.casefold(): label for label in (fields.get("name"), *fields.get("aliases", ())) if label}
            again = next((label for key, label in labels.items() if key in names), None)
            if again is not None:
                raise ValidationError(f"the note name or alias {again!r} is given to two facts", field="name")
            names |= labels

    def _remember_one(self, item: dict[str, Any], op: list[Any], owner: str | None) -> Memory:
        """Resolve persons, build the record, find what it supersedes; one frame. Engine thread."""
        resolutions = self._subjects_of(item, owner)
        person_ops = _unique_ops(r.op for r in resolutions)
        subject_ids = _unique(r.person.id for r in resolutions if r.person is not None)
        row = dict(op[1]) | {"subjects": subject_ids, "owner": owner, "shared": bool(item.get("shared"))}
        if item.get("expires_in_days") is not None:
            row["expires"] = row["created"] + float(item["expires_in_days"]) * 86400.0
        row |= self._name_fields(item.get("name"), item.get("aliases") or ())
        vector, new = op[2], Record(**row)
        similar = self._similar_facts(new, vector)
        same = next((rec for rec, _ in similar[:CANDIDATES]
                     if _same_fact(rec, new) and not self._decayed(rec, new.created)), None)
        if same is None:
            self._commit([*person_ops, ["put", row, vector], *self._superseded_by(new, similar)])
        elif person_ops:  # told again (a model's retry): the fact it already is, not a second copy
            self._commit(person_ops)
        if subject_ids:
            self._recent_subjects[owner] = [*subject_ids, *self._recent_subjects.get(owner, [])][:8]
        return (same or self._state.records[row["id"]]).memory()

    def _subjects_of(self, item: dict[str, Any], owner: str | None) -> list[Resolution]:
        refs = item.get("subjects")
        if refs is not None:  # given: only those persons; [] or only "me"/"the user": a fact about nobody
            return [self._people.resolve_person(_enriched(_text(r, "subjects"), item["content"]), owner,
                                                for_memory=True)  # a name: among the persons it may be about
                    for r in refs if self._people.check_subject(r, owner)]
        recent = self._recent_subjects.get(owner, [])
        return self._people.subjects_in(item["content"], owner, recent)

    def _name_fields(self, name: str | None, aliases: Sequence[str]) -> dict[str, Any]:
        """The record fields of a note name and its aliases (none without either). Raises
        ValidationError: aliases without a name or not a list, a label taken by a memory."""
        if name is None and not aliases:
            return {}
        if name is None:
            raise ValidationError("aliases need a note name", field="aliases")
        if not isinstance(aliases, list | tuple) or len(aliases) > MAX_ALIASES:  # a string: its letters
            raise ValidationError(f"aliases must be a list of at most {MAX_ALIASES} names", field="aliases")
        return {"name": self._free_label(name), "aliases": [self._free_label(a) for a in aliases]}

    def _free_label(self, label: str) -> str:
        """``label`` as a note name or alias is kept; ValidationError if a memory holds it."""
        kept = _label(label)
        taken = self._note_holder(kept)
        if taken is not None:
            raise ValidationError(f"the note name or alias {label!r} is already used by memory {taken}",
                                  field="name")
        return kept

    def _similar_facts(self, new: Record, vector: bytes | None) -> list[tuple[Record, float]]:
        """The live facts about exactly ``new``'s persons (same owner), with their cosine,
        most like it first; none in lexical-only mode (precision first)."""
        if vector is None:
            return []
        candidates = [self._state.by_slot[s] for s in self._same_subject_slots(new)]
        candidates = [r for r in candidates if r.type == MemoryType.FACT.value and not r.hidden
                      and r.id != new.id and r.owner == new.owner]
        if not candidates:
            return []
        query = np.frombuffer(vector, np.float32)
        sims = self._state.vectors.similarity(query, np.array([r.slot for r in candidates], np.int64))
        return [(candidates[i], float(sims[i])) for i in np.argsort(-sims, kind="stable")]

    def _superseded_by(self, new: Record, similar: list[tuple[Record, float]]) -> list[list[Any]]:
        """``update`` ops marking the older facts ``new`` replaces (automatic rule), among
        the CANDIDATES most similar that can be (confirmed facts and named notes never are:
        taken before the cut, they would push a conflicting fact out; a note is kept by its
        name, and ``note()`` would answer the hidden version; ``rewrite_note`` replaces it)."""
        similar = [(rec, sim) for rec, sim in similar if not rec.protected and rec.name is None][:CANDIDATES]
        if not new.subjects:  # facts about nobody: the same only when their sentences name the same persons
            named = _named_in(new.content)
            similar = [(rec, sim) for rec, sim in similar if _named_in(rec.content) == named]
        return [_supersede_op(rec.id, new.id, new.created) for rec, sim in similar
                if decide(new.content, rec.content, sim).conflict]

    def _same_subject_slots(self, new: Record) -> set[int]:
        if not new.subjects:
            return {s for s in self._state.by_owner.get(new.owner, set()) if not self._state.by_slot[s].subjects}
        sets = [self._state.by_subject.get(p, set()) for p in new.subjects]
        same = set.intersection(*sets)
        wanted = set(new.subjects)
        return {s for s in same if set(self._state.by_slot[s].subjects) == wanted}

    def recall(self, query: str, about: str | None = None, owner: str | None = None, limit: int = SEARCH_LIMIT,
               include_superseded: bool = False) -> list[SearchResult]:
        """Facts relevant to ``query`` (spec 004), optionally about a person."""
        return self.search(query, MemoryType.FACT, limit=limit, min_score=0.2, about=about, owner=owner,
                           include_superseded=include_superseded)

    # -- supersession, confirm, correct, history ----------------------------------------------

    def correct(self, memory_id: str, new_content: str) -> Memory:
        """Store the corrected fact (same subjects, owner, name) and supersede the old one.
        Returns the new memory. Raises NotFoundError, ValidationError."""
        self._require_open()
        old = self._require_memory(memory_id)
        # its owner and sharing: a corrected turn borrows the previous turn's words by them
        prepared = self.prepare([{"content": new_content, "memory_type": old.type, "metadata": old.metadata,
                                  "owner": old.owner, "shared": old.shared}])
        with self._lock:
            old = self._require_memory(memory_id)
            op = prepared.ops[0]
            row = dict(op[1]) | {"subjects": list(old.subjects), "owner": old.owner, "shared": old.shared,
                                 "protected": old.protected}
            if old.name:
                row |= {"name": old.name, "aliases": list(old.aliases)}
            superseded = _supersede_fields(row["id"], row["created"])
            vector = op[2]
            if old.type == MemoryType.CONVERSATION.value:  # a corrected turn keeps its place in the dialogue
                row |= {"created": old.created, "expires": old.expires, "follows": old.follows,
                        "previous_text": old.previous_text}
                vector = self._vector_in_place(row, prepared.texts[0], vector)
            release: dict[str, Any] = {"name": None, "aliases": []} if old.name else {}
            self._commit([["update", old.id, release | superseded], ["put", row, vector]])
            return self._state.records[row["id"]].memory()

    def _vector_in_place(self, row: dict[str, Any], embedded: str | None, vector: bytes | None) -> bytes | None:
        """The vector of a corrected turn as the turn it follows (``row["follows"]``) gives
        it, as the backfill and a reindex derive it: prepare embedded it with the store's
        newest turn instead.  Re-embedded when that text differs (None if the model fails
        now: the backfill embeds it later).  Engine thread, under the lock."""
        text = self._stored_text(Record(**row))
        if embedded is None or text == embedded:
            return vector
        vectors = self._embed([text])
        return vectors[0].astype(np.float32).tobytes() if vectors is not None else None

    def confirm(self, memory_id: str) -> Memory:
        """Mark a fact confirmed: never superseded automatically. Raises NotFoundError."""
        self._require_open()
        with self._lock:
            rec = self._require_memory(memory_id)
            self._commit([["update", rec.id, {"protected": True}]])
            return self._state.records[rec.id].memory()

    def supersede(self, old_id: str, new_id: str) -> Memory:
        """Explicitly mark ``old_id`` as replaced by ``new_id`` (both kept). Raises NotFoundError;
        ValidationError when ``new_id`` is ``old_id`` or already replaced, down its chain, by
        ``old_id``: a loop would hide every memory in it (and an import refuses one)."""
        self._require_open()
        with self._lock:
            old, new = self._require_memory(old_id), self._require_memory(new_id)
            if old.id == new.id:
                raise ValidationError("a memory cannot supersede itself", field="new_id")
            if old.id in self._replaced_by(new):
                raise ValidationError(f"{new.id} is already superseded, down its chain, by {old.id}: "
                                      "the link would loop", field="new_id")
            self._commit([_supersede_op(old.id, new.id, time.time())])
            return self._state.records[old.id].memory()

    def _replaced_by(self, rec: Record) -> list[str]:
        """The ids down ``rec``'s supersession chain (``superseded_by``, then its own...)."""
        chain: list[str] = []
        while rec.superseded_by is not None and rec.superseded_by not in chain:
            chain.append(rec.superseded_by)
            nxt = self._state.records.get(rec.superseded_by)
            if nxt is None:
                break
            rec = nxt
        return chain

    def history(self, memory_id: str) -> list[Memory]:
        """The supersession chain through ``memory_id``, oldest first (superseded ones included,
        expired ones not: as ``get``, before the sweep too).  Raises NotFoundError, also for
        a memory that expired."""
        self._require_open()
        now = time.time()
        with self._lock:
            rec = self._require_memory(memory_id)
            if rec.expired(now):
                raise NotFoundError(f"no memory with id {memory_id!r} (it expired)", memory_id=memory_id)
            before = {r.superseded_by: r for r in self._state.records.values() if r.superseded_by}
            chain = [rec]
            while chain[0].id in before and before[chain[0].id] not in chain:
                chain.insert(0, before[chain[0].id])
            for later in self._replaced_by(rec):
                nxt = self._state.records.get(later)
                if nxt is None or nxt in chain:
                    break
                chain.append(nxt)
            return [r.memory() for r in chain if not r.expired(now)]

    def _require_memory(self, memory_id: str) -> Record:
        rec = self._state.records.get(_text(memory_id, "memory_id"))
        if rec is None:
            raise NotFoundError(f"no memory with id {memory_id!r}", memory_id=memory_id)
        return rec

    # -- named notes ---------------------------------------------------------------------------

    def note(self, name: str) -> Memory | None:
        """The live note with this name or alias (case-insensitive), or None."""
        self._require_open()
        with self._lock:
            memory_id = self._note_holder(_text(name, "name"))
            return self._state.records[memory_id].memory() if memory_id else None

    def rename_note(self, name: str, new_name: str) -> Memory:
        """Give a note a new name (its words become searchable). Raises NotFoundError, ValidationError."""
        with self._lock:
            rec = self._require_note(name)
            taken = self._note_holder(_label(new_name))
            if taken is not None and taken != rec.id:
                raise ValidationError(f"the note name {new_name!r} is already used by memory {taken}", field="name")
            self._commit([["update", rec.id, {"name": _label(new_name)}]])
            return self._state.records[rec.id].memory()

    def alias_note(self, name: str, alias: str) -> Memory:
        """Add an alias (resolution only, not searchable). Raises NotFoundError, ValidationError
        (the alias is a name or alias of a memory, this one's included)."""
        with self._lock:
            rec = self._require_note(name)
            if len(rec.aliases) >= MAX_ALIASES:
                raise ValidationError(f"a note has at most {MAX_ALIASES} aliases", field="alias")
            self._commit([["update", rec.id, {"aliases": [*rec.aliases, self._free_label(alias)]}]])
            return self._state.records[rec.id].memory()

    def rewrite_note(self, name: str, content: str) -> Memory:
        """New content for a note; the old version stays in its history."""
        with self._lock:
            rec = self._require_note(name)
            return self.correct(rec.id, content)

    def remove_note(self, name: str) -> bool:
        """Forget a note by name or alias, and every earlier version of it (what it
        superseded, down the chain: a removed note's old contents must not linger,
        hidden, in exports and ``include_superseded`` results); False if there is none."""
        self._require_open()
        with self._lock:
            memory_id = self._note_holder(_text(name, "name"))
            if memory_id is None:
                return False
            self._commit([["del", i] for i in [memory_id, *self._earlier_versions(memory_id)]])
            return True

    def _earlier_versions(self, memory_id: str) -> list[str]:
        """The ids of the memories ``memory_id`` superseded, directly or down their chains."""
        replaced_by: dict[str, list[str]] = {}
        for rec in self._state.records.values():
            if rec.superseded_by is not None:
                replaced_by.setdefault(rec.superseded_by, []).append(rec.id)
        found, todo = [], list(replaced_by.get(memory_id, ()))
        while todo:
            old = todo.pop()
            if old != memory_id and old not in found:
                found.append(old)
                todo.extend(replaced_by.get(old, ()))
        return found

    def _require_note(self, name: str) -> Record:
        self._require_open()
        memory_id = self._note_holder(_text(name, "name"))
        if memory_id is None:
            raise NotFoundError(f"no note named {name!r}", memory_id=name)
        return self._state.records[memory_id]

    def _note_holder(self, label: str) -> str | None:
        """The id of the live memory named or aliased ``label`` (case-insensitive), or None.
        An expired note the hourly sweep has not deleted yet holds nothing: readers never
        see it (``get``), so its name must not answer nor stay taken until the sweep."""
        memory_id = self._state.names.get(label.casefold())
        rec = self._state.records.get(memory_id) if memory_id else None
        return memory_id if rec is not None and not rec.expired(time.time()) else None

    # -- archives ----------------------------------------------------------------------------

    def archive_conversation(self, summary: str, until: Any = None, name: str | None = None,
                             owner: str | None = None) -> Memory:
        """Record a summary (written by the app's LLM) of the conversation up to ``until``
        (default now) as an archive: a fact that never expires, searched like facts.
        A compact marker is appended to the context window."""
        self._require_open()
        covers = _epoch_or_now(until)
        prepared = self.prepare([{"content": summary, "memory_type": MemoryType.FACT,
                                  "metadata": {"archive": True}}])
        with self._lock:
            op = prepared.ops[0]
            row = dict(op[1]) | {"covers_until": covers, "owner": owner} | self._name_fields(name, ())
            marker = f"[archived conversation: {_flat(summary)[:ARCHIVE_MARKER]}]"
            self._commit([["put", row, op[2]], ["win", "system", marker, time.time()]])
            return self._state.records[row["id"]].memory()

    # -- import (the round trip of export) -------------------------------------------------------

    def import_memories(self, memories: Sequence[Mapping[str, Any]], people: Sequence[Mapping[str, Any]] = (),
                        batch: int = 200) -> dict[str, int]:
        """Recreate exported persons and memories with their ids, times, subjects, names and
        supersession links (ids already present are kept as they are), and the person ids
        merged away (a person's ``merged_ids``: each resolves to that person again, see
        :meth:`_redirect_ops`).  Everything is checked before anything is written.  A
        memory about a person its owner may not see (``people.may_be_about``) is imported
        without that link, reported (:meth:`commit_import`).
        Returns the counts imported and the links left out (summed over the batches).
        Raises ValidationError naming the entry at fault, or for ``batch`` not a positive int."""
        memories, people = _entries(memories, "memories"), _entries(people, "people")  # an iterator: read once
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValidationError(f"batch must be a positive number of memories, not {batch!r}", field="batch")
        person_ops = [_person_op(f"person {n}", p) for n, p in enumerate(people)]  # all checked before any write
        merged = check_merged_ids("import", people)
        rows = self._import_rows(memories)
        done: dict[str, Any] = {"people": 0, "memories": 0, "links_left_out": 0, "left_out_links": []}
        for start in range(0, max(len(rows), 1), batch):
            first = not start
            got = self.commit_import(self._prepare_rows(rows[start:start + batch], person_ops if first else [],
                                                        merged if first else {}))
            done = {k: done[k] + got[k] for k in done}  # counts added, left-out links in order
        return done

    def prepare_import(self, memories: Sequence[Mapping[str, Any]],
                       people: Sequence[Mapping[str, Any]] = ()) -> _Import:
        """The checked, embedded half of an import (thread-safe: the daemon runs it on its
        embed thread, so an import does not hold the engine while it embeds).  Memories
        already present are left out.  Raises ValidationError naming the entry at fault
        (as :meth:`import_memories` does)."""
        self._require_open()
        memories, people = _entries(memories, "memories"), _entries(people, "people")
        person_ops = [_person_op(f"person {n}", p) for n, p in enumerate(people)]
        return self._prepare_rows(self._import_rows(memories), person_ops, check_merged_ids("import", people))

    def _import_rows(self, memories: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Every memory checked (their supersession links too) as record fields, oldest
        first: a conversation turn links to the turn before it as it is stored."""
        check_supersession("import", memories)
        check_note_names("import", memories)
        rows = [check_import_memory(f"memory {n}", m, self._config) for n, m in enumerate(memories)]
        self._check_names_free(rows)
        self._check_no_loop_with_stored(rows)
        return sorted(rows, key=lambda r: r["created"])

    def _check_no_loop_with_stored(self, rows: list[dict[str, Any]]) -> None:
        """Raise ValidationError if the ``superseded_by`` links of rows not stored yet close a
        loop through stored memories (a stored A left pointing at a forgotten B, and the
        import's B superseded by A: both hidden, and the store's export then refused by
        import).  Each link is followed once (``check_supersession``, with the store)."""
        after = {r["id"]: r.get("superseded_by") for r in rows if r["id"] not in self._state.records}

        def link(node: str) -> str | None:  # the import's link, else the stored memory's
            stored = self._state.records.get(node)
            return after.get(node, stored.superseded_by if stored is not None else None)

        loop = _supersession_loop(after, link)
        if loop:
            raise ValidationError(f"import: superseded_by links loop through stored memories ({' -> '.join(loop)})"
                                  ": every memory in it would be superseded by another of them", field="superseded_by")

    def _check_names_free(self, rows: list[dict[str, Any]]) -> None:
        """Raise ValidationError if a row not stored yet names its note by a name or alias
        a stored memory holds: two notes of one name, ``note()`` answering whichever the
        names index saw last (not the same after a reload)."""
        for row in rows:
            if row["id"] in self._state.records:
                continue  # kept as it is
            for label in note_labels(row):
                taken = self._note_holder(label)
                if taken is not None and taken != row["id"]:
                    raise ValidationError(f"import: memory {row['id']}: the note name or alias {label!r} is "
                                          f"already used by memory {taken}", field="name")

    def _seen_subjects(self, row: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """(the subjects an imported ``row`` is stored with, the person ids left out): its
        ids as they are now (``_current_ids``) but a person its owner may not see
        (``people.may_be_about``; the person as stored: :meth:`commit_import` calls it
        after writing the import's persons).  Ids the store does not know stay."""
        kept: list[str] = []
        left_out: list[str] = []
        for person_id in self._current_ids(row.get("subjects", [])):
            person = self._people.get(person_id)
            seen = person is None or may_be_about(person, row.get("owner"))
            (kept if seen else left_out).append(person_id)
        return kept, left_out

    def _check_anchors(self, person_ops: list[dict[str, Any]]) -> None:
        """Raise ValidationError if a person not stored yet would take an external id a
        stored person, or an earlier one of ``person_ops``, holds: two persons for one face,
        and every later update of one of them refused (``external_id`` must be unique)."""
        seen: dict[str, str] = {}
        for op in person_ops:
            external = op.get("external_id")
            if external is None or self._people.get(op["id"]) is not None:
                continue  # a stored person is kept as it is
            holder = self._people.find_by_external_id(external)
            holder_id = holder.id if holder is not None else seen.setdefault(external, op["id"])
            if holder_id != op["id"]:
                raise ValidationError(f"import: person {op['id']}: external_id {external!r} already belongs to "
                                      f"{holder_id}", field="external_id")

    def _prepare_rows(self, rows: list[dict[str, Any]], person_ops: list[dict[str, Any]],
                      merged: dict[str, str]) -> _Import:
        """Embed the checked ``rows`` not stored yet (those present are kept as they are)."""
        self._check_anchors(person_ops)
        self._redirect_ops(merged, [op for op in person_ops if self._people.get(op["id"]) is None])  # refused early
        rows = [r for r in rows if r["id"] not in self._state.records]
        items = [{"content": r["content"], "memory_type": r["type"], "metadata": r.get("metadata"), "id": r["id"],
                  "created_at": r["created"], "owner": r.get("owner"), "shared": r.get("shared", False)}
                 for r in rows]  # owned: a turn borrows the previous turn's words by its owner (_ingest.lends_to)
        ops = self.prepare(items, imported=True).ops if items else []
        return _Import(person_ops, rows, {op[1]["id"]: op for op in ops}, merged)

    def _redirect_ops(self, merged: Mapping[str, str], fresh: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The ``person_merge`` ops (``other`` absent: a redirect only) making each merged-away
        id of an import (``merged``: old id -> the imported person it was merged into)
        resolve to that person as stored: one of ``fresh`` (the import's new persons,
        journaled just before) or the stored person it is now.  An id already redirected
        here is kept as it is.  Raises ValidationError: an id that is a live person's
        (stored or imported), or a person neither the import nor the store knows."""
        new = {op["id"] for op in fresh}
        ops = []
        for old, target in merged.items():
            if old in new or self._people.is_live(old):
                raise ValidationError(f"import: person id {old} is merged into {target} in the import, but it is a "
                                      "live person here: import into a store without it", field="merged_ids")
            if self._people.get(old) is not None:
                continue  # redirected already: kept as it is
            known = self._people.get(target)
            keep = target if target in new else known.id if known is not None else None
            if keep is None:
                raise ValidationError(f"import: person id {old} is merged into {target}, a person neither the import "
                                      "nor the store knows", field="merged_ids")
            ops.append({"op": "person_merge", "keep": keep, "other": old, "at": time.time()})
        return ops

    def commit_import(self, prepared: _Import) -> dict[str, Any]:
        """Write a :meth:`prepare_import`: its new persons, then its memories not stored
        since, in one frame each.  A memory about a person its owner may not see
        (``people.may_be_about``: a file written before that rule held, or edited) is
        imported without that link, about the other persons it names or nobody: decided
        here, with the persons as stored (kept as they are, owner included; an owner may
        have changed since ``prepare_import``).  Returns ``{"people", "memories"}`` (the
        counts imported), ``"links_left_out"`` (how many links) and ``"left_out_links"``
        (``[{"memory_id", "person_id"}]``, in import order).  A memory already present is
        kept as it is: an import done twice leaves nothing out the second time."""
        self._require_open()
        with self._lock:
            self._check_names_free(prepared.rows)  # again: a note may have been named since prepare_import
            self._check_no_loop_with_stored(prepared.rows)  # and a memory superseded or forgotten
            self._check_anchors(prepared.person_ops)  # and a face anchored
            fresh_people = [op for op in prepared.person_ops if self._people.get(op["id"]) is None]
            redirects = self._redirect_ops(prepared.merged, fresh_people)  # again: a person may have come since
            if fresh_people or redirects:
                self._commit([*fresh_people, *redirects])  # one frame: a redirect never without its person
            ops, left_out = [], []
            for row in prepared.rows:
                op = prepared.ops.get(row["id"])
                if op is None or row["id"] in self._state.records:
                    continue
                fields = {k: v for k, v in row.items() if k not in ("content", "type", "metadata", "created")}
                fields["subjects"], unseen = self._seen_subjects(row)  # the persons as stored now
                left_out += [{"memory_id": row["id"], "person_id": p} for p in unseen]
                ops.append(["put", dict(op[1]) | fields, op[2]])
            hidden = {row["id"] for row in prepared.rows if row.get("superseded_at") is not None}
            for op in ops:  # a turn imported superseded lends no text to the one after it
                if op[1].get("follows") in hidden:
                    op[1]["previous_text"] = None
            if ops:
                self._commit(ops)
            return {"people": len(fresh_people), "memories": len(ops), "links_left_out": len(left_out),
                    "left_out_links": left_out}

    def _current_ids(self, person_ids: Iterable[str]) -> list[str]:
        """Person ids as they are now: one merged into another since is the kept one's (as
        ``merge_people`` relinks the stored memories); ids the store does not know stay."""
        return _unique(p.id if (p := self._people.get(i)) is not None else i for i in person_ids)

    # -- one-call context ---------------------------------------------------------------------

    def context_for(self, message: str, owner: str | None = None, max_tokens: int = 800, max_memories: int = 10,
                    max_messages: int = 5, min_similarity: float = 0.3) -> RetrievedContext:
        """Everything a prompt needs about ``message``: the window, relevant past messages
        (above ``min_similarity``), relevant memories, known people, and ``.text`` with
        source and subject attribution, cut to ``max_tokens`` (the embedder's tokens)."""
        self._require_open()
        ingest.validate_text(message, "message", self._config)
        qvec = self.embed_query(message)
        facts = self.search_vector(message, qvec, MemoryType.FACT, max(max_memories, 1), 0.0, owner=owner)
        context = self.search_vector(message, qvec, MemoryType.CONTEXT, max(max_memories, 1), 0.0, owner=owner)
        past = self.search_vector(message, qvec, MemoryType.CONVERSATION, max(max_messages * 2, 1), 0.0,
                                  owner=owner)
        window = [Turn(t["role"], t["content"]) for t in self.get_context_window()]
        return build_context(window=window, messages=[_item(h) for h in past],
                             memories=[_item(h) for h in facts + context], people=self.people(owner),
                             count_tokens=self._token_counter(), max_tokens=max_tokens, max_memories=max_memories,
                             max_messages=max_messages, min_similarity=min_similarity,
                             tz=self._tz)  # dated as the user's day, not UTC's

    def _token_counter(self) -> CountTokens:
        """The embedder's own tokenizer, or an estimate in lexical-only mode."""
        if self._count_tokens is None:
            self._count_tokens = approximate_tokens
            if getattr(self, "_embedder", None) is not None:
                try:
                    self._count_tokens = token_counter(tokenizer_path(self._config))
                except ReachyMemoryError as exc:
                    log.warning("counting prompt tokens approximately: %s", exc)
        return self._count_tokens

    def _about_ids(self, about: str | None, owner: str | None) -> list[str] | None:
        """The person ids ``about`` names; None (no filter) when it names nobody known."""
        if about is None:
            return None
        person = self._people.find_person(_text(about, "about"), owner)
        if person is None:
            log.info("search about %r: no such person, results are not filtered", about)
            return None
        return [person.id]

    def _named_slots(self, person_ids: list[str] | None) -> set[int]:
        """Slots whose ``metadata.person`` (spec 000's way of saying who a memory is
        about: ``store(..., {"person": "Sarah"})``, the robot bridge) names one of these
        persons by name or alias, in any case: ``about=`` finds them beside the memories
        whose ``subjects`` hold the person."""
        if not person_ids:
            return set()
        people = (self._people.get(p) for p in person_ids)
        names = {norm(n) for person in people if person is not None for n in (person.name, *person.aliases) if n}
        values = self._state.fields.string_values(PERSON_FIELD)  # live or not: keep the live ones
        slots = set().union(*(slots for value, slots in values.items() if norm(value) in names))
        return {slot for slot in slots if slot in self._state.by_slot}

    def subject_names(self, rec: Record, owner: str | None = None) -> tuple[str, ...]:
        """Display names of a memory's persons, as they are now; with ``owner``, only the
        persons that user knows (theirs and the household's): a fact another user shared
        about one of their own persons ("my therapist") does not give away that person's name."""
        people = (self._people.get(p) for p in rec.subjects)
        return tuple(p.display_name for p in people if p is not None and visible_to(p, owner))


def _named_in(content: str) -> set[tuple[str | None, str | None, str | None]]:
    """Who a sentence names (names, relations, pronouns), for facts about nobody: "Mom likes
    coffee" and "Dad does not like coffee" (stored with ``subjects=[]``, store_memory without
    ``metadata.person``) are about different people, and neither supersedes the other."""
    return {(norm(r.name) if r.name else None, r.relation, r.pronoun)
            for r in (m.reference for m in extract_mentions(content))}


def _enriched(reference: str, content: str) -> str:
    """A bare relation ("my wife") completed with the name the fact gives it
    ("my wife's name is Sarah" -> "my wife Sarah"), so the person learns it."""
    ref = parse_reference(reference)
    if ref.name or not ref.relation:
        return reference
    for mention in extract_mentions(content):
        found = mention.reference
        if found.relation == ref.relation and found.name:
            return f"my {ref.relation} {found.name}"
    return reference


_IMPORT_OPTIONAL = {"expires_at": "expires", "superseded_at": "superseded_at", "covers_until": "covers_until"}


@dataclass(frozen=True)
class _Import:
    """A checked, embedded import waiting for the engine (see ``prepare_import``)."""

    person_ops: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    ops: dict[str, list[Any]]  # by memory id: the prepared put
    merged: dict[str, str]  # merged-away person id -> the imported person it was merged into


def _entries(given: Any, field: str) -> list[Any]:
    """``given`` (a list, tuple or other iterable of entries) as a list, read once: an
    iterator checked first and imported after would import nothing.  Raises
    ValidationError naming ``field`` for None, a mapping, text or a non-iterable."""
    if isinstance(given, Mapping | str | bytes) or not isinstance(given, Iterable):
        raise ValidationError(f"{field} must be a list of exported entries, not {type(given).__name__}", field=field)
    return list(given)


def check_supersession(source: str, memories: Sequence[Any]) -> None:
    """Refuse ``superseded_by`` links that loop (a memory superseded by itself, or A by
    B and B by A): each memory of the loop would point past the other, and those
    marked superseded would all be hidden with no current one to show.
    ValidationError naming ``source`` and the loop.  Links to memories outside
    ``memories`` are not followed (they may be stored already)."""
    after: dict[str, str] = {m["id"]: m["superseded_by"] for m in memories
             if isinstance(m, Mapping) and isinstance(m.get("id"), str) and isinstance(m.get("superseded_by"), str)}
    loop = _supersession_loop(after, after.get)
    if loop:
        raise ValidationError(f"{source}: superseded_by links loop ({' -> '.join(loop)}): every memory in it "
                              "would be superseded by another of them", field="superseded_by")


def _supersession_loop(starts: Iterable[str], link: Callable[[str], str | None]) -> list[str] | None:
    """The first loop of ``superseded_by`` links walked from ``starts`` (``link``: the id a
    memory is superseded by, or None), as its ids ending with the first again; None when
    every chain ends.  Each id is walked once: linear in the links, however long a chain."""
    cleared: set[str] = set()  # ids whose chain was walked to its end
    for start in starts:
        path: dict[str, None] = {}  # ordered, with set lookups
        node: str | None = start
        while node is not None and node not in cleared and node not in path:
            path[node] = None
            node = link(node)
        if node is not None and node in path:
            walked = list(path)
            return [*walked[walked.index(node):], node]
        cleared.update(path)
    return None


def check_note_names(source: str, memories: Sequence[Any]) -> None:
    """Refuse a note name or alias (case aside) given to two memories of ``memories``:
    ValidationError naming ``source``, the label and both ids.  Names stored already
    are the store's to check (``import_memories``)."""
    holders: dict[str, str] = {}
    for m in memories:
        if not isinstance(m, Mapping) or not isinstance(m.get("id"), str):
            continue  # refused by check_import_memory
        for label in note_labels(m):
            holder = holders.setdefault(label.casefold(), m["id"])
            if holder != m["id"]:
                raise ValidationError(f"{source}: the note name or alias {label!r} is given to memories {holder} "
                                      f"and {m['id']}", field="name")


def note_labels(memory: Mapping[str, Any]) -> list[str]:
    """A memory's note name and aliases (the strings among them), as its record keeps them."""
    aliases = memory.get("aliases")
    labels = [memory.get("name"), *(aliases if isinstance(aliases, list | tuple) else ())]
    return [label for label in labels if isinstance(label, str) and label]


def check_import_memory(where: str, memory: Any, config: Config) -> dict[str, Any]:
    """One exported memory as the record fields import writes, checked as a store would
    (text, type, metadata, times, links); ValidationError starting with ``where`` otherwise."""
    try:
        row = _import_row(where, memory)
        ingest.validate_item({"content": row["content"], "memory_type": row["type"],
                              "metadata": row.get("metadata"), "id": row["id"]}, config, imported=True)
    except ValidationError as exc:
        if exc.message.startswith(f"{where}:"):
            raise
        raise type(exc)(f"{where}: {exc.message}", **exc.fields) from exc
    return row


def check_import_person(where: str, person: Any) -> None:
    """Raise ValidationError (starting with ``where``) if import would refuse this person
    (its ``merged_ids`` included)."""
    _person_op(where, person)


def check_merged_ids(source: str, people: Sequence[Any]) -> dict[str, str]:
    """The person ids merged away that exported ``people`` carry (each person's
    ``merged_ids``; none in exports written before them), each mapped to the person it
    was merged into.  Raises ValidationError naming ``source``: malformed ``merged_ids``
    (:func:`merged_ids_of`), an id that is also a person of ``people``, or an id merged
    into two persons.  Whether an id is a live person in the store is the store's
    to check (``import_memories``)."""
    persons = [p for p in people if isinstance(p, Mapping)]  # others: refused by check_import_person
    ids = {p.get("id") for p in persons}
    merged: dict[str, str] = {}
    for p in persons:
        for old in merged_ids_of(f"{source}: person {p.get('id')}", p):
            if old in ids:
                raise ValidationError(f"{source}: person id {old} is a person of the import and merged into "
                                      f"{p['id']}", field="merged_ids")
            if merged.setdefault(old, p["id"]) != p["id"]:
                raise ValidationError(f"{source}: person id {old} is merged into both {merged[old]} and {p['id']}",
                                      field="merged_ids")
    return merged


def merged_ids_of(where: str, p: Mapping[str, Any]) -> list[str]:
    """A person's ``merged_ids``: ids as a person's are (no whitespace around them), not
    its own.  Missing or None: none.  Raises ValidationError starting with ``where``."""
    value = p.get("merged_ids")
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValidationError(f"{where}: merged_ids must be a list of person ids", field="merged_ids")
    for old in value:
        check_unicode(ingest.check_label(old, "merged_ids", f"{where}: "), "merged_ids")
        if old != old.strip() or old == p.get("id"):
            raise ValidationError(f"{where}: merged_ids holds {old!r}: not another person's id", field="merged_ids")
        _exact_person_id(where, old, "merged_ids")  # a control character: no operation could name it
    return list(value)


def _import_row(where: str, m: Any) -> dict[str, Any]:
    """One exported memory (``Memory.to_dict`` or its wire form) as record fields, checked."""
    if not isinstance(m, Mapping) or not isinstance(m.get("id"), str) or not isinstance(m.get("content"), str):
        raise ValidationError(f"{where}: needs an id and content", field="memories")
    row: dict[str, Any] = {"id": m["id"], "content": m["content"],
                           "type": MemoryType.parse(m.get("type", "fact")).value,
                           "metadata": m.get("metadata") or {},
                           "created": _when(where, m.get("created_at"), "created_at")}
    for key, field in _IMPORT_OPTIONAL.items():
        if m.get(key) is not None:
            row[field] = _when(where, m[key], key)
    check_unicode(row["id"], "id")  # here, not at the journal write (after earlier requests were stored)
    for key in ("owner", "name", "superseded_by"):
        if m.get(key) is not None:
            row[key] = check_unicode(ingest.check_label(m[key], key, f"{where}: "), key)
    for key, limit in (("subjects", 64), ("aliases", MAX_ALIASES)):
        values = m.get(key) or []
        if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values) or len(values) > limit:
            raise ValidationError(f"{where}: {key} must be a list of at most {limit} strings", field=key)
        row[key] = list(values)
    _check_import_labels(where, row)
    for key in ("shared", "protected"):
        if not isinstance(m.get(key, False), bool):
            raise ValidationError(f"{where}: {key} must be true or false", field=key)
        row[key] = bool(m.get(key, False))
    return row


def _check_import_labels(where: str, row: Mapping[str, Any]) -> None:
    """Refuse labels no store operation writes: a note name or alias with whitespace around
    it (``remember`` strips them) or over :data:`MAX_NAME_CHARS`, aliases without a note
    name, a subject that is not a person id as ``people.read_person_id`` reads one (no
    whitespace around, no control character, at most 200 characters).  ValidationError
    starting with ``where`` and naming the field."""
    if row.get("aliases") and row.get("name") is None:
        raise ValidationError(f"{where}: aliases need a note name", field="aliases")
    for key, label in [("name", row.get("name")), *(("aliases", a) for a in row.get("aliases", ()))]:
        if label is not None and (not label.strip() or label != label.strip() or len(label) > MAX_NAME_CHARS):
            raise ValidationError(f"{where}: {key} {label[:40]!r} is not a note name (1 to {MAX_NAME_CHARS} "
                                  "characters, no whitespace around it)", field=key)
        check_unicode(label or "", key)
    for subject in row.get("subjects", ()):
        _exact_person_id(where, subject, "subjects")


def _exact_person_id(where: str, value: str, field: str) -> None:
    """Refuse a person id that ``people.read_person_id`` would not read back as itself (no
    operation could name it). ValidationError starting with ``where``, naming ``field``."""
    try:
        ok = read_person_id(value, field) == value
    except ValidationError as exc:
        raise ValidationError(f"{where}: {exc.message}", field=field) from exc
    if not ok:
        raise ValidationError(f"{where}: {field} {value[:40]!r}: a person id must not start or end with "
                              "whitespace", field=field)


def _when(where: str, value: Any, field: str) -> float:
    from datetime import datetime

    from reachy_memory.model import check_time

    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValidationError(f"{where}: {field} {value!r} is not a time", field=field) from exc
    epoch = check_time(value, field)
    if epoch is None:
        raise ValidationError(f"{where}: {field} is missing", field=field)
    return epoch


def _person_op(where: str, p: Any) -> dict[str, Any]:
    """The ``person_put`` op recreating an exported person (checked; its metadata as a
    caller's: ``people.check_metadata``)."""
    if not isinstance(p, Mapping):
        raise ValidationError(f"{where}: not a map", field="people")
    for key in ("name", "relation"):  # person_from_op would store None or 5 as the text 'None' / '5'
        if p.get(key) is not None and not isinstance(p[key], str):
            raise ValidationError(f"{where}: {key} must be a string", field="people")
    if not (p.get("name") or p.get("relation")):
        raise ValidationError(f"{where}: a person needs a name or a relation", field="people")
    if isinstance(p.get("id"), str):  # one no operation could name (read_person_id) is refused
        _exact_person_id(where, p["id"], "id")
    merged_ids_of(where, p)
    op = {"op": "person_put", **{k: p.get(k) for k in ("id", "name", "relation", "aliases", "owner",
                                                      "external_id", "metadata")}}
    op["name"] = op["name"] or ""  # a relation only ("my wife"): no name, as the registry keeps it
    op["created_at"] = _when(where, p.get("created_at"), "created_at")
    op["updated_at"] = _when(where, p.get("updated_at") or p.get("created_at"), "updated_at")
    try:
        op["metadata"] = check_metadata(op["metadata"])
        return person_from_op(op).to_op()
    except ValidationError as exc:
        raise ValidationError(f"{where}: {exc.message}", field="people") from exc


def _item(hit: SearchResult) -> ContextItem:
    m = hit.memory
    kind = "archive" if m.is_archive else m.memory_type.value
    role = m.metadata.get("role") if isinstance(m.metadata.get("role"), str) else None
    return ContextItem(m.content, kind, m.created_at, hit.score, hit.subject_names, m.id, role)


def _fact_items(content: str | None, facts: Sequence[Mapping[str, Any]] | None, subjects: Sequence[str] | None,
                expires_in_days: float | None, shared: bool, name: str | None,
                aliases: Sequence[str], memory_id: str | None = None) -> list[dict[str, Any]]:
    """The facts of a ``remember`` call, each a checked dict (its id checked by ``prepare``)."""
    if (content is None) == (facts is None):
        raise ValidationError("give either content or facts", field="content")
    if facts is None:
        facts = [{"content": content, "name": name, "aliases": aliases, "id": memory_id}]
    elif name is not None or aliases:
        raise ValidationError("with facts, a note name and aliases go inside the fact they name", field="name")
    elif memory_id is not None:
        raise ValidationError("with facts, each fact's id goes inside it", field="id")
    if isinstance(facts, str | bytes | Mapping) or not facts:
        raise ValidationError("facts must be a non-empty list of dicts", field="facts")
    # The other top-level arguments are defaults for every fact that does not give its own.
    defaults = {"shared": shared, "subjects": subjects, "expires_in_days": expires_in_days}
    return [_check_fact(f, defaults) for f in facts]


def _check_fact(fact: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(fact, Mapping) or "content" not in fact:
        raise ValidationError("each fact must be a dict with content", field="facts")
    unknown = set(fact) - FACT_KEYS
    if unknown:
        raise ValidationError(f"unknown fact keys: {sorted(unknown, key=str)}", field="facts")
    item = {k: v for k, v in defaults.items() if v is not None} | {k: v for k, v in fact.items() if v is not None}
    refs = item.get("subjects") or []
    if isinstance(refs, str) or not isinstance(refs, list | tuple) or len(refs) > MAX_SUBJECTS:
        raise ValidationError(f"subjects must be a list of at most {MAX_SUBJECTS} references", field="subjects")
    days = item.get("expires_in_days")
    if days is not None and (isinstance(days, bool) or not isinstance(days, int | float)
                             or not math.isfinite(days) or not 0 < days <= 36500):
        raise ValidationError("expires_in_days must be a number of days from 0 to 36500", field="expires_in_days")
    if not isinstance(item.get("shared", False), bool):
        raise ValidationError("shared must be true or false", field="shared")
    return item


def _same_fact(old: Record, new: Record) -> bool:
    """Whether ``new`` only repeats ``old`` (already about the same persons and owner):
    the same text but for spacing (case matters: "Blue42Sky" is not "blue42sky"), told
    within :data:`REPEAT_SECONDS` (a model's retry; "Sarah visited today" a week later is
    another event), the same sharing and metadata, neither a note nor expiring."""
    return (_flat(old.content) == _flat(new.content) and 0 <= new.created - old.created <= REPEAT_SECONDS
            and old.shared == new.shared and old.metadata == new.metadata and old.name is None
            and new.name is None and old.expires is None and new.expires is None)


def _supersede_fields(by: str, at: float) -> dict[str, Any]:
    return {"superseded_at": at, "superseded_by": by}


def _supersede_op(old_id: str, new_id: str, at: float) -> list[Any]:
    return ["update", old_id, _supersede_fields(new_id, at)]


def _unique(values: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _unique_ops(ops: Iterable[dict[str, Any] | None]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for op in ops:
        if op is not None:
            seen[op["id"]] = op
    return list(seen.values())


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 4000:
        raise ValidationError(f"{field} must be a non-empty string of at most 4000 characters", field=field)
    return value


def _label(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_CHARS:
        raise ValidationError(f"a note name or alias must be a non-empty string of at most {MAX_NAME_CHARS} "
                              "characters", field="name")
    return check_unicode(value.strip(), "name")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _epoch_or_now(value: Any) -> float:
    if value is None:
        return time.time()
    from reachy_memory.model import check_time, to_epoch

    epoch = to_epoch(value)
    checked = check_time(epoch, "until")
    assert checked is not None
    return checked


def _household_owner(household: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with ``owner`` None when ``household`` is True, else as given.  Raises
    ValidationError (field "household") for a ``household`` that is not a bool, or True
    beside an owner: the household's and a user's at once is no one change."""
    if not isinstance(household, bool):
        raise ValidationError(f"household must be a bool, got {type(household).__name__}", field="household")
    if not household:
        return fields
    if fields.get("owner") is not None:
        raise ValidationError(f"household=True makes the person the household's (no owner) and owner "
                              f"{fields['owner']!r} gives them to a user: give one of them, not both",
                              field="household", owner=fields["owner"])
    return fields | {"owner": None}
