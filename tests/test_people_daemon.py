"""People-aware memory end to end through a real daemon and the client (issue 10):
one test per feature, the client's answers as typed objects."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_util import DaemonProcess
from daemon_util import run_cli as cli

from reachy_memory import MemoryClient, NotFoundError, ValidationError


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("people")).start()
    yield d
    assert d.stop() == 0, d.log.read_text()[-2000:]


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[MemoryClient]:
    with daemon.client(timeout=10) as c:
        yield c


def test_remember_and_recall_about_a_person(client: MemoryClient) -> None:
    first = client.remember("my wife's name is Sarah", subjects=["my wife"], owner="alex")[0]
    second = client.remember("she likes Italian food", subjects=["my wife"], owner="alex")[0]
    assert first.subjects == second.subjects
    hits = client.recall("what food does she like", about="my wife", owner="alex")
    assert hits and hits[0].memory.id == second.id and hits[0].subject_names == ("Sarah",)


def test_supersession_history_correct_confirm(client: MemoryClient) -> None:
    red = client.remember("Alex's favorite color is red", subjects=["Alex"])[0]
    blue = client.remember("Alex's favorite color is blue", subjects=["Alex"])[0]
    assert [m.id for m in client.history(blue.id)] == [red.id, blue.id]
    assert client.get(red.id).superseded_by == blue.id
    green = client.correct(blue.id, "Alex's favorite color is green")
    assert client.confirm(green.id).protected
    shown = client.search("favorite color", include_superseded=True, min_score=0, limit=10)
    assert {red.id, blue.id, green.id} <= {h.memory.id for h in shown}
    with pytest.raises(NotFoundError):
        client.confirm("no-such-memory")


def test_persons_through_the_daemon(client: MemoryClient) -> None:
    person = client.add_person("Tom", relation="son", external_id="face:tom")
    assert client.person_by_external_id("face:tom").id == person.id
    assert client.find_person("my son").name == "Tom"
    found, created = client.resolve_person("my daughter Lily")
    assert created and found.relation == "daughter"
    other = client.add_person("Tommy")
    merged = client.merge_people(person.id, other.id)
    assert "Tommy" in merged.aliases and client.update_person(person.id, relation="grandson").relation == "grandson"
    assert client.delete_person(found.id) and not client.delete_person(found.id)
    assert {p.name for p in client.people()} >= {"Tom"}


def test_a_merged_away_id_through_the_daemon(client: MemoryClient) -> None:
    """Deleting through an id merged away deleted the person it was merged into; it is a
    bad request naming that person, and a retried merge answers the person merged already."""
    ines, nes = client.add_person("Ines"), client.add_person("Nes")
    client.merge_people(ines.id, nes.id)
    with pytest.raises(ValidationError, match=f"{nes.id} was merged into {ines.id}") as caught:
        client.delete_person(nes.id)
    assert caught.value.merged_into == ines.id  # type: ignore[attr-defined]
    assert client.merge_people(ines.id, nes.id).id == ines.id and client.find_person(nes.id).id == ines.id
    assert client.delete_person(ines.id) and client.find_person("Ines") is None


def test_a_deleted_persons_id_is_no_subject_through_the_daemon_and_the_cli(daemon: DaemonProcess,
                                                                             client: MemoryClient) -> None:
    """remember(subjects=[a deleted person's id]) made a person named after the id."""
    gil = client.add_person("Gil")
    client.delete_person(gil.id)
    with pytest.raises(ValidationError, match="not the id of a person here"):
        client.remember("Gil plays chess", subjects=[gil.id])
    done = cli(daemon, "remember", "Gil plays chess", "--about", gil.id)
    assert done.returncode == 2 and "not the id of a person here" in done.stderr, done
    assert all(p.name.casefold() != gil.id for p in client.people())


def test_person_ids_with_spaces_around_them_through_the_daemon(client: MemoryClient) -> None:
    """The client passes ids as given; the daemon reads them as every person operation does
    (delete_person(" id ") answered False, update_person and merge_people not found)."""
    ann, bob = client.add_person("Annika"), client.add_person("Bobbie")
    assert client.update_person(f" {ann.id} ", relation="niece").relation == "niece"
    assert client.merge_people(f" {ann.id}", f"{bob.id} ").id == ann.id
    assert client.delete_person(f"  {ann.id}\u00a0") and client.find_person("Annika") is None


def test_person_metadata_the_rules_refuse_is_a_validation_error(client: MemoryClient) -> None:
    """NaN metadata (which the daemon stored before) is refused as bad_request, not internal."""
    with pytest.raises(ValidationError) as err:
        client.add_person("Quinn", metadata={"score": float("nan")})
    assert err.value.remote_code == "bad_request" and err.value.field == "metadata.score"  # type: ignore[attr-defined]
    assert "Quinn" not in {p.name for p in client.people()}


def test_named_notes_and_archives(client: MemoryClient) -> None:
    note = client.remember("Feed the cat at 7", name="cat routine", aliases=["cat"])[0]
    assert client.note("CAT").id == note.id
    assert client.rename_note("cat routine", "pet routine").name == "pet routine"
    assert client.alias_note("pet routine", "kitty").aliases == ("cat", "kitty")
    rewritten = client.rewrite_note("kitty", "Feed the cat at 7 and 19")
    assert client.note("pet routine").id == rewritten.id and client.remove_note("pet routine")
    archive = client.archive_conversation("We talked about the holiday in Lisbon", name="lisbon talk")
    assert archive.is_archive and client.note("lisbon talk").id == archive.id


def test_context_for_in_one_round_trip(client: MemoryClient) -> None:
    client.remember("my husband Paul is allergic to peanuts", subjects=["my husband Paul"], owner="kim")
    client.add_to_context_window("user", "I'm baking cookies tonight")
    ctx = client.context_for("Can I put peanuts in the cookies for my husband?", owner="kim", max_tokens=200)
    assert "Paul" in ctx.text and "peanuts" in ctx.text and ctx.tokens <= 200
    assert any(p.name == "Paul" for p in ctx.people) and ctx.memories


def test_an_owner_change_hiding_a_person_is_a_bad_request_with_fields(client: MemoryClient) -> None:
    """Giving a household person to Alice while Bob's memory is about them: bad_request,
    its fields as the store's ValidationError has them, nothing changed."""
    uma = client.add_person("Uma")
    client.remember("Uma walks the dog", subjects=[uma.id], owner="bob")
    with pytest.raises(ValidationError, match="1 of owner 'bob'") as caught:
        client.update_person(uma.id, owner="alice", name="Umaa")
    assert caught.value.remote_code == "bad_request"  # type: ignore[attr-defined]
    assert (caught.value.field, caught.value.person_id, caught.value.owner,  # type: ignore[attr-defined]
            caught.value.memories, caught.value.other_owner) == ("owner", uma.id, "alice", 1, "bob")  # type: ignore[attr-defined]
    assert client.find_person(uma.id, owner="bob") == uma
    assert client.update_person(uma.id, owner="bob").owner == "bob"  # every memory about Uma is Bob's


def test_a_person_made_the_households_through_the_daemon_then_two_users_persons_merge(
        client: MemoryClient) -> None:
    """README's way to unite two users' persons (make the kept one the household's, then
    merge) could not be taken through the daemon: the client dropped ``owner=None`` and the
    daemon read a missing owner as "unchanged". ``household=True`` says it."""
    alices, bobs = client.add_person("Nana", owner="alice"), client.add_person("Nana", owner="bob")
    [tea] = client.remember("Nana likes mint tea", subjects=[bobs.id], owner="bob")
    with pytest.raises(ValidationError, match="household=True") as caught:  # the error says the way
        client.merge_people(alices.id, bobs.id)
    assert (caught.value.owner, caught.value.other_owner) == ("alice", "bob")  # type: ignore[attr-defined]
    assert client.update_person(alices.id, owner=None).owner == "alice"  # None: "not given", as documented
    made = client.update_person(alices.id, household=True)
    assert made.owner is None and client.find_person(alices.id, owner="bob") == made
    united = client.merge_people(alices.id, bobs.id)
    assert united.owner is None and client.find_person(bobs.id, owner="bob") == united
    assert client.get(tea.id).subjects == (alices.id,)
    assert [h.memory.id for h in client.recall("mint tea", about="Nana", owner="bob")] == [tea.id]


@pytest.mark.parametrize("owner", ["alice", "bob"])
def test_owner_and_household_together_is_a_bad_request(client: MemoryClient, owner: str) -> None:
    """``household=True`` with an ``owner`` asks for two owners at once: bad_request naming
    "household", nothing changed (not the name given beside them either)."""
    vera = client.add_person("Vera", owner="alice")
    with pytest.raises(ValidationError, match="not both") as caught:
        client.update_person(vera.id, owner=owner, household=True, name="Verena")
    assert caught.value.remote_code == "bad_request"  # type: ignore[attr-defined]
    assert (caught.value.field, caught.value.owner) == ("household", owner)  # type: ignore[attr-defined]
    assert client.find_person(vera.id) == vera


def test_household_through_the_async_client(daemon: DaemonProcess) -> None:
    """The async client shares the API: ``household=True`` works and beside an owner is refused."""
    import asyncio

    from reachy_memory import AsyncMemoryClient

    async def calls() -> tuple[Any, Any]:
        async with AsyncMemoryClient(daemon.endpoint, config=daemon.config, timeout=10) as c:
            ida = await c.add_person("Ida", owner="carl")
            made = await c.update_person(ida.id, household=True)
            with pytest.raises(ValidationError) as caught:
                await c.update_person(ida.id, owner="carl", household=True)
            return made, caught.value

    made, refused = asyncio.run(asyncio.wait_for(calls(), 30))
    assert made.owner is None and refused.field == "household"


def test_the_client_sends_household_only_when_true() -> None:
    """The request without ``household`` is the one daemons before it know (a plain update
    keeps working with them); ``household=True`` goes on the wire as ``household: true``."""
    from reachy_memory.client import _Api

    class Recorder(_Api):
        def _call(self, op: str, args: dict[str, Any], convert: Any = None, timeout: float | None = None) -> Any:
            return op, args

    api = Recorder()
    assert api.update_person("p1", name="Ann") == ("update_person", {"id": "p1", "name": "Ann"})
    assert api.update_person("p1", household=True) == ("update_person", {"id": "p1", "household": True})


def test_an_unscoped_memory_about_a_users_person_is_a_bad_request_with_fields(client: MemoryClient) -> None:
    """remember without an owner (unscoped: every user sees it) about Alice's person by id
    was stored; now bad_request with the store's fields, nothing written."""
    vic = client.add_person("Vic", owner="alice")
    with pytest.raises(ValidationError, match=rf"unscoped.* cannot be about {vic.id} \(Vic, owner 'alice'\)") \
            as caught:
        client.remember("Vic plays chess", subjects=[vic.id])
    assert caught.value.remote_code == "bad_request"  # type: ignore[attr-defined]
    assert (caught.value.field, caught.value.person_id, caught.value.owner,  # type: ignore[attr-defined]
            caught.value.other_owner) == ("subjects", vic.id, None, "alice")  # type: ignore[attr-defined]
    assert client.recall("chess", about=vic.id) == []
    assert client.remember("Vic plays chess", subjects=[vic.id], owner="alice")[0].subjects == (vic.id,)


def test_bad_people_requests_are_bad_request(client: MemoryClient) -> None:
    with pytest.raises(ValidationError) as err:
        client.remember()  # neither content nor facts
    assert err.value.field == "content"
    with pytest.raises(ValidationError):
        client.remember("x", subjects="not a list")  # type: ignore[arg-type]
    assert client.ping()["pong"]


def test_people_survive_a_daemon_restart(daemon: DaemonProcess, tmp_path: Path) -> None:
    with daemon.client(timeout=10) as c:
        memory = c.remember("my sister Ana lives in Porto", subjects=["my sister Ana"])[0]
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client(timeout=10) as c:
        assert c.find_person("my sister").name == "Ana"
        assert c.get(memory.id).subjects == memory.subjects


# (who searches, whose turns a search for "seeing on Fridays" finds)
TURN_SCOPE_CASES = [
    ("ivy", {"ivy", "house", "anyone"}),  # her own, the shared and the unscoped turn
    ("jon", {"jon", "house", "anyone"}),  # not Ivy's (was: every turn)
    (None, {"ivy", "jon", "house", "anyone"}),  # unbound: every user's, as before
]


def test_owned_turns_through_the_daemon_survive_a_restart(daemon: DaemonProcess) -> None:
    with daemon.client(timeout=10) as c:
        ids = {"ivy": c.record_turn("user", "Ivy: I am secretly seeing Carol on Fridays", owner="ivy").id,
               "jon": c.store("Jon: I am seeing the dentist on Fridays", "conversation", owner="jon").id,
               "house": c.store_batch([{"content": "We are seeing the plumber on Fridays", "owner": "kai",
                                        "memory_type": "conversation", "shared": True}])[0].id,
               "anyone": c.record_turn("user", "Someone is seeing the gardener on Fridays").id}
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client(timeout=10) as c:
        for searcher, found in TURN_SCOPE_CASES:
            hits = {h.memory.id for h in c.search("seeing on Fridays", "conversation", 20, 0.0, owner=searcher)}
            assert hits & set(ids.values()) == {ids[k] for k in found}, searcher
        assert (c.get(ids["ivy"]).owner, c.get(ids["house"]).shared) == ("ivy", True)


# (the call, the field refused): the daemon's answer before anything is written
BAD_OWNED_REQUESTS = [
    (lambda c: c.record_turn("user", "bad owner turn", owner=""), "owner"),  # empty: the store's check
    (lambda c: c.record_turn("user", "bad owner turn", owner=7), "owner"),  # not a string: the op table's
    (lambda c: c.store("bad owner turn", "conversation", owner="x" * 201), "owner"),
    (lambda c: c.store_batch([{"content": "bad owner turn", "owner": "ivy", "shared": "yes"}]), "shared"),
]


@pytest.mark.parametrize(("call", "field"), BAD_OWNED_REQUESTS)
def test_a_bad_owner_is_a_bad_request_and_stores_nothing(client: MemoryClient, call: Any, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        call(client)
    assert err.value.remote_code == "bad_request" and err.value.field == field  # type: ignore[attr-defined]
    assert all(h.memory.content != "bad owner turn" for h in client.search("bad owner turn", min_score=0.0))
    assert all(t["content"] != "bad owner turn" for t in client.get_context_window())


def test_export_then_import_into_an_empty_store_reproduces_people_and_links(
        daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    with daemon.client(timeout=10) as c:
        c.remember("my friend Bea plays the cello", subjects=["my friend Bea"], name="bea music", aliases=["cello"])
        old = c.remember("Bea's favorite composer is Bach", subjects=["Bea"])[0]
        c.remember("Bea's favorite composer is Elgar", subjects=["Bea"])
        c.remember("The house wifi is slow", owner="kim", shared=True)
        bea, beatrice = c.find_person("Bea"), c.add_person("Beatrice")
        c.merge_people(bea.id, beatrice.id)  # an app may still hold Beatrice's id
        people = sorted((p.to_dict() for p in c.people()), key=lambda p: p["id"])
        memories = sorted((m.to_dict() for m in _all(c)), key=lambda m: m["id"])
    dump = tmp_path_factory.mktemp("dump") / "all.jsonl"
    assert cli(daemon, "export", str(dump)).returncode == 0
    other = DaemonProcess(tmp_path_factory.mktemp("empty")).start()
    try:
        assert cli(other, "import", str(dump)).returncode == 0
        assert cli(other, "import", str(dump)).returncode == 0  # again: nothing doubles
        with other.client(timeout=10) as c:
            assert sorted((p.to_dict() for p in c.people()), key=lambda p: p["id"]) == people
            assert sorted((m.to_dict() for m in _all(c)), key=lambda m: m["id"]) == memories
            assert c.get(old.id).superseded_by is not None and c.note("cello").name == "bea music"
            assert c.find_person(beatrice.id).id == bea.id  # the merge's redirect came along: it found nobody
            assert "Bea" in cli(other, "recall", "cello", "--about", "Bea").stdout
    finally:
        assert other.stop() == 0


def _all(c: MemoryClient) -> list:
    out, cursor = [], None
    while True:
        page, cursor = c.export_page(cursor, 500)
        out += page
        if cursor is None:
            return out



def test_markdown_export_and_import_round_trip(daemon: DaemonProcess,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    with daemon.client(timeout=10) as c:
        c.remember("my aunt Rosa grows tomatoes", subjects=["my aunt Rosa"])
        aunt, rosie = c.find_person("Rosa"), c.add_person("Rosie")
        c.merge_people(aunt.id, rosie.id)
        redirects = c.person_redirects()
        c.add_to_context_window("user", "hello")
        c.remember_conversation("we talked about tomatoes", {"role": "user"})
        people = sorted((p.to_dict() for p in c.people()), key=lambda p: p["id"])
        memories = sorted((m.to_dict() for m in _all(c)), key=lambda m: m["id"])
    folder = tmp_path_factory.mktemp("md") / "export"
    assert cli(daemon, "export", "--format", "markdown", str(folder)).returncode == 0
    rosa = next(folder.glob("people/Rosa*.md")).read_text()
    assert "relation: aunt" in rosa and "- my aunt Rosa grows tomatoes" in rosa  # readable by a person
    assert list(folder.glob("daily/*.md"))  # the conversation turn, by day
    other = DaemonProcess(tmp_path_factory.mktemp("md-empty")).start()
    try:
        out = cli(other, "import", str(folder))
        assert out.returncode == 0, out.stderr
        with other.client(timeout=10) as c:
            assert sorted((p.to_dict() for p in c.people()), key=lambda p: p["id"]) == people
            assert sorted((m.to_dict() for m in _all(c)), key=lambda m: m["id"]) == memories
            assert c.person_redirects() == redirects and redirects[rosie.id] == aunt.id  # front matter's merged_ids
    finally:
        assert other.stop() == 0
