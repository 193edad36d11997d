"""Persons: who the robot's memories are about (spec 004, issue 10).

:class:`Person` is an immutable view; :class:`PersonRegistry` is the in-memory
state of every person, changed only by :meth:`PersonRegistry.apply` of
journal ops.  Planning methods (``add_person``, ``resolve_person``,
``update_person``, ``merge_people``, ``delete_person``, ``subjects_in``) never
change the state: they return the op(s) the store journals first and then
applies (the one mutation funnel).  Queries (``find_person``, ``people``,
``get``, ``find_by_external_id``) are answered from memory.

Journal op vocabulary (msgpack-safe dicts; epochs are UTC seconds)::

    {"op": "person_put", "id", "name", "relation", "aliases": [str], "owner",
     "external_id", "metadata": {str: any}, "created_at", "updated_at"}
        create or replace the whole person (replay is idempotent).
    {"op": "person_merge", "keep", "other", "at"}
        ``other`` is gone; its id now resolves to ``keep`` (``get`` follows it).
        ``merge_people`` journals the united ``keep`` (person_put) before it.
        ``other`` may already be absent (snapshots replay redirects this way).
    {"op": "person_delete", "id", "at"}
        the person is gone; redirects to it are dropped.

References (``find_person``, ``resolve_person``) are read by
``_mentions.parse_reference``, case-insensitively: a person id, a name
("Sarah", "sarah"), an alias, a relation phrase ("my wife", "wife",
"my wife's", "mom" -> mother), or both ("my wife Sarah", "Sarah, my wife").
Match order: id, exact name, alias, relation, unique first name; within a
tier the owner's own people come before shared ones (``owner=None``), then
the most recently updated.  A person whose name is not known yet ("my wife")
has ``name == ""`` and is shown as "the user's wife".

Metadata: what a caller gives (``add_person``, ``update_person``, an import)
follows the rules of a memory's metadata (``_filters.validate_metadata``: str
keys not starting with ``$``; values str, int, finite float, bool, None or lists
of those) within ``MAX_METADATA_BYTES`` and ``MAX_METADATA_KEYS``.  Stored
persons (journal, snapshot) are only checked for shape and size when read, so
persons written before these rules still load; ``merge_people`` keeps the
stored metadata of both as it is (plus ``merged_external_ids``, a list of str: the
external ids of the persons merged in, which ``find_by_external_id`` still finds the
person by, and which ``update_person(metadata=)`` keeps unless it gives the key).

Old ids: an id merged away names the person it was merged into for lookups,
updates and merges (a merge already done is a no-op); ``delete_person`` needs the
person's own id (an old one is refused, naming the live person).  A subject or
reference shaped like the ids ``add_person`` makes that names no person the caller
sees (deleted, another user's) is refused rather than made a person of that name.

Owner scoping: a person belongs to an owner (a user of the robot) or, with
``owner=None``, to the household.  ``people(owner="alex")`` and
``find_person(..., owner="alex")`` see Alex's people plus household ones;
``owner=None`` sees everyone (an unscoped store keeps today's behaviour).
A reference resolved for an owner teaches (a missing name or relation) only that
owner's persons: "my therapist Dr. Evil" from Bob links a household therapist
but does not rename it for everyone.  A merge keeps a person everyone who saw
either sees (:func:`check_merge_owners`): two persons of one owner, or an owned
person into the household's; the memories it re-links stay about a person their owner sees.
A change of owner (``update_person(owner=)``, checked by the store, which knows the
memories: :func:`check_owner_change`) keeps it too: to the household always, to a user
only when every memory about the person is that user's.  A new memory's persons
(:func:`may_be_about`) are its owner's or the household's: for an unscoped memory
(owner None, seen by every user) the household's only, so ``check_subject`` refuses
another owner's person id (:func:`check_about`) and ``subjects_in`` and
``resolve_person(..., for_memory=True)`` find names among those persons only (a name
only Alice's person has makes a household person: merge hers into it if they are one).

Thread ownership: a registry is owned by the store's writer thread; it takes
no locks.  Readers on other threads must go through that owner.
"""

from __future__ import annotations

import re
import time
import unicodedata
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, NamedTuple

import msgpack

from reachy_memory.engine.filters import validate_metadata
from reachy_memory.engine.mentions import (
    Reference,
    extract_mentions,
    means_user_or_robot,
    norm,
    parse_reference,
    pronoun_gender,
    reference_problem,
)
from reachy_memory.errors import NotFoundError, TooLargeError, ValidationError
from reachy_memory.model import check_unicode, to_datetime, to_epoch

MAX_NAME_CHARS = 100
MAX_RELATION_CHARS = 50
MAX_ALIASES = 32
MAX_ALIAS_CHARS = 100
MAX_EXTERNAL_ID_CHARS = 200
MAX_METADATA_BYTES = 4096  # packed msgpack
MAX_METADATA_KEYS = 64
MAX_REFERENCE_CHARS = 200
MAX_SENTENCE_CHARS = 4000
OPS = ("person_put", "person_merge", "person_delete")
MERGED_EXTERNAL_IDS = "merged_external_ids"  # the metadata key keeping the external ids of persons merged in

_UNSET: Any = object()


@dataclass(frozen=True, slots=True)
class Person:
    """One person the robot knows about (immutable view)."""

    id: str
    name: str  # "" while only the relation is known ("my wife")
    relation: str | None = None  # canonical: "wife", "mother", "boss"
    aliases: tuple[str, ...] = ()
    owner: str | None = None  # the user whose relationship this is; None: household
    external_id: str | None = None  # face / voice recognition identity
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: datetime = field(default_factory=lambda: to_datetime(0.0))
    updated_at: datetime = field(default_factory=lambda: to_datetime(0.0))

    @property
    def display_name(self) -> str:
        """The name, or "the user's wife" while the name is unknown."""
        return self.name or f"the user's {self.relation}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (ISO 8601 timestamps)."""
        return {"id": self.id, "name": self.name, "relation": self.relation, "aliases": list(self.aliases),
                "owner": self.owner, "external_id": self.external_id, "metadata": dict(self.metadata),
                "created_at": self.created_at.isoformat(), "updated_at": self.updated_at.isoformat()}

    def to_op(self) -> dict[str, Any]:
        """The ``person_put`` op that recreates this person."""
        return {"op": "person_put", "id": self.id, "name": self.name, "relation": self.relation,
                "aliases": list(self.aliases), "owner": self.owner, "external_id": self.external_id,
                "metadata": dict(self.metadata), "created_at": to_epoch(self.created_at),
                "updated_at": to_epoch(self.updated_at)}


class Resolution(NamedTuple):
    """What a reference resolved to; ``op`` (when not None) must be journaled and applied."""

    person: Person | None
    created: bool
    op: dict[str, Any] | None


class Merge(NamedTuple):
    """The plan of a merge: the united person, ops to journal in order, id map for memories."""

    person: Person
    ops: list[dict[str, Any]]
    relink: dict[str, str]  # old person id -> kept id, for memories' subjects


class PersonRegistry:
    """All persons, in memory; see the module doc for ops, matching and scoping."""

    def __init__(self, *, clock: Callable[[], float] = time.time,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self._people: dict[str, Person] = {}
        self._redirects: dict[str, str] = {}
        self._clock = clock
        self._new_id = new_id

    def __len__(self) -> int:
        return len(self._people)

    # -- state: the only mutator -------------------------------------------------

    def apply(self, op: dict[str, Any]) -> None:
        """Apply one journal op (replay-safe). Raises ValidationError on a malformed op."""
        kind = op.get("op") if isinstance(op, dict) else None
        if kind == "person_put":
            person = person_from_op(op)
            self._people[person.id] = person
            self._redirects.pop(person.id, None)
        elif kind == "person_merge":
            self._apply_merge(_str_field(op, "keep"), _str_field(op, "other"))
        elif kind == "person_delete":
            self._apply_delete(_str_field(op, "id"))
        else:
            raise ValidationError(f"unknown person op {kind!r}; expected one of {', '.join(OPS)}", field="op")

    def _apply_merge(self, keep: str, other: str) -> None:
        if keep not in self._people or keep == other:
            raise ValidationError(f"person_merge: {keep!r} is not a live person or equals {other!r}", field="keep")
        was_live = self._people.pop(other, None) is not None
        self._redirects[other] = keep
        if was_live:  # only a live person is a redirect's target: a redirect-only op retargets none
            for source, target in self._redirects.items():  # (one per import's merged id: linear, not quadratic)
                if target == other:
                    self._redirects[source] = keep

    def _apply_delete(self, person_id: str) -> None:
        self._people.pop(person_id, None)
        self._redirects = {s: t for s, t in self._redirects.items() if t != person_id and s != person_id}

    def snapshot_ops(self) -> list[dict[str, Any]]:
        """Ops that rebuild this exact state in an empty registry (for snapshots)."""
        ops = [p.to_op() for p in self._people.values()]
        at = self._clock()
        ops += [{"op": "person_merge", "keep": t, "other": s, "at": at} for s, t in self._redirects.items()]
        return ops

    # -- queries ---------------------------------------------------------------------

    def get(self, person_id: str) -> Person | None:
        """The person with that id, following merges; None if unknown or deleted."""
        return self._people.get(self._redirects.get(person_id, person_id))

    def redirects(self) -> dict[str, str]:
        """Every merged-away person id and the live person id it resolves to (a copy)."""
        return dict(self._redirects)

    def is_live(self, person_id: str) -> bool:
        """Whether ``person_id`` is a live person's own id (not a merged-away one)."""
        return person_id in self._people

    def people(self, owner: str | None = None) -> list[Person]:
        """Everyone (``owner=None``) or that owner's people plus household ones, by name."""
        return sorted(self._visible(owner), key=lambda p: (norm(p.display_name), p.id))

    def find_by_external_id(self, external_id: str) -> Person | None:
        """The person anchored to that outside identity, else the person a person anchored
        to it was merged into (it is in their ``metadata["merged_external_ids"]``: a face
        seen again finds the merged person, not nobody), or None."""
        anchored = next((p for p in self._people.values() if p.external_id == external_id), None)
        return anchored or next((p for p in self._people.values() if external_id in _listed_external_ids(p)), None)

    def check_subject(self, reference: Any, owner: str | None = None) -> bool:
        """Whether ``reference`` (a subject of a fact of ``owner``) is a person: True for the
        id of a person a memory of ``owner`` may be about (:func:`may_be_about`) or one
        person's name or relation, False for the user or the robot (the fact is about
        nobody).  Raises ValidationError as :func:`subject_reference` does, for an id this
        store made that names no person ``owner`` sees (:func:`_unknown_id`), and for the
        id of an owned person given to an unscoped fact (``owner`` None: :func:`check_about`)."""
        if isinstance(reference, str):
            person = self.get(reference.strip())  # as read_person_id reads it
            if person is not None and visible_to(person, owner):
                check_about(person, owner)  # owner None sees everyone, but its memory is every user's
                return True
            _unknown_id(reference, "subjects")
        return subject_reference(reference) is not None

    def find_person(self, reference: str, owner: str | None = None) -> Person | None:
        """The person a reference means (see module doc), or None. Raises ValidationError on bad input."""
        by_id = self.get(read_person_id(reference, "reference"))
        if by_id is not None and visible_to(by_id, owner):
            return by_id
        return self._match(parse_reference(reference), owner)

    def _match(self, ref: Reference, owner: str | None, for_memory: bool = False) -> Person | None:
        candidates = self._visible(owner, for_memory)
        if ref.name:
            hit = self._by_name(ref, candidates, owner)
            if hit is not None or not ref.relation:
                return hit
        if ref.relation:
            same = [p for p in candidates if p.relation == ref.relation and (not ref.name or not p.name)]
            return _best(same, owner)
        return None

    def _by_name(self, ref: Reference, candidates: list[Person], owner: str | None) -> Person | None:
        key = norm(ref.name or "")
        for tier in (lambda p: norm(p.name) == key,
                     lambda p: any(norm(a) == key for a in p.aliases)):
            hits = [p for p in candidates if tier(p)]
            if hits:
                matching = [p for p in hits if p.relation == ref.relation]
                return _best(matching or hits, owner)
        first = [p for p in candidates if p.name and norm(p.name).split()[0] == key]
        return first[0] if len(first) == 1 else None  # a first name only counts when unique

    def _visible(self, owner: str | None, for_memory: bool = False) -> list[Person]:
        """The persons ``owner`` sees; ``for_memory``: those a memory of ``owner`` may be about
        (:func:`may_be_about`: for owner None the household's, not everyone)."""
        seen = may_be_about if for_memory else visible_to
        return [p for p in self._people.values() if seen(p, owner)]

    # -- planners: return ops, never change state ------------------------------------

    def add_person(self, name: str, relation: str | None = None, aliases: Sequence[str] = (),
                   owner: str | None = None, external_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> Resolution:
        """Plan a new person (``created`` is True). Raises ValidationError / TooLargeError."""
        now = self._clock()
        person = Person(id=self._new_id(), name=_display(name), relation=_relation(relation),
                        aliases=_aliases(aliases), owner=owner, external_id=external_id,
                        metadata=check_metadata(metadata), created_at=to_datetime(now), updated_at=to_datetime(now))
        self._check_person(person)
        return Resolution(person, True, person.to_op())

    def resolve_person(self, reference: str, owner: str | None = None, create: bool = True, *,
                       for_memory: bool = False) -> Resolution:
        """Find the person a reference means, or plan creating it.

        Returns ``Resolution(person, created, op)``: ``op`` is the person_put to
        journal when the person is new or a missing name/relation was learnt
        ("my wife Sarah" after "my wife"); ``person`` is None only when
        ``create`` is False and nobody matched.  ``for_memory``: the subject of a
        memory of ``owner``, found among the persons it may be about
        (:func:`may_be_about`; an id: :func:`check_about`).  Raises ValidationError for
        an empty reference or a bare pronoun (resolve those with ``subjects_in``).
        """
        ref = _reference(reference)
        by_id = self.get(read_person_id(reference, "reference"))
        if by_id is not None and visible_to(by_id, owner):
            if for_memory:
                check_about(by_id, owner)
            return Resolution(by_id, False, None)
        if create:  # not a person named after the id: "C3a6317adb1c44d6..."
            _unknown_id(reference, "reference")
        return self._resolve_ref(ref, owner, create, for_memory)

    def _learn(self, person: Person, ref: Reference) -> Resolution:
        changes: dict[str, Any] = {}
        if ref.name and not person.name:
            changes["name"] = _display(ref.name)
        if ref.relation and not person.relation:
            changes["relation"] = ref.relation
        if not changes:
            return Resolution(person, False, None)
        updated = replace(person, **changes, updated_at=to_datetime(self._clock()))
        self._check_person(updated)
        return Resolution(updated, False, updated.to_op())

    def update_person(self, person_id: str, *, name: str = _UNSET, relation: str | None = _UNSET,
                      aliases: Sequence[str] = _UNSET, external_id: str | None = _UNSET,
                      metadata: dict[str, Any] = _UNSET, owner: str | None = _UNSET) -> Resolution:
        """Plan a change of the given fields (``metadata`` replaces the person's, but for
        ``merged_external_ids``, kept unless given). Raises NotFoundError, ValidationError."""
        person = self._require(person_id)
        given: dict[str, Any] = {"name": name, "relation": relation, "aliases": aliases, "external_id": external_id,
                 "metadata": metadata, "owner": owner}
        changes = {k: v for k, v in given.items() if v is not _UNSET}
        if "name" in changes:
            changes["name"] = _display(changes["name"])
        if "relation" in changes:
            changes["relation"] = _relation(changes["relation"])
        if "aliases" in changes:
            changes["aliases"] = _aliases(changes["aliases"])
        if "metadata" in changes:
            changes["metadata"] = _kept_merged_ids(person, check_metadata(changes["metadata"]))
        updated = replace(person, **changes, updated_at=to_datetime(self._clock()))
        self._check_person(updated)
        return Resolution(updated, False, updated.to_op())

    def merge_people(self, keep: str, other: str) -> Merge:
        """Plan merging ``other`` into ``keep``: aliases united (other's name becomes one),
        missing relation / external id taken from ``other`` (a second external id goes
        to ``metadata["merged_external_ids"]``), keep's metadata wins.  The stored
        metadata is not re-checked against the input rules (``check_metadata``), only
        for size.  Either id may be one merged away: it names the person it was merged
        into; ``other`` merged away into ``keep``'s person already is a retried merge (no
        ops, the person as it is).  Raises NotFoundError, ValidationError (same person,
        or the union is too large, or ``keep`` is not seen by everyone who sees ``other``:
        :func:`check_merge_owners`).
        """
        kept, gone = self._require(keep, "keep"), self._require(other, "other")
        if kept.id == gone.id:
            return self._merged_already(kept, read_person_id(keep, "keep"), read_person_id(other, "other"))
        check_merge_owners(kept, gone)
        united = replace(kept, aliases=_united_aliases(kept, gone), relation=kept.relation or gone.relation,
                         external_id=kept.external_id or gone.external_id, metadata=_merged_metadata(kept, gone),
                         updated_at=to_datetime(self._clock()))
        self._check_person(united, exempt=(kept.id, gone.id))
        relink = {gone.id: kept.id} | {s: kept.id for s, t in self._redirects.items() if t == gone.id}
        ops = [united.to_op(), {"op": "person_merge", "keep": kept.id, "other": gone.id, "at": self._clock()}]
        return Merge(united, ops, relink)

    def _merged_already(self, person: Person, keep: str, other: str) -> Merge:
        """The plan of a merge whose two ids name one person: nothing to do (no ops) when
        ``other`` was merged away into that person (a retried merge), else ValidationError
        (``merge_people(a, a)``, or ``keep`` merged away into ``other``: the reverse merge)."""
        if not self.is_live(other):
            return Merge(person, [], {})
        why = f": {keep} was merged into {person.id}" if keep != person.id else ""
        raise ValidationError(f"cannot merge a person with itself{why}", field="other")

    def delete_person(self, person_id: str) -> dict[str, Any]:
        """Plan deleting a person (the store drops the id from memories' subjects).

        Only a live person's own id deletes: an id merged away (``merge_people``) names
        the person it was merged into for reads, updates and merges, but deleting through
        it (a stale id: "delete the duplicate I merged") would forget that other record.
        Raises NotFoundError (unknown or deleted), ValidationError (a merged-away id: the
        message and ``merged_into`` name the live person)."""
        person = self._require(person_id)
        wanted = read_person_id(person_id)
        if wanted != person.id:
            raise ValidationError(f"person id {wanted} was merged into {person.id} ({person.display_name}); "
                                  f"delete {person.id} to forget that person", field="person_id",
                                  merged_into=person.id)
        return {"op": "person_delete", "id": person.id, "at": self._clock()}

    def subjects_in(self, sentence: str, owner: str | None = None, recent: Sequence[str] = (),
                    create: bool = True) -> list[Resolution]:
        """The persons a sentence is about, resolved or planned (one Resolution each).

        ``recent`` are person ids most recent first (the subjects of the last
        turns); a sentence that names nobody but uses she/he refers to the most
        recent of them whose relation does not contradict the pronoun.  The persons
        are those a memory of ``owner`` may be about (:func:`may_be_about`): a fact's.
        Journal every non-None ``op`` before applying it.  Raises ValidationError.
        """
        if not isinstance(sentence, str) or len(sentence) > MAX_SENTENCE_CHARS:
            raise ValidationError(f"sentence must be a string of at most {MAX_SENTENCE_CHARS} characters",
                                  field="sentence")
        known = [k for p in self._visible(owner, for_memory=True) for k in (p.name, *p.aliases) if k]
        out: list[Resolution] = []
        for mention in extract_mentions(sentence, known):
            ref = mention.reference
            try:
                resolution = self._from_context(ref.pronoun, recent, owner) if ref.pronoun else \
                    self._resolve_ref(ref, owner, create, for_memory=True)
            except ValidationError:  # a candidate over the input limits is not a person; the sentence is fine
                continue
            if resolution.person is not None and all(r.person is None or r.person.id != resolution.person.id
                                                      for r in out):
                out.append(resolution)
        return out

    def _resolve_ref(self, ref: Reference, owner: str | None, create: bool, for_memory: bool = False) -> Resolution:
        found = self._match(ref, owner, for_memory)
        if found is not None:
            # A user's words teach only their own persons: "my therapist Dr. Evil" from Bob must
            # not rename the household's nameless therapist that Alice's facts are about (nor
            # "my sister Carol" give the household's Carol a relation for everyone).
            return self._learn(found, ref) if owner is None or found.owner == owner else Resolution(found, False, None)
        if not create:
            return Resolution(None, False, None)
        return self.add_person(ref.name or "", ref.relation, owner=owner)

    def _from_context(self, pronoun: str, recent: Sequence[str], owner: str | None) -> Resolution:
        for person_id in recent:
            person = self.get(person_id)
            gender = pronoun_gender(person.relation) if person else None
            if person is not None and may_be_about(person, owner) and gender in (None, pronoun):
                return Resolution(person, False, None)
        return Resolution(None, False, None)

    # -- validation ------------------------------------------------------------------

    def _require(self, person_id: Any, field: str = "person_id") -> Person:
        """The person ``person_id`` (read by :func:`read_person_id`) is, following merges.
        Raises ValidationError, NotFoundError."""
        wanted = read_person_id(person_id, field)
        person = self.get(wanted)
        if person is None:
            raise NotFoundError(f"no person with id {wanted!r}", memory_id=wanted, person_id=wanted)
        return person

    def _check_person(self, person: Person, exempt: Iterable[str] = ()) -> None:
        check_person(person)
        if person.external_id is not None:
            holder = self.find_by_external_id(person.external_id)
            if holder is not None and holder.id != person.id and holder.id not in set(exempt):
                raise ValidationError(f"external_id {person.external_id!r} already belongs to {holder.id}",
                                      field="external_id")


def read_person_id(value: Any, field: str = "person_id") -> str:
    """A person id as every person operation reads one (a reference to a person too):
    surrounding whitespace is ignored (no person id starts or ends with it).
    Raises ValidationError (not a string, empty, a control character) or TooLargeError
    (over ``MAX_REFERENCE_CHARS``), naming ``field``."""
    _check_text(value, field, MAX_REFERENCE_CHARS)
    return str(value).strip()


def check_person(person: Person) -> None:
    """Input limits of a person. Raises ValidationError, TooLargeError."""
    _check_text(person.name, "name", MAX_NAME_CHARS, allow_empty=bool(person.relation))
    if person.relation is not None:
        _check_text(person.relation, "relation", MAX_RELATION_CHARS)
    if len(person.aliases) > MAX_ALIASES:
        raise TooLargeError(f"at most {MAX_ALIASES} aliases", field="aliases", size=len(person.aliases),
                            limit=MAX_ALIASES)
    for alias in person.aliases:
        _check_text(alias, "aliases", MAX_ALIAS_CHARS)
    for name, value in (("owner", person.owner), ("external_id", person.external_id)):
        if value is not None:
            _check_text(value, name, MAX_EXTERNAL_ID_CHARS)
    _check_stored_metadata(person.metadata)


def check_metadata(metadata: Any) -> dict[str, Any]:
    """A clean copy of metadata a caller gives for a person (None: ``{}``), under the
    rules of a memory's metadata (``_filters.validate_metadata``) with the person
    limits ``MAX_METADATA_BYTES`` and ``MAX_METADATA_KEYS``.  Raises ValidationError /
    TooLargeError whose ``field`` is ``"metadata"`` or ``"metadata.<key>"``."""
    return validate_metadata(metadata, max_bytes=MAX_METADATA_BYTES, max_keys=MAX_METADATA_KEYS)


def person_from_op(op: dict[str, Any]) -> Person:
    """The Person a ``person_put`` op describes. Raises ValidationError on a malformed op.

    Its metadata is checked for shape and size only (stored persons must load);
    new input goes through :func:`check_metadata` first."""
    try:
        aliases = op.get("aliases") or ()
        if not isinstance(aliases, list | tuple):  # a bare string would become its letters
            raise TypeError("aliases must be a list of strings")
        person = Person(id=_str_field(op, "id"), name=str(op["name"]), relation=op.get("relation"),
                        aliases=tuple(aliases), owner=op.get("owner"),
                        external_id=op.get("external_id"), metadata=dict(op.get("metadata") or {}),
                        created_at=to_datetime(float(op["created_at"])),
                        updated_at=to_datetime(float(op["updated_at"])))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ValidationError(f"malformed person_put op: {exc}", field="op") from exc
    check_person(person)
    return person


def visible_to(person: Person, owner: str | None) -> bool:
    """Whether ``owner`` sees ``person``: their own or the household's (None sees everyone)."""
    return owner is None or person.owner is None or person.owner == owner


def may_be_about(person: Person, owner: str | None) -> bool:
    """Whether a memory of ``owner`` may be about ``person``: the promise remember, merges,
    owner changes and import keep, that a memory's persons are ones its owner sees.  The
    household's persons, or the owner's own.  Unlike :func:`visible_to`, where ``owner``
    None is a caller who sees everyone, an unscoped memory (owner None) is household
    knowledge, seen by every user: it may be about household persons only (Bob would see
    a fact about a person of Alice's he cannot look up, and :func:`check_owner_change`
    counts such a memory as the household's)."""
    return person.owner is None or person.owner == owner


def check_about(person: Person, owner: str | None, memory_id: str | None = None, where: str = "",
                remedy: str = "") -> None:
    """Raise ValidationError unless a memory of ``owner`` may be about ``person``
    (:func:`may_be_about`).  The error names the memory (``memory_id``, when it has one
    yet), its ``owner`` and the person (``person_id``; its owner ``other_owner``), its
    message starting with ``where`` and ending with ``remedy`` (by default: give the
    memory the person's owner, or make the person the household's)."""
    if may_be_about(person, owner):
        return
    memory = f"memory {memory_id}" if memory_id is not None else "a memory"
    scope = "(unscoped: owner None, seen by every user)" if owner is None else f"(of owner {owner!r})"
    who = "not every user sees" if owner is None else "its owner does not see"
    remedy = remedy or (f"give the memory owner {person.owner!r}, or make the person the household's "
                        "(update_person(id, owner=None))")
    fields = {"memory_id": memory_id} if memory_id is not None else {}
    raise ValidationError(
        f"{where}{memory} {scope} cannot be about {person.id} ({person.display_name}, {_whose(person)}): {who} "
        f"that person; {remedy}", field="subjects", person_id=person.id, owner=owner, other_owner=person.owner,
        **fields)


def check_merge_owners(kept: Person, gone: Person) -> None:
    """Raise ValidationError unless everyone who sees ``gone`` sees ``kept``: the same owner,
    or ``kept`` the household's (owner None).  A merge re-links every memory about ``gone``
    and makes its id name ``kept``: merged into another user's person, ``gone``'s owner's
    memories (and lookups, ``recall(about=)``) would name a person that owner cannot see,
    and a household person merged into one user's would vanish for every other user.  The
    error names both owners (``owner`` and ``other_owner``; None: the household)."""
    if kept.owner is None or kept.owner == gone.owner:
        return
    raise ValidationError(
        f"cannot merge {gone.id} ({gone.display_name}, {_whose(gone)}) into {kept.id} ({kept.display_name}, "
        f"{_whose(kept)}): the memories and users that see the first would not see the person it becomes; "
        "merge persons of one owner, or into a household person (update_person(keep, household=True) makes one)",
        field="other", owner=kept.owner, other_owner=gone.owner)


def check_owner_change(person: Person, owner: str | None, memory_owners: Iterable[str | None]) -> None:
    """Raise ValidationError unless ``person`` may become ``owner``'s: every memory about
    them (``memory_owners``: each one's owner) must still be about a person its owner
    sees.  Always allowed: the same owner, or the household's (``owner`` None: everyone
    sees it).  To a user, only when every such memory is that user's own (shared or not):
    another user's memory would name a person that user cannot see (their lookups and
    ``recall(about=)`` lose it); an unscoped memory (owner None) is household knowledge,
    seen by every user, and its persons stay the household's, as :func:`check_merge_owners`
    keeps a household person from being merged into one user's.  In short: a person may be
    the owner each memory about them would have made it (``remember(owner=)`` makes new
    persons its owner's, the household's without one).  The error names the person
    (``person_id``), the new ``owner``, how many memories (``memories``) and the owner of
    most of them (``other_owner``; None: unscoped); its message counts each owner's."""
    if owner is None or owner == person.owner:
        return
    others = Counter(o for o in memory_owners if o != owner)
    if not others:
        return
    ranked = sorted(others.items(), key=lambda item: (-item[1], item[0] is not None, item[0] or ""))
    counted = ", ".join(f"{n} {'unscoped (seen by every user)' if o is None else f'of owner {o!r}'}"
                        for o, n in ranked)
    raise ValidationError(
        f"cannot give {person.id} ({person.display_name}, {_whose(person)}) to owner {owner!r}: memories about "
        f"them ({counted}) would name a person their owners do not see; forget those memories first, "
        "or keep the person the household's (owner None)",
        field="owner", person_id=person.id, owner=owner, memories=sum(others.values()), other_owner=ranked[0][0])


def _whose(person: Person) -> str:
    return "the household's (no owner)" if person.owner is None else f"owner {person.owner!r}"


def _best(people: list[Person], owner: str | None) -> Person | None:
    """Owner's own before household, then the most recently updated."""
    if not people:
        return None
    return max(people, key=lambda p: (owner is not None and p.owner == owner, p.updated_at, p.id))


def _united_aliases(kept: Person, gone: Person) -> tuple[str, ...]:
    out: list[str] = []
    for alias in (*kept.aliases, gone.name, *gone.aliases):
        if alias and norm(alias) != norm(kept.name) and all(norm(alias) != norm(a) for a in out):
            out.append(alias)
    return tuple(out)


def _merged_metadata(kept: Person, gone: Person) -> dict[str, Any]:
    """The united person's metadata: keep's wins, but ``merged_external_ids`` unites both
    lists and ``gone``'s external id when keep has another (none is lost: each still finds
    the person, :meth:`PersonRegistry.find_by_external_id`). Raises ValidationError when a
    list to unite is a caller's value that is not a list of strings."""
    metadata = {**gone.metadata, **kept.metadata}
    lost = [gone.external_id] if kept.external_id and gone.external_id not in (None, kept.external_id) else []
    both = MERGED_EXTERNAL_IDS in kept.metadata and MERGED_EXTERNAL_IDS in gone.metadata
    if lost or (both and kept.metadata[MERGED_EXTERNAL_IDS] != gone.metadata[MERGED_EXTERNAL_IDS]):
        united = [*_external_ids_list(kept), *_external_ids_list(gone), *lost]
        anchor = kept.external_id or gone.external_id
        metadata[MERGED_EXTERNAL_IDS] = [x for x in dict.fromkeys(united) if x != anchor]
    return metadata


def _kept_merged_ids(person: Person, metadata: dict[str, Any]) -> dict[str, Any]:
    """New metadata for ``person``, with the ``merged_external_ids`` a merge recorded
    unless ``metadata`` gives that key itself (a caller replacing the metadata would
    otherwise unknowingly stop the faces merged in from finding the person)."""
    if MERGED_EXTERNAL_IDS in person.metadata and MERGED_EXTERNAL_IDS not in metadata:
        return {**metadata, MERGED_EXTERNAL_IDS: person.metadata[MERGED_EXTERNAL_IDS]}
    return metadata


def _external_ids_list(person: Person) -> list[str]:
    """A person's ``merged_external_ids`` to unite ([] when absent or None). Raises
    ValidationError for a caller's own value that is not a list of strings (refused
    rather than lost or split into letters)."""
    previous = person.metadata.get(MERGED_EXTERNAL_IDS) or []
    if not isinstance(previous, list) or not all(isinstance(x, str) for x in previous):
        raise ValidationError("metadata.merged_external_ids must be a list of strings to merge "
                              "two persons with different external ids", field="metadata")
    return previous


def _listed_external_ids(person: Person) -> list[str]:
    """The outside identities of persons merged into ``person`` (none if its metadata
    holds something else under the key)."""
    value = person.metadata.get(MERGED_EXTERNAL_IDS)
    return [x for x in value if isinstance(x, str)] if isinstance(value, list) else []


def _reference(reference: str) -> Reference:
    _check_text(reference, "reference", MAX_REFERENCE_CHARS)
    ref = parse_reference(reference)
    if ref.pronoun or ref.empty:
        raise ValidationError(f"{reference!r} does not name a person (a pronoun needs the sentence it is in: "
                              "give a name or a relation, such as 'Sarah' or 'my wife')", field="reference")
    return ref


_MADE_ID = re.compile(r"[0-9a-fA-F]{32}")  # the ids add_person makes (uuid4 hex); no one's name


def _unknown_id(reference: str, field: str) -> None:
    """Raise ValidationError if ``reference`` is a person id as this store makes them (the
    caller has checked it names no person it may see): a person deleted, or another
    user's.  Read as a name, it made a new person named after the id."""
    if _MADE_ID.fullmatch(reference.strip()):
        raise ValidationError(f"{reference.strip()!r} is not the id of a person here (deleted?): give a live "
                              "person's id, or their name or relation", field=field)


def subject_reference(reference: Any) -> Reference | None:
    """``reference`` read as the subject of a fact: the Reference of one person, or
    None when it means the user or the robot ("me", "the user", "Reachy": a fact about
    nobody).  Raises ValidationError (TooLargeError past the name or relation limits)
    saying what to send instead: a pronoun, several persons ("John and Mary"),
    someone else's relation ("her brother"), no letters at all ("42")."""
    ref = _reference(reference)
    if means_user_or_robot(reference):
        return None
    problem = reference_problem(reference, ref)
    if problem is not None:
        raise ValidationError(f"{reference!r} {problem}", field="subjects")
    for text, limit, name in ((ref.name, MAX_NAME_CHARS, "name"), (ref.relation, MAX_RELATION_CHARS, "relation")):
        if text is not None and len(text) > limit:
            raise TooLargeError(f"the {name} in {reference[:60]!r} is longer than {limit} characters",
                                field="subjects", size=len(text), limit=limit)
    return ref


def names_someone(reference: Any) -> bool:
    """Whether ``reference`` names one person other than the user or the robot
    (:func:`subject_reference` neither refuses it nor reads it as the user)."""
    try:
        return subject_reference(reference) is not None
    except ValidationError:  # TooLargeError too
        return False


def _aliases(aliases: Any) -> tuple[str, ...]:
    # A bare string would become a tuple of its characters.
    if isinstance(aliases, str | bytes) or not isinstance(aliases, Sequence):
        raise ValidationError("aliases must be a list of strings", field="aliases")
    if len(aliases) > MAX_ALIASES:
        raise TooLargeError(f"at most {MAX_ALIASES} aliases", field="aliases", size=len(aliases), limit=MAX_ALIASES)
    return tuple(_shown(" ".join(a.split()), "aliases") if isinstance(a, str) else a for a in aliases)


def _display(name: str) -> str:
    """"sarah" -> "Sarah" (a name typed in lowercase); other capitalisations are kept.
    Raises ValidationError for a name that is not a string or shows nothing."""
    if not isinstance(name, str):
        raise ValidationError("name must be a string", field="name")
    name = _shown(" ".join(unicodedata.normalize("NFC", name).split()), "name")
    return name.title() if name.islower() else name


# Format characters (zero-width space, joiners), marks and separators: alone, they show
# nothing.  Unassigned and private-use code points may show on another system: not these.
_INVISIBLE = frozenset({"Cf", "Mn", "Mc", "Me", "Zs", "Zl", "Zp"})


def _shown(text: str, field: str) -> str:
    """``text``, unless it is not empty and yet shows nothing (only zero-width or other
    format characters, or marks with no letter): ValidationError.  Checked on input only:
    a stored person keeps loading."""
    if text and all(unicodedata.category(ch) in _INVISIBLE for ch in text):
        raise ValidationError(f"{field} shows no character (only invisible ones): {text!r}", field=field)
    return text


def _relation(relation: str | None) -> str | None:
    if relation is None:
        return None
    if not isinstance(relation, str):
        raise ValidationError("relation must be a string", field="relation")
    ref = parse_reference(relation)
    return ref.relation or norm(relation) or None


def _check_text(value: Any, name: str, limit: int, allow_empty: bool = False) -> None:
    if not isinstance(value, str):
        raise ValidationError(f"{name} must be a string, got {type(value).__name__}", field=name)
    if len(value) > limit:
        raise TooLargeError(f"{name} is longer than {limit} characters", field=name, size=len(value), limit=limit)
    if not allow_empty and not value.strip():
        raise ValidationError(f"{name} must not be empty", field=name)
    if any(unicodedata.category(ch) == "Cc" for ch in value):
        raise ValidationError(f"{name} must not contain control characters", field=name)
    check_unicode(value, name)


def _check_stored_metadata(metadata: Any) -> None:
    """Shape and size of a person's metadata as stored: a str-keyed dict that packs
    within ``MAX_METADATA_BYTES``.  Looser than :func:`check_metadata` on purpose:
    persons stored before it (NaN, bytes, nested maps...) must still load."""
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise ValidationError("metadata must be a dict with string keys", field="metadata")
    try:
        size = len(msgpack.packb(metadata, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValidationError(f"metadata is not serialisable: {exc}", field="metadata") from exc
    if size > MAX_METADATA_BYTES:
        raise TooLargeError("metadata is too large", field="metadata", size=size, limit=MAX_METADATA_BYTES)


def _str_field(op: dict[str, Any], key: str) -> str:
    value = op.get(key)
    if not isinstance(value, str) or not value:
        raise ValidationError(f"person op field {key!r} must be a non-empty string", field="op")
    return value
