"""Persons: add, find, resolve, update, merge and forget the people the robot knows.

:class:`Persons` writes ``person_*`` ops through the engine's funnel; the persons
themselves are the engine state's :class:`~.registry.PersonRegistry` (owned by the
state, changed only by those ops).  A merge or a deletion relinks the memories about
the person in the same frame.  Owns no state of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from reachy_memory.engine.ports import Component
from reachy_memory.errors import NotFoundError, ValidationError
from reachy_memory.people.checks import text_arg, unique
from reachy_memory.people.registry import Person, Resolution, check_owner_change


class Persons(Component):
    """The person operations of :class:`~reachy_memory.engine.store.MemoryStore`."""

    def add_person(self, name: str, relation: str | None = None, aliases: Sequence[str] = (),
                   owner: str | None = None, external_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> Person:
        """Add a person (``name`` may be "" while only the relation is known).
        Raises ValidationError / TooLargeError."""
        self._engine.require_open()
        with self._lock:
            return self._commit_person(self._people.add_person(name, relation, aliases, owner, external_id,
                                                               metadata))

    def find_person(self, reference: str, owner: str | None = None) -> Person | None:
        """The person a reference means ("my wife", "Sarah", "sarah", an id), or None."""
        self._engine.require_open()
        with self._lock:  # the registry is read by iteration: not while another thread writes
            return self._people.find_person(text_arg(reference, "reference"), owner)

    def person_by_external_id(self, external_id: str) -> Person | None:
        """The person anchored to an outside identity (face or voice recognition), or the one
        a person anchored to it was merged into (``people.PersonRegistry.find_by_external_id``), or None."""
        self._engine.require_open()
        with self._lock:
            return self._people.find_by_external_id(text_arg(external_id, "external_id"))

    def resolve_person(self, reference: str, owner: str | None = None,
                       create: bool = True) -> tuple[Person | None, bool]:
        """(person, created): the person a reference means, created when new (and ``create``)."""
        self._engine.require_open()
        with self._lock:
            resolution = self._people.resolve_person(text_arg(reference, "reference"), owner, create)
            if resolution.op is not None:
                self._engine.commit([resolution.op])
            return resolution.person, resolution.created

    def people(self, owner: str | None = None) -> list[Person]:
        """The persons ``owner`` knows (theirs and the household's); everyone for None."""
        self._engine.require_open()
        with self._lock:
            return self._people.people(owner)

    def person_redirects(self) -> dict[str, str]:
        """Every person id merged away (``merge_people``) and the live person id it resolves
        to now: what an export carries (the kept person's ``merged_ids``), so that an app
        holding an old id finds the person after an import into another store."""
        self._engine.require_open()
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
        self._engine.require_open()
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
        self._engine.require_open()
        with self._lock:
            plan = self._people.merge_people(keep, other)
            if plan.ops:
                self._engine.commit([*plan.ops, *self._relink_ops(plan.relink)])
            return plan.person

    def delete_person(self, person_id: str) -> bool:
        """Forget a person (their memories stay, no longer linked); False if unknown.
        ``person_id`` is read as ``people.read_person_id`` says, and must be the person's
        own id: one merged away (``merge_people``) is a ValidationError whose message and
        ``merged_into`` name the live person (deleting it would forget that person, whom
        the caller may not mean). Raises ValidationError."""
        self._engine.require_open()
        with self._lock:
            try:
                op = self._people.delete_person(person_id)
            except NotFoundError:
                return False
            self._engine.commit([op, *self._relink_ops({op["id"]: None})])
            return True

    def _commit_person(self, resolution: Resolution) -> Person:
        if resolution.op is not None:
            self._engine.commit([resolution.op])
        assert resolution.person is not None
        return resolution.person

    def _relink_ops(self, relink: Mapping[str, str | None]) -> list[list[Any]]:
        """``update`` ops moving every memory's subjects from the old ids to the new (None: drop)."""
        ops = []
        slots = set().union(*(self._state.by_subject.get(old, set()) for old in relink))
        for slot in sorted(slots):
            rec = self._state.by_slot[slot]
            subjects = unique(relink.get(s, s) for s in rec.subjects)
            ops.append(["update", rec.id, {"subjects": [s for s in subjects if s is not None]}])
        return ops

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
