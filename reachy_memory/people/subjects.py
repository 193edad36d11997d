"""Who a memory is about, as search reads it: ``about=`` filters and subject names.

Pure functions over the person registry and the state's indexes (no lock taken, no
state owned): the search pipeline (:mod:`reachy_memory.engine.search`) calls them
under the store lock.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from reachy_memory.engine.mentions import norm
from reachy_memory.people.registry import PersonRegistry, visible_to

if TYPE_CHECKING:
    from reachy_memory.engine.records import Record
    from reachy_memory.engine.state import MemoryState

log = logging.getLogger(__name__)
# The metadata key spec 000's callers and the robot bridge name a memory's person with.
PERSON_FIELD = "person"


def about_ids(people: PersonRegistry, about: str | None, owner: str | None) -> list[str] | None:
    """The person ids ``about`` (checked by the search's check) names; None (no filter)
    when it names nobody known."""
    if about is None:
        return None
    person = people.find_person(about, owner)
    if person is None:
        log.info("search about %r: no such person, results are not filtered", about)
        return None
    return [person.id]


def named_slots(state: MemoryState, person_ids: list[str] | None) -> set[int]:
    """Slots whose ``metadata.person`` (spec 000's way of saying who a memory is
    about: ``store(..., {"person": "Sarah"})``, the robot bridge) names one of these
    persons by name or alias, in any case: ``about=`` finds them beside the memories
    whose ``subjects`` hold the person."""
    if not person_ids:
        return set()
    people = (state.people.get(p) for p in person_ids)
    names = {norm(n) for person in people if person is not None for n in (person.name, *person.aliases) if n}
    values = state.fields.string_values(PERSON_FIELD)  # live or not: keep the live ones
    slots = set().union(*(slots for value, slots in values.items() if norm(value) in names))
    return {slot for slot in slots if slot in state.by_slot}


def subject_names(people: PersonRegistry, rec: Record, owner: str | None = None) -> tuple[str, ...]:
    """Display names of a memory's persons, as they are now; with ``owner``, only the
    persons that user knows (theirs and the household's): a fact another user shared
    about one of their own persons ("my therapist") does not give away that person's name."""
    found = (people.get(p) for p in rec.subjects)
    return tuple(p.display_name for p in found if p is not None and visible_to(p, owner))

