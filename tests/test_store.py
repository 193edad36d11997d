import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reachy_memory import (
    ClosedError,
    Config,
    Memory,
    MemoryStore,
    MemoryType,
    ModelError,
    ModelMismatchError,
    StoreLockedError,
    TooLargeError,
    ValidationError,
)
from reachy_memory.engine import vector_index
from reachy_memory.engine.vector_index import BF16_TOLERANCE
from reachy_memory.storage.files import GRAPH_FILE, JOURNAL_FILE, NEXT_JOURNAL_FILE, SNAPSHOT_FILE
from tests import store_util
from tests.conftest import HashEmbedder

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def test_store_get_search_forget(store: MemoryStore) -> None:
    fact = store.remember_fact("Sarah likes Italian food", person="Sarah")
    store.remember_fact("The meeting moved to Friday 10:30")
    hits = store.search("what food does Sarah enjoy?")
    assert hits and hits[0].memory.id == fact.id
    assert 0 < hits[0].score <= 1
    assert store.get(fact.id) == fact
    assert store.forget(fact.id) is True
    assert store.forget(fact.id) is False
    assert store.get(fact.id) is None
    assert all(h.memory.id != fact.id for h in store.search("Sarah food", min_score=0))


def test_vector_search_finds_meaning_without_shared_words(store: MemoryStore) -> None:
    target = store.remember_fact("My wife's name is Sarah")
    store.remember_fact("The robot battery is charging")
    hits = store.search("who am I married to?", mode="vector", min_score=0)
    assert hits[0].memory.id == target.id


def test_everything_survives_reopen(config: Config, embedder: object) -> None:
    with MemoryStore(config=config, embedder=embedder) as s:
        kept = s.remember_fact("User prefers to be called Alex", category="user_profile")
        gone = s.remember_conversation("temporary chat")
        s.forget(gone.id)
        s.add_to_context_window("user", "hello")
        s.add_to_context_window("assistant", "hi there")
        s.set_context("task", "tidy the living room")
    with MemoryStore(config=config, embedder=embedder) as s:
        assert s.get(kept.id) == kept
        assert s.get(gone.id) is None
        assert [m["content"] for m in s.get_context_window()] == ["hello", "hi there"]
        assert s.get_context("task") == "tidy the living room"
        assert s.search("what should I call the user", min_score=0)[0].memory.id == kept.id


def test_reopen_from_journal_only_after_a_crash(config: Config, embedder: object) -> None:
    s = MemoryStore(config=config, embedder=embedder)
    memory = s.remember_fact("The user's favorite color is red")
    s._storage.journal.close()  # simulate a crash: no compaction, no clean close
    s._dir_lock.release()
    with MemoryStore(config=config, embedder=embedder) as again:
        assert again.get(memory.id) == memory
        assert again.search("favourite colour", min_score=0)[0].memory.id == memory.id


def test_a_filter_bomb_is_refused_before_any_work(lexical_store: MemoryStore) -> None:
    lexical_store.store("one memory", metadata={"n": 1})
    with pytest.raises(TooLargeError):  # the 125,000-branch $or (here 2,000 is enough)
        lexical_store.search("memory", where={"$or": [{"n": i} for i in range(2000)]})


def test_filters_by_type_and_where(store: MemoryStore) -> None:
    a = store.store("Alex likes tea", MemoryType.FACT, {"speaker": "alex", "age": 30, "tags": ["drink", "uk"]})
    b = store.store("Alex likes coffee", MemoryType.CONVERSATION, {"speaker": "alex", "age": 40})
    c = store.store("Sam likes tea", MemoryType.FACT, {"speaker": "sam", "age": 20, "flag": True})
    cases = [
        ({"memory_type": "fact"}, {a.id, c.id}),
        ({"where": {"speaker": "alex"}}, {a.id, b.id}),
        ({"where": {"age": {"$gte": 30}}}, {a.id, b.id}),
        ({"where": {"age": {"$lt": 30}}}, {c.id}),
        ({"where": {"speaker": {"$ne": "alex"}}}, {c.id}),
        ({"where": {"speaker": {"$in": ["sam", "bob"]}}}, {c.id}),
        ({"where": {"speaker": {"$nin": ["sam"]}}}, {a.id, b.id}),
        ({"where": {"flag": {"$ne": True}}}, {a.id, b.id}),  # missing key matches $ne (ChromaDB, MongoDB)
        ({"where": {"flag": {"$nin": [False]}}}, {a.id, b.id, c.id}),  # and $nin
        ({"where": {"flag": {"$gt": 0}}}, set()),  # but never a range
        ({"where": {"tags": "uk"}}, {a.id}),  # list values match any element
        ({"where": {"flag": True}}, {c.id}),
        ({"where": {"flag": 1}}, set()),  # True is not the number 1
        ({"where": {"$or": [{"speaker": "sam"}, {"age": 40}]}}, {a.id, b.id, c.id} - {a.id}),
        ({"where": {"$and": [{"speaker": "alex"}, {"age": {"$gt": 35}}]}}, {b.id}),
        ({"memory_type": "fact", "where": {"speaker": "alex"}}, {a.id}),
    ]
    for kwargs, expected in cases:
        got = {h.memory.id for h in store.search("likes", limit=10, min_score=0, **kwargs)}
        assert got == expected, kwargs


@pytest.mark.parametrize(
    "where",
    [
        {"age": {"$gt": "x"}},  # range needs a number
        {"age": {"$regex": "x"}},  # unknown operator
        {"$not": {"a": 1}},  # unknown logical operator
        {1: "x"},  # integer key (msgpack allows it; was answered "internal")
        {"$and": [{"$and": [{"$and": [{"$and": [{"$and": [{"$and": [{"$and": [{"$and": [{"$and": [
            {"a": 1}]}]}]}]}]}]}]}]}]},  # nested deeper than MAX_FILTER_DEPTH
        {"$and": []},  # empty list
        {"a": {"$in": "notalist"}},  # $in needs a list
        {"a": {"$eq": 1, "$ne": 2}},  # two operators in one condition
        "speaker = alex",  # not a dict
    ],
)
def test_bad_where_is_refused(store: MemoryStore, where: object) -> None:
    store.remember_fact("something")
    with pytest.raises(ValidationError):
        store.search("something", where=where)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "metadata", "error"),
    [
        ("", None, ValidationError),  # empty
        ("   \n\t", None, ValidationError),  # whitespace only
        (42, None, ValidationError),  # not a string
        ("ok", {"when": datetime.now()}, ValidationError),  # datetime value
        ("ok", {"nested": {"a": 1}}, ValidationError),  # dict value
        ("ok", {"l": [1, [2]]}, ValidationError),  # nested list
        ("ok", {"x": float("nan")}, ValidationError),  # NaN
        ("ok", {1: "a"}, ValidationError),  # non-string key
        ("ok", {"$op": "a"}, ValidationError),  # operator-like key
        ("ok", {"n": 2**70}, ValidationError),  # an int msgpack cannot store (was OverflowError)
        ("ok", {"n": [-(2**64)]}, ValidationError),  # the same inside a list
        ("x" * 16_001, None, TooLargeError),  # content over the limit
        ("ok", {"big": "y" * 9000}, TooLargeError),  # metadata over the limit
    ],
)
def test_bad_input_is_refused_and_nothing_is_stored(lexical_store: MemoryStore, content: object,
                                                    metadata: object, error: type) -> None:
    with pytest.raises(error):
        lexical_store.store(content, "fact", metadata)  # type: ignore[arg-type]
    assert len(lexical_store) == 0


def test_batch_is_all_or_nothing(lexical_store: MemoryStore) -> None:
    with pytest.raises(ValidationError):
        lexical_store.store_batch([{"content": "fine", "memory_type": "fact"},
                                   {"content": "", "memory_type": "fact"}])
    assert len(lexical_store) == 0
    out = lexical_store.store_batch([{"content": f"item {i}", "memory_type": "conversation"} for i in range(5)])
    assert [m.content for m in out] == [f"item {i}" for i in range(5)]


def test_client_ids_make_store_idempotent(lexical_store: MemoryStore) -> None:
    first = lexical_store.store("hello", "fact", id="req-1")
    again = lexical_store.store("hello", "fact", id="req-1")
    assert first == again and len(lexical_store) == 1
    with pytest.raises(ValidationError):
        lexical_store.store("different", "fact", id="req-1")


def test_a_turn_recorded_again_with_its_id_is_kept_once(lexical_store: MemoryStore) -> None:
    """record_turn had no id: a retry after a lost reply appended the turn twice (window and memory)."""
    first = lexical_store.record_turn("user", "I am back from Lyon", {"person": "Alex"}, id="turn-1")
    lexical_store.record_turn("assistant", "Welcome back!", id="turn-2")
    again = lexical_store.record_turn("user", "I am back from Lyon", {"person": "Alex"}, id="turn-1")
    assert again == first and len(lexical_store) == 2
    assert [m["content"] for m in lexical_store.get_context_window()] == ["I am back from Lyon", "Welcome back!"]


@pytest.mark.parametrize("reused", [
    {"role": "user", "content": "I am back from Paris"},  # other content
    {"role": "assistant", "content": "I am back from Lyon"},  # another speaker
    {"role": "user", "content": "I am back from Lyon", "owner": "bob"},  # another user's
])
def test_a_turn_id_reused_for_another_turn_is_refused(lexical_store: MemoryStore, reused: dict[str, Any]) -> None:
    lexical_store.record_turn("user", "I am back from Lyon", id="turn-1")
    with pytest.raises(ValidationError, match="turn-1"):
        lexical_store.record_turn(**reused, id="turn-1")
    assert len(lexical_store) == 1 and len(lexical_store.get_context_window()) == 1


def test_a_turn_sent_twice_at_once_is_kept_once(lexical_store: MemoryStore) -> None:
    """The daemon prepares a request and its retry side by side (the first timed out
    while waiting): both prepared before either commits, the second commits nothing."""
    first = lexical_store.prepare_turn("user", "hello robot", id="turn-1")
    second = lexical_store.prepare_turn("user", "hello robot", id="turn-1")
    kept = lexical_store.commit_turn("user", first)
    assert lexical_store.commit_turn("user", second) == kept
    assert len(lexical_store) == 1 and len(lexical_store.get_context_window()) == 1


def _told(s: MemoryStore) -> list[Memory]:
    """Facts told with their ids: one with subjects (a new person), a batch with a note name, a remember_fact."""
    return [*s.remember("Sarah likes green tea", subjects=["Sarah"], id="f1"),
            *s.remember(facts=[{"content": "Tom plays chess", "id": "f2"},
                               {"content": "The wifi password is on the fridge", "name": "wifi", "id": "f3"},
                               {"content": "Tom plays chess", "id": "f2"}]),  # the same id twice: one memory
            s.remember_fact("Trash day is Monday", id="f4")]


def test_remember_told_again_with_its_ids_stores_nothing_twice_across_a_crash_and_a_compaction(
        config: Config) -> None:
    """``remember`` (what the LLM tools store a fact with) took no id, and ``remember_fact``
    read ``id=`` as metadata: a tool sending a fact again after a daemon restart stored it
    twice (lexical-only, where no repeat is recognised by its meaning). With each fact's id
    the retry returns the memory kept first and writes nothing (no person, no note name
    "already used"); the memory is the journal's record, so it holds after a crash (the
    journal replayed) and a compaction (folded into the snapshot)."""
    s = MemoryStore(config=config, embedder=None)
    first = _told(s)
    assert [m.id for m in first] == ["f1", "f2", "f3", "f2", "f4"] and first[-1].metadata == {}
    assert _told(s) == first
    store_util.abandon(s)  # a crash: only the journal holds them
    for compact in (True, False):
        with MemoryStore(config=config, embedder=None) as s:
            assert _told(s) == first
            assert len(s) == 4 and sorted(p.name for p in s.people()) == ["Sarah", "Tom"]  # each person once
            if compact:
                s.compact()
    with MemoryStore(config=config, embedder=None) as s:
        for refused in (lambda: s.remember("Sarah likes black tea", id="f1"),  # the id of another fact
                        lambda: s.remember("Sarah likes green tea", id="f1", owner="bob"),  # another user's
                        lambda: s.remember(facts=[{"content": "Ann sings", "id": "f5"},
                                                  {"content": "Tom plays chess", "id": "f2", "shared": True}])):
            with pytest.raises(ValidationError, match="already used by another memory"):
                refused()
        with pytest.raises(ValidationError, match="each fact's id goes inside it"):
            s.remember(facts=[{"content": "Ann sings"}], id="f6")
        assert len(s) == 4 and s.get("f5") is None  # all or nothing


HOSTILE_IDS = ["a\nb", "tab\there", "nul\x00", "del\x7f", " lead", "trail ", "in side", "no\u00a0break",
               '"quoted"', "'quoted'", "`quoted`", "zero\u200bwidth", "rtl\u202eflip", "lone\ud800", "x" * 129, "", 7,
               ["a"], b"bytes"]


def test_a_hostile_client_id_is_refused_by_every_write(lexical_store: MemoryStore) -> None:
    """A client-chosen id was any string of 1 to 128 characters: a newline, NUL, a space, quotes,
    an invisible character were stored as a memory's id (a lone surrogate failed only at the
    journal write, naming no field). An id is handed to models and people, who copy it; the
    tools strip the whitespace and quotes copies come wrapped in, so such a memory could never
    be forgotten by its id. Every write refuses it, naming the field, storing nothing; an
    export's ids still import (a backup must restore)."""
    s = lexical_store
    writes: list[Callable[[Any], Any]] = [
        lambda i: s.store("hello", id=i), lambda i: s.store_batch([{"content": "hello", "id": i}]),
        lambda i: s.remember_fact("hello", id=i), lambda i: s.remember_conversation("hello", id=i),
        lambda i: s.record_turn("user", "hello", id=i), lambda i: s.remember("hello", id=i),
        lambda i: s.remember(facts=[{"content": "hello", "id": i}])]
    for bad in HOSTILE_IDS:
        for write in writes:
            with pytest.raises(ValidationError) as refused:
                write(bad)
            assert refused.value.fields["field"] == "id", (bad, refused.value)
    assert len(s) == 0 and s.get_context_window() == []
    assert s.store("hello", id="face:1.turn-2_A").id == "face:1.turn-2_A"  # what clients make still goes
    s.import_memories([{"id": "in side", "content": "exported", "type": "fact", "created_at": NOW.isoformat()}])
    assert s.get("in side") is not None


def test_an_id_stored_before_the_id_rules_is_still_a_retry_of_its_memory(lexical_store: MemoryStore) -> None:
    """An id kept before ids' characters were checked (an older version, an import) holds its
    memory: storing it again (an app's idempotent "make sure it is there", a retry) returned
    that memory, and was refused as a hostile id once the characters were checked. A new id
    with those characters is still refused."""
    s = lexical_store
    s.import_memories([{"id": "user prefs", "content": "likes the lights dim", "type": "fact",
                        "created_at": NOW.isoformat()},
                       {"id": "turn 1", "content": "hello there", "type": "conversation",
                        "created_at": datetime.now(UTC).isoformat(), "metadata": {"role": "user"}}])
    assert s.store("likes the lights dim", id="user prefs").id == "user prefs"
    assert s.store_batch([{"content": "likes the lights dim", "id": "user prefs"}])[0].id == "user prefs"
    assert s.record_turn("user", "hello there", id="turn 1").id == "turn 1"
    assert len(s) == 2 and s.get_context_window() == []  # nothing written again
    with pytest.raises(ValidationError, match="already used"):  # the id holding another memory
        s.store("likes the lights bright", id="user prefs")
    with pytest.raises(ValidationError, match="holds ' '"):  # a new one
        s.store("likes tea", id="user tea")


@pytest.mark.parametrize(("second", "refused"), [
    ({"content": "hello", "memory_type": "fact"}, False),  # the same memory twice: stored once
    ({"content": "other", "memory_type": "fact"}, True),  # was dropped silently, "hello" returned for it
    ({"content": "hello", "memory_type": "conversation"}, True),  # another type
    ({"content": "hello", "memory_type": "fact", "owner": "bob"}, True),  # another user's
])
def test_an_id_given_twice_in_one_batch_is_one_memory_or_an_error(lexical_store: MemoryStore,
                                                                    second: dict[str, Any], refused: bool) -> None:
    items = [{"content": "hello", "memory_type": "fact", "id": "req-1"}, {**second, "id": "req-1"}]
    if refused:
        with pytest.raises(ValidationError, match="req-1"):
            lexical_store.store_batch(items)
        assert len(lexical_store) == 0  # all or nothing
    else:
        first, again = lexical_store.store_batch(items)
        assert first == again and len(lexical_store) == 1


def test_expired_memories_never_come_back_even_before_cleanup(lexical_store: MemoryStore) -> None:
    chat = lexical_store.store_batch([{"content": "we talked about dinosaurs", "memory_type": "conversation"}])[0]
    fact = lexical_store.remember_fact("dinosaurs are extinct")
    later = chat.created_at + timedelta(days=31)
    assert lexical_store.get(chat.id, now=later) is None
    assert {h.memory.id for h in lexical_store.search("dinosaurs", now=later, min_score=0)} == {fact.id}
    assert lexical_store.cleanup_expired(now=chat.created_at + timedelta(days=29)) == 0
    assert lexical_store.cleanup_expired(now=later) == 1
    assert lexical_store.get(chat.id) is None and lexical_store.get(fact.id) is not None


def test_apply_retention_gives_stored_turns_the_configured_ttl_once_asked_and_replays(tmp_path: Path) -> None:
    """A changed conversation TTL reaches stored turns only through apply_retention
    (an open with another TTL changes nothing), the change is journaled as one op, a
    crash replays it whatever config the store reopens with, and lengthening works."""
    now = time.time()
    cfg30 = Config().replace("memory", path=str(tmp_path))
    cfg7 = cfg30.replace("memory", conversation_ttl_days=7)
    with MemoryStore(config=cfg30, embedder=None) as s:
        old, recent = s.store_batch([
            {"content": "we talked about kites", "memory_type": "conversation", "created_at": now - 20 * 86400},
            {"content": "we talked about trains", "memory_type": "conversation", "created_at": now - 2 * 86400}])
        fact = s.remember_fact("kites need wind")
        s.set_context("topic", "kites")
    with MemoryStore(config=cfg7, embedder=None) as s:
        assert s.get(old.id) == old  # opening with a shorter TTL applies nothing
        journal = s._storage.journal.size
        plan = s.apply_retention(dry_run=True)
        assert plan == {"conversation_days": 7, "turns": 2, "earlier": 2, "later": 0, "expire_now": 1,
                        "applied": False, "deleted": 0}
        assert s._storage.journal.size == journal and s.get(old.id) == old  # a dry run writes nothing
        assert s.apply_retention()["applied"] and s.get(old.id) is None
        assert s.get(recent.id).expires_at == recent.created_at + timedelta(days=7)
        assert s.get(fact.id) == fact and s.get_context("topic") == "kites"
        fresh = s.remember_conversation("we talked about boats")
        store_util.abandon(s)  # a crash: the retention op and the sweep are replayed
    with MemoryStore(config=cfg30, embedder=None) as s:
        assert s.get(old.id) is None and s.get(fact.id) == fact
        assert s.get(recent.id).expires_at == recent.created_at + timedelta(days=7)
        assert s.get(fresh.id).expires_at == fresh.created_at + timedelta(days=7)
        back = s.apply_retention()  # lengthening: the turns still stored get the 30 days
        assert (back["earlier"], back["later"], back["expire_now"], back["deleted"]) == (0, 2, 0, 0)
        assert s.get(recent.id).expires_at == recent.created_at + timedelta(days=30)
        assert not s.apply_retention()["applied"]  # already in force: nothing journaled


def test_a_longer_ttl_revives_no_expired_turn_and_consent_bounds_deletions(tmp_path: Path) -> None:
    """A turn expired but not yet swept stays gone when the TTL grows (the sweep comes
    first); max_deletions refuses, changing nothing, when more turns would go."""
    now = time.time()
    cfg7 = Config().replace("memory", path=str(tmp_path), conversation_ttl_days=7)
    with MemoryStore(config=cfg7, embedder=None) as s:
        gone, kept = s.store_batch([
            {"content": "my bank PIN is 4321", "memory_type": "conversation", "created_at": now - 10 * 86400},
            {"content": "we talked about kites", "memory_type": "conversation", "created_at": now - 3 * 86400}])
    with MemoryStore(config=cfg7.replace("memory", conversation_ttl_days=30), embedder=None) as s:
        assert s.apply_retention(dry_run=True)["turns"] == 1  # the expired one is not counted
        result = s.apply_retention()
        assert (result["later"], result["deleted"]) == (1, 1)
        assert s.get(gone.id) is None and s.search("PIN", min_score=0) == []
        assert s.get(kept.id).expires_at == kept.created_at + timedelta(days=30)
    with MemoryStore(config=cfg7.replace("memory", conversation_ttl_days=1), embedder=None) as s:
        journal = s._storage.journal.size
        with pytest.raises(ValidationError) as refused:
            s.apply_retention(max_deletions=0)
        assert refused.value.field == "max_deletions" and s._storage.journal.size == journal
        assert s.get(kept.id) is not None
        assert s.apply_retention(dry_run=True, max_deletions=0)["expire_now"] == 1  # a dry run is never refused
        assert s.apply_retention(max_deletions=1)["deleted"] == 1 and s.get(kept.id) is None


def test_a_longer_ttl_applied_as_of_a_past_time_revives_no_turn_expired_since(tmp_path: Path) -> None:
    """``now`` earlier than the clock (the wire op takes one) counts as the clock: a turn
    that expired in between came back with the longer TTL."""
    now = time.time()
    cfg7 = Config().replace("memory", path=str(tmp_path), conversation_ttl_days=7)
    with MemoryStore(config=cfg7, embedder=None) as s:
        [gone] = s.store_batch([{"content": "my bank PIN is 4321", "memory_type": "conversation",
                                 "created_at": now - 10 * 86400}])  # expired 3 days ago, not swept
    with MemoryStore(config=cfg7.replace("memory", conversation_ttl_days=30), embedder=None) as s:
        assert s.get(gone.id) is None
        assert s.apply_retention(now=now - 5 * 86400)["deleted"] == 1
        assert s.get(gone.id) is None and s.search("PIN", min_score=0) == []


def test_a_retention_change_is_synced_whatever_the_fsync_policy(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The ttl op sets expiries in place, which a background snapshot may write: its
    frame must be on disk first, even with memory.fsync: never."""
    from reachy_memory.storage import journal as jr

    cfg = Config().replace("memory", path=str(tmp_path), fsync="never")
    with MemoryStore(config=cfg, embedder=None) as s:
        s.store_batch([{"content": "we talked about kites", "memory_type": "conversation"}])
    synced: list[int] = []
    monkeypatch.setattr(jr._os, "fdatasync", lambda fd: synced.append(fd))
    with MemoryStore(config=cfg.replace("memory", conversation_ttl_days=7), embedder=None) as s:
        s.remember_fact("kites need wind")
        assert synced == []  # the policy: no sync per write
        assert s.apply_retention()["applied"] and synced == [s._storage.journal._fd]


def test_context_expires_at_end_of_local_day(tmp_path: Path) -> None:
    cfg = Config().replace("memory", path=str(tmp_path), timezone="Asia/Tokyo")
    with MemoryStore(config=cfg, embedder=None) as s:
        s.set_context("topic", "dinosaurs")
        memory = s.search("dinosaurs", memory_type="context")[0].memory
        local = memory.created_at.astimezone(__import__("zoneinfo").ZoneInfo("Asia/Tokyo"))
        assert memory.expires_at is not None
        assert memory.expires_at.astimezone(local.tzinfo).time().hour == 0
        assert memory.expires_at - memory.created_at <= timedelta(days=1)
        assert s.get_context("topic", now=memory.expires_at) is None
        assert s.get_context("topic", now=memory.expires_at - timedelta(seconds=1)) == "dinosaurs"


def test_set_context_replaces_the_earlier_value(lexical_store: MemoryStore) -> None:
    lexical_store.set_context("task", "tidy the living room")
    lexical_store.set_context("task", "wash the dishes")
    lexical_store.set_context("topic", "dinosaurs")
    assert lexical_store.get_context("task") == "wash the dishes"
    assert lexical_store.get_context("topic") == "dinosaurs"
    assert lexical_store.get_context("absent") is None
    assert lexical_store.stats()["by_type"]["context"] == 2


def test_context_window_keeps_last_n_turns(tmp_path: Path) -> None:
    cfg = Config().replace("memory", path=str(tmp_path), context_window_size=2)
    with MemoryStore(config=cfg, embedder=None) as s:
        for i in range(7):
            s.add_to_context_window("user" if i % 2 == 0 else "assistant", f"m{i}")
        assert [m["content"] for m in s.get_context_window()] == ["m3", "m4", "m5", "m6"]
        s.clear_context_window()
        assert s.get_context_window() == []
        with pytest.raises(ValidationError):
            s.add_to_context_window("", "x")


def test_context_window_leaves_out_turns_older_than_its_max_age(tmp_path: Path) -> None:
    # Persisted, so a restart mid-conversation keeps it; but a turn from before the night
    # must not open the morning's prompt as if it were the current conversation.
    cfg = Config().replace("memory", path=str(tmp_path), context_window_max_age_minutes=0.04)  # 2.4 s
    with MemoryStore(config=cfg, embedder=None) as s:
        s.add_to_context_window("user", "good night")
        assert [m["content"] for m in s.get_context_window()] == ["good night"]  # a slow machine has 2.4 s
        time.sleep(2.5)
        assert s.get_context_window() == []
        s.add_to_context_window("user", "good morning")
        assert [m["content"] for m in s.get_context_window()] == ["good morning"]
    with MemoryStore(config=cfg.replace("memory", context_window_max_age_minutes=0), embedder=None) as s:
        assert [m["content"] for m in s.get_context_window()] == ["good night", "good morning"]  # 0: no limit


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    ((), {"category": "user_profile"}, {"category": "user_profile"}),  # spec 000's **metadata
    (({"person": "Sarah"},), {}, {"person": "Sarah"}),  # a dict, as the clients take it
    (({"a": 1, "b": 1},), {"b": 2}, {"a": 1, "b": 2}),  # both: the keywords win
])
def test_remember_takes_metadata_as_keywords_or_a_dict(lexical_store: MemoryStore, args: tuple[Any, ...],
                                                      kwargs: dict[str, Any], expected: dict[str, Any]) -> None:
    assert lexical_store.remember_fact("User prefers tea", *args, **kwargs).metadata == expected
    assert lexical_store.remember_conversation("hello there", *args, **kwargs).metadata == expected


def test_stats_count_the_context_window_shown(tmp_path: Path) -> None:
    # stats counted every persisted turn, also those get_context_window leaves out as too old
    cfg = Config().replace("memory", path=str(tmp_path), context_window_max_age_minutes=60)
    with MemoryStore(config=cfg, embedder=None) as s:
        s._core.commit([["win", "user", "good night", time.time() - 8 * 3600]])  # written before the night
        s.add_to_context_window("user", "good morning")
        assert len(s.get_context_window()) == s.stats()["context_window"] == 1


def test_min_score_and_limit(store: MemoryStore) -> None:
    for i in range(20):
        store.remember_fact(f"note number {i} about robots")
    assert len(store.search("robots", limit=7, min_score=0)) == 7
    assert store.search("robots", min_score=1.01) == []
    for bad in (0, 1001, "5", True):
        with pytest.raises(ValidationError):
            store.search("robots", limit=bad)  # type: ignore[arg-type]


def test_embedder_failure_degrades_to_lexical(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = HashEmbedder(fail=True)
    with MemoryStore(tmp_path, embedder=broken) as s:
        memory = s.remember_fact("the red ball is under the sofa")
        hits = s.search("red ball")
        assert hits and hits[0].memory.id == memory.id
    assert "lexical-only" in caplog.text


def test_second_process_is_refused(config: Config) -> None:
    with MemoryStore(config=config, embedder=None):
        code = (
            "import sys; from reachy_memory import MemoryStore, StoreLockedError\n"
            f"try:\n    MemoryStore({str(config.data_dir)!r}, embedder=None)\n"
            "except StoreLockedError as e:\n    print('LOCKED', e); sys.exit(3)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 3, done.stderr
        assert "in use by another process" in done.stdout
    with pytest.raises(StoreLockedError), MemoryStore(config=config, embedder=None):
        MemoryStore(config=config, embedder=None)


def test_use_after_close_and_idempotent_close(lexical_store: MemoryStore) -> None:
    lexical_store.close()
    lexical_store.close()
    with pytest.raises(ClosedError):
        lexical_store.remember_fact("x")
    with pytest.raises(ClosedError):
        lexical_store.search("x")


def test_model_mismatch_is_refused_then_reindex_fixes_it(tmp_path: Path, embedder: object) -> None:
    with MemoryStore(tmp_path, embedder=HashEmbedder()) as s:
        s.remember_fact("The user's favorite color is blue")
    with pytest.raises(ModelMismatchError) as info:
        MemoryStore(tmp_path, embedder=embedder)
    assert "HashEmbedder" in str(info.value) and "all-MiniLM-L6-v2" in str(info.value)
    seen: list[tuple[int, int]] = []
    with MemoryStore(tmp_path, embedder=embedder, reindex=True) as s:
        assert s.reindex(progress=lambda done, total: seen.append((done, total))) == 1
    assert seen == [(1, 1)]
    with MemoryStore(tmp_path, embedder=embedder) as s:
        assert s.search("which colour does the user like", mode="vector", min_score=0)


def test_lexical_store_gains_vectors_via_reindex(tmp_path: Path, embedder: object) -> None:
    with MemoryStore(tmp_path, embedder=None) as s:
        s.remember_fact("My wife's name is Sarah")
    with MemoryStore(tmp_path, embedder=embedder) as s:
        # no vector yet: only reindex (or the idle backfill) gives it one
        assert s.search("who is my spouse", mode="vector", min_score=0) == []
        assert s.reindex() == 1
        assert s.search("who is my spouse", mode="vector", min_score=0)[0].memory.content == "My wife's name is Sarah"


def test_graph_cache_is_rebuilt_when_corrupt(tmp_path: Path, embedder: object) -> None:
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", exact_below=10)
    with MemoryStore(config=cfg, embedder=embedder) as s:
        ids = [s.remember_fact(f"fact number {i} about the garden").id for i in range(30)]
    graph = tmp_path / "vectors.hnsw.1"  # the FACT graph
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    with MemoryStore(config=cfg, embedder=embedder) as s:
        hits = s.search("fact number 7 about the garden", mode="vector", min_score=0, limit=30)
        assert {h.memory.id for h in hits} == set(ids)


def test_slot_reuse_keeps_indexes_consistent(store: MemoryStore) -> None:
    rng = np.random.default_rng(1)
    live: dict[str, str] = {}
    for i in range(200):
        if live and rng.random() < 0.4:
            victim = list(live)[int(rng.integers(len(live)))]
            store.forget(victim)
            del live[victim]
        else:
            text = f"memory {i} mentions {'apples' if i % 2 else 'pears'}"
            live[store.remember_fact(text).id] = text
    found = {h.memory.id for h in store.search("apples pears memory", limit=1000, min_score=0)}
    assert found == set(live)
    assert {h.memory.id for h in store.search("apples", mode="lexical", limit=1000, min_score=0)} == {
        k for k, v in live.items() if "apples" in v}


def test_graph_path_with_pending_vectors_matches_exact(tmp_path: Path) -> None:
    """Above exact_below the graph (+ pending set) must agree with exact search."""
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", exact_below=50, exact_threshold=5)
    emb = HashEmbedder()
    emb.dim = 8
    with MemoryStore(config=cfg, embedder=emb) as s:
        ids = [s.remember_fact(f"fact {i} " + "x" * (i % 7)).id for i in range(300)]
        for victim in ids[::5]:
            s.forget(victim)
        s.maintain(budget=100)  # part in the graph, part still pending
        assert 0 < s.stats()["index"]["pending"] < 300
        vi = s._state.vectors
        q = emb.embed(["query"])[0]
        exact = vi.exact(q, np.flatnonzero(vi.alive), 10)[0]
        assert set(vi.search(q, 10)[0].tolist()) == set(exact.tolist())
    with MemoryStore(config=cfg, embedder=emb) as s:  # reopened from the saved graph cache
        assert s._state.vectors._adopt_loaded(wait=True)  # it loads in the background
        assert s.stats()["index"]["pending"] == 0
        q = emb.embed(["query"])[0]
        vi = s._state.vectors
        assert set(vi.search(q, 10)[0].tolist()) == set(vi.exact(q, np.flatnonzero(vi.alive), 10)[0].tolist())


class _FlakyEmbedder:
    """Wraps a real embedder and fails after ``ok_calls`` calls (an interrupted reindex)."""

    def __init__(self, inner: object, ok_calls: int) -> None:
        self.inner, self.ok_calls = inner, ok_calls
        self.dim = inner.dim  # type: ignore[attr-defined]
        self.identity = inner.identity  # type: ignore[attr-defined]

    def embed(self, texts: list[str]) -> np.ndarray:
        if self.ok_calls <= 0:
            raise RuntimeError("power cut")
        self.ok_calls -= 1
        return self.inner.embed(texts)  # type: ignore[attr-defined]


def test_interrupted_reindex_resumes_without_loss(tmp_path: Path, embedder: object) -> None:
    with MemoryStore(tmp_path, embedder=None) as s:
        s.store_batch([{"content": f"lexical-only memory {i}", "memory_type": "fact"} for i in range(10)])
    flaky = _FlakyEmbedder(embedder, ok_calls=2)
    with MemoryStore(tmp_path, embedder=flaky, reindex=True) as s, pytest.raises(ModelError):
        s.reindex(batch=3)  # two batches done, the third fails
    with MemoryStore(tmp_path, embedder=embedder, reindex=True) as s:
        assert len(s) == 10
        assert s.reindex(batch=3) == 4  # only what was left
        assert s.reindex() == 0
        assert len(s.search("lexical-only memory", mode="vector", limit=20, min_score=0)) == 10


def test_close_caches_the_graph_even_after_an_in_service_compaction(tmp_path: Path) -> None:
    cfg = Config().replace("memory", path=str(tmp_path), compact_journal_bytes=1).replace(
        "search", exact_below=40, exact_threshold=5)
    emb = HashEmbedder()
    with MemoryStore(config=cfg, embedder=emb) as s:
        s.store_batch([{"content": f"fact {i}", "memory_type": "fact"} for i in range(100)])
        s._storage.wait()  # the one the model op started at open (it carried the batch over)
        s.store("one more")  # starts a compaction that folds everything
        s._storage.wait()
        assert not s._storage.journal.holds_ops  # nothing left to fold
        assert s._state.vectors.pending  # and that compaction did not build the graph
    with MemoryStore(config=cfg, embedder=emb) as s:
        assert s._state.vectors._loader is not None  # a cache to load, not a rebuild
        assert s._state.vectors._adopt_loaded(wait=True) and not s._state.vectors.pending


def test_after_a_crash_the_graph_cache_of_the_last_close_is_reused(tmp_path: Path) -> None:
    """A crash (or a power cut) after a clean close and a background compaction:
    reopening keeps the cached graph's nodes that are still right and inserts only what
    was written since (the new generation made it throw the cache away and rebuild the
    whole graph: 5.8 s of idle work at 10k memories here, exact search meanwhile)."""
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", exact_below=40, exact_threshold=5)
    emb = HashEmbedder()
    with MemoryStore(config=cfg, embedder=emb) as s:
        old = s.store_batch([{"content": f"fact {i}", "memory_type": "fact"} for i in range(200)])
    s = MemoryStore(config=cfg, embedder=emb)
    new = s.store_batch([{"content": f"later fact {i}", "memory_type": "fact"} for i in range(10)])
    with s._lock:  # a daemon's background compaction: a new generation, the graph cache left as it was
        s._storage.compact_in_background()
    s._storage.wait()
    new += s.store_batch([{"content": f"later fact {i}", "memory_type": "fact"} for i in range(10, 20)])
    for memory in old[:5]:
        assert s.forget(memory.id)
    store_util.abandon(s)  # no close: the cache is the one the clean close saved
    with MemoryStore(config=cfg, embedder=emb) as s:
        vectors = s._state.vectors
        assert vectors._adopt_loaded(wait=True)
        assert {s._state.by_slot[slot].id for slot in vectors.pending} == {m.id for m in new}
        assert s.search("fact 7", mode="vector", limit=1)[0].memory.id == old[7].id
        assert all(h.memory.id not in {m.id for m in old[:5]}
                   for h in s.search("fact 2", mode="vector", limit=30, min_score=0))


def test_a_store_never_closed_cleanly_caches_its_graph_in_idle_time(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A robot switched off at the plug never closes its store: there was no graph
    cache at all, and every start rebuilt the whole graph in idle time (exact search
    meanwhile).  ``maintain`` now saves a graph that changed enough; after a crash
    only what was written since is inserted."""
    monkeypatch.setattr(vector_index, "CACHE_MIN_CHANGES", 16)
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", exact_below=40, exact_threshold=5)
    emb = HashEmbedder()
    s = MemoryStore(config=cfg, embedder=emb)
    old = s.store_batch([{"content": f"fact {i}", "memory_type": "fact"} for i in range(200)])
    assert s.maintain(budget=1000, save_cache=False) == 200  # inserted; not saved when not asked
    assert s.maintain(save_cache=False) == 0 and not (tmp_path / f"{GRAPH_FILE}.meta").exists()
    assert s.maintain() == 200  # the saved graph's nodes
    new = s.store_batch([{"content": f"later fact {i}", "memory_type": "fact"} for i in range(5)])
    assert s.forget(old[3].id)
    while s.maintain():  # 5 inserted, 1 marked: not enough to save again
        pass
    store_util.abandon(s)
    _reopen_with_cache(cfg, emb, left={m.id for m in new}, found=("fact 7", old[7].id), gone=old[3].id)


def _reopen_with_cache(cfg: Config, emb: HashEmbedder, *, left: set[str], found: tuple[str, str], gone: str) -> None:
    """Reopen after a crash: once the cached graph is adopted, exactly the memories ``left``
    wait to be inserted, ``found[0]`` finds ``found[1]`` first, and ``gone`` never comes back."""
    with MemoryStore(config=cfg, embedder=emb) as s:
        vectors = s._state.vectors
        assert vectors._adopt_loaded(wait=True)
        assert {s._state.by_slot[slot].id for slot in vectors.pending} == left
        assert s.search(found[0], mode="vector", limit=1)[0].memory.id == found[1]
        assert all(h.memory.id != gone for h in s.search("fact 3", mode="vector", limit=30, min_score=0))


def test_a_crash_keeps_the_cached_nodes_of_what_the_journal_replays(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Memories written after the last snapshot are replayed from the journal at open.
    The cached graph was loaded while that replay ran, and every slot the replay wrote
    counted as changed while the cache loaded: none of them was kept, even when idle time
    had cached its node.  Under a saturated CPU (a daemon killed 14 times, its snapshot
    older than 3k-6k writes) that threw each type's whole graph away at every reopen."""
    monkeypatch.setattr(vector_index, "CACHE_MIN_CHANGES", 16)
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", exact_below=40, exact_threshold=5)
    emb = HashEmbedder()
    with MemoryStore(config=cfg, embedder=emb) as s:  # a snapshot and a graph cache
        old = s.store_batch([{"content": f"fact {i}", "memory_type": "fact"} for i in range(200)])
    s = MemoryStore(config=cfg, embedder=emb)
    cached = s.store_batch([{"content": f"journal fact {i}", "memory_type": "fact"} for i in range(40)])
    assert s.forget(old[3].id)
    while s.maintain():  # inserted, marked, then the graph cached in idle time
        pass
    new = s.store_batch([{"content": f"later fact {i}", "memory_type": "fact"} for i in range(5)])
    store_util.abandon(s)  # a crash: the journal holds every write since the snapshot
    _reopen_with_cache(cfg, emb, left={m.id for m in new}, found=("journal fact 7", cached[7].id),
                       gone=old[3].id)


def test_a_cache_without_node_lists_is_not_taken_after_a_journal_replay(tmp_path: Path) -> None:
    """A cache saved before node lists is taken only when it matches the snapshot.  The
    graph now loads after the journal's replay, which no longer counts as changes made
    while it loads, so nothing would tell a slot forgotten and reused since (the count
    the same): it kept the node of its old vector.  Such a cache is now rebuilt (before,
    its unchanged nodes were kept)."""
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", exact_below=40, exact_threshold=5)
    emb = HashEmbedder()
    with MemoryStore(config=cfg, embedder=emb) as s:
        old = s.store_batch([{"content": f"fact {i}", "memory_type": "fact"} for i in range(200)])
    meta = vector_index._read_meta(tmp_path / GRAPH_FILE)
    assert meta is not None
    del meta["nodes"]
    vector_index._write_meta(tmp_path / GRAPH_FILE, meta)
    s = MemoryStore(config=cfg, embedder=emb)
    assert s.forget(old[3].id)
    new = s.store("a parrot named Kiwi", memory_type="fact")  # slot 3 again: 200 memories, as cached
    store_util.abandon(s)
    with MemoryStore(config=cfg, embedder=emb) as s:
        vectors = s._state.vectors
        assert vectors._adopt_loaded(wait=True)
        s.maintain(budget=1000, save_cache=False)
        for group, graph in vectors._graphs.items():  # no node keeps a vector its slot no longer holds
            held = vectors._members(group, None)
            assert np.allclose(graph.get_items(held), vectors.rows(held), rtol=0, atol=BF16_TOLERANCE)
        assert s.search("a parrot named Kiwi", mode="vector", limit=1)[0].memory.id == new.id


@pytest.mark.parametrize(("name", "removed"), [
    (f".{GRAPH_FILE}.2.tmp-999999", True),  # a group's graph being saved when the robot lost power
    (f".{GRAPH_FILE}.meta.tmp-999999-1", True),  # the meta being written then
    (f".{SNAPSHOT_FILE}.tmp-999999-1", True),  # a compaction's snapshot cut short (as large as the store)
    (f".{NEXT_JOURNAL_FILE}.tmp-999999-1", True),  # a compaction's next journal, cut short
    (f".{JOURNAL_FILE}.tmp-999999-1", True),  # a repaired journal being written
    (f".{JOURNAL_FILE}.damaged-1700000000.tmp-999999-1", True),  # a damaged journal's copy set aside
    (".notes.tmp-999999-1", False),  # not the store's
    (f".{SNAPSHOT_FILE}x.tmp-999999-1", False),  # another name that only starts like the store's
    (f".{SNAPSHOT_FILE}.tmp-mine", False),  # not a temp file's name
])
def test_a_write_cut_short_by_a_crash_leaves_no_temp_file_for_good(tmp_path: Path, name: str,
                                                                   removed: bool) -> None:
    """Idle time now saves graphs while the robot runs (before, only a clean close did):
    a power cut or a kill mid-save left its temp file (55 MB for a graph of 33k), named
    after a pid that never writes again, and nothing removed it; a snapshot, a journal
    switch or a repair cut short did the same.  Under the store's lock no one else
    writes these names: an open removes them."""
    cfg = Config().replace("memory", path=str(tmp_path))
    MemoryStore(config=cfg, embedder=HashEmbedder()).close()
    (tmp_path / name).write_bytes(b"half a graph")
    with MemoryStore(config=cfg, embedder=HashEmbedder()):
        assert (tmp_path / name).exists() is not removed


class _WideHashEmbedder(HashEmbedder):
    """Another model: vectors of another dimension."""

    dim = 16


class _OtherHashEmbedder(HashEmbedder):
    """Another model of the same size: other vectors in the same slots."""

    def embed(self, texts: list[str]) -> np.ndarray:
        return -super().embed(texts)


@pytest.mark.parametrize("model", [
    _WideHashEmbedder,  # another size: the old 8-dimensional graph was adopted and inserting into
                        # it overwrote its labels (searches raised IndexError on slots like -4.8e18)
    _OtherHashEmbedder,  # the same size: every node stale, every vector then updated in place,
                         # 7-17x the idle work of building the graph afresh
])
def test_a_crash_after_a_reindex_builds_the_graph_afresh(tmp_path: Path, model: type[HashEmbedder]) -> None:
    """The cache of the last clean close holds the old model's graph; after a reindex,
    a background compaction and a crash, it is not adopted: the graph is built afresh."""
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", exact_below=40, exact_threshold=5)
    with MemoryStore(config=cfg, embedder=HashEmbedder()) as s:
        old = s.store_batch([{"content": f"fact {i}", "memory_type": "fact"} for i in range(200)])
    s = MemoryStore(config=cfg, embedder=model(), reindex=True)
    assert s.reindex() == 200
    with s._lock:  # a daemon's background compaction: the graph cache left as it was
        s._storage.compact_in_background()
    s._storage.wait()
    store_util.abandon(s)
    with MemoryStore(config=cfg, embedder=model()) as s:
        vectors = s._state.vectors
        assert vectors._adopt_loaded(wait=True)
        assert not vectors._graphs and len(vectors.pending) == vectors.count == 200
        assert vectors.flush() == 200
        for i in range(0, 200, 9):  # (digit permutations share a HashEmbedder vector: "fact 12", "fact 21")
            assert old[i].id in {h.memory.id for h in s.search(f"fact {i}", mode="vector", limit=10)}


def test_reindex_embeds_turns_exactly_as_storing_does(tmp_path: Path, embedder: object) -> None:
    turns = [{"content": text, "memory_type": "conversation"}
             for text in ("Do you like hiking?", "Yes, I go every Sunday with my sister.", "Where do you go?")]
    with MemoryStore(tmp_path / "direct", embedder=embedder) as direct:
        direct.store_batch(turns)
        expected = direct._state.vectors.rows(np.arange(3))
    with MemoryStore(tmp_path / "later", embedder=None) as later:
        later.store_batch(turns)  # no model yet: lexical-only
    with MemoryStore(tmp_path / "later", embedder=embedder) as later:
        assert later.reindex() == 3
        got = later._state.vectors.rows(np.arange(3))
        assert np.allclose(got, expected, rtol=0, atol=BF16_TOLERANCE)  # each turn embedded with the turn before it


@pytest.mark.parametrize("created_at", [
    1e300,  # overflowed every datetime conversion: get/search/export failed for good
    datetime(9999, 12, 31, tzinfo=UTC),  # the same, as a datetime
    -1.0,  # before 2000
    float("nan"),  # not a time at all
    "2020-01-01",  # a string is not a time here (import parses it first)
    True,  # a bool is not a number of seconds
])
def test_out_of_range_created_at_is_refused_and_nothing_is_stored(lexical_store: MemoryStore,
                                                                  created_at: object) -> None:
    lexical_store.store("a good memory")
    with pytest.raises(ValidationError) as info:
        lexical_store.store_batch([{"content": "poison", "created_at": created_at}])
    assert info.value.field == "created_at" and len(lexical_store) == 1
    assert lexical_store.search("memory", min_score=0) and lexical_store.export_page()[0]


def test_created_at_inside_the_range_is_kept(lexical_store: MemoryStore) -> None:
    when = datetime(2024, 5, 1, 12, tzinfo=UTC)
    (memory,) = lexical_store.store_batch([{"content": "an imported fact", "created_at": when}])
    assert memory.created_at == when


class _RecordingEmbedder(HashEmbedder):
    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def embed(self, texts: list[str]) -> np.ndarray:
        self.texts.extend(texts)
        return super().embed(texts)


def test_interleaved_prepares_embed_each_turn_with_the_turn_committed_before_it(config: Config) -> None:
    """Daemon order: prepare runs on the embed thread, commit on the engine thread."""
    embedder = _RecordingEmbedder()
    with MemoryStore(config=config, embedder=embedder) as store:
        a = store.prepare([{"content": "turn A", "memory_type": "conversation"}])
        b = store.prepare([{"content": "turn B", "memory_type": "conversation"}])  # saw no turn before it
        store.commit(a)
        (memory,) = store.commit(b)
        expected = HashEmbedder().embed(["turn A\nturn B"])[0]
        got = store._state.vectors.rows(store._state.records[memory.id].slot)
        assert "turn A\nturn B" in embedder.texts and np.allclose(got, expected, rtol=0, atol=BF16_TOLERANCE)


def test_each_turn_records_the_turn_it_follows_across_interleaving_and_restart(config: Config) -> None:
    """``follows`` is resolved at commit (engine thread), like the embedded text, and persisted."""
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        a = store.prepare([{"content": "turn A", "memory_type": "conversation"}])
        b = store.prepare([{"content": "turn B", "memory_type": "conversation"}])
        (first,) = store.commit(a)
        (second,) = store.commit(b)
        fact, third = store.store_batch([{"content": "a fact"}, {"content": "turn C", "memory_type": "conversation"}])
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        follows = {m.id: store._state.records[m.id].follows for m in (first, second, fact, third)}
    assert follows == {first.id: None, second.id: first.id, fact.id: None, third.id: second.id}


def test_links_follow_time_across_reopen_back_dating_and_correction(config: Config) -> None:
    emb = HashEmbedder()
    with MemoryStore(config=config, embedder=emb) as store:
        a = store.store("turn A", "conversation")
    with MemoryStore(config=config, embedder=emb) as store:  # close compacted: the link survives the snapshot
        b = store.store("turn B", "conversation")
        (old,) = store.store_batch([{"content": "a turn from yesterday", "memory_type": "conversation",
                                     "created_at": time.time() - 86400}])
        c = store.store("turn C", "conversation")
        fixed = store.correct(b.id, "turn B, corrected")
        d = store.store("turn D", "conversation")
        follows = {m.content: store._state.records[m.id].follows for m in (b, old, c, fixed, d)}
        previous = {m.content: store._state.records[m.id].previous_text for m in (b, old, c, fixed, d)}
    assert previous == {"turn B": "turn A", "a turn from yesterday": None,
                        "turn C": None,  # it followed turn B, corrected since: B's old words are gone
                        "turn B, corrected": "turn A", "turn D": "turn C"}  # the text of the turn each follows
    assert follows == {"turn B": a.id,  # the newest turn before the reopen
                       "a turn from yesterday": None,  # older than the newest turn: follows nothing
                       "turn C": b.id,  # and it did not become the newest turn
                       "turn B, corrected": a.id,  # a corrected turn keeps its place
                       "turn D": c.id}  # the correction is not the newest turn


def _found_by(store: MemoryStore, query: str) -> list[str]:
    return [h.memory.content for h in store.search(query, mode="lexical", min_score=0)]


def test_a_reply_is_found_by_the_words_of_the_turn_it_follows(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.store_batch([{"content": "What did you paint last week?", "memory_type": "conversation"},
                           {"content": "A sunrise over the lake", "memory_type": "conversation"},
                           {"content": "I like to paint", "memory_type": "fact"}])
        store.store_batch([{"content": "Nice weather", "memory_type": "conversation",
                            "created_at": time.time() + 3600}])  # an hour later: follows nothing
        texts = {r.content: r.previous_text for r in store._state.records.values()}
        assert texts == {"What did you paint last week?": None, "I like to paint": None, "Nice weather": None,
                         "A sunrise over the lake": "What did you paint last week?"}
        # Own words first, then the reply by its question's words (at half weight).
        found = _found_by(store, "paint")
        assert set(found[:2]) == {"What did you paint last week?", "I like to paint"}
        assert found[2:] == ["A sunrise over the lake"]


def test_the_previous_turn_field_survives_reopening_and_follows_a_new_weight(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.store_batch([{"content": "What did you paint?", "memory_type": "conversation"},
                           {"content": "A sunrise", "memory_type": "conversation"}])
        assert "A sunrise" in _found_by(store, "paint")
    with MemoryStore(config=config, embedder=None) as store:  # from the snapshot close wrote
        assert "A sunrise" in _found_by(store, "paint")
    own_only = config.replace("search", previous_turn_weight=0.0)
    with MemoryStore(config=own_only, embedder=None) as store:  # a snapshot indexed at 0.5: re-indexed
        assert _found_by(store, "paint") == ["What did you paint?"]
        assert _found_by(store, "sunrise") == ["A sunrise"]
    with MemoryStore(config=config, embedder=None) as store:
        assert "A sunrise" in _found_by(store, "paint")


def test_forgotten_and_corrected_words_are_not_found_through_the_next_turn(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        pin, _ = store.store_batch([{"content": "my bank PIN is 4921", "memory_type": "conversation"},
                                    {"content": "ok, noted", "memory_type": "conversation"}])
        address, _ = store.store_batch([{"content": "I live at Elm Street", "memory_type": "conversation"},
                                        {"content": "nice", "memory_type": "conversation"}])
        assert _found_by(store, "PIN 4921") == ["my bank PIN is 4921", "ok, noted"]  # before
        store.forget(pin.id)
        store.correct(address.id, "I live at Oak Road")
        assert _found_by(store, "PIN 4921") == [] and _found_by(store, "Elm Street") == []
    with MemoryStore(config=config, embedder=None) as store:  # and after a reopen
        assert _found_by(store, "PIN 4921") == [] and _found_by(store, "Elm Street") == []
        assert _found_by(store, "Oak Road") == ["I live at Oak Road"]


def test_a_superseded_turn_lends_no_words_to_a_later_turn_or_an_import(config: Config, tmp_path: Path) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        pin = store.store("my bank PIN is 4921", "conversation")
        store.supersede(pin.id, store.store("my bank PIN changed", "fact").id)  # still the newest turn
        store.store("ok, noted", "conversation")
        assert _found_by(store, "4921") == []
        exported = [m.to_dict() for m in store.export_page(limit=100)[0]]  # superseded ones included
    target = config.replace("memory", path=str(tmp_path / "imported"))
    with MemoryStore(config=target, embedder=None) as store:
        store.import_memories(exported)
        assert _found_by(store, "4921") == []


def test_reindex_leaves_a_memory_forgotten_meanwhile_forgotten(config: Config) -> None:
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        a, b = store.store_batch([{"content": "turn A", "memory_type": "conversation"},
                                  {"content": "turn B", "memory_type": "conversation"}])
        listed = [store._state.records[a.id], store._state.records[b.id]]  # what a reindex listed
        store.forget(a.id)  # before its batch was written back
        store._maintenance.reembed(listed, {})
        assert a.id not in store._state.records and b.id in store._state.records


def test_imported_turns_link_in_time_order_whatever_the_file_order(tmp_path: Path) -> None:
    cfg = Config().replace("memory", path=str(tmp_path / "a"))
    with MemoryStore(config=cfg, embedder=HashEmbedder()) as source:
        start = time.time() - 3600
        turns = source.store_batch([{"content": f"turn {i}", "memory_type": "conversation",
                                     "created_at": start + 60 * i} for i in range(6)])
        exported = [m.to_dict() for m in source.export_page(limit=100)[0]]  # id order, not time order
    with MemoryStore(config=cfg.replace("memory", path=str(tmp_path / "b")), embedder=HashEmbedder()) as target:
        target.import_memories(exported)
        follows = [target._state.records[m.id].follows for m in turns]
    assert follows == [None] + [m.id for m in turns[:-1]]


def test_neighbour_boost_lifts_the_turn_next_to_a_strong_hit(tmp_path: Path) -> None:
    # The previous turn's words would lift the reply on their own: off, to see the boost.
    cfg = Config().replace("memory", path=str(tmp_path)).replace("search", previous_turn_weight=0.0)
    turns = ["we should plan the trip to Lisbon", "sure, my cousin lives there", "filler about the weather",
             "more filler on the weather", "a word on Lisbon trains"]
    with MemoryStore(config=cfg, embedder=HashEmbedder()) as store:  # every turn is a vector candidate
        store.store_batch([{"content": t, "memory_type": "conversation"} for t in turns])

        def order(boost: float) -> list[str]:
            store._config = cfg.replace("search", neighbour_boost=boost)
            return [h.memory.content for h in store.search("Lisbon trip", min_score=0, limit=5)]

        assert "sure, my cousin lives there" not in order(0.0)[:2]  # no word of the query in it
        assert order(0.5)[:2] == ["we should plan the trip to Lisbon", "sure, my cousin lives there"]


def test_cheap_reads_never_wait_for_the_store_lock(lexical_store: MemoryStore) -> None:
    """get, get_context, get_context_window and stats read views, not locked state:
    a compaction, backup or search holding the lock (held here) never delays them."""
    import threading

    lexical_store.add_to_context_window("user", "hello")
    lexical_store.set_context("task", "tidy the room")
    fact = lexical_store.remember_fact("kept")
    answers: dict[str, object] = {}

    def reads() -> None:
        answers["window"] = [t["content"] for t in lexical_store.get_context_window()]
        answers["context"] = lexical_store.get_context("task")
        answers["get"] = lexical_store.get(fact.id)
        answers["stats"] = lexical_store.stats()["memories"]

    with lexical_store._lock:  # what a compaction holds for 0.6-0.8 s at 100k memories
        reader = threading.Thread(target=reads)
        reader.start()
        reader.join(timeout=10)
        finished = not reader.is_alive()
    reader.join()
    assert finished, "a cheap read waited for the store lock"
    assert answers == {"window": ["hello"], "context": "tidy the room", "get": fact, "stats": 2}


def test_context_view_follows_set_replace_and_reopen(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.set_context("task", "first")
        store.set_context("task", "second")  # replaces: the view drops the old record
        store.set_context("topic", "robots")
        assert (store.get_context("task"), store.get_context("topic")) == ("second", "robots")
    with MemoryStore(config=config, embedder=None) as store:  # rebuilt from the snapshot
        assert (store.get_context("task"), store.get_context("topic")) == ("second", "robots")


def test_a_store_written_in_fp32_still_opens_after_int8_became_the_default(config: Config) -> None:
    fp32 = config.replace("embedding", precision="fp32")
    with MemoryStore(config=fp32) as store:
        memory = store.remember_fact("Sarah likes Italian food")
    with MemoryStore(config=config) as store:  # the default: int8
        assert store.embedder.identity["precision"] == "fp32"  # kept the store's vector space
        assert store.search("what food does Sarah like?")[0].memory.id == memory.id
    with MemoryStore(config=config, reindex=True) as store:  # the fix the warning names
        assert store.reindex() == 1 and store.embedder.identity["precision"] == "int8"
    with MemoryStore(config=config) as store:
        assert store.embedder.identity["precision"] == "int8"


def test_a_mass_expiry_is_gone_everywhere_and_after_a_crash(tmp_path: Path) -> None:
    cfg = Config().replace("memory", path=str(tmp_path))
    rows = [{"content": f"chat {i} about {'tea' if i % 2 else 'trains'}", "memory_type": "conversation",
             "metadata": {"speaker": f"user{i % 3}"}} for i in range(400)]
    later = time.time() + 31 * 86400
    with MemoryStore(config=cfg, embedder=HashEmbedder()) as s:
        s.store_batch(rows)
        facts = s.store_batch([{"content": f"fact {i} about tea", "metadata": {"speaker": "user1"}}
                               for i in range(20)])
        journal = s._storage.journal.size
        assert s.cleanup_expired(now=later) == 400
        assert s._storage.journal.size - journal < 100  # one small "expire" op, not 400 ids
        assert s._state._ghosts  # the bulk path: index work left for idle time
        survivors = {m.id for m in facts}

        def check(store: MemoryStore) -> None:
            assert len(store) == 20 and store.stats()["by_type"]["conversation"] == 0
            assert {h.memory.id for h in store.search("tea trains chat", limit=50, min_score=0)} <= survivors
            assert {h.memory.id for h in store.search("tea", where={"speaker": "user1"}, limit=50,
                                                      min_score=0)} == survivors
            assert store.search("chat", memory_type="conversation", min_score=0) == []

        check(s)
        while s.maintain() or s._state.bury(0):
            pass
        check(s)
        store_util.abandon(s)  # a crash: the sweep is replayed from the journal
    with MemoryStore(config=cfg, embedder=HashEmbedder()) as again:
        check(again)
        fresh = again.store("a new chat about tea", "conversation", {"speaker": "user1"})
        assert fresh.id in {h.memory.id for h in again.search("new chat", where={"speaker": "user1"}, min_score=0)}


def test_prepare_while_the_engine_holds_the_lock_neither_scans_nor_moves_the_newest_turn(config: Config) -> None:
    """prepare runs on the daemon's embed thread while the engine thread changes the
    records: it must not iterate them (a scan raced a store into "dictionary changed
    size during iteration", failing the request) nor write the state's cached newest
    turn.  Its guess of the turn before is checked at commit, which re-links."""
    import threading

    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        a = store.store("turn A", "conversation")
        b = store.store("turn B", "conversation")
        store.forget(b.id)  # the newest turn went: the next read of it scans the records
        scans: list[str] = []
        real_scan = store._state._newest_turn
        store._state._newest_turn = lambda: scans.append(threading.current_thread().name) or real_scan()
        prepared: dict[str, object] = {}
        with store._lock:  # the engine thread, busy
            worker = threading.Thread(target=lambda: prepared.update(
                p=store.prepare([{"content": "turn C", "memory_type": "conversation"}])), name="embed")
            worker.start()
            worker.join(timeout=10)
        assert "p" in prepared and scans == []  # prepared without a scan from the embed thread
        (c,) = store.commit(prepared["p"])  # type: ignore[arg-type]
        assert scans == ["MainThread"]  # the commit found the newest turn, under the lock
        rec = store._state.records[c.id]
        assert (rec.follows, rec.previous_text) == (a.id, "turn A")
        expected = HashEmbedder().embed(["turn A\nturn C"])[0]
        got = store._state.vectors.rows(rec.slot)
        assert np.allclose(got, expected, rtol=0, atol=BF16_TOLERANCE)  # re-embedded with its turn


def test_prepares_on_another_thread_survive_stores_and_forgets_of_the_newest_turn(config: Config) -> None:
    """The daemon's two threads, racing: one prepares turns while the other stores and
    forgets the newest turn.  Every prepare succeeds (before, some raised RuntimeError)."""
    import threading

    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        for start in range(0, 6000, 500):
            store.store_batch([{"content": f"filler {start + i}", "memory_type": "fact"} for i in range(500)])
        errors: list[BaseException] = []
        stop = threading.Event()

        def prepares() -> None:
            while not stop.is_set():
                try:
                    store.prepare([{"content": "a turn", "memory_type": "conversation"}])
                except BaseException as exc:  # any failure is the finding
                    errors.append(exc)
                    return

        worker = threading.Thread(target=prepares)
        with store_util.frequent_switches():  # switch threads often, mid-scan
            worker.start()
            try:
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and not errors:
                    turn = store.store("the newest turn", "conversation")
                    store.store_batch([{"content": f"more {i}", "memory_type": "fact"} for i in range(3)])
                    store.forget(turn.id)
            finally:
                stop.set()
                worker.join(timeout=10)
        assert errors == []


@pytest.mark.parametrize("call", [
    lambda s: s.store("tea \ud800"),  # content
    lambda s: s.store("tea", "fact", {"k": "\udc80"}),  # a metadata value
    lambda s: s.store("tea", "fact", {"\ud800": 1}),  # a metadata key
    lambda s: s.remember("Sarah likes tea", subjects=["Sa\ud800rah"]),  # a subject (was cut to a person 'Sa')
    lambda s: s.remember("tea notes", name="n\ud800"),  # a note name
    lambda s: s.add_person("Bob\ud800"),  # a person
    lambda s: s.add_to_context_window("user", "hi \ud800"),  # a window turn
    lambda s: s.search("tea \ud800"),  # a query
])
def test_a_lone_surrogate_is_refused_by_name_and_stores_nothing(lexical_store: MemoryStore, call: Any) -> None:
    """msgpack raised UnicodeEncodeError from the journal (a foreign exception) for any
    text holding one ("\\ud800" from a broken JSON escape)."""
    with pytest.raises(ValidationError, match="Unicode"):
        call(lexical_store)
    assert len(lexical_store) == 0 and lexical_store.people() == [] and lexical_store.get_context_window() == []
    assert lexical_store.store("tea").content == "tea"  # and the store goes on


def test_a_metadata_integer_past_64_bits_says_so(lexical_store: MemoryStore) -> None:
    with pytest.raises(ValidationError, match="64 bits"):
        lexical_store.store("tea", "fact", {"a": 10**30})


def test_record_turn_keeps_window_and_memory_together(lexical_store: MemoryStore, config: Config,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One frame for both: a full disk leaves neither (two calls could leave the window
    turn without its memory), a crash after it keeps both."""
    import errno

    from reachy_memory import StorageFullError
    from reachy_memory.storage import journal as jr

    turn = lexical_store.record_turn("user", "I am back from Lyon", {"person": "Alex"})
    assert turn.metadata == {"person": "Alex", "role": "user"} and turn.memory_type is MemoryType.CONVERSATION
    assert [w["content"] for w in lexical_store.get_context_window()] == ["I am back from Lyon"]

    def full(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jr._os, "write", full)
    with pytest.raises(StorageFullError):
        lexical_store.record_turn("assistant", "Welcome back")
    monkeypatch.undo()
    assert len(lexical_store) == 1 and len(lexical_store.get_context_window()) == 1
    for bad in ({"role": ""}, {"content": "hi \ud800"}, {"metadata": {"k": float("nan")}}):  # refused before writing
        with pytest.raises(ValidationError):
            lexical_store.record_turn(**({"role": "user", "content": "hi"} | bad))
    assert len(lexical_store) == 1 and len(lexical_store.get_context_window()) == 1
    store_util.abandon(lexical_store)
    with MemoryStore(config=config, embedder=None) as again:
        assert again.get(turn.id) == turn and [w["role"] for w in again.get_context_window()] == ["user"]


class _OtherRecordingEmbedder(_RecordingEmbedder):
    """Another vector space (its key names the class): a reindex re-embeds everything."""


# (the scope of turn A, of turn B that follows it, whether B borrows A's words): everyone who
# can find B must be able to find A, or A's private words would find B
BORROW_CASES = [
    ({}, {}, True),  # both unscoped: as before
    ({"owner": "alice"}, {"owner": "alice"}, True),  # one user's turns
    ({}, {"owner": "bob"}, True),  # an unscoped turn lends to anyone's
    ({"owner": "alice", "shared": True}, {"owner": "bob"}, True),  # so does a shared one
    ({"owner": "alice"}, {"owner": "bob"}, False),  # Alice's words never find Bob's turn (was: borrowed)
    ({"owner": "alice"}, {}, False),  # nor an unscoped turn, which every user sees
    ({"owner": "alice"}, {"owner": "alice", "shared": True}, False),  # nor her own shared one
]


@pytest.mark.parametrize(("first", "second", "borrows"), BORROW_CASES)
def test_a_turn_borrows_the_previous_turns_words_only_within_their_scope(
        config: Config, tmp_path: Path, first: dict[str, Any], second: dict[str, Any], borrows: bool) -> None:
    """At the write (its lexical field and vector), in the idle backfill and in a reindex."""
    turns = [{"content": "lighthouse question", "memory_type": "conversation", **first},
             {"content": "plain answer", "memory_type": "conversation", **second}]
    want = "lighthouse question\nplain answer" if borrows else "plain answer"
    written = _RecordingEmbedder()
    with MemoryStore(config=config, embedder=written) as store:
        _, b = store.store_batch(turns)
        rec = store._state.records[b.id]
        assert (rec.follows is not None, rec.previous_text) == (True, "lighthouse question" if borrows else None)
        assert written.texts[-1] == want and ("plain answer" in _found_by(store, "lighthouse")) == borrows
    later = _RecordingEmbedder()
    with MemoryStore(tmp_path / "lexical", embedder=None) as store:
        store.store_batch(turns)
    with MemoryStore(tmp_path / "lexical", embedder=later) as store:
        while store.maintain():  # the backfill embeds what was stored without a vector
            pass
        assert later.texts == ["lighthouse question", want]
    again = _OtherRecordingEmbedder()
    with MemoryStore(config=config, embedder=again, reindex=True) as store:
        assert store.reindex() == 2 and again.texts == ["lighthouse question", want]


def test_a_corrected_turn_and_a_reindex_embed_each_turn_with_the_turn_it_follows(config: Config) -> None:
    """correct() embedded the corrected turn with the store's newest turn (prepare's guess), and
    reindex paired turns by time: it embedded a correction with the superseded original's words
    and a turn after a forgotten one with the turn before that. All now agree with the backfill
    (the turn a record ``follows``)."""
    conversation = "conversation"
    with MemoryStore(config=config, embedder=_RecordingEmbedder()) as store:
        _, answer = store.store_batch([{"content": "question one", "memory_type": conversation},
                                       {"content": "answer one", "memory_type": conversation}])
        [third] = store.store_batch([{"content": "third turn", "memory_type": conversation}])
        corrected = store.correct(answer.id, "answer corrected")
        rec = store._state.records[corrected.id]
        assert store._core.stored_text(rec) == "question one\nanswer corrected"
        # the turn after the corrected one lends it no superseded words (as its lexical copy)
        assert store._core.stored_text(store._state.records[third.id]) == "third turn"
        assert store._state.records[third.id].previous_text is None
        expected = HashEmbedder().embed([store._core.stored_text(rec)])[0]
        assert np.allclose(store._state.vectors.rows(rec.slot), expected, rtol=0, atol=BF16_TOLERANCE)
        _, gone, _ = store.store_batch([{"content": f"turn {n}", "memory_type": conversation} for n in "xyz"])
        store.forget(gone.id)
        stored = sorted(store._core.stored_text(r) for r in store._state.records.values())
    again = _OtherRecordingEmbedder()
    with MemoryStore(config=config, embedder=again, reindex=True) as store:
        assert store.reindex() == len(stored) and sorted(again.texts) == stored
