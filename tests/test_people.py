"""Persons (reachy_memory.people.registry): spec 004's behaviour rows that need no store,
reference matching, merge, owner scoping, input limits and op round trips."""

from __future__ import annotations

import itertools
import unicodedata
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reachy_memory.engine.mentions import extract_mentions, parse_reference
from reachy_memory.errors import NotFoundError, TooLargeError, ValidationError
from reachy_memory.people.registry import _INVISIBLE, MAX_ALIASES, MAX_NAME_CHARS, Person, PersonRegistry, Resolution
from reachy_memory.storage.journal import pack, unpack


class Clock:
    """A clock that moves one second per reading, so 'most recent' is well defined."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def registry() -> PersonRegistry:
    counter = itertools.count(1)
    return PersonRegistry(clock=Clock(), new_id=lambda: f"p{next(counter)}")


def commit(reg: PersonRegistry, resolutions: Iterable[Resolution]) -> list[Person]:
    """What the store will do: journal (here: round-trip through msgpack) then apply."""
    people = []
    for res in resolutions:
        if res.op is not None:
            reg.apply(unpack(pack(res.op)))
        assert res.person is not None
        people.append(res.person)
    return people


def state(reg: PersonRegistry) -> tuple[list[Person], dict[str, str]]:
    return reg.people(), {pid: p.id for pid in reg._redirects if (p := reg.get(pid)) is not None}


# -- spec 004 behaviour rows ------------------------------------------------------------

def test_my_wifes_name_is_sarah_then_she_likes_italian_food_links_one_person() -> None:
    reg = registry()
    [sarah] = commit(reg, reg.subjects_in("Remember my wife's name is Sarah"))
    assert (sarah.name, sarah.relation) == ("Sarah", "wife")
    [again] = reg.subjects_in("She likes Italian food", recent=[sarah.id])
    assert again == Resolution(sarah, False, None)
    # And the relation alone finds her: recall(about="my wife").
    assert reg.find_person("my wife") == sarah
    assert len(reg) == 1


def test_sarah_and_john_are_getting_married_links_both() -> None:
    reg = registry()
    [sarah] = commit(reg, reg.subjects_in("my wife's name is Sarah"))
    found = commit(reg, reg.subjects_in("Remember Sarah and John are getting married"))
    assert [p.name for p in found] == ["Sarah", "John"]
    assert found[0].id == sarah.id  # existing person linked, not duplicated
    assert len(reg) == 2


def test_first_mention_creates_subsequent_mention_finds() -> None:
    reg = registry()
    first = reg.resolve_person("Michael")
    assert first.created and first.op is not None
    commit(reg, [first])
    second = reg.resolve_person("michael")
    assert second == Resolution(first.person, False, None)


def test_my_wife_sarah_creates_with_name_and_relation() -> None:
    reg = registry()
    [person] = commit(reg, [reg.resolve_person("my wife Sarah")])
    assert (person.name, person.relation) == ("Sarah", "wife")


def test_name_learnt_after_relation_only_mention() -> None:
    reg = registry()
    [wife] = commit(reg, [reg.resolve_person("my wife")])
    assert wife.name == "" and wife.display_name == "the user's wife"
    learnt = reg.resolve_person("my wife Sarah")
    assert not learnt.created and learnt.op is not None and learnt.person is not None
    assert (learnt.person.id, learnt.person.name) == (wife.id, "Sarah")


def test_person_not_found_for_filter_returns_none() -> None:
    reg = registry()
    commit(reg, [reg.resolve_person("Sarah")])
    assert reg.find_person("my boss") is None
    assert reg.resolve_person("my boss", create=False) == Resolution(None, False, None)


# -- reference matching -----------------------------------------------------------------

@pytest.mark.parametrize("reference", [
    "Sarah",  # name
    "sarah",  # case-insensitive name
    "SARAH",  # shouting
    "my wife",  # relation phrase
    "wife",  # bare relation
    "my wife's",  # possessive relation
    "My Wife",  # relation, any case
    "Sarah, my wife",  # name and relation
    "Sassy",  # alias
    "sassy",  # alias, any case
])
def test_find_person_references(reference: str) -> None:
    reg = registry()
    [sarah] = commit(reg, [reg.add_person("Sarah", "wife", aliases=["Sassy"])])
    commit(reg, [reg.add_person("John", "brother")])
    assert reg.find_person(reference) == sarah


def test_relation_synonyms_and_unique_first_name() -> None:
    reg = registry()
    [mum, anna] = commit(reg, [reg.add_person("Maria", "mom"), reg.add_person("Anna Schmidt")])
    assert mum.relation == "mother"
    assert reg.find_person("my mum") == mum
    assert reg.find_person("Anna") == anna
    commit(reg, [reg.add_person("Anna Berg")])
    assert reg.find_person("Anna") is None  # two Annas: a first name alone is ambiguous


def test_find_by_id_and_external_id() -> None:
    reg = registry()
    [sarah] = commit(reg, [reg.add_person("Sarah", external_id="face:17")])
    assert reg.find_person(sarah.id) == sarah
    assert reg.find_by_external_id("face:17") == sarah
    assert reg.find_by_external_id("face:18") is None
    with pytest.raises(ValidationError):
        reg.add_person("Other", external_id="face:17")  # one identity, one person


def test_pronoun_picks_most_recent_compatible_person() -> None:
    reg = registry()
    husband, wife = commit(reg, [reg.add_person("Tom", "husband"), reg.add_person("Sarah", "wife")])
    [she] = reg.subjects_in("she likes tea", recent=[husband.id, wife.id])
    assert she.person == wife  # Tom is a husband: "she" skips him
    [he] = reg.subjects_in("he likes tea", recent=[husband.id, wife.id])
    assert he.person == husband
    assert reg.subjects_in("she likes tea") == []  # no context, nobody


def test_pronouns_and_empty_references_are_refused() -> None:
    reg = registry()
    for bad in ("she", "", "   "):
        with pytest.raises(ValidationError):
            reg.resolve_person(bad)


# -- merge, update, delete ----------------------------------------------------------------

def test_merge_unites_aliases_and_relinks() -> None:
    reg = registry()
    keep, other = commit(reg, [reg.add_person("Sarah", "wife", aliases=["Sassy"]),
                               reg.add_person("Sally", aliases=["Sal", "sassy"], external_id="voice:3")])
    plan = reg.merge_people(keep.id, other.id)
    assert plan.relink == {other.id: keep.id}
    for op in plan.ops:
        reg.apply(unpack(pack(op)))
    merged = reg.get(keep.id)
    assert merged is not None and merged.aliases == ("Sassy", "Sally", "Sal")
    assert merged.external_id == "voice:3" and merged.relation == "wife"
    assert reg.get(other.id) == merged  # old id follows the merge
    assert reg.find_person("Sal") == merged and reg.find_person("sally") == merged
    assert len(reg) == 1


def test_merge_chain_relinks_earlier_merges() -> None:
    reg = registry()
    a, b, c = commit(reg, [reg.add_person("A"), reg.add_person("B"), reg.add_person("C")])
    for op in reg.merge_people(b.id, c.id).ops:
        reg.apply(op)
    plan = reg.merge_people(a.id, b.id)
    assert plan.relink == {b.id: a.id, c.id: a.id}
    for op in plan.ops:
        reg.apply(op)
    assert reg.get(c.id) == reg.get(a.id)


def test_merge_refuses_self_and_unknown() -> None:
    reg = registry()
    [a] = commit(reg, [reg.add_person("A")])
    with pytest.raises(ValidationError):
        reg.merge_people(a.id, a.id)
    with pytest.raises(NotFoundError):
        reg.merge_people(a.id, "nobody")


@pytest.mark.parametrize("previous", [
    5,  # not a list: list(5) raised a foreign TypeError
    "abc",  # a string: it was split into ['a', 'b', 'c', ...]
    {"x": 1},  # a map: only its keys were kept (add_person refuses it now; stored persons may hold it)
    ["ok", 3],  # a list holding a non-string
])
def test_merge_refuses_a_callers_merged_external_ids_that_is_not_a_list_of_strings(previous: object) -> None:
    reg = registry()
    keep, other = commit(reg, [reg.add_person("A", external_id="ea"), reg.add_person("B", external_id="eb")])
    reg.apply(keep.to_op() | {"metadata": {"merged_external_ids": previous}})  # as stored (older versions took it)
    with pytest.raises(ValidationError, match="merged_external_ids"):
        reg.merge_people(keep.id, other.id)
    assert reg.get(other.id) == other  # nothing merged


def test_a_person_op_whose_aliases_are_a_string_is_refused_not_split_into_letters() -> None:
    reg = registry()
    [p] = commit(reg, [reg.add_person("A")])
    op = p.to_op() | {"id": "imported", "aliases": "abc"}
    with pytest.raises(ValidationError):
        reg.apply(op)
    assert reg.get("imported") is None


def test_update_and_delete() -> None:
    reg = registry()
    [p] = commit(reg, [reg.add_person("sarah")])
    assert p.name == "Sarah"  # typed in lowercase, shown capitalised
    update = reg.update_person(p.id, relation="my wife", aliases=["Sassy"])
    assert reg.get(p.id) == p  # planning changes nothing
    commit(reg, [update])
    updated = reg.get(p.id)
    assert updated is not None and (updated.relation, updated.aliases) == ("wife", ("Sassy",))
    assert updated.updated_at > p.updated_at and updated.created_at == p.created_at
    reg.apply(reg.delete_person(p.id))
    assert reg.get(p.id) is None and reg.find_person("Sarah") is None
    with pytest.raises(NotFoundError):
        reg.update_person(p.id, name="X")


def test_a_merged_away_id_does_not_delete_the_person_it_was_merged_into() -> None:
    """delete_person(an id merged away) deleted the kept person: an app cleaning up the
    duplicate it had just merged lost the merged person instead."""
    reg = registry()
    ann, bob = commit(reg, [reg.add_person("Ann"), reg.add_person("Bob")])
    for op in reg.merge_people(ann.id, bob.id).ops:
        reg.apply(op)
    with pytest.raises(ValidationError, match=f"{bob.id} was merged into {ann.id}") as caught:
        reg.delete_person(f" {bob.id} ")
    assert caught.value.fields == {"field": "person_id", "merged_into": ann.id}
    assert reg.update_person(bob.id, relation="sister").person.id == ann.id  # reads and updates follow it
    reg.apply(reg.delete_person(ann.id))  # her own id deletes her, and the redirect with her
    with pytest.raises(NotFoundError):
        reg.delete_person(bob.id)


def test_a_retried_merge_changes_nothing_and_a_reversed_one_is_refused() -> None:
    """merge_people(a, b) again after it succeeded (a retry after a timeout) said "cannot
    merge a person with itself"; along a chain (b into a, a into c) the old ids follow."""
    reg = registry()
    a, b, c = commit(reg, [reg.add_person("Ann"), reg.add_person("Bob"), reg.add_person("Cy")])
    for op in reg.merge_people(a.id, b.id).ops:
        reg.apply(op)
    again = reg.merge_people(a.id, b.id)
    assert again.ops == [] and again.person == reg.get(a.id)
    with pytest.raises(ValidationError, match=f"{b.id} was merged into {a.id}"):
        reg.merge_people(b.id, a.id)
    for op in reg.merge_people(c.id, a.id).ops:
        reg.apply(op)
    assert reg.merge_people(b.id, a.id).ops == [] and reg.merge_people(c.id, b.id).person.id == c.id
    with pytest.raises(ValidationError, match=f"merged into {c.id}"):
        reg.delete_person(b.id)


def test_the_external_ids_of_merged_persons_still_find_the_person() -> None:
    """After merging two face-anchored persons the second face found nobody (its id sat in
    metadata only), so a recognizer made the duplicate again; along a chain of merges
    (Dee into Cy, then Bob into Ann, then Ann into Cy) keep's metadata overwrote gone's
    list and Bob's face was recorded nowhere."""
    reg = registry()
    ann, bob, cy, dee = commit(reg, [reg.add_person(n, external_id=f"face:{n}") for n in ("Ann", "Bob", "Cy", "Dee")])
    for keep, other in ((cy, dee), (ann, bob), (cy, ann)):
        for op in reg.merge_people(keep.id, other.id).ops:
            reg.apply(op)
    united = reg.get(cy.id)
    assert united is not None and sorted(united.metadata["merged_external_ids"]) == ["face:Ann", "face:Bob", "face:Dee"]
    assert {getattr(reg.find_by_external_id(f"face:{n}"), "id", None) for n in ("Ann", "Bob", "Cy", "Dee")} == {cy.id}
    with pytest.raises(ValidationError, match=f"already belongs to {cy.id}"):
        reg.add_person("Bobby", external_id="face:Bob")  # a second person for a face the store knows
    assert reg.update_person(cy.id, external_id="face:Bob").person.external_id == "face:Bob"  # his own: allowed
    commit(reg, [reg.update_person(cy.id, metadata={"likes": "tea"})])  # new metadata keeps what the merges noted
    assert reg.find_by_external_id("face:Dee") == reg.get(cy.id)
    commit(reg, [reg.update_person(cy.id, metadata={"merged_external_ids": []})])  # unless it gives the key itself
    assert reg.find_by_external_id("face:Dee") is None


# -- owner scoping ---------------------------------------------------------------------------

def test_people_are_scoped_by_owner() -> None:
    reg = registry()
    alex_wife, sam_wife, dog_walker = commit(reg, [
        reg.add_person("Sarah", "wife", owner="alex"),
        reg.add_person("Julia", "wife", owner="sam"),
        reg.add_person("Pete", "neighbour"),  # household: everyone sees him
    ])
    assert reg.people(owner="alex") == [dog_walker, alex_wife]
    assert reg.people(owner="sam") == [sam_wife, dog_walker]
    assert len(reg.people()) == 3  # unscoped: everyone
    assert reg.find_person("my wife", owner="alex") == alex_wife
    assert reg.find_person("my wife", owner="sam") == sam_wife
    assert reg.find_person("Sarah", owner="sam") is None
    created = reg.resolve_person("Sarah", owner="sam")
    assert created.created and created.person is not None and created.person.owner == "sam"


# -- input limits ------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "error"), [
    ({"name": "x" * (MAX_NAME_CHARS + 1)}, TooLargeError),  # name too long
    ({"name": "Sarah", "aliases": ["a"] * (MAX_ALIASES + 1)}, TooLargeError),  # too many aliases
    ({"name": "Sarah", "aliases": "Sassy"}, ValidationError),  # a string is not a list of aliases
    ({"name": ""}, ValidationError),  # neither name nor relation
    ({"name": "Sa\x00rah"}, ValidationError),  # control character
    ({"name": "\u200b"}, ValidationError),  # only a zero-width space: shown as nothing
    ({"name": "\u200d\u0301", "relation": "wife"}, ValidationError),  # a joiner and a lone accent
    ({"name": "Sarah", "aliases": ["\u2060"]}, ValidationError),  # an invisible alias
    ({"name": "Sarah", "metadata": {"blob": "x" * 5000}}, TooLargeError),  # metadata too large
    ({"name": "Sarah", "metadata": {1: "x"}}, ValidationError),  # non-string metadata key
    ({"name": "Sarah", "aliases": [3]}, ValidationError),  # non-string alias
])
def test_input_limits(kwargs: dict, error: type[Exception]) -> None:
    reg = registry()
    with pytest.raises(error):
        reg.add_person(**kwargs)
    assert len(reg) == 0


@pytest.mark.parametrize("op", [
    {"op": "person_explode", "id": "x"},  # unknown op
    {"op": "person_put", "id": "x"},  # missing fields
    {"op": "person_put", "id": "x", "name": "A", "created_at": "soon", "updated_at": 0},  # bad time
    {"op": "person_merge", "keep": "nobody", "other": "x", "at": 0},  # keep must exist
    {"op": "person_delete", "id": 7},  # id must be a string
    ["not", "a", "dict"],  # not an op at all
])
def test_malformed_ops_are_refused(op: object) -> None:
    with pytest.raises(ValidationError):
        registry().apply(op)  # type: ignore[arg-type]


# -- op round trip ---------------------------------------------------------------------------

names = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=30).filter(
    lambda n: any(unicodedata.category(c) not in _INVISIBLE for c in n))  # a name that shows something
metadata_keys = st.text(min_size=1, max_size=5).filter(lambda k: not k.startswith("$"))  # as memories' keys
person_args = st.fixed_dictionaries({
    "name": names,
    "relation": st.one_of(st.none(), st.sampled_from(["wife", "boss", "mom", "my physio"])),
    "aliases": st.lists(names, max_size=4),
    "owner": st.one_of(st.none(), st.sampled_from(["alex", "sam"])),
    "metadata": st.dictionaries(metadata_keys, st.one_of(st.integers(-5, 5), st.text(max_size=5)), max_size=3),
})
actions = st.lists(st.one_of(
    st.tuples(st.just("add"), person_args),
    st.tuples(st.just("merge"), st.tuples(st.integers(0, 9), st.integers(0, 9))),
    st.tuples(st.just("delete"), st.integers(0, 9)),
    st.tuples(st.just("update"), st.tuples(st.integers(0, 9), names)),
), max_size=25)


@settings(max_examples=60, deadline=None)
@given(actions)
def test_ops_round_trip_through_msgpack(steps: list) -> None:
    live = registry()
    journal: list[bytes] = []

    def run(ops: list[dict]) -> None:
        for op in ops:
            journal.append(pack(op))
            live.apply(op)

    for kind, arg in steps:
        ids = [p.id for p in live.people()]
        if kind == "add":
            run([live.add_person(**arg).op])  # type: ignore[list-item]
        elif kind == "merge" and len(ids) >= 2 and ids[arg[0] % len(ids)] != ids[arg[1] % len(ids)]:
            keep, other = ids[arg[0] % len(ids)], ids[arg[1] % len(ids)]
            if live.get(keep).owner in (None, live.get(other).owner):  # type: ignore[union-attr]
                run(live.merge_people(keep, other).ops)
            else:  # into another owner's person: refused (test_a_merge_across_owners_is_refused_naming_both)
                with pytest.raises(ValidationError, match="cannot merge"):
                    live.merge_people(keep, other)
        elif kind == "delete" and ids:
            run([live.delete_person(ids[arg % len(ids)])])
        elif kind == "update" and ids:
            run([live.update_person(ids[arg[0] % len(ids)], name=arg[1]).op])  # type: ignore[list-item]
    replayed = PersonRegistry()
    for frame in journal:
        replayed.apply(unpack(frame))
    assert state(replayed) == state(live)
    rebuilt = PersonRegistry()
    for op in live.snapshot_ops():
        rebuilt.apply(unpack(pack(op)))
    assert state(rebuilt) == state(live)


# -- mention extraction (the documented rules) -------------------------------------------------

@pytest.mark.parametrize(("sentence", "expected"), [
    # Relation with its name after "'s name is".
    ("Remember my wife's name is Sarah", [("Sarah", "wife", None)]),
    # Two names joined by "and"; "Remember" is a sentence starter, not a name.
    ("Remember Sarah and John are getting married", [("Sarah", None, None), ("John", None, None)]),
    # No name at all: the pronoun is returned for the registry to resolve.
    ("she likes Italian food", [(None, None, "she")]),
    # Apposition before the relation.
    ("Sarah, my wife, likes tea", [("Sarah", "wife", None)]),
    # Apposition after the relation; "Google" follows "at" (an employer, not a person).
    ("My boss Michael works at Google", [("Michael", "boss", None)]),
    # A pet's name is not a person.
    ("Sarah has a dog named Rex", [("Sarah", None, None)]),
    # Honorifics stay with the name; a place after "in" is skipped.
    ("Mr Lee lives in Seoul", [("Mr Lee", None, None)]),
    # A capitalised relation word used as a name.
    ("Mom called about dinner", [(None, "mother", None)]),
    # Months, days and nationalities are not names.
    ("On Monday in May we eat Thai food", []),
    # Spec 000's profile fact: "User" is who the robot talks to, not a person to know; the name is.
    ("User prefers to be called Alex", [("Alex", None, None)]),
    # The robot itself is not one of the people it knows.
    ("Reachy should speak French in Paris", []),
    # A household word at a sentence's start and a token with digits are not names.
    ("The Wi-Fi password is Banana42", []),
    # Acronyms are not names; the name beside them is.
    ("Sarah watches TV with NASA documentaries", [("Sarah", None, None)]),
    # A hyphenated first name still is one.
    ("Jean-Luc visits on Sunday", [("Jean-Luc", None, None)]),
    # Initials beside a relation are a name (the acronym rule made them an unnamed son / wife).
    ("AJ is my son", [("AJ", "son", None)]),
    ("My wife KC likes tea", [("KC", "wife", None)]),
])
def test_extract_mentions(sentence: str, expected: list) -> None:
    got = [(m.reference.name, m.reference.relation, m.reference.pronoun) for m in extract_mentions(sentence)]
    assert got == expected


def test_known_names_are_found_in_lowercase() -> None:
    assert extract_mentions("sarah likes tea") == []  # stated limit: unknown lowercase names
    [mention] = extract_mentions("sarah likes tea", known=["Sarah"])
    assert mention.reference.name == "Sarah"


def test_parse_reference_unknown_relation_word() -> None:
    assert parse_reference("my physio").relation == "physio"
    assert parse_reference("the user's boss").relation == "boss"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=120))
def test_subjects_in_never_raises_on_text(sentence: str) -> None:
    reg = registry()
    for res in reg.subjects_in(sentence):
        assert res.person is not None


@pytest.mark.parametrize("sentence", [
    "Aa " * 1333,  # one endless capitalised run: not a name
    "Aa Bb, my wife " * 260,  # many appositions
    "SARAH AND JOHN ARE GETTING MARRIED " * 100,  # shouting
])
def test_hostile_sentences_at_the_limit_do_not_raise(sentence: str) -> None:
    reg = registry()
    for res in reg.subjects_in(sentence[:4000]):
        assert res.person is not None and len(res.person.name) <= MAX_NAME_CHARS
    with pytest.raises(ValidationError):
        reg.subjects_in("x" * 4001)
