"""People-aware memory on the store (issue 10): spec 004's behaviour rows with the
real model, supersession, confirm/correct, history, scoping, named notes,
archives, one-call context, persistence of all of it, lexical-only mode."""

from __future__ import annotations

import errno
import itertools
import json
import math
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from reachy_memory import Config, MemoryStore, NotFoundError, TooLargeError, ValidationError
from reachy_memory.embedding.embedder import OnnxEmbedder
from reachy_memory.storage.export import check_entries, person_entries, read_jsonl
from reachy_memory.storage.markdown import parse, render
from tests.store_util import frequent_switches

FIXTURE_V1 = Path(__file__).parent / "fixtures" / "v1_store"


@pytest.fixture
def people_store(config: Config, embedder: OnnxEmbedder) -> Iterator[MemoryStore]:
    with MemoryStore(config=config, embedder=embedder) as s:
        yield s


def _names(store: MemoryStore, ids: tuple[str, ...]) -> set[str]:
    return {p.display_name for p in store.people() if p.id in ids}


# -- spec 004, "Behaviors" and "Person Resolution" ------------------------------------------

def test_my_wifes_name_then_she_links_to_one_person(people_store: MemoryStore) -> None:
    first = people_store.remember("my wife's name is Sarah", subjects=["my wife"])[0]
    second = people_store.remember("she likes Italian food", subjects=["my wife"])[0]
    assert first.subjects == second.subjects and len(first.subjects) == 1
    sarah = people_store.find_person("Sarah")
    assert sarah is not None and sarah.relation == "wife" and sarah.id == first.subjects[0]


def test_pronoun_without_explicit_subjects_follows_the_last_fact(people_store: MemoryStore) -> None:
    first = people_store.remember("my wife's name is Sarah")[0]
    second = people_store.remember("she likes Italian food")[0]
    assert first.subjects and second.subjects == first.subjects


def test_a_fact_about_two_people_links_both(people_store: MemoryStore) -> None:
    memory = people_store.remember("Sarah and John are getting married", subjects=["Sarah", "John"])[0]
    assert _names(people_store, memory.subjects) == {"Sarah", "John"}


def test_several_facts_at_once_each_with_its_subjects(people_store: MemoryStore) -> None:
    stored = people_store.remember(facts=[
        {"content": "My boss Michael prefers email", "subjects": ["my boss Michael"]},
        {"content": "Michael's birthday is in May", "subjects": ["Michael"]},
        {"content": "The wifi password is on the fridge"},
    ])
    assert len(stored) == 3 and stored[0].subjects == stored[1].subjects and stored[2].subjects == ()
    michael = people_store.find_person("my boss")
    assert michael is not None and michael.name == "Michael"


def test_recall_about_my_wife_finds_her_facts_with_attribution(people_store: MemoryStore) -> None:
    people_store.remember("my wife Sarah likes Italian food", subjects=["my wife Sarah"])
    people_store.remember("my boss Michael likes Italian food too", subjects=["my boss Michael"])
    hits = people_store.recall("what food does she like", about="my wife")
    assert [h.subject_names for h in hits] == [("Sarah",)]
    assert len(people_store.recall("Italian food")) == 2  # without about: both


def test_empty_subjects_is_a_fact_about_nobody(lexical_store: MemoryStore) -> None:
    [omitted] = lexical_store.remember("Sarah likes tea")  # None: the sentence's persons are found
    [nobody] = lexical_store.remember("Trash day is Monday", subjects=[])  # []: about nobody
    assert omitted.subjects and nobody.subjects == ()
    assert [p.display_name for p in lexical_store.people()] == ["Sarah"]


def test_about_finds_what_spec_000_callers_said_with_metadata_person(lexical_store: MemoryStore) -> None:
    # Spec 000 (and the robot bridge) say who a memory is about with metadata.person; spec 004
    # with subjects. about= hid the first kind as soon as the person was known.
    store = lexical_store
    sarah_meta = store.store("Sarah likes Italian food", "fact", {"person": "Sarah"})
    nickname = store.store("Sassy takes her tea with lemon", "fact", {"person": "sassy"})  # an alias, any case
    store.store("John likes Italian food too", "fact", {"person": "John"})  # someone else
    store.remember("my wife's name is Sarah", subjects=["my wife"])
    store.update_person(store.find_person("Sarah").id, aliases=["Sassy"])  # type: ignore[union-attr]
    found = {r.memory.id for r in store.search("Italian food tea lemon", about="my wife", min_score=0.0)}
    assert {sarah_meta.id, nickname.id} <= found
    assert all(r.memory.metadata.get("person") != "John"
               for r in store.search("Italian food", about="Sarah", min_score=0.0))
    store.forget(sarah_meta.id)
    assert sarah_meta.id not in {r.memory.id for r in store.search("Italian food", about="Sarah", min_score=0.0)}


@pytest.mark.parametrize(("reference", "expected"), [
    ("my wife", "Sarah"),  # relation phrase
    ("Sarah", "Sarah"),  # name
    ("sarah", "Sarah"),  # any case
    ("wife", "Sarah"),  # bare relation
])
def test_person_resolution(people_store: MemoryStore, reference: str, expected: str) -> None:
    people_store.add_person("Sarah", relation="wife")
    person = people_store.find_person(reference)
    assert person is not None and person.display_name == expected


def test_first_mention_creates_subsequent_finds(people_store: MemoryStore) -> None:
    person, created = people_store.resolve_person("my wife Sarah")
    again, created_again = people_store.resolve_person("Sarah")
    assert created and not created_again and person is not None and again is not None
    assert person.id == again.id and (person.name, person.relation) == ("Sarah", "wife")


# -- supersession --------------------------------------------------------------------------

def test_favorite_color_red_then_blue_supersedes_and_keeps_history(people_store: MemoryStore) -> None:
    red = people_store.remember("User's favorite color is red")[0]
    blue = people_store.remember("User's favorite color is blue")[0]
    old = people_store.get(red.id)
    assert old is not None and old.superseded_by == blue.id and old.superseded_at is not None
    assert [h.memory.id for h in people_store.recall("favorite color")] == [blue.id]
    shown = people_store.recall("favorite color", include_superseded=True)
    assert {h.memory.id for h in shown} == {red.id, blue.id}
    assert [m.id for m in people_store.history(red.id)] == [red.id, blue.id]


def test_refinement_does_not_supersede(people_store: MemoryStore) -> None:
    tea = people_store.remember("Sarah likes tea")[0]
    people_store.remember("Sarah likes green tea")
    assert people_store.get(tea.id).superseded_by is None  # type: ignore[union-attr]


def test_different_subjects_never_conflict(people_store: MemoryStore) -> None:
    sarah = people_store.remember("Her favorite color is red", subjects=["Sarah"])[0]
    people_store.remember("His favorite color is blue", subjects=["John"])
    assert people_store.get(sarah.id).superseded_by is None  # type: ignore[union-attr]


def test_confirmed_facts_are_never_superseded_automatically(people_store: MemoryStore) -> None:
    red = people_store.remember("User's favorite color is red")[0]
    assert people_store.confirm(red.id).protected
    people_store.remember("User's favorite color is blue")
    assert people_store.get(red.id).superseded_by is None  # type: ignore[union-attr]


def test_named_notes_are_never_superseded_automatically(people_store: MemoryStore) -> None:
    # note() answers by name: a note hidden by a new fact would be answered hidden
    red = people_store.remember("User's favorite color is red", name="colour")[0]
    blue = people_store.remember("User's favorite color is blue")[0]
    assert people_store.get(red.id).superseded_by is None  # type: ignore[union-attr]
    assert people_store.note("colour").id == red.id  # type: ignore[union-attr]
    assert people_store.rewrite_note("colour", "User's favorite color is green").content.endswith("green")
    assert people_store.get(blue.id).superseded_by is None  # type: ignore[union-attr]


def test_correct_replaces_with_same_subjects_and_history(people_store: MemoryStore) -> None:
    old = people_store.remember("Sarah works at the bakery", subjects=["Sarah"])[0]
    new = people_store.correct(old.id, "Sarah works at the library")
    assert new.subjects == old.subjects and new.id != old.id
    assert people_store.get(old.id).superseded_by == new.id  # type: ignore[union-attr]
    assert [m.content for m in people_store.history(new.id)] == [old.content, new.content]
    with pytest.raises(NotFoundError):
        people_store.correct("no-such-id", "x")


# -- persons: merge, update, delete ------------------------------------------------------------

def test_merge_relinks_memories_and_unites_aliases(people_store: MemoryStore) -> None:
    a = people_store.remember("Sarah likes jazz", subjects=["Sarah"])[0]
    b = people_store.remember("Sassy plays the piano", subjects=["Sassy"])[0]
    kept = people_store.merge_people(a.subjects[0], b.subjects[0])
    assert "Sassy" in kept.aliases and len(people_store.people()) == 1
    assert people_store.get(b.id).subjects == (kept.id,)  # type: ignore[union-attr]
    assert {h.memory.id for h in people_store.recall("music", about="Sassy", limit=5)} <= {a.id, b.id}


def test_delete_person_keeps_memories_unlinked(people_store: MemoryStore) -> None:
    memory = people_store.remember("John likes chess", subjects=["John"])[0]
    assert people_store.delete_person(memory.subjects[0])
    assert people_store.get(memory.id).subjects == ()  # type: ignore[union-attr]
    assert people_store.find_person("John") is None
    assert not people_store.delete_person("unknown")


def test_deleting_through_a_merged_away_id_is_refused_and_loses_nothing(config: Config) -> None:
    """delete_person(Bob's id) after Bob was merged into Ann deleted Ann: her record and
    every memory's link to her were gone, though the caller named someone no longer there."""
    with MemoryStore(config=config, embedder=None) as store:
        ann, bob = store.add_person("Ann"), store.add_person("Bob")
        [tea] = store.remember("Bob likes tea", subjects=[bob.id])
        store.merge_people(ann.id, bob.id)
        with pytest.raises(ValidationError, match=f"{bob.id} was merged into {ann.id} \\(Ann\\)") as caught:
            store.delete_person(bob.id)
        assert caught.value.merged_into == ann.id  # type: ignore[attr-defined]
        assert store.merge_people(ann.id, bob.id).id == ann.id  # a retried merge: done already
        assert store.update_person(bob.id, relation="sister").id == ann.id  # updates follow the old id
    with MemoryStore(config=config, embedder=None) as store:  # nothing of it was lost on disk either
        assert [p.id for p in store.people()] == [ann.id] and store.find_person(bob.id).id == ann.id  # type: ignore[union-attr]
        assert store.get(tea.id).subjects == (ann.id,)  # type: ignore[union-attr]
        assert store.delete_person(ann.id) and store.find_person(bob.id) is None


# (keep's owner, other's owner): merged into another user's person, or a household person
# into one user's, the memories and users that saw the person merged away would not see it.
CROSS_OWNER_MERGES = [("alice", "bob"), ("alice", None)]


@pytest.mark.parametrize(("keeps", "others"), CROSS_OWNER_MERGES)
def test_a_merge_across_owners_is_refused_naming_both(lexical_store: MemoryStore, keeps: str,
                                                      others: str | None) -> None:
    """merge_people(Alice's Carol, Bob's Carol) re-linked Bob's memories to Alice's person:
    Bob's own facts named a person Bob cannot see (recall(about=) by him found nothing).
    The way the error gives: the kept person made the household's, the merge is allowed
    (everyone sees the person) and Bob's facts follow it."""
    kept, gone = lexical_store.add_person("Carol", owner=keeps), lexical_store.add_person("Carol", owner=others)
    [tea] = lexical_store.remember("Carol likes tea", subjects=[gone.id], owner="bob")
    with pytest.raises(ValidationError, match=f"owner {keeps!r}") as caught:
        lexical_store.merge_people(kept.id, gone.id)
    assert (caught.value.owner, caught.value.other_owner) == (keeps, others)  # type: ignore[attr-defined]
    assert ("household" if others is None else repr(others)) in caught.value.message
    assert lexical_store.get(tea.id).subjects == (gone.id,)  # type: ignore[union-attr]  # nothing merged
    assert lexical_store.find_person(gone.id, owner="bob") == gone and lexical_store.person_redirects() == {}
    lexical_store.update_person(kept.id, owner=None)
    united = lexical_store.merge_people(kept.id, gone.id)
    assert united.owner is None and lexical_store.find_person(gone.id, owner="bob") == united
    assert lexical_store.get(tea.id).subjects == (kept.id,)  # type: ignore[union-attr]
    assert [h.memory.id for h in lexical_store.recall("tea", about="Carol", owner="bob")] == [tea.id]


def test_household_true_makes_a_person_the_households_and_not_beside_an_owner(lexical_store: MemoryStore) -> None:
    """``update_person(id, household=True)`` (what the clients send) is ``owner=None`` here; with
    an owner too it is a ValidationError (field "household"), nothing changed; not a bool: refused."""
    dora = lexical_store.add_person("Dora", owner="alice")
    with pytest.raises(ValidationError, match="not both") as caught:
        lexical_store.update_person(dora.id, household=True, owner="bob", name="Doro")
    assert (caught.value.field, caught.value.owner) == ("household", "bob")  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="household must be a bool"):
        lexical_store.update_person(dora.id, household="yes")  # type: ignore[arg-type]
    assert lexical_store.find_person(dora.id) == dora
    assert lexical_store.update_person(dora.id, household=True, owner=None).owner is None  # one ask, said twice


def _unseen(store: MemoryStore) -> list[tuple[str, str]]:
    """(memory id, subject) for each subject not everyone who sees the memory sees (none is):
    a person neither the household's nor the memory owner's (an unscoped memory, seen by
    every user: the household's only)."""
    return [(m.id, s) for m in store.export_page(None, 10_000)[0] for s in m.subjects
            if (p := store.find_person(s)) is None or p.owner not in (None, m.owner)]


def test_an_owner_change_that_would_hide_a_person_from_memories_is_refused(lexical_store: MemoryStore) -> None:
    """update_person(household Carol, owner="alice") made Bob's and the unscoped facts about
    Carol name a person they could not see (find_person/recall(about=) by Bob lost her),
    as a merge across owners did.  Refused naming the person, the new owner and whose
    memories, nothing changed; to the household is always allowed; once the other
    memories are forgotten, the move is allowed."""
    store = lexical_store
    carol = store.add_person("Carol")  # the household's
    [tea] = store.remember("Carol likes tea", subjects=[carol.id], owner="bob")
    [jam] = store.remember("Carol makes jam", subjects=[carol.id], owner="bob")
    [plum] = store.remember("Carol grows plums", subjects=[carol.id])  # unscoped: every user sees it
    [own] = store.remember("Carol owes me a book", subjects=[carol.id], owner="alice")
    with pytest.raises(ValidationError, match=r"to owner 'alice'.*2 of owner 'bob', 1 unscoped") as caught:
        store.update_person(carol.id, owner="alice", name="Caroline")
    assert caught.value.field == "owner" and caught.value.fields == {  # type: ignore[attr-defined]
        "field": "owner", "person_id": carol.id, "owner": "alice", "memories": 3, "other_owner": "bob"}
    assert store.find_person(carol.id) == carol and store.find_person("Carol", owner="bob") == carol  # unchanged
    assert [h.memory.id for h in store.recall("tea", about="Carol", owner="bob")] == [tea.id]
    assert store.forget(tea.id) and store.forget(jam.id)
    with pytest.raises(ValidationError, match="1 unscoped") as caught:  # the unscoped memory still needs her
        store.update_person(carol.id, owner="alice")
    assert (caught.value.memories, caught.value.other_owner) == (1, None)  # type: ignore[attr-defined]
    store.forget(plum.id)
    assert store.update_person(carol.id, owner="alice").owner == "alice"  # only Alice's memory is about her
    assert store.find_person("Carol", owner="bob") is None and store.get(own.id).subjects == (carol.id,)  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match=r"to owner 'bob'.*1 of owner 'alice'"):  # one user's to another's
        store.update_person(carol.id, owner="bob")
    assert store.update_person(carol.id, owner=None).owner is None  # to the household: always
    assert store.remember("Carol sings", subjects=[carol.id], owner="bob")[0].subjects == (carol.id,)
    assert _unseen(store) == []


def test_an_unscoped_memory_about_a_users_person_by_id_is_refused(lexical_store: MemoryStore) -> None:
    """remember(owner=None, subjects=[Alice's Carol's id]) stored an unscoped memory, seen by
    every user, about a person only Alice sees (Bob read a fact about someone he cannot look
    up; an owner change counts such a memory as the household's).  Refused naming the person
    and both owners, the whole batch unwritten; Alice's own memory about her, or one about
    her once she is the household's, is stored."""
    store = lexical_store
    carol = store.add_person("Carol", owner="alice")
    with pytest.raises(ValidationError, match=rf"unscoped.* cannot be about {carol.id} \(Carol, owner 'alice'\)") \
            as caught:
        store.remember(facts=[{"content": "Dan likes tea", "subjects": ["Dan"]},
                              {"content": "Carol likes jam", "subjects": [f" {carol.id} "]}])
    assert caught.value.fields == {"field": "subjects", "person_id": carol.id, "owner": None,  # type: ignore[attr-defined]
                                   "other_owner": "alice"}
    assert len(store) == 0 and store.people() == [carol]  # nothing written, not even Dan
    with pytest.raises(ValidationError, match="owner 'alice'"):
        store.remember("Carol likes jam", subjects=[carol.id], shared=True)
    assert store.remember("Carol likes jam", subjects=[carol.id], owner="alice")[0].subjects == (carol.id,)
    store.update_person(carol.id, owner=None)  # to the household: every user sees her now
    assert store.remember("Carol likes tea", subjects=[carol.id])[0].subjects == (carol.id,)
    assert _unseen(store) == [] and len(store) == 2


def test_an_unscoped_memory_finds_names_among_household_persons(lexical_store: MemoryStore) -> None:
    """An unscoped fact naming Carol (a subject given by name, or found in the sentence)
    linked Alice's Carol, whom only Alice sees.  Its names are now found among household
    persons, as a user's are among theirs and the household's: a household Carol is made,
    Alice's facts keep hers, and merging hers into the household's is allowed."""
    store = lexical_store
    alices = store.add_person("Carol", owner="alice")
    [given] = store.remember("Carol likes jam", subjects=["Carol"])
    [found] = store.remember("Carol grows plums")
    household = store.find_person(given.subjects[0])
    assert household is not None and household.owner is None and household.id != alices.id
    assert found.subjects == given.subjects
    [own] = store.remember("Carol sings", owner="alice")
    assert own.subjects == (alices.id,) and store.find_person("Carol", owner="alice") == alices
    assert _unseen(store) == []
    store.merge_people(household.id, alices.id)  # an owned person into the household's
    assert store.get(own.id).subjects == (household.id,) and _unseen(store) == []  # type: ignore[union-attr]


def test_the_id_of_a_deleted_or_unseen_person_is_no_subject(lexical_store: MemoryStore) -> None:
    """remember(subjects=[an id of a person deleted]) (an app holding the id) made a new
    person named after the id ("C3A6317Adb1C44D6..."); another user's person id did too."""
    ann, alexs = lexical_store.add_person("Ann"), lexical_store.add_person("Zoe", owner="alex")
    lexical_store.delete_person(ann.id)
    for subject, owner in ((ann.id, None), (f" {ann.id.upper()} ", None), (alexs.id, "bob")):
        with pytest.raises(ValidationError, match="not the id of a person here"):
            lexical_store.remember(facts=[{"content": "Ann likes tea", "subjects": ["Ann"]},
                                          {"content": "She likes jazz", "subjects": [subject]}], owner=owner)
        with pytest.raises(ValidationError, match="not the id of a person here"):
            lexical_store.resolve_person(subject, owner=owner)
        assert lexical_store.resolve_person(subject, owner=owner, create=False) == (None, False)
    assert [p.id for p in lexical_store.people()] == [alexs.id] and len(lexical_store) == 0  # nothing written
    assert lexical_store.remember("Zoe likes tea", subjects=[alexs.id], owner="alex")[0].subjects == (alexs.id,)


# How a caller may wrap a person id, and whether every person operation finds the person.
WRAPPED_PERSON_IDS = [
    (" {id} ", True),  # spaces around it: ignored
    ("{id}\u00a0", True),  # a no-break space after it: whitespace too
    ("\t{id}", False),  # a tab: a control character, refused (ValidationError) by all alike
]
# Each person operation given a wrapped id of Ann (Bob is the other person), and Ann's id back.
PERSON_ID_OPERATIONS = [
    ("find_person", lambda s, pid, bob: s.find_person(pid).id),  # stripped before this fix too
    ("update_person", lambda s, pid, bob: s.update_person(pid, relation="cousin").id),  # was NotFoundError
    ("merge_people keep", lambda s, pid, bob: s.merge_people(pid, bob).id),  # was NotFoundError
    ("merge_people other", lambda s, pid, bob: s.merge_people(bob, pid).aliases == ("Ann",)),  # was NotFoundError
    ("delete_person", lambda s, pid, bob: s.delete_person(pid) and s.find_person("Ann") is None),  # was False
]


@pytest.mark.parametrize(("wrapped", "found"), WRAPPED_PERSON_IDS)
@pytest.mark.parametrize(("operation", "call"), PERSON_ID_OPERATIONS, ids=[o[0] for o in PERSON_ID_OPERATIONS])
def test_every_person_operation_reads_a_person_id_alike(lexical_store: MemoryStore, wrapped: str, found: bool,
                                                         operation: str, call: Any) -> None:
    ann, bob = lexical_store.add_person("Ann"), lexical_store.add_person("Bob")
    if not found:
        with pytest.raises(ValidationError):
            call(lexical_store, wrapped.format(id=ann.id), bob.id)
        return
    assert call(lexical_store, wrapped.format(id=ann.id), bob.id) in (ann.id, True), operation


def test_external_id_anchors_a_person(people_store: MemoryStore) -> None:
    person = people_store.add_person("Alex", external_id="face:17")
    found = people_store.person_by_external_id("face:17")
    assert found is not None and found.id == person.id
    updated = people_store.update_person(person.id, relation="son")
    assert people_store.find_person("my son").id == updated.id  # type: ignore[union-attr]


VALID_METADATA = {"nick": "Sassy", "age": 41, "height_m": 1.68, "vegan": True, "pet": None,
                  "languages": ["fr", "en"], "merged_external_ids": ["face:1"]}


@pytest.mark.parametrize(("metadata", "error"), [
    ({"score": math.nan}, ValidationError),  # NaN: memory metadata refuses it, person metadata took it
    ({"score": math.inf}, ValidationError),  # inf, likewise
    ({"photo": b"\x89PNG"}, ValidationError),  # bytes
    ({"x": msgpack.ExtType(5, b"x")}, ValidationError),  # a msgpack ext value
    ({"a": {"b": {"c": {"d": 1}}}}, ValidationError),  # nested maps (only scalars and lists of scalars)
    ({"tags": [["a"]]}, ValidationError),  # a list of lists
    ({"$where": "x"}, ValidationError),  # a key starting with '$' (a filter operator)
    ({"": "x"}, ValidationError),  # an empty key
    ({1: "x"}, ValidationError),  # a non-string key
    ({"blob": "x" * 5000}, TooLargeError),  # over MAX_METADATA_BYTES (4096 packed)
    ({f"k{i}": i for i in range(65)}, TooLargeError),  # over MAX_METADATA_KEYS (64)
    ("nick=Sassy", ValidationError),  # not a map
    (VALID_METADATA, None),  # valid: every kind of value allowed, merge's own key included
])
def test_person_metadata_follows_the_memory_metadata_rules(lexical_store: MemoryStore, metadata: Any,
                                                           error: type[ValidationError] | None) -> None:
    """add_person and update_person check metadata as store() does (field "metadata" or
    "metadata.<key>"), and a refused call stores nothing."""
    if error is None:
        person = lexical_store.add_person("Sarah", metadata=metadata)
        assert person.metadata == metadata == lexical_store.update_person(person.id, metadata=metadata).metadata
        return
    with pytest.raises(error) as added:
        lexical_store.add_person("Sarah", metadata=metadata)
    assert lexical_store.people() == []
    person = lexical_store.add_person("Sarah", metadata={"nick": "Sassy"})
    with pytest.raises(error) as updated:
        lexical_store.update_person(person.id, metadata=metadata)
    assert lexical_store.people() == [person]
    for err in (added, updated):
        assert err.value.field == "metadata" or err.value.field.startswith("metadata.")  # type: ignore[attr-defined]


def test_imported_person_metadata_follows_the_same_rules(lexical_store: MemoryStore) -> None:
    person = {"id": "p1", "name": "Ida", "created_at": 1.7e9, "metadata": {"score": math.nan}}
    with pytest.raises(ValidationError, match="person 0"):
        lexical_store.import_memories([], people=[person])
    assert lexical_store.people() == []


def test_persons_stored_before_the_metadata_rules_still_load_update_and_merge(config: Config) -> None:
    """The rules apply to new input: a person whose stored metadata they refuse (written
    by an older version) opens, can be renamed and merged, and its metadata is kept."""
    old = {"score": math.nan, "photo": b"\x89PNG", "deep": {"a": {"b": 1}}, "$odd": 1}
    op = {"op": "person_put", "id": "old", "name": "Ida", "relation": None, "aliases": [], "owner": None,
          "external_id": "face:1", "metadata": old, "created_at": 1.7e9, "updated_at": 1.7e9}
    with MemoryStore(config=config, embedder=None) as store:
        store._core.commit([op])  # as an older version journaled it
    for _ in range(2):  # from the journal, then from the snapshot written on close
        with MemoryStore(config=config, embedder=None) as store:
            person = store.find_person("Ida")
            assert person is not None and math.isnan(person.metadata["score"])
    with MemoryStore(config=config, embedder=None) as store:
        renamed = store.update_person("old", name="Idaline")
        other = store.add_person("Ida B", external_id="face:2", metadata={"merged_external_ids": ["face:0"]})
        merged = store.merge_people(renamed.id, other.id)
        assert merged.metadata["photo"] == b"\x89PNG" and merged.metadata["merged_external_ids"] == ["face:0", "face:2"]


# -- scoping ---------------------------------------------------------------------------------------

def test_owner_sees_own_plus_shared_and_unscoped(people_store: MemoryStore) -> None:
    alex = people_store.remember("I like running in the morning", owner="alex")[0]
    sam = people_store.remember("I like running at night", owner="sam")[0]
    house = people_store.remember("The house rule: running shoes off inside", owner="sam", shared=True)[0]
    seen = {h.memory.id for h in people_store.search("running", owner="alex", min_score=0)}
    assert alex.id in seen and house.id in seen and sam.id not in seen
    everyone = {h.memory.id for h in people_store.search("running", min_score=0)}
    assert {alex.id, sam.id, house.id} <= everyone  # unscoped search keeps today's behaviour


def test_people_are_scoped_by_owner(people_store: MemoryStore) -> None:
    people_store.resolve_person("my wife Sarah", owner="alex")
    people_store.resolve_person("my wife Maria", owner="sam")
    assert people_store.find_person("my wife", owner="alex").name == "Sarah"  # type: ignore[union-attr]
    assert people_store.find_person("my wife", owner="sam").name == "Maria"  # type: ignore[union-attr]


# (who searches, the names a hit on sam's shared fact about his own therapist carries)
ABOUT_CASES = [
    ("alex", ()),  # another user: the fact is shared, sam's person is not ("Dr. Lane" would leak)
    ("sam", ("Dr. Lane",)),  # its owner sees who it is about
    (None, ("Dr. Lane",)),  # unscoped: everyone's, as before
]


@pytest.mark.parametrize(("searcher", "about"), ABOUT_CASES)
def test_a_shared_fact_names_only_the_persons_the_searcher_knows(lexical_store: MemoryStore, searcher: str | None,
                                                                  about: tuple[str, ...]) -> None:
    lexical_store.remember("The therapist's office is closed on Monday", subjects=["my therapist Dr. Lane"],
                           owner="sam", shared=True)
    [search] = lexical_store.search("office closed Monday", owner=searcher)
    [recall] = lexical_store.recall("office closed Monday", owner=searcher)
    assert search.subject_names == recall.subject_names == about


# (who owns the nameless "my therapist", who then says "my therapist Dr. Evil", the person's name after)
LEARN_CASES = [
    (None, "bob", ""),  # a household person: a user's words do not rename it for everyone (was "Dr. Evil")
    (None, None, "Dr. Evil"),  # unbound: learnt, as before
    ("bob", "bob", "Dr. Evil"),  # the user's own person: learnt
]


@pytest.mark.parametrize(("owner", "teller", "name"), LEARN_CASES)
def test_a_user_teaches_only_their_own_persons(lexical_store: MemoryStore, owner: str | None,
                                               teller: str | None, name: str) -> None:
    [first] = lexical_store.remember("My therapist is great", subjects=["my therapist"], owner=owner)
    lexical_store.remember("My therapist's name is Dr. Evil", subjects=["my therapist"], owner=teller)
    assert lexical_store.people(owner)[0].id == first.subjects[0]
    assert lexical_store.people(owner)[0].name == name and lexical_store.people(owner)[0].relation == "therapist"


# -- named notes and archives ------------------------------------------------------------------------

def test_named_notes_by_name_and_alias(people_store: MemoryStore) -> None:
    note = people_store.remember("Water the ferns every Sunday", name="plant care", aliases=["ferns"])[0]
    assert people_store.note("PLANT CARE").id == note.id  # type: ignore[union-attr]
    assert people_store.note("ferns").id == note.id  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="already used"):
        people_store.remember("Something else", name="Ferns")
    people_store.rename_note("plant care", "garden routine")
    assert people_store.note("plant care") is None
    hits = people_store.search("garden routine", mode="lexical", min_score=0)
    assert hits and hits[0].memory.id == note.id  # name tokens are searchable
    people_store.alias_note("garden routine", "green thumb")
    rewritten = people_store.rewrite_note("green thumb", "Water the ferns on Sundays and Wednesdays")
    assert people_store.note("garden routine").id == rewritten.id  # type: ignore[union-attr]
    assert people_store.history(rewritten.id)[0].content == note.content
    assert people_store.remove_note("garden routine") and people_store.note("green thumb") is None


def test_removing_a_note_forgets_its_earlier_versions_and_nothing_else(lexical_store: MemoryStore) -> None:
    first = lexical_store.remember("The wifi password is tulip42", name="wifi")[0]
    second = lexical_store.rewrite_note("wifi", "The wifi password is daisy17")
    third = lexical_store.rewrite_note("wifi", "The wifi password is rose99")
    other = lexical_store.remember("The door code is 1234", name="door")[0]
    unrelated = lexical_store.remember("The wifi router is in the hall")[0]
    assert lexical_store.remove_note("wifi")
    assert [lexical_store.get(m.id) for m in (first, second, third)] == [None, None, None]
    assert lexical_store.get(other.id) is not None and lexical_store.get(unrelated.id) is not None
    hits = lexical_store.search("wifi password", mode="lexical", min_score=0, include_superseded=True)
    assert [h.memory.id for h in hits] == [unrelated.id]  # no old password is left to find


def test_archive_conversation_is_searched_like_facts_and_marks_the_window(people_store: MemoryStore) -> None:
    people_store.add_to_context_window("user", "Let's plan the trip to Lisbon")
    archive = people_store.archive_conversation("We planned a trip to Lisbon in June: flights booked.")
    assert archive.is_archive and archive.expires_at is None
    assert people_store.recall("Lisbon trip")[0].memory.id == archive.id
    assert people_store.get_context_window()[-1]["content"].startswith("[archived conversation:")


# -- one-call context ---------------------------------------------------------------------------------

def test_context_for_attributes_and_respects_the_budget(people_store: MemoryStore) -> None:
    people_store.remember("my wife Sarah likes Italian food", subjects=["my wife Sarah"])
    people_store.remember("The user prefers concise answers")
    people_store.add_to_context_window("user", "I want to cook something tonight")
    ctx = people_store.context_for("What should I cook for my wife?")
    assert "Sarah (wife)" in ctx.text and "about Sarah" in ctx.text and "Italian food" in ctx.text
    assert "I want to cook something tonight" in ctx.text
    small = people_store.context_for("What should I cook for my wife?", max_tokens=25)
    assert small.tokens <= 25 and small.dropped_lines > 0


# -- persistence and modes ------------------------------------------------------------------------------

def test_people_subjects_and_supersession_survive_reopen_and_compaction(config: Config,
                                                                       embedder: OnnxEmbedder) -> None:
    with MemoryStore(config=config, embedder=embedder) as s:
        red = s.remember("User's favorite color is red")[0]
        blue = s.remember("User's favorite color is blue")[0]
        sarah = s.remember("my wife Sarah likes jazz", subjects=["my wife Sarah"], name="sarah music")[0]
    for _ in range(2):  # from the snapshot written on close, then again after a compaction
        with MemoryStore(config=config, embedder=embedder) as s:
            assert s.get(red.id).superseded_by == blue.id  # type: ignore[union-attr]
            assert s.find_person("my wife").name == "Sarah"  # type: ignore[union-attr]
            assert s.get(sarah.id).subjects == sarah.subjects  # type: ignore[union-attr]
            assert s.note("sarah music").id == sarah.id  # type: ignore[union-attr]
            s.compact()


def test_lexical_only_keeps_every_feature(lexical_store: MemoryStore) -> None:
    memory = lexical_store.remember("my wife's name is Sarah", subjects=["my wife"])[0]
    assert lexical_store.recall("Sarah", about="my wife")[0].memory.id == memory.id
    new = lexical_store.correct(memory.id, "my wife's name is Sara")
    assert lexical_store.get(memory.id).superseded_by == new.id  # type: ignore[union-attr]
    assert "Sara" in lexical_store.context_for("who is my wife").text


def test_a_store_written_before_people_aware_memory_opens(tmp_path: Path, base_config: Config) -> None:
    data = tmp_path / "v1"
    shutil.copytree(FIXTURE_V1, data)
    cfg = base_config.replace("memory", path=str(data), timezone="UTC")
    with MemoryStore(config=cfg, embedder=None) as store:
        assert store.get("f0").subjects == () and store.people() == []  # type: ignore[union-attr]
        added = store.remember("my son Tom loves trains", subjects=["my son Tom"])[0]
    with MemoryStore(config=cfg, embedder=None) as store:
        assert store.get(added.id).subjects and store.find_person("my son").name == "Tom"  # type: ignore[union-attr]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({}, "content"),  # neither content nor facts
    ({"content": "a", "facts": [{"content": "b"}]}, "content"),  # both
    ({"facts": []}, "facts"),  # empty batch
    ({"facts": [{"content": "a", "when": 1}]}, "facts"),  # unknown key
    ({"content": "a", "subjects": "Sarah"}, "subjects"),  # a string, not a list
    ({"content": "a", "expires_in_days": -1}, "expires_in_days"),  # negative
    ({"content": "a", "aliases": ["x"]}, "aliases"),  # aliases without a name
    ({"content": "a", "name": "n", "aliases": ["x"] * 33}, "aliases"),  # too many aliases
    ({"content": "a", "name": "n", "aliases": 5}, "aliases"),  # not a list: was a TypeError
    ({"facts": [{"content": "a", "name": "n", "aliases": 5}]}, "aliases"),  # the same in a batch (the LLM tool)
    ({"facts": [{"content": "a", "name": "n", "aliases": {"x": 1}}]}, "aliases"),  # a map: was its keys
])
def test_bad_remember_calls_are_refused_and_store_nothing(lexical_store: MemoryStore, kwargs: dict[str, object],
                                                          field: str) -> None:
    with pytest.raises(ValidationError) as err:
        lexical_store.remember(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field and len(lexical_store) == 0


def test_decay_archives_unused_facts_and_retrieval_refreshes_them(config: Config) -> None:
    cfg = config.replace("decay", enabled=True, rate_per_day=0.1, threshold=0.5)
    day = 86400.0
    with MemoryStore(config=cfg, embedder=None) as store:
        old = store.store_batch([{"content": "The spare key is under the blue pot", "created_at": 1_700_000_000.0}])[0]
        kept = store.store_batch([{"content": "The spare bike key is in the drawer", "created_at": 1_700_000_000.0}])[0]
        store.confirm(kept.id)
        later = 1_700_000_000.0 + 10 * day  # exp(-1) = 0.37 < 0.5
        hits = {h.memory.id for h in store.search("spare key", now=later, min_score=0)}
        assert hits == {kept.id}  # the unused fact left default retrieval; the confirmed one stays
        shown = {h.memory.id for h in store.search("spare key", now=later, min_score=0, include_superseded=True)}
        assert shown == {old.id, kept.id} and store.get(old.id) is not None  # archived, never deleted
        fresh = 1_700_000_000.0 + 2 * day  # exp(-0.2) = 0.82: found, so its clock is refreshed
        assert old.id in {h.memory.id for h in store.search("spare key", now=fresh, min_score=0)}
    with MemoryStore(config=cfg, embedder=None) as store:  # the refresh was journaled on close
        at = 1_700_000_000.0 + 2 * day + 5 * day  # 5 days after the refresh: exp(-0.5) = 0.61
        assert old.id in {h.memory.id for h in store.search("spare key", now=at, min_score=0)}


def test_a_damaged_snapshot_of_a_people_store_is_rebuilt(config: Config) -> None:
    from reachy_memory.storage import backup as bk

    with MemoryStore(config=config, embedder=None) as s:  # one generation: no previous snapshot to start from
        s.remember("my niece Ida likes kites", subjects=["my niece Ida"])
        later = s.remember("my nephew Bo likes boats", subjects=["my nephew Bo"])[0]  # person ops in the journal
    snapshot = config.data_dir / "snapshot.rms"
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    bk.repair(config.data_dir, config)
    with MemoryStore(config=config, embedder=None) as s:
        assert s.find_person("my nephew").name == "Bo" and s.find_person("my niece").name == "Ida"  # type: ignore[union-attr]
        assert s.get(later.id).subjects == later.subjects  # type: ignore[union-attr]


@pytest.mark.parametrize(("memory", "field"), [
    ({"id": "a", "content": "x", "created_at": "2026-01-01T00:00:00+00:00", "subjects": "p1"}, "subjects"),  # a str
    ({"id": "a", "content": "x", "created_at": "yesterday"}, "created_at"),  # not a time
    ({"id": "a", "content": "x", "created_at": 4_000_000_000_000.0}, "created_at"),  # out of range
    ({"id": "a", "content": "x", "created_at": 1.7e9, "owner": 5}, "owner"),  # not a string
    ({"id": "a", "content": "x", "created_at": 1.7e9, "shared": "yes"}, "shared"),  # not a bool
    ({"id": "a", "content": "x", "created_at": 1.7e9, "name": "n" * 500}, "name"),  # too long
    ({"id": "a", "content": "", "created_at": 1.7e9}, "content"),  # empty
])
def test_hostile_imports_are_refused_before_anything_is_written(lexical_store: MemoryStore,
                                                                memory: dict[str, object], field: str) -> None:
    good = {"id": "ok", "content": "kept out too", "created_at": 1.7e9}
    person = {"id": "p1", "name": "Ida", "created_at": 1.7e9}
    with pytest.raises(ValidationError) as err:
        lexical_store.import_memories([good] * 1 + [memory], people=[person], batch=1)
    assert err.value.field == field and len(lexical_store) == 0 and lexical_store.people() == []


# -- what a model's remember calls send (the LLM-surface attack, 2026-11-25) -------------------

@pytest.mark.parametrize(("second", "field"), [
    ({"content": "He hates boats", "subjects": ["he"]}, "reference"),  # a pronoun as a subject
    ({"content": "Tall", "subjects": ["x" * 150]}, "subjects"),  # a name past the limit
    ({"content": "Chess on Fridays", "subjects": ["John and Mary"]}, "subjects"),  # two persons in one
    ({"content": "Takes the bus", "name": "commute"}, "name"),  # a note name already used by fact 1
])
def test_a_refused_fact_in_a_batch_stores_nothing(people_store: MemoryStore, second: dict[str, Any],
                                                  field: str) -> None:
    """All or nothing: fact 1 used to be committed before fact 2 was refused, and the
    model's retry of the whole batch stored fact 1 again."""
    first = {"content": "Sarah loves sailing", "subjects": ["Sarah"], "name": "commute"}
    for _ in range(2):  # the retry a model makes
        with pytest.raises(ValidationError) as refused:
            people_store.remember(facts=[first, second])
        assert refused.value.field == field
    assert len(people_store) == 0 and people_store.people() == []


@pytest.mark.parametrize(("reference", "says"), [
    ("her brother", "someone other than the user"),  # another person's relation: not a new 'Her Brother'
    ("Sarah's brother", "someone other than the user"),  # was read as Sarah herself
    ("John and Mary", "['John', 'Mary']"),  # was one person 'John and Mary'
    ("Bob, Alice", "['Bob', 'Alice']"),  # a list in one string
    ("42", "does not name a person"),  # no letters
    ("she", "pronoun"),  # a pronoun, with words a model can act on (not 'use subjects_in')
])
def test_subjects_that_name_no_one_person_are_refused_with_what_to_send(people_store: MemoryStore, reference: str,
                                                                        says: str) -> None:
    people_store.remember("Sarah likes tea", subjects=["Sarah"])
    with pytest.raises(ValidationError) as refused:
        people_store.remember("likes chess", subjects=[reference])
    assert says in refused.value.message and "subjects_in" not in refused.value.message
    assert len(people_store) == 1 and [p.display_name for p in people_store.people()] == ["Sarah"]


@pytest.mark.parametrize("user", ["me", "I", "myself", "user", "the user", "you", "Reachy"])
def test_the_user_or_the_robot_as_a_subject_is_a_fact_about_nobody(people_store: MemoryStore, user: str) -> None:
    """They made persons 'Me', 'User'...: the user's own facts then split over fake people
    and never superseded each other."""
    red = people_store.remember("My favourite colour is red", subjects=[user])[0]
    both = people_store.remember("Tom likes jazz", subjects=[user, "Tom"])[0]
    assert red.subjects == () and people_store.people()[0].display_name == "Tom"
    assert len(people_store.people()) == 1 and len(both.subjects) == 1


@pytest.mark.parametrize("sentence", [
    "Likes green tea", "Loves hiking", "Prefers tea over coffee", "Trash day is Monday", "Usually wakes at 7",
    "Allergic to peanuts", "Birthday party on Saturday",
])
def test_subject_less_facts_a_model_writes_make_no_person(people_store: MemoryStore, sentence: str) -> None:
    assert people_store.remember(sentence)[0].subjects == () and people_store.people() == []


def test_remember_told_the_same_fact_again_keeps_one(people_store: MemoryStore) -> None:
    """A model's retry stored a second copy of the same fact, which then crowded results."""
    first = people_store.remember("Sarah is allergic to peanuts", subjects=["Sarah"])[0]
    again = people_store.remember("Sarah is  allergic to peanuts ", subjects=["Sarah"])[0]
    assert again.id == first.id and len(people_store) == 1
    other = people_store.remember("Sarah is allergic to peanuts", subjects=["Sarah"], shared=True)[0]
    assert other.id != first.id  # another sharing is another fact
    tom = people_store.remember("Sarah is allergic to peanuts", subjects=["Tom"])[0]
    assert tom.id != first.id and len(people_store) == 3


@pytest.mark.parametrize(("told", "later"), [
    (("The wifi password is Blue42Sky", "The wifi password is blue42sky"), 0),  # case matters: another code
    (("Sarah visited today", "Sarah visited today"), 2 * 3600),  # dated by its telling: the event recurs
])
def test_what_is_not_a_repeat_is_stored(people_store: MemoryStore, told: tuple[str, str], later: float) -> None:
    import time as clock

    first = people_store.remember(told[0])[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(clock, "time", lambda: first.created_at.timestamp() + later)
        second = people_store.remember(told[1])[0]
    assert second.id != first.id and second.content == told[1]


def test_a_fact_told_again_hours_later_refreshes_the_one_kept(people_store: MemoryStore) -> None:
    """It was stored again past an hour (a retry window); a restatement is the same fact."""
    import time as clock

    first = people_store.remember("The wifi password is Blue42Sky")[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(clock, "time", lambda: first.created_at.timestamp() + 2 * 3600)
        second = people_store.remember("the wifi password is Blue42Sky.")[0]
    assert second.id == first.id and len(people_store) == 1 and second.metadata["confirmations"] == 1


def test_a_confirmed_fact_told_again_is_not_stored_twice(people_store: MemoryStore) -> None:
    first = people_store.remember("Tom is allergic to cats", subjects=["Tom"])[0]
    people_store.confirm(first.id)
    assert people_store.remember("Tom is allergic to cats", subjects=["Tom"])[0].id == first.id


def test_a_decayed_fact_told_again_is_refreshed_visible(config: Config, embedder: OnnxEmbedder,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Returning the decayed (hidden) one left the fact invisible to search and recall; told
    again, it is the kept fact refreshed (its decay clock too)."""
    import time as clock

    cfg = config.replace("decay", enabled=True, rate_per_day=0.1, threshold=0.5)
    with MemoryStore(config=cfg, embedder=embedder) as s:
        old = s.remember("Tom likes green tea", subjects=["Tom"])[0]
        monkeypatch.setattr(clock, "time", lambda: old.created_at.timestamp() + 30 * 86400)
        assert s.recall("green tea", about="Tom") == []  # decayed
        new = s.remember("Tom likes green tea", subjects=["Tom"])[0]
        assert new.id == old.id and [h.memory.id for h in s.recall("green tea", about="Tom")] == [new.id]
    off = cfg.replace("memory", dedupe=False, path=cfg.memory.path + "-off")
    with MemoryStore(config=off, embedder=embedder) as s:  # without dedupe: a fresh copy, as before
        old = s.remember("Tom likes green tea", subjects=["Tom"])[0]
        monkeypatch.setattr(clock, "time", lambda: old.created_at.timestamp() + 30 * 86400)
        new = s.remember("Tom likes green tea", subjects=["Tom"])[0]
        assert new.id != old.id and [h.memory.id for h in s.recall("green tea", about="Tom")] == [new.id]


@pytest.mark.parametrize("name", ["Will", "June", "May", "April", "Love"])
def test_a_name_that_is_also_a_common_word_is_still_a_subject(people_store: MemoryStore, name: str) -> None:
    """The user/robot rule dropped every stop word: 'Will' became a fact about nobody."""
    fact = people_store.remember(f"{name} is allergic to peanuts", subjects=[name])[0]
    assert [p.display_name for p in people_store.people()] == [name] and len(fact.subjects) == 1


@pytest.mark.parametrize(("reference", "says"), [
    ("my wife's brother", "someone other than the user"),  # was linked to the wife
    ("my mom and dad", "['my mom', 'dad']"),  # was the mother only
    ("my wife and Tom", "['my wife', 'Tom']"),  # was a relation 'wife and tom'
])
def test_relation_forms_naming_someone_else_or_several_are_refused(people_store: MemoryStore, reference: str,
                                                                   says: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(says)):
        people_store.remember("He is a pilot", subjects=[reference])
    assert len(people_store) == 0 and people_store.people() == []


@pytest.mark.parametrize("second", [
    {"content": "router notes", "name": "r\ud800"},  # a lone surrogate in a note name
    {"content": "My wife's name is A" + "a" * 120, "subjects": ["my wife"]},  # the name the fact gives is too long
    {"content": "router notes", "name": "router", "aliases": ["Wifi"]},  # an alias fact 1 names
])
def test_what_fails_late_in_a_batch_is_caught_before_any_fact(people_store: MemoryStore,
                                                               second: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        people_store.remember(facts=[{"content": "Sarah likes tea", "subjects": ["Sarah"], "name": "wifi"}, second])
    assert len(people_store) == 0 and people_store.people() == []


def test_a_note_may_have_its_own_name_as_an_alias(people_store: MemoryStore) -> None:
    assert people_store.remember("router on the shelf", name="wifi", aliases=["WiFi"])[0].name == "wifi"


def test_top_level_subjects_and_expiry_apply_to_each_fact_that_gives_none(people_store: MemoryStore) -> None:
    """They were dropped silently when facts were given."""
    a, b = people_store.remember(facts=[{"content": "Likes green tea"}, {"content": "Plays chess",
                                                                          "subjects": ["Tom"]}],
                                 subjects=["Sarah"], expires_in_days=1)
    assert {p.display_name for p in people_store.people()} == {"Sarah", "Tom"}
    assert a.subjects != b.subjects and a.expires_at is not None and b.expires_at is not None
    with pytest.raises(ValidationError):  # a name belongs to one fact
        people_store.remember(facts=[{"content": "x"}, {"content": "y"}], name="shopping")


def _turn(i: int, day: str = "2026-01-01") -> dict[str, Any]:
    return {"id": f"t{i}", "content": f"turn {i} about kites", "type": "conversation",
            "created_at": f"{day}T10:0{i}:00+00:00"}


def test_an_in_process_import_links_turns_across_its_batches(people_store: MemoryStore) -> None:
    people_store.import_memories([_turn(i) for i in reversed(range(4))], batch=1)
    assert [people_store._state.records[f"t{i}"].follows for i in range(4)] == [None, "t0", "t1", "t2"]


def test_an_import_with_a_bad_id_anywhere_writes_nothing(people_store: MemoryStore) -> None:
    rows = [_turn(i) for i in range(4)] + [{**_turn(5), "id": ""}]
    with pytest.raises(ValidationError, match="memory 4: id"):
        people_store.import_memories(rows, [{"id": "p1", "name": "Ann", "created_at": "2026-01-01T00:00:00+00:00"}],
                                     batch=2)
    assert len(people_store) == 0 and people_store.people() == []


@pytest.mark.parametrize(("person", "says"), [
    ({"id": "p1"}, "needs a name or a relation"),  # was stored named 'None'
    ({"id": "p2", "name": 5}, "name must be a string"),  # was stored named '5'
    ({"id": " p4", "name": "Ann"}, "must not start or end with whitespace"),  # no person operation could name it
])
def test_an_imported_person_needs_a_text_name_or_relation(lexical_store: MemoryStore, person: dict[str, Any],
                                                          says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        lexical_store.import_memories([], [{**person, "created_at": "2026-01-01T00:00:00+00:00"}])
    assert lexical_store.people() == []


def test_an_imported_relation_only_person_has_no_name(lexical_store: MemoryStore) -> None:
    lexical_store.import_memories([], [{"id": "p3", "relation": "wife", "created_at": "2026-01-01T00:00:00+00:00"}])
    [wife] = lexical_store.people()
    assert (wife.name, wife.relation) == ("", "wife")


def test_confirmed_facts_do_not_push_a_conflicting_one_out_of_supersession(people_store: MemoryStore) -> None:
    """Protected facts stayed among the 10 candidates and were dropped after the cut: ten
    confirmed, more similar facts left 'coffee' live beside the newer 'tea'."""
    for extra in ("with milk", "with lemon", "with honey", "with mint", "with sugar", "with ginger", "at noon",
                  "at night", "in winter", "in summer"):
        people_store.confirm(people_store.remember(f"Tom's favourite drink is tea {extra}", subjects=["Tom"])[0].id)
    coffee = people_store.remember("Tom's favourite drink is coffee", subjects=["Tom"])[0]
    people_store.remember("Tom's favourite drink is tea", subjects=["Tom"])
    assert people_store.get(coffee.id).superseded_at is not None


@pytest.mark.parametrize("links", [
    {"a": "a"},  # superseded by itself
    {"a": "b", "b": "a"},  # by each other: both hidden, neither current
    {"a": "b", "b": "c", "c": "a", "d": "a"},  # a longer loop, reached from outside it
])
def test_an_import_whose_supersession_links_loop_writes_nothing(lexical_store: MemoryStore,
                                                                links: dict[str, str]) -> None:
    memories = [{"id": i, "content": f"fact {i}", "created_at": 1.7e9, "superseded_at": 1.7e9 + 1,
                 "superseded_by": to} for i, to in links.items()]
    with pytest.raises(ValidationError, match="loop") as err:
        lexical_store.import_memories([{"id": "ok", "content": "kept out too", "created_at": 1.7e9}, *memories])
    assert err.value.field == "superseded_by" and len(lexical_store) == 0


def test_an_import_with_a_supersession_chain_is_accepted(lexical_store: MemoryStore) -> None:
    chain = [{"id": "v1", "content": "Ida lives in Lyon", "created_at": 1.7e9, "superseded_at": 1.7e9 + 5,
              "superseded_by": "v2"},
             {"id": "v2", "content": "Ida lives in Paris", "created_at": 1.7e9 + 5, "superseded_at": 1.7e9 + 9,
              "superseded_by": "v3"},
             {"id": "v3", "content": "Ida lives in Nice", "created_at": 1.7e9 + 9},
             {"id": "x", "content": "superseded by a stored memory", "created_at": 1.7e9, "superseded_by": "elsewhere"}]
    assert lexical_store.import_memories(chain)["memories"] == 4
    assert [m.id for m in lexical_store.history("v2")] == ["v1", "v2", "v3"]


# -- owners on plain writes: turns, store, store_batch ------------------------------------------

def _owned_turns(store: MemoryStore) -> dict[str, str]:
    """One turn per scope, each a write path that takes an owner; returns content -> id."""
    alice = store.record_turn("user", "Alice here: I am secretly seeing Carol on Fridays", owner="alice")
    bob = store.record_turn("user", "Bob here: I am seeing the dentist on Fridays", owner="bob")
    [house] = store.store_batch([{"content": "Dana here: we are seeing the plumber on Fridays",
                                  "memory_type": "conversation", "owner": "dana", "shared": True}])
    anyone = store.store("Someone is seeing the gardener on Fridays", "conversation")
    return {"alice": alice.id, "bob": bob.id, "house": house.id, "anyone": anyone.id}


# (who searches, whose turns a search for "seeing Fridays" finds)
TURN_SCOPE_CASES = [
    ("alice", {"alice", "house", "anyone"}),  # her own, the shared and the unscoped turn; not Bob's
    ("bob", {"bob", "house", "anyone"}),  # was: Alice's secret too
    ("erin", {"house", "anyone"}),  # a user with no turns of their own
    (None, {"alice", "bob", "house", "anyone"}),  # unbound: every user's, as before
]


@pytest.mark.parametrize(("searcher", "found"), TURN_SCOPE_CASES)
def test_owned_turns_are_found_by_their_owner_only_and_survive_a_reopen(config: Config, searcher: str | None,
                                                                        found: set[str]) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        ids = _owned_turns(store)
    with MemoryStore(config=config, embedder=None) as store:  # closing compacted: owners come from the snapshot
        hits = {h.memory.id for h in store.search("seeing Fridays", "conversation", 10, 0.0, owner=searcher)}
        assert hits == {ids[k] for k in found}
        assert (store.get(ids["alice"]).owner, store.get(ids["house"]).shared) == ("alice", True)  # type: ignore[union-attr]


# (the call, the field refused): each before anything is written, the window included
BAD_OWNED_WRITES: list[tuple[Any, str]] = [
    (lambda s: s.record_turn("user", "hi", owner=""), "owner"),  # empty
    (lambda s: s.record_turn("user", "hi", owner=7), "owner"),  # not a string
    (lambda s: s.record_turn("user", "hi", owner="a" * 201), "owner"),  # over 200 characters
    (lambda s: s.record_turn("user", "hi", owner="\ud800"), "owner"),  # a lone surrogate
    (lambda s: s.store("hi", "conversation", owner=["alice"]), "owner"),
    (lambda s: s.store("hi", "conversation", owner="alice", shared="yes"), "shared"),  # not a bool
    (lambda s: s.store_batch([{"content": "fine", "memory_type": "conversation"},
                              {"content": "hi", "owner": ""}]), "owner"),  # the batch's first item neither
]


@pytest.mark.parametrize(("call", "field"), BAD_OWNED_WRITES)
def test_a_bad_owner_on_a_write_stores_nothing(lexical_store: MemoryStore, call: Any, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        call(lexical_store)
    assert err.value.field == field and len(lexical_store) == 0 and lexical_store.get_context_window() == []


# (the second write with the first's id, whether it is the same memory): as for content
RETRY_CASES = [
    ({"owner": "alice"}, True),  # the same owner: an idempotent retry
    ({"owner": "bob"}, False),  # another owner: a retry must not move it into Bob's scope
    ({}, False),  # no owner: neither (it would be unscoped)
    ({"owner": "alice", "shared": True}, False),  # shared now: every user would see it
]


@pytest.mark.parametrize(("again", "same"), RETRY_CASES)
def test_a_retry_with_another_owner_is_refused_like_other_content(lexical_store: MemoryStore,
                                                                  again: dict[str, Any], same: bool) -> None:
    first = lexical_store.store("I am seeing Carol", "conversation", id="turn-1", owner="alice")
    if same:
        assert lexical_store.store("I am seeing Carol", "conversation", id="turn-1", **again).id == first.id
    else:
        with pytest.raises(ValidationError, match="already used by another memory"):
            lexical_store.store("I am seeing Carol", "conversation", id="turn-1", **again)
    assert len(lexical_store) == 1 and lexical_store.get("turn-1").owner == "alice"  # type: ignore[union-attr]


def test_owner_less_writes_are_unscoped_as_before(lexical_store: MemoryStore) -> None:
    turn = lexical_store.record_turn("user", "hello there")
    memory = lexical_store.store("a plain fact", id="f1")
    assert (turn.owner, turn.shared, memory.owner, memory.shared) == (None, False, None, False)
    assert lexical_store.store("a plain fact", id="f1").id == "f1"  # its retry, as before


# -- the people attack (2026-11-26) ------------------------------------------------------------

@pytest.mark.parametrize("links", [
    [("a", "b"), ("b", "a")],  # by each other
    [("a", "b"), ("b", "c"), ("c", "a")],  # a longer loop closed by the last link
])
def test_a_supersede_that_would_close_a_loop_is_refused(lexical_store: MemoryStore,
                                                        links: list[tuple[str, str]]) -> None:
    """Explicit ``supersede`` closed loops an import refuses (a memory hidden behind
    another that is hidden behind it): every memory of the loop was hidden, and the
    store's own export could not be imported again."""
    ids = {k: lexical_store.store(f"Ida fact {k}", "fact").id for k in "abc"}
    *chain, closing = links
    for old, new in chain:
        lexical_store.supersede(ids[old], ids[new])
    with pytest.raises(ValidationError, match="loop") as err:
        lexical_store.supersede(ids[closing[0]], ids[closing[1]])
    assert err.value.field == "new_id" and lexical_store.get(ids[closing[0]]).superseded_by is None  # type: ignore[union-attr]
    exported = [m.to_dict() for m in lexical_store.export_page()[0]]
    with MemoryStore(f"{lexical_store.path}-copy", config=lexical_store.config, embedder=None) as copy:
        assert copy.import_memories(exported)["memories"] == 3


@pytest.mark.parametrize(("name", "aliases"), [("WIFI", []), ("router", ["Wifi"])])
def test_an_import_naming_a_note_by_a_stored_notes_name_writes_nothing(config: Config, name: str,
                                                                        aliases: list[str]) -> None:
    """An imported note took a name (or alias) a stored note holds: two notes of one
    name, ``note()`` answering the imported one, and after an update of the stored one and
    a clean close, the other again (the names index rebuilt in table order)."""
    with MemoryStore(config=config, embedder=None) as store:
        [wifi] = store.remember("The wifi password is hunter2", subjects=[], name="wifi")
        clash = {"id": "imported", "content": "another note", "created_at": 1.7e9, "name": name, "aliases": aliases}
        with pytest.raises(ValidationError, match="already used by memory") as err:
            store.import_memories([{"id": "ok", "content": "kept out too", "created_at": 1.7e9}, clash])
        assert err.value.field == "name" and len(store) == 1
        assert store.import_memories([wifi.to_dict()])["memories"] == 0  # the note itself: present, kept
        store.confirm(wifi.id)
    with MemoryStore(config=config, embedder=None) as store:
        assert store.note("wifi").id == wifi.id  # type: ignore[union-attr]


def test_an_import_giving_one_note_name_to_two_memories_writes_nothing(lexical_store: MemoryStore,
                                                                       tmp_path: Path) -> None:
    twins = [{"id": i, "content": f"note {i}", "created_at": 1.7e9, "name": n}
             for i, n in (("a", "Gate"), ("b", "gate"))]
    with pytest.raises(ValidationError, match="'gate'") as err:
        lexical_store.import_memories(twins, batch=1)
    assert err.value.field == "name" and len(lexical_store) == 0
    exported = tmp_path / "twins.jsonl"  # the CLI's check, before the first request is sent
    exported.write_text("".join(json.dumps(t) + "\n" for t in twins))
    with pytest.raises(ValidationError, match=r"twins\.jsonl: the note name"):
        read_jsonl(exported, lexical_store.config)


def test_an_import_anchoring_a_person_to_a_held_external_id_writes_nothing(lexical_store: MemoryStore) -> None:
    """An imported person took an external id a stored person holds: two persons for one
    face, ``person_by_external_id`` answering one of them, and every later update of the
    other refused ("external_id 'face:1' already belongs to ...")."""
    ann = lexical_store.add_person("Ann", external_id="face:1")
    cat = {"id": "c" * 32, "name": "Cat", "external_id": "face:1", "created_at": 1.7e9}
    with pytest.raises(ValidationError, match="already belongs to") as err:
        lexical_store.import_memories([{"id": "ok", "content": "kept out too", "created_at": 1.7e9}], [cat])
    assert err.value.field == "external_id" and len(lexical_store) == 0 and lexical_store.people() == [ann]
    twins = [cat | {"external_id": "face:2"}, cat | {"id": "d" * 32, "name": "Dee", "external_id": "face:2"}]
    with pytest.raises(ValidationError, match="face:2") as err:
        lexical_store.import_memories([], twins)
    assert err.value.field == "external_id" and lexical_store.people() == [ann]
    assert lexical_store.import_memories([], [ann.to_dict()])["people"] == 0  # Ann herself: present, kept


def test_person_and_note_lookups_on_another_thread_than_the_writer(lexical_store: MemoryStore) -> None:
    """``people``, ``find_person``, ``person_by_external_id`` and ``note`` read the registry
    and the names index without the store lock (``search`` and ``get`` take it): beside a
    thread adding and deleting persons and notes they raised "dictionary changed size
    during iteration" within a second."""
    done, errors = threading.Event(), []

    def write() -> None:
        for i in itertools.count():
            if done.is_set():
                return
            person = lexical_store.add_person(f"Person{i}", external_id=f"face:{i}")
            lexical_store.remember(f"note {i}", subjects=[], name=f"note{i}")
            if i % 2:
                lexical_store.delete_person(person.id)
                lexical_store.remove_note(f"note{i}")

    def read() -> None:
        while not done.is_set():
            try:
                lexical_store.people(), lexical_store.find_person("Person5")
                lexical_store.person_by_external_id("face:none"), lexical_store.note("nothing")
            except Exception as exc:  # any exception is the failure reported
                errors.append(exc)
                return

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    with frequent_switches():
        for thread in threads:
            thread.start()
        done.wait(1.5)
        done.set()
        for thread in threads:
            thread.join()
    assert errors == []


def test_an_import_from_before_a_merge_links_its_memories_to_the_kept_person(lexical_store: MemoryStore) -> None:
    """A memory exported before Sarah was merged into Sally came back about Sarah's old id:
    ``recall(about="Sally")`` (or "Sarah", now her alias) left it out, and once Sally was
    deleted it kept a link to nobody (merge_people relinks stored memories, not later ones)."""
    sarah, sally = lexical_store.add_person("Sarah"), lexical_store.add_person("Sally")
    [tea] = lexical_store.remember("Sarah likes tea", subjects=[sarah.id])
    exported, people = [tea.to_dict()], [p.to_dict() for p in lexical_store.people()]
    lexical_store.forget(tea.id)
    lexical_store.merge_people(sally.id, sarah.id)
    assert lexical_store.import_memories(exported, people) == {"people": 0, "memories": 1, "links_left_out": 0,
                                                               "left_out_links": []}
    assert lexical_store.get(tea.id).subjects == (sally.id,)  # type: ignore[union-attr]
    for about in ("Sally", "Sarah"):
        assert [h.memory.id for h in lexical_store.recall("tea", about=about)] == [tea.id]
    lexical_store.delete_person(sally.id)
    assert lexical_store.get(tea.id).subjects == ()  # type: ignore[union-attr]


def test_a_note_named_underscore_does_not_block_every_alias(lexical_store: MemoryStore) -> None:
    """alias_note checked the alias as ``_name_fields("_", [alias])``: the placeholder name
    "_" was checked too, so once a note was named "_" no note could take an alias."""
    lexical_store.remember("The spare key is under the mat", subjects=[], name="_")
    lexical_store.remember("The router is in the hall", subjects=[], name="wifi")
    assert lexical_store.alias_note("wifi", "router").aliases == ("router",)
    with pytest.raises(ValidationError, match="already used by memory"):
        lexical_store.alias_note("wifi", "_")  # a name another note holds stays refused


# -- merges carried by export and import (a person's merged_ids) ------------------------------

# How the persons Ann, Bob and Cy were merged before the export (ids by first name).
MERGES = [
    ("none", lambda s, ids: None),  # an export without merged_ids, as every export before them was
    ("Bob into Ann", lambda s, ids: s.merge_people(ids["ann"], ids["bob"])),
    ("Bob into Ann, then Ann into Cy", lambda s, ids: [s.merge_people(ids["ann"], ids["bob"]),
                                                       s.merge_people(ids["cy"], ids["ann"])]),  # a chain
    ("Bob into Ann, Ann renamed", lambda s, ids: [s.merge_people(ids["ann"], ids["bob"]),
                                                  s.update_person(ids["ann"], name="Annie")]),
    ("Bob into Ann, Ann deleted", lambda s, ids: [s.merge_people(ids["ann"], ids["bob"]),
                                                  s.delete_person(ids["ann"])]),  # the redirect goes with her
]


def _export_then_import(source: MemoryStore, target: MemoryStore, form: str, folder: Path) -> None:
    """What ``reachy-memory export`` then ``import`` do, in-process, in either form."""
    people = person_entries(source.people(), source.person_redirects())
    memories = [m.to_dict() for m in source.export_page(None, 1000)[0]]
    if form == "jsonl":
        lines = [json.dumps({"kind": "person", **p}) for p in people] + [json.dumps(m) for m in memories]
        (folder / "all.jsonl").write_text("".join(f"{line}\n" for line in lines))
        memories, people = read_jsonl(folder / "all.jsonl", target.config)
    else:
        memories, people = parse(render(memories, people))
        check_entries(memories, people, "folder", target.config)
    target.import_memories(memories, people)


@pytest.mark.parametrize("form", ["jsonl", "markdown"])
@pytest.mark.parametrize(("merged", "merge"), MERGES, ids=[m[0] for m in MERGES])
def test_merged_away_person_ids_still_resolve_after_export_and_import(config: Config, tmp_path: Path, form: str,
                                                                      merged: str, merge: Any) -> None:
    """Merges' redirects were not exported: an app holding Bob's id found nobody after an
    import into a fresh store (and recall about him was not filtered)."""
    with MemoryStore(config=config, embedder=None) as source, \
            MemoryStore(tmp_path / "fresh", config=config, embedder=None) as fresh:
        ids = {name: source.add_person(name.title()).id for name in ("ann", "bob", "cy")}
        source.remember("Bob likes green tea", subjects=[ids["bob"]])
        source.remember("Cy likes black coffee", subjects=[ids["cy"]])
        merge(source, ids)
        redirects = source.person_redirects()
        _export_then_import(source, fresh, form, tmp_path)
        _export_then_import(source, fresh, form, tmp_path)  # again: everything present is kept, nothing refused
        assert fresh.person_redirects() == redirects
        for pid in ids.values():
            assert getattr(fresh.find_person(pid), "id", None) == getattr(source.find_person(pid), "id", None)
        bob_facts = [h.memory.content for h in fresh.recall("likes", about=ids["bob"])]
        assert bob_facts == [h.memory.content for h in source.recall("likes", about=ids["bob"])]
    with MemoryStore(tmp_path / "fresh", config=config, embedder=None) as reopened:  # journaled
        assert reopened.person_redirects() == redirects


def _person(pid: str, **fields: Any) -> dict[str, Any]:
    return {"id": pid, "name": pid.title(), "created_at": "2026-01-01T00:00:00+00:00"} | fields


# Exported persons whose merged_ids import refuses (nothing written), and why.
BAD_MERGED_IDS = [
    ([_person("ann", merged_ids=["bob"]), _person("bob")], "is a person of the import"),  # alive and merged away
    ([_person("ann", merged_ids=["x"]), _person("cy", merged_ids=["x"])], "merged into both"),  # two targets
    ([_person("ann", merged_ids=["ann"])], "not another person's id"),  # into itself
    ([_person("ann", merged_ids=[" x"])], "not another person's id"),  # no person operation could name it
    ([_person("ann", merged_ids="x")], "must be a list"),  # a string would be its letters
    ([_person("ann", merged_ids=[5])], "must be a list"),  # ids are text
    ([_person("ann", merged_ids=["dora"])], "live person here"),  # a person of the store (Dora, below)
]


@pytest.mark.parametrize(("people", "says"), BAD_MERGED_IDS)
def test_an_import_refuses_merged_ids_it_cannot_restore(lexical_store: MemoryStore, tmp_path: Path,
                                                        people: list[dict[str, Any]], says: str) -> None:
    lexical_store.import_memories([], [_person("dora")])
    with pytest.raises(ValidationError, match=says):
        lexical_store.import_memories([{"id": "m1", "content": "kept out too", "created_at": 1.7e9}], people)
    assert [p.id for p in lexical_store.people()] == ["dora"] and lexical_store.person_redirects() == {}
    assert len(lexical_store) == 0
    if says != "live person here":  # the files are refused before anything is sent
        (tmp_path / "all.jsonl").write_text("".join(json.dumps({"kind": "person", **p}) + "\n" for p in people))
        with pytest.raises(ValidationError, match=says):
            read_jsonl(tmp_path / "all.jsonl", lexical_store.config)


def test_a_remember_of_several_facts_is_one_frame_all_stored_or_none(config: Config,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up in the middle of a ``remember(facts=[...])``: nothing of it is stored,
    in memory or on disk, and the error says so (the first fact was kept while the error
    said nothing was stored: each fact was its own journal frame).  With room again, the
    same call is one frame, and all of it survives a crash."""
    from store_util import abandon

    from reachy_memory import StorageFullError
    from reachy_memory.storage import journal as jr
    from tests.conftest import HashEmbedder

    facts = [{"content": "the robot likes the garden"}, {"content": "My wife Sarah likes green tea"},
             {"content": "Sarah's brother Tom plays chess"}]
    real, room = jr._os.write, [0]

    def write(fd: int, data: Any) -> int:
        if len(data) > room[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        room[0] -= len(data)
        return real(fd, data)

    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        journal = store._storage.journal
        size = journal.size
        store.remember_fact("the robot lives in Lyon")
        room[0] = (journal.size - size) * 3 // 2  # the disk takes one fact's frame, not two
        frames = len(jr.read_file(journal.path, jr.JOURNAL).frames)
        monkeypatch.setattr(jr._os, "write", write)
        with pytest.raises(StorageFullError):
            store.remember(facts=facts)
        assert len(store) == 1 and store.people() == []  # none of it, not in memory either
        assert len(jr.read_file(journal.path, jr.JOURNAL).frames) == frames  # nor on disk
        monkeypatch.setattr(jr._os, "write", real)
        stored = store.remember(facts=facts)
        assert len(stored) == 3 and len(jr.read_file(journal.path, jr.JOURNAL).frames) == frames + 1  # one frame
        people = sorted(p.name for p in store.people())
        abandon(store)
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        assert all(store.get(m.id) is not None for m in stored) and len(store) == 4
        assert sorted(p.name for p in store.people()) == people
