"""Facts about people: remember, recall, correct, confirm, supersede, history.

:class:`Facts` writes through the engine's funnel: a new person and the memory
about it in one frame, so a crash never leaves one without the other.

Supersession (automatic, when a FACT is remembered): the candidates are the
live, unprotected, unnamed facts in the same owner scope whose subjects are exactly the
new fact's, the ten closest by cosine; :func:`~reachy_memory.engine.supersession.decide`
says which of them the new fact replaces.  Lexical-only stores (no vectors) do not
supersede automatically: a wrong supersession hides a true fact, and the rule
was only measured with embeddings.  ``correct`` always supersedes.

Owns ``recent_subjects`` (the persons the last facts of each owner were about, for
"she likes ..."), engine thread only.  The records, persons and indexes are the
engine state's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from reachy_memory.engine import dedupe, ingest
from reachy_memory.engine.mentions import extract_mentions, norm, parse_reference
from reachy_memory.engine.ports import Component, Engine
from reachy_memory.engine.records import Record
from reachy_memory.engine.supersession import decide
from reachy_memory.errors import NotFoundError, ValidationError
from reachy_memory.model import SEARCH_LIMIT, Memory, MemoryType, SearchResult
from reachy_memory.people.checks import flat, text_arg, unique
from reachy_memory.people.notes import name_fields
from reachy_memory.people.registry import Resolution

MAX_SUBJECTS = 16
CANDIDATES = 10  # older facts checked for supersession per new fact
REPEAT_SECONDS = 3600.0  # a fact told again within this is the same telling (see _same_fact)
FACT_KEYS = frozenset({"content", "subjects", "name", "aliases", "shared", "expires_in_days", "metadata", "id"})


class Facts(Component):
    """The fact operations of :class:`~reachy_memory.engine.store.MemoryStore` (see the module doc)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.recent_subjects: dict[str | None, list[str]] = {}  # engine thread: persons of the last facts

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
        self._engine.require_open()
        items = _fact_items(content, facts, subjects, expires_in_days, shared, name, aliases, id)
        # owner and sharing too: a retry is recognised (check_duplicate) by what its id's memory holds
        prepared = self._engine.prepare([{"content": i["content"], "memory_type": MemoryType.FACT,
                                  "metadata": i.get("metadata"), "id": i.get("id"), "owner": owner,
                                  "shared": bool(i.get("shared"))} for i in items])
        with self._lock:
            # all or nothing: a refusal in fact 3, or a full disk, must not leave facts 1-2 stored
            self._engine.check_retries_still_stored(prepared)
            kept = self._kept_facts(items, prepared.ids, owner)
            self._check_facts([item for item, i in zip(items, prepared.ids, strict=True) if i not in kept], owner)
            ops = {op[1]["id"]: op for op in prepared.ops}
            recent = dict(self.recent_subjects)
            try:
                with self._engine.one_frame():  # one journal frame: a full disk stores none of them
                    return [self._remembered(item, memory_id, ops, owner)
                            for item, memory_id in zip(items, prepared.ids, strict=True)]
            except BaseException:
                self.recent_subjects = recent
                raise

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
            fields = name_fields(self._state, item.get("name"), item.get("aliases") or ())
            labels = {label.casefold(): label for label in (fields.get("name"), *fields.get("aliases", ())) if label}
            again = next((label for key, label in labels.items() if key in names), None)
            if again is not None:
                raise ValidationError(f"the note name or alias {again!r} is given to two facts", field="name")
            names |= labels

    def _remember_one(self, item: dict[str, Any], op: list[Any], owner: str | None) -> Memory:
        """Resolve persons, build the record, find what it supersedes; one frame. Engine thread."""
        resolutions = self._subjects_of(item, owner)
        person_ops = _unique_ops(r.op for r in resolutions)
        subject_ids = unique(r.person.id for r in resolutions if r.person is not None)
        row = dict(op[1]) | {"subjects": subject_ids, "owner": owner, "shared": bool(item.get("shared"))}
        if item.get("expires_in_days") is not None:
            row["expires"] = row["created"] + float(item["expires_in_days"]) * 86400.0
        row |= name_fields(self._state, item.get("name"), item.get("aliases") or ())
        vector, new = op[2], Record(**row)
        similar = self._similar_facts(new, vector)
        same = self._told_again(new, similar, vector is None)
        if same is None:
            self._engine.commit([*person_ops, ["put", row, vector], *self._superseded_by(new, similar)])
        elif self._engine.config.memory.dedupe:  # a restatement: the kept fact refreshed, not a second copy
            limits = self._engine.dedupe_limits()
            self._engine.commit([*person_ops, ["update", same.id, dedupe.refreshed(
                same, new.metadata, new.created, max_bytes=limits.max_bytes, max_keys=limits.max_keys)]])
            same = self._state.records[same.id]
        elif person_ops:  # told again (a model's retry): the fact it already is, not a second copy
            self._engine.commit(person_ops)
        if subject_ids:
            self.recent_subjects[owner] = [*subject_ids, *self.recent_subjects.get(owner, [])][:8]
        return (same or self._state.records[row["id"]]).memory()

    def _told_again(self, new: Record, similar: list[tuple[Record, float]], wordless: bool) -> Record | None:
        """The kept fact ``new`` restates, among the facts about its persons most like it
        (:func:`.dedupe.same`, with ``memory.dedupe``; a decayed one is refreshed too; without
        a vector, ``wordless``, the same text once normalized among the facts of the most
        words in common), or without ``memory.dedupe`` only its exact repeat within
        :data:`REPEAT_SECONDS` (:func:`_same_fact`)."""
        if self._engine.config.memory.dedupe:
            limits = self._engine.dedupe_limits()
            if wordless:
                found = dedupe.worded_restatement(new, self._state.lexical, self._state.by_slot, limits.entity_keys,
                                                  new.created, limits.bm25_b)
                return found[0] if found is not None else None
            return next((rec for rec, sim in similar[:CANDIDATES]
                         if dedupe.same(rec, new, sim, limits.entity_keys).same), None)
        return next((rec for rec, _ in similar[:CANDIDATES]
                     if _same_fact(rec, new) and not self._engine.decayed(rec, new.created)), None)

    def _subjects_of(self, item: dict[str, Any], owner: str | None) -> list[Resolution]:
        refs = item.get("subjects")
        if refs is not None:  # given: only those persons; [] or only "me"/"the user": a fact about nobody
            return [self._people.resolve_person(_enriched(text_arg(r, "subjects"), item["content"]), owner,
                                                for_memory=True)  # a name: among the persons it may be about
                    for r in refs if self._people.check_subject(r, owner)]
        recent = self.recent_subjects.get(owner, [])
        return self._people.subjects_in(item["content"], owner, recent)

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
        return self._engine.search(query, MemoryType.FACT, limit=limit, min_score=0.2, about=about, owner=owner,
                           include_superseded=include_superseded)

    def correct(self, memory_id: str, new_content: str) -> Memory:
        """Store the corrected fact (same subjects, owner, name) and supersede the old one.
        Returns the new memory. Raises NotFoundError, ValidationError."""
        self._engine.require_open()
        old = self._require_memory(memory_id)
        # its owner and sharing: a corrected turn borrows the previous turn's words by them
        prepared = self._engine.prepare([{"content": new_content, "memory_type": old.type, "metadata": old.metadata,
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
            self._engine.commit([["update", old.id, release | superseded], ["put", row, vector]])
            return self._state.records[row["id"]].memory()

    def _vector_in_place(self, row: dict[str, Any], embedded: str | None, vector: bytes | None) -> bytes | None:
        """The vector of a corrected turn as the turn it follows (``row["follows"]``) gives
        it, as the backfill and a reindex derive it: prepare embedded it with the store's
        newest turn instead.  Re-embedded when that text differs (None if the model fails
        now: the backfill embeds it later).  Engine thread, under the lock."""
        text = self._engine.stored_text(Record(**row))
        if embedded is None or text == embedded:
            return vector
        vectors = self._engine.embed([text])
        return vectors[0].astype(np.float32).tobytes() if vectors is not None else None

    def confirm(self, memory_id: str) -> Memory:
        """Mark a fact confirmed: never superseded automatically. Raises NotFoundError."""
        self._engine.require_open()
        with self._lock:
            rec = self._require_memory(memory_id)
            self._engine.commit([["update", rec.id, {"protected": True}]])
            return self._state.records[rec.id].memory()

    def supersede(self, old_id: str, new_id: str) -> Memory:
        """Explicitly mark ``old_id`` as replaced by ``new_id`` (both kept). Raises NotFoundError;
        ValidationError when ``new_id`` is ``old_id`` or already replaced, down its chain, by
        ``old_id``: a loop would hide every memory in it (and an import refuses one)."""
        self._engine.require_open()
        with self._lock:
            old, new = self._require_memory(old_id), self._require_memory(new_id)
            if old.id == new.id:
                raise ValidationError("a memory cannot supersede itself", field="new_id")
            if old.id in self._replaced_by(new):
                raise ValidationError(f"{new.id} is already superseded, down its chain, by {old.id}: "
                                      "the link would loop", field="new_id")
            self._engine.commit([_supersede_op(old.id, new.id, time.time())])
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
        self._engine.require_open()
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
        rec = self._state.records.get(text_arg(memory_id, "memory_id"))
        if rec is None:
            raise NotFoundError(f"no memory with id {memory_id!r}", memory_id=memory_id)
        return rec


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
    return (flat(old.content) == flat(new.content) and 0 <= new.created - old.created <= REPEAT_SECONDS
            and old.shared == new.shared and old.metadata == new.metadata and old.name is None
            and new.name is None and old.expires is None and new.expires is None)


def _supersede_fields(by: str, at: float) -> dict[str, Any]:
    return {"superseded_at": at, "superseded_by": by}


def _supersede_op(old_id: str, new_id: str, at: float) -> list[Any]:
    return ["update", old_id, _supersede_fields(new_id, at)]


def _unique_ops(ops: Iterable[dict[str, Any] | None]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for op in ops:
        if op is not None:
            seen[op["id"]] = op
    return list(seen.values())


def supersession_loop(starts: Iterable[str], link: Callable[[str], str | None]) -> list[str] | None:
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
