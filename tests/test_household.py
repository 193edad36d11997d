"""Forgetting a person, seeing what is kept about one, and pausing remembering
(docs/HOUSEHOLD.md): the store's semantics, then each face (daemon and both clients, the
CLI, the MCP and conversation tools, the bridge)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import AsyncMemoryClient, Config, MemoryStore, NotFoundError, ValidationError
from reachy_memory.cli import main as cli_main
from reachy_memory.engine.household import Remembering, name_pattern, redact
from reachy_memory.errors import RememberingPausedError
from reachy_memory.integrations.conversation import ForgetPerson, PauseRemembering, ResumeRemembering
from reachy_memory.integrations.reachy_mini import MemoryBridge
from reachy_memory.integrations.tools import TOOLS_BY_NAME, LocalBackend
from tests.daemon_util import DaemonProcess


def seed(store: Any) -> dict[str, str]:
    """A household's memory about Dave (alias Davey), Sarah and others; the ids to look at."""
    [only] = store.remember("Dave is allergic to zebranut peanuts", subjects=["Dave"])
    dave = store.find_person("Dave")
    store.update_person(dave.id, aliases=["Davey"])
    [both] = store.remember("Dave and Sarah play tennis on Sundays", subjects=["Dave", "Sarah"])
    [sarah] = store.remember("Sarah loves lasagne", subjects=["Sarah"])
    [bike] = store.remember("The blue bike in the garage is Davey's", subjects=[])
    said = store.record_turn("user", "My secret is the flamingo password", {"person": "Dave"})
    other = store.record_turn("user", "Dave is coming for dinner tonight", {"person": "Alex"})
    return {"only": only.id, "both": both.id, "sarah": sarah.id, "bike": bike.id, "said": said.id,
            "other": other.id, "dave": dave.id}


def _files_text(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())


# -- the pieces ------------------------------------------------------------------------------------


def test_names_are_removed_as_whole_words_any_case() -> None:
    pattern = name_pattern(["Dave", "Davey", "Dave Smith"])
    assert redact("Dave Smith met davey; Davidson stays. dave's bike", pattern) == \
        "Someone met someone; Davidson stays. Someone's bike"
    assert redact("no names here", pattern) == "no names here"
    assert name_pattern([]) is None and redact("Dave", None) == "Dave"


def test_a_pause_ends_by_itself_on_the_monotonic_clock() -> None:
    wall, mono = [1_800_000_000.0], [100.0]
    r = Remembering(4, clock=lambda: wall[0], monotonic=lambda: mono[0])
    assert r.pause(10)["paused"] is True and r.status()["until"] == 1_800_000_600.0
    wall[0] -= 3600  # the wall clock set back: the pause neither lengthens nor ends
    mono[0] += 599
    assert r.paused
    mono[0] += 1
    assert not r.paused and r.status() == {"paused": False, "until": None, "seconds_left": 0.0, "private_turns": 0}
    for bad in (0, -1, 10_081, float("nan"), "5", True, None):
        with pytest.raises(ValidationError):
            r.pause(bad)
    for i in range(6):
        r.add_turn("user", f"t{i}")
    assert [t[1] for t in r.private_turns()] == ["t2", "t3", "t4", "t5"]  # the window's size


# -- the store ---------------------------------------------------------------------------------------


def test_forget_person_deletes_rewrites_reports_and_survives_a_reopen(config: Config, embedder: Any) -> None:
    with MemoryStore(config=config, embedder=embedder) as store:
        ids = seed(store)
        sarah = store.find_person("Sarah")
        before = len(store)
        plan = store.forget_person("Davey", dry_run=True)  # an alias finds him
        assert len(store) == before and store.find_person("Dave") is not None  # a dry run changes nothing
        done = store.forget_person("Davey")
        assert {k: v for k, v in plan.items() if k != "dry_run"} == {k: v for k, v in done.items() if k != "dry_run"}
        assert done["person"] == {"id": ids["dave"], "name": "Dave"} and done["aliases"] == ["Davey"]
        assert (done["memories_deleted"], done["turns_deleted"], done["unlinked"], done["mentions_rewritten"]) == \
            (1, 1, 1, 3)  # the tennis fact (unlinked), the bike fact and Alex's turn (named)
        assert done["window_turns_dropped"] == 1 and done["window_turns_rewritten"] == 1
        assert done["names_removed"] == ["Dave", "Davey"] and done["names_kept"] == []
        _check_forgotten(store, ids, sarah.id)
        with pytest.raises(NotFoundError):
            store.forget_person("Dave")  # nobody by that name now
        hits = store.search("Dave Davey zebranut flamingo", limit=10, min_score=0.0, include_superseded=True)
        assert all(not re.search(r"Dave|zebranut|flamingo", h.memory.content) for h in hits)
    with MemoryStore(config=config, embedder=embedder) as store:  # the journal replays the same
        _check_forgotten(store, ids, sarah.id)


def _check_forgotten(store: MemoryStore, ids: dict[str, str], sarah: str) -> None:
    assert store.find_person("Dave") is None and store.find_person("Davey") is None
    assert store.get(ids["only"]) is None and store.get(ids["said"]) is None
    both = store.get(ids["both"])
    assert both is not None and both.content == "Someone and Sarah play tennis on Sundays"
    assert both.subjects == (sarah,)
    assert store.get(ids["bike"]).content == "The blue bike in the garage is someone's"
    assert store.get(ids["other"]).content == "Someone is coming for dinner tonight"
    assert store.get(ids["sarah"]).content == "Sarah loves lasagne"
    assert [t["content"] for t in store.get_context_window()] == ["Someone is coming for dinner tonight"]
    assert all("Dave" not in json.dumps(m.to_dict()) for m in store.export_page()[0])


def test_a_name_another_person_has_is_kept(lexical_store: MemoryStore) -> None:
    store = lexical_store
    store.remember("Sam Smith fixes bikes", subjects=["Sam Smith"])
    store.remember("Sam Jones bakes bread", subjects=["Sam Jones"])
    [note] = store.remember("Sam Smith and Sam called at noon", subjects=[])
    plan = store.forget_person("Sam Smith")
    assert plan["names_removed"] == ["Sam Smith"] and plan["names_kept"] == ["Sam"]
    assert store.get(note.id).content == "Someone and Sam called at noon"
    assert store.find_person("Sam Jones") is not None


def test_about_person_lists_what_is_kept_about_them(lexical_store: MemoryStore) -> None:
    ids = seed(lexical_store)
    about = lexical_store.about_person("dave")
    assert about["person"]["name"] == "Dave" and about["person"]["aliases"] == ["Davey"]
    assert [m["id"] for m in about["memories"]] == [ids["only"]]
    assert [m["id"] for m in about["turns"]] == [ids["said"]]
    assert [m["id"] for m in about["shared"]] == [ids["both"]]
    assert {m["id"] for m in about["mentions"]} == {ids["bike"], ids["other"]}
    assert [t["content"] for t in about["window"]] == ["My secret is the flamingo password",
                                                       "Dave is coming for dinner tonight"]
    json.dumps(about)
    for bad in ("", "  ", 5):
        with pytest.raises(ValidationError):
            lexical_store.about_person(bad)  # type: ignore[arg-type]
    with pytest.raises(NotFoundError):
        lexical_store.about_person("Nobody Atall")


def test_while_paused_nothing_reaches_the_disk(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.record_turn("user", "before the guest came")
        status = store.pause_remembering(30)
        assert status["paused"] is True and 1790 < status["seconds_left"] <= 1800
        assert store.remembering()["paused"] is True
        turn = store.record_turn("user", "The guest's code is toucan42", {"person": "Guest"})
        store.add_to_context_window("assistant", "Noted, toucanreply")
        assert store.get(turn.id) is None
        assert [t["content"] for t in store.get_context_window()] == [
            "before the guest came", "The guest's code is toucan42", "Noted, toucanreply"]
        for write in (lambda: store.store("toucan fact"), lambda: store.remember("toucan likes tea", subjects=[]),
                      lambda: store.add_person("Toucan Guest"), lambda: store.set_context("who", "toucan"),
                      lambda: store.resolve_person("Toucan Visitor")):
            with pytest.raises(RememberingPausedError) as caught:
                write()
            assert caught.value.paused_until == status["until"]
        store.compact(full=True)  # a snapshot now holds the window: not the private turns
        assert store.remembering()["private_turns"] == 2
        assert store.resume_remembering()["paused"] is False
        store.store("after the guest left")
        assert len(store) == 2
    assert b"toucan" not in _files_text(config.data_dir)


def test_a_pause_ends_by_itself(lexical_store: MemoryStore) -> None:
    lexical_store.pause_remembering(0.01)  # 0.6 s
    with pytest.raises(RememberingPausedError):
        lexical_store.store("too soon")
    time.sleep(0.7)
    assert lexical_store.remembering()["paused"] is False
    lexical_store.store("remembered again")
    for bad in (0, -5, 10_081, "ten"):
        with pytest.raises(ValidationError):
            lexical_store.pause_remembering(bad)  # type: ignore[arg-type]


def test_forget_person_drops_their_private_window_turns(lexical_store: MemoryStore) -> None:
    seed(lexical_store)
    lexical_store.pause_remembering(10)
    lexical_store.add_to_context_window("Dave", "a private word from him")
    lexical_store.add_to_context_window("user", "Dave said hello")
    done = lexical_store.forget_person("Dave")
    window = [t["content"] for t in lexical_store.get_context_window()]
    assert "a private word from him" not in window and "Someone said hello" in window
    assert done["window_turns_dropped"] >= 2


# -- every face --------------------------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    with DaemonProcess(tmp_path, embedding={"enabled": False}) as d:
        yield d


def test_the_daemon_clients_and_cli(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    with daemon.client() as c:
        ids = seed(c)
        plan = c.forget_person("Dave", dry_run=True)
        assert plan["dry_run"] is True and plan["memories_deleted"] == 1 and c.find_person("Dave") is not None
        about = c.about_person("Dave")
        assert [m["id"] for m in about["memories"]] == [ids["only"]]
        status = c.pause_remembering(5)
        assert status["paused"] is True and c.health()["remembering"]["paused"] is True
        with pytest.raises(RememberingPausedError):
            c.store("not while paused")
        c.record_turn("user", "a private turn")
        assert c.get_context_window()[-1]["content"] == "a private turn"
        assert c.resume_remembering()["paused"] is False
        with pytest.raises(NotFoundError):
            c.forget_person("Nobody Atall")
        for minutes, field in ((0, "minutes"), (7 * 24 * 60 + 1, "minutes"), ("5", "minutes")):
            with pytest.raises(ValidationError) as bad:  # the daemon's checks: the row's, then the store's
                c.pause_remembering(minutes)  # type: ignore[arg-type]
            assert bad.value.field == field
        assert c.health()["remembering"]["paused"] is False

    async def via_async() -> dict[str, Any]:
        client = AsyncMemoryClient(daemon.endpoint, config=daemon.config, timeout=10)
        try:
            assert (await client.pause_remembering(1))["paused"] is True
            assert (await client.resume_remembering())["paused"] is False
            assert (await client.about_person("Sarah"))["person"]["name"] == "Sarah"
            return await client.forget_person("Dave")  # type: ignore[no-any-return]
        finally:
            await client.close()

    done = asyncio.run(via_async())
    assert done["dry_run"] is False and done["turns_deleted"] == 1
    base = ["--config", str(daemon.config_path), "--endpoint", daemon.endpoint]
    assert cli_main([*base, "forget-person", "--dry-run", "Sarah"]) == 0
    out = capsys.readouterr().out
    assert "would forget Sarah" in out and "nothing changed" in out
    assert cli_main([*base, "about", "Sarah", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["person"]["name"] == "Sarah"
    assert cli_main([*base, "pause", "15"]) == 0
    assert capsys.readouterr().out.startswith("paused until")
    assert cli_main([*base, "stats"]) == 0
    assert "paused until" in capsys.readouterr().out
    assert cli_main([*base, "resume"]) == 0
    assert capsys.readouterr().out.strip() == "remembering"
    assert cli_main([*base, "forget-person", "Sarah", "--json"]) == 0
    # her lasagne, and the tennis: about her only since Dave was forgotten ("Someone and Sarah ...")
    assert json.loads(capsys.readouterr().out)["memories_deleted"] == 2
    assert cli_main([*base, "forget-person", "Sarah"]) == 3  # nobody now: not found
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal, before any request
        cli_main([*base, "pause", "0"])
    assert refused.value.code == 2


def test_the_bridge_pauses_and_resumes(daemon: DaemonProcess) -> None:
    with MemoryBridge(daemon.endpoint, config=daemon.config) as bridge:
        assert bridge.pause_remembering(5).result(timeout=10)["paused"] is True
        bridge.record_turn("user", "said while paused")
        assert bridge.resume_remembering().result(timeout=10)["paused"] is False
    with daemon.client() as c:
        assert [m.content for m in c.export_page()[0]] == []  # the turn was not kept
        assert c.get_context_window()[-1]["content"] == "said while paused"


def test_a_paused_daemon_writes_no_turn_to_disk_and_the_pause_ends_by_itself(daemon: DaemonProcess) -> None:
    """A real daemon process: what is said while paused is in no file under the data directory
    (nor the daemon's log), through a compaction and a stop; a short pause ends by itself."""
    with daemon.client() as c:
        c.record_turn("user", "before the guest came")
        assert c.pause_remembering(30)["paused"] is True
        said = c.record_turn("user", "The guest's code is quokka8841", {"person": "Guest"})
        c.add_to_context_window("assistant", "Noted, quokkareply")
        for write in (lambda: c.store("quokka fact"), lambda: c.remember("quokka likes tea", subjects=[]),
                      lambda: c.set_context("who", "quokka"), lambda: c.add_person("Quokka Guest")):
            with pytest.raises(RememberingPausedError):
                write()
        assert c.get(said.id) is None
        assert [t["content"] for t in c.get_context_window()][-2:] == ["The guest's code is quokka8841",
                                                                         "Noted, quokkareply"]
        assert c.health()["remembering"]["private_turns"] == 2
        c.compact()  # a snapshot of the window now: without the private turns
        assert b"quokka" not in _files_text(daemon.data)
        # a short pause replaces the long one and ends by itself (the API is in minutes: 0.05 = 3 s)
        started = time.monotonic()
        assert 2.5 < c.pause_remembering(0.05)["seconds_left"] <= 3.0
        deadline = started + 20.0
        while c.health()["remembering"]["paused"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not c.health()["remembering"]["paused"], "the pause did not end by itself"
        assert time.monotonic() - started >= 2.9  # not before its time
        kept = c.record_turn("user", "After the guest left: kiwi5512")
        assert c.get(kept.id) is not None  # it follows the last kept turn: no copy of a private one
        c.store("kiwi fact")
    assert daemon.stop() == 0  # closing writes no private turn either
    on_disk = _files_text(daemon.data)
    assert b"kiwi5512" in on_disk  # the same reading finds what was kept: it would see a leak
    assert b"quokka" not in on_disk and b"quokka" not in daemon.log.read_bytes()


def test_the_tools(config: Config) -> None:
    """The MCP tools and the conversation tools share the table: run both on a store here."""
    async def scenario() -> None:
        backend = LocalBackend.open(config.replace("embedding", enabled=False))
        try:
            await backend._run(lambda: seed(backend.memory_store))
            plan = await TOOLS_BY_NAME["forget_person"].run(backend, {"person": "'Dave'", "dry_run": True})
            assert plan["dry_run"] is True and plan["memories_deleted"] == 1
            paused = await PauseRemembering(backend)(None, minutes=5)
            assert paused["paused"] is True
            with pytest.raises(RememberingPausedError):  # the model's store refused, nothing written
                await TOOLS_BY_NAME["store_memory"].run(backend, {"content": "a guest's secret"})
            assert (await ResumeRemembering(backend)(None))["paused"] is False
            done = await ForgetPerson(backend)(None, person="Dave")
            assert done["dry_run"] is False and done["turns_deleted"] == 1
            refused = await ForgetPerson(backend.for_owner("alice"))(None, person="Sarah")
            assert "user-bound" in refused["error"]  # it would reach every user's memories
            bad = await PauseRemembering(backend)(None, minutes=0)
            assert "minutes" in bad["error"]
        finally:
            await backend.aclose()

    asyncio.run(scenario())
