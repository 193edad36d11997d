"""A hypothesis state machine over person operations on a store, through every id it
ever handed out: live, merged away (alone or along a chain of merges) or deleted.

Persons and memories belong to two users or the household (owner None).  What it
holds, after every step: a memory's subjects are live persons its owner sees (its
owner's or the household's; an unscoped memory, seen by every user: the household's),
``remember`` is refused exactly when a subject given by id would break that (for an
unscoped memory naming the person and both owners; a name is found among those
persons), a merged-away id resolves to a live person, a delete only ever forgets the person its id
names (an id merged away is refused, naming that person), a merge keeps every outside
identity (external id) of both persons finding the united one and is refused, naming
both owners, unless everyone who saw the person merged away sees the kept one, a change
of owner is refused, naming the person, the owner and how many memories, unless it is
to the household or every memory about the person is the new owner's, no person is
ever named after an id.  And on demand: reopening, a full compaction (then
``verify`` clean) and an export imported into a fresh store give the same persons,
owners, redirects, links and lookups (the fresh store's memories too only about persons
their owners see), as does a reopen after a crash (the journal replayed); the export
goes as entries (JSON Lines) or through a markdown folder's files; the same export with
one memory's or person's owner edited imports every memory, leaving out (and reporting)
exactly the links to a person the memory's owner does not see.  Lexical-only stores
(no model): person operations do not embed.

Found by it: ``remember(subjects=[a deleted person's id])`` made a person named after
the id ("C3A6317Adb1C44D6..."); merging Bob's person into Alice's linked Bob's memories
to a person Bob cannot see, and so did giving a household person to Alice
(``update_person(owner=)``, now refused unless every memory about them is Alice's);
``remember(owner=None, subjects=[Alice's person's id])`` (or a name only Alice's person
had) made an unscoped memory, seen by every user, about a person only Alice sees, and an
import let in any memory's owner and persons (it now leaves such links out); the
registry and store tests then pinned each fault found.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from reachy_memory import MemoryStore, NotFoundError, ValidationError
from reachy_memory.config import load_config
from reachy_memory.storage.backup import verify
from reachy_memory.storage.export import person_entries
from reachy_memory.storage.markdown import parse, render
from tests.store_util import abandon

NAMES = ("Ann", "Bob", "Cy", "Dee")
FACES = tuple(f"face:{n}" for n in range(4))
OWNERS = st.sampled_from([None, "alice", "bob"])  # None: the household's person, an unscoped memory
THEIRS = "(the subject's owner)"
OTHER = "(an owner not the subject's)"  # its memory may not be about the person (unless gone)
ANY = st.integers(0, 63)  # an index into every id handed out (modulo their number)


def _state(store: MemoryStore, ids: list[str]) -> tuple[Any, ...]:
    """What a caller can see of the persons: persons, redirects, links, lookups by id and face."""
    people = sorted((p.id, p.name, p.relation, p.aliases, p.owner, p.external_id, repr(sorted(p.metadata.items())))
                    for p in store.people())
    links = sorted((m.id, m.owner, m.subjects) for m in store.export_page(None, 10_000)[0])
    by_id = [getattr(store.find_person(i), "id", None) for i in ids]
    by_face = [getattr(store.person_by_external_id(f), "id", None) for f in FACES]
    return people, store.person_redirects(), links, by_id, by_face


def _sees(person_owner: str | None, memory_owner: str | None) -> bool:
    """Whether a memory of ``memory_owner`` may be about a person of ``person_owner``: the
    household's, or the memory owner's own (an unscoped memory: the household's only)."""
    return person_owner is None or person_owner == memory_owner


def _unseen_subjects(store: MemoryStore) -> list[tuple[str, str | None, str]]:
    """(memory id, its owner, subject) for each subject that is no live person everyone who
    sees the memory sees (none is)."""
    return [(m.id, m.owner, s) for m in store.export_page(None, 10_000)[0] for s in m.subjects
            if (p := store.find_person(s)) is None or not _sees(p.owner, m.owner)]


class PeopleStates(RuleBasedStateMachine):
    """Person operations through any id ever handed out (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="people-states-"))
        # fsync adds nothing this test checks (a crash is not one of its steps), only time
        self.config = load_config(memory={"path": str(self.tmp / "data"), "fsync": "never"})
        self.store = MemoryStore(config=self.config, embedder=None)
        self.ids: list[str] = []
        self.facts = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _id(self, index: int) -> str:
        return self.ids[index % len(self.ids)]

    def _faces(self) -> dict[str, str | None]:
        return {f: getattr(self.store.person_by_external_id(f), "id", None) for f in FACES}

    @initialize(owner=OWNERS, tellers=st.lists(OWNERS, max_size=3))
    def a_person_told_about(self, owner: str | None, tellers: list[str | None]) -> None:
        """Each run starts with a person whom users (or nobody in particular: unscoped) told
        facts about: memories of several owners about one person, what an owner change
        must keep in sight, made likely.  A teller whose memory may not be about the person
        (another user, or unscoped about a user's person) is refused."""
        person = self.store.add_person(NAMES[0], owner=owner)
        self.ids.append(person.id)
        for teller in tellers:
            self.facts += 1
            try:
                self.store.remember(f"fact {self.facts} zq{self.facts}", subjects=[person.id], owner=teller)
            except ValidationError:
                assert not _sees(owner, teller)
                continue
            assert _sees(owner, teller), f"{teller!r} told about {owner}'s person"

    @rule(name=st.sampled_from(NAMES), face=st.one_of(st.none(), st.sampled_from(FACES)), owner=OWNERS)
    def add(self, name: str, face: str | None, owner: str | None) -> None:
        try:
            self.ids.append(self.store.add_person(name, external_id=face, owner=owner).id)
        except ValidationError as exc:  # the face is anchored to someone already
            assert self.store.person_by_external_id(face or "") is not None, exc

    @precondition(lambda self: self.ids)
    @rule(keep=ANY, other=ANY)
    def merge(self, keep: int, other: int) -> None:
        kept, gone = self.store.find_person(self._id(keep)), self.store.find_person(self._id(other))
        faces = self._faces()
        across = kept is not None and gone is not None and kept.id != gone.id and kept.owner not in (None, gone.owner)
        try:
            united = self.store.merge_people(self._id(keep), self._id(other))
        except ValidationError as exc:
            if across:  # refused, naming both owners
                assert (exc.owner, exc.other_owner) == (kept.owner, gone.owner), exc  # type: ignore[union-attr,attr-defined]
                assert self.store.find_person(self._id(other)) == gone  # nothing merged
            return
        except NotFoundError:
            return
        assert kept is not None and gone is not None and united.id == kept.id
        assert not across, f"{gone.owner}'s person merged into {kept.owner}'s"
        for face, holder in faces.items():  # every face of either still finds the united person
            if holder in (kept.id, gone.id):
                assert self.store.person_by_external_id(face).id == united.id  # type: ignore[union-attr]

    @precondition(lambda self: self.ids)
    @rule(index=ANY)
    def delete(self, index: int) -> None:
        pid = self._id(index)
        before = self.store.find_person(pid)
        try:
            deleted = self.store.delete_person(pid)
        except ValidationError as exc:  # an id merged away: refused, naming who it is now
            assert before is not None and before.id != pid and exc.merged_into == before.id  # type: ignore[attr-defined]
            assert self.store.find_person(pid) == before
            return
        assert deleted == (before is not None) and (before is None or before.id == pid)
        assert self.store.find_person(pid) is None

    @precondition(lambda self: self.ids)
    @rule(index=ANY, name=st.sampled_from(NAMES), face=st.one_of(st.none(), st.sampled_from(FACES)))
    def update(self, index: int, name: str, face: str | None) -> None:
        before = self.store.find_person(self._id(index))
        fields: dict[str, Any] = {"name": name} if face is None else {"name": name, "external_id": face}
        try:
            updated = self.store.update_person(self._id(index), **fields)
        except (ValidationError, NotFoundError):
            return
        assert before is not None and updated.id == before.id  # an old id updates the person it names

    @precondition(lambda self: self.ids)
    @rule(index=ANY, owner=OWNERS, linked=st.booleans())
    def change_owner(self, index: int, owner: str | None, linked: bool) -> None:
        """Allowed to the household always, to a user only when every memory about the
        person is that user's (an unscoped one is every user's); else refused naming them.
        ``linked``: a person some memory is about (the cases that matter), if there is one."""
        memories = self.store.export_page(None, 10_000)[0]
        subjects = [s for m in memories for s in m.subjects]
        pid = subjects[index % len(subjects)] if linked and subjects else self._id(index)
        before = self.store.find_person(pid)
        about = [m.owner for m in memories if before and before.id in m.subjects]
        others = [o for o in about if o != owner]
        try:
            updated = self.store.update_person(pid, owner=owner)
        except NotFoundError:
            assert before is None
            return
        except ValidationError as exc:
            assert before is not None and owner not in (None, before.owner) and others, exc
            assert (exc.person_id, exc.owner, exc.memories) == (before.id, owner, len(others))  # type: ignore[attr-defined]
            assert exc.other_owner in others and self.store.find_person(before.id) == before  # type: ignore[attr-defined]
            event("owner change refused")
            return
        assert before is not None and updated.owner == owner
        assert owner in (None, before.owner) or not others, f"{owner} took {before.owner}'s person from {others}"
        event(f"owner change allowed ({'to the household' if owner is None else 'to a user'}, "
              f"{'with' if about else 'without'} memories)")

    @rule(index=ANY, by_id=st.booleans(), owner=st.one_of(OWNERS, st.just(THEIRS), st.just(OTHER)))
    def remember(self, index: int, by_id: bool, owner: str | None) -> None:
        """A subject by id is refused exactly when it names nobody (gone) or a person the
        memory may not be about; a name is found among the persons it may be about."""
        self.facts += 1
        subject = self._id(index) if self.ids and by_id else NAMES[index % len(NAMES)]
        person = self.store.find_person(subject)  # anyone's
        if owner == THEIRS:  # the person's owner speaking of them: the memories a merge must keep in sight
            owner = getattr(person, "owner", None)
        elif owner == OTHER:  # across owners: the person's id (or name) told by someone else
            theirs = getattr(person, "owner", None)
            owner = [o for o in (None, "alice", "bob") if o != theirs][index % 2]
        refused = bool(by_id and self.ids) and (person is None or not _sees(person.owner, owner))
        try:
            [memory] = self.store.remember(f"fact {self.facts} zq{self.facts}", subjects=[subject], owner=owner)
        except ValidationError as exc:
            assert refused, exc
            if person is not None and owner is None:  # seen by the caller: named, with the owners
                assert (exc.person_id, exc.owner, exc.other_owner) == (person.id, None, person.owner), exc  # type: ignore[attr-defined]
            event(f"remember by id refused ({'gone' if person is None else 'unscoped' if owner is None else 'user'})")
            return
        assert not refused, f"{owner!r}'s memory about {person}"
        found = [getattr(self.store.find_person(s, owner=owner), "id", None) for s in memory.subjects]
        assert found == list(memory.subjects)
        assert all(_sees(self.store.find_person(s).owner, owner) for s in memory.subjects)  # type: ignore[union-attr]

    @rule()
    def reopen(self) -> None:
        before = _state(self.store, self.ids)
        self.store.close()
        self.store = MemoryStore(config=self.config, embedder=None)
        assert _state(self.store, self.ids) == before

    @rule()
    def crash_reopen(self) -> None:
        """Reopen from the journal alone (no closing snapshot): the person ops replayed."""
        before = _state(self.store, self.ids)
        abandon(self.store)
        self.store = MemoryStore(config=self.config, embedder=None)
        assert _state(self.store, self.ids) == before

    @rule()
    def compact_and_verify(self) -> None:
        before = _state(self.store, self.ids)
        self.store.compact(full=True)
        self.store.close()
        report = verify(self.tmp / "data")
        assert report.ok, report.problems
        self.store = MemoryStore(config=self.config, embedder=None)
        assert _state(self.store, self.ids) == before

    @rule(markdown=st.booleans())
    def export_into_a_fresh_store(self, markdown: bool) -> None:
        """JSON Lines' entries as they are, or through the markdown folder's files."""
        people = person_entries(self.store.people(), self.store.person_redirects())
        memories = [m.to_dict() for m in self.store.export_page(None, 10_000)[0]]
        if markdown:
            memories, people = parse(render(memories, people))
        fresh = self.config.replace("memory", path=str(Path(tempfile.mkdtemp(dir=self.tmp)) / "data"))
        with MemoryStore(config=fresh, embedder=None) as other:
            other.import_memories(memories, people)
            assert _state(other, self.ids) == _state(self.store, self.ids)
            assert _unseen_subjects(other) == []

    @rule(memory_side=st.booleans(), index=ANY, owner=OWNERS)
    def import_an_owner_edited_export(self, memory_side: bool, index: int, owner: str | None) -> None:
        """The export with one memory's (or person's) owner edited (as a store written
        before the rule, or an edited file), imported into a fresh store: every memory
        imported, exactly the links to a person the memory's owner does not see left out
        and reported, the others kept; the same import again changes nothing."""
        people = person_entries(self.store.people(), self.store.person_redirects())
        memories = [m.to_dict() for m in self.store.export_page(None, 10_000)[0]]
        linked = {s for m in memories for s in m.get("subjects", ())}  # the edits that matter
        edited = [m for m in memories if m.get("subjects")] if memory_side else [p for p in people if p["id"] in linked]
        if not edited:
            return
        edited[index % len(edited)]["owner"] = owner
        owners = {p["id"]: p["owner"] for p in people}
        bad = {(m["id"], s) for m in memories for s in m.get("subjects", ()) if not _sees(owners[s], m["owner"])}
        fresh = self.config.replace("memory", path=str(Path(tempfile.mkdtemp(dir=self.tmp)) / "data"))
        with MemoryStore(config=fresh, embedder=None) as other:
            got = other.import_memories(memories, people)
            left_out = [(link["memory_id"], link["person_id"]) for link in got["left_out_links"]]
            assert (got["memories"], got["links_left_out"]) == (len(memories), len(bad)), got
            assert sorted(left_out) == sorted(bad), got
            assert _unseen_subjects(other) == []
            kept = {m.id: m.subjects for m in other.export_page(None, 10_000)[0]}
            assert kept == {m["id"]: tuple(s for s in m.get("subjects", ()) if (m["id"], s) not in bad)
                            for m in memories}
            assert other.import_memories(memories, people) == {"people": 0, "memories": 0, "links_left_out": 0,
                                                               "left_out_links": []}
            event(f"edited import {'left links out' if bad else 'kept every link'}")

    @invariant()
    def links_and_redirects_name_live_persons(self) -> None:
        live = {p.id for p in self.store.people()}
        redirects = self.store.person_redirects()
        assert set(redirects.values()) <= live and not set(redirects) & live
        assert all(set(m.subjects) <= live for m in self.store.export_page(None, 10_000)[0])
        assert _unseen_subjects(self.store) == []  # a memory's persons are ones its owner sees
        assert not any(re.fullmatch(r"[0-9a-f]{32}", p.name.casefold()) for p in self.store.people())


PeopleStates.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_people_states = PeopleStates.TestCase
