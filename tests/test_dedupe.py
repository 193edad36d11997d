"""Restated facts: the rule on the labelled pairs, the store's write and read sides, the
dedupe command, and a restart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reachy_memory import Config, Memory, MemoryStore
from reachy_memory.daemon.operations import OPERATIONS
from reachy_memory.engine import dedupe, restating, vector_index
from reachy_memory.engine.records import Record
from reachy_memory.engine.restating import decide, normalized
from tests.daemon_util import DaemonProcess, run_cli
from tests.store_util import abandon
from tools.eval_dedupe import Pair, choose, cosines, halves, load_pairs, pooled, rule, sample, score

PAIRS = load_pairs()
FOUR_WAYS = ("exact", "case_space", "punctuation", "filler")


# -- the rule on the labelled pairs -----------------------------------------------------------------

def test_the_labelled_set_is_large_and_balanced() -> None:
    kinds = {p.kind for p in PAIRS}
    assert len(PAIRS) >= 200 and sum(p.merge for p in PAIRS) >= 100 and sum(not p.merge for p in PAIRS) >= 100
    assert {"negation", "number", "date", "name", "person", "object", *FOUR_WAYS, "paraphrase"} <= kinds
    for half, _ in halves(PAIRS, np.zeros(len(PAIRS))):  # every kind in both halves of the cross rule
        assert {p.kind for p in half} >= kinds - {"tense"}


def _named(pair: Pair) -> str:
    return f"{pair.kind}:{pair.b[:30]}"


@pytest.mark.parametrize("pair", [p for p in PAIRS if p.kind in FOUR_WAYS], ids=_named)
def test_the_four_ways_of_restating_are_the_same_text_without_any_model(pair: Pair) -> None:
    assert normalized(pair.a) == normalized(pair.b)
    assert decide(pair.b, pair.a, None).same


def _contrast(pair: Pair) -> object:
    """A contrast pair, marked as an expected failure when the data says the rule still merges it."""
    why = pair.row.get("still_merged")
    return pytest.param(pair, marks=pytest.mark.xfail(strict=True, reason=why)) if why else pair


@pytest.mark.parametrize("pair", [_contrast(p) for p in PAIRS if not p.merge and not p.apart], ids=_named)
def test_no_contrast_is_the_same_whatever_its_cosine(pair: Pair) -> None:
    """Negations, numbers, dates, names, objects, roles: words the rule compares, so not
    even a cosine of 1.0 merges them (left/right of the bed has 0.988); the few a reviewer
    found that it still merges are marked in the data (``still_merged``) and expected to fail."""
    decision = decide(pair.b, pair.a, 1.0)
    assert not decision.same, decision.reason


@pytest.mark.parametrize(("a", "b", "same"), [
    ("The wifi password is Blue42Sky", "THE WIFI PASSWORD IS BLUE42SKY", False),  # a code keeps its case
    ("The wifi password is Blue42Sky", "  the wifi password is Blue42Sky. ", True),
    ("I know that Sarah doesn't like tea", "Sarah does not like tea!", True),
    ("Sarah is Emma's mother", "Emma is Sarah's mother", False),  # roles swapped
    ("Sarah is Emma's mother", "Emma's mother is Sarah", True),  # a phrase moved: the same roles
    ("Sarah is Emma's mother", "Sarah's mother is Emma", False),
    ("Every evening Mia walks the dog", "Mia walks the dog every evening", True),
    ("The user has two daughters", "The user has 2 daughters", True),
    ("The dentist appointment is tomorrow", "the dentist appointment is tomorrow", True),
    ("The Wi-Fi router is in the study", "The wifi router is in the study", True),  # a hyphen inside a word
    ("The hamster gets water every day", "The hamster gets water daily", True),  # "every day" is "daily"
    ("The bins go out every week", "The bins go out every day", False),
    ("The garage door code is 7391", "The code for the garage door is 7391", True),  # a compound turned
    ("Jack is Lucy's boss", "Jack is the boss of Lucy", True),  # a possessive turned around "of"
    ("Ben prefers cats to dogs", "Ben prefers dogs to cats", False),  # "to" on both sides: roles swapped
    ("The key to the shed is in the house", "The key to the house is in the shed", False),
    ("The light is controlled by the plug", "The plug controls the light", True),  # the passive
    ("Tom is helped by Anna", "Tom helps Anna", False),  # the passive's agent is the other person
    ("The fan is switched on by the timer", "The timer switches on the fan", True),  # a phrasal verb
    ("The alarm is tested by Dad every month", "Dad tests the alarm monthly", True),  # the agent ends at "every"
    ("Reachy, remember that Ella likes jazz", "Ella likes jazz", True),  # the robot addressed
    ("Robot vacuums are noisy", "Vacuums are noisy", False),  # "robot" without a comma is a word
    ("Robot, Lego and dinosaurs are his toys", "Lego and dinosaurs are his toys", False),  # a list, no address
    ("Lucy wants to visit Grandma", "Lucy wants Grandma to visit", False),  # "to" of an infinitive
    ("Anna's friend's mother is a nurse", "The friend of Anna's mother is a nurse", False),  # a chain
    ("Grandma's painting hangs in the hall", "The painting of Grandma hangs in the hall", False),  # not a relation
    ("Tom likes Anna's cooking", "Tom likes cooking for Anna", False),  # a possessive is not "for"
    ("Anna wants a glass of wine", "Anna wants a wine glass", False),  # a compound is not turned around "of"
    ("Tom takes the number 5 bus", "Tom takes the bus to number 5", False),  # a number in the parts
    ("Tom is the boss of Anna", "Tom's boss is Anna", False),  # whose: "of" and "'s" are kept as marks
    ("Mia is afraid of the dog", "Mia is afraid for the dog", False),
    ("Lucy is picked up by Tom's mother", "Tom's mother picks up Lucy", True),  # the agent holds "'s"
    ("Lucy is picked up by Tom's mother", "Tom picks up Lucy's mother", False),
    ("Tom is seated by Anna at dinner", "Anna seats Tom at dinner", False),  # "by" says where
    ("The bins are put out by Tuesday", "Tuesday puts out the bins", False),  # "by" says when
    ("The wifi password is tiger!", "The wifi password is tiger?", False),  # a password verbatim
    ("The wifi password is blue-sky", "The wifi password is bluesky", False),
    ("The toolbox is in the shed", "The tool-box is in the shed", True),  # a hyphen between two words
    ("Tom needs to re-cover the sofa", "Tom needs to recover the sofa", False),  # but after a prefix
    ("Anna's email is anna-lee@gmail.com", "Anna's email is annalee@gmail.com", False),  # nor in an address
    ("The heating comes on at 6 am", "The heating comes on at 6 a.m.", True),
    ("The freezer is set to -18 degrees", "The freezer is set to 18 degrees", False),  # a minus is kept
    ("Grandpa takes 1/2 a pill", "Grandpa takes 1-2 pills", False),
    ("Tom's favourite emoji is \U0001f44d", "Tom's favourite emoji is \u2764\ufe0f", False),  # a symbol is a word
    ("Grandpa likes to watch the news", "Grandpa likes watching the news", True),  # -ing after "like" is "to"
    ("Tom stopped to smoke", "Tom stopped smoking", False),  # but not after "stop"
    ("The dog's name is Biscuit", "The dog is called Biscuit", True),
])
def test_rule_examples(a: str, b: str, same: bool) -> None:
    assert decide(b, a, 0.99).same is same


def test_a_nan_cosine_merges_nothing() -> None:
    assert not decide("Sarah likes tea", "Sarah really likes tea", float("nan")).same
    assert decide("Sarah likes tea", "Sarah really likes tea", 0.99).same


def test_long_texts_are_only_rotated_not_turned() -> None:
    """The compound turn is quadratic in words: past MOVES_WORDS content words it is not tried."""
    filler = " ".join(f"word{i}x" for i in range(restating.MOVES_WORDS))
    short_a, short_b = "the garage door code is 7391", "the code for the garage door is 7391"
    assert decide(short_b, short_a, 0.99).same
    assert not decide(f"{short_b} {filler}", f"{short_a} {filler}", 0.99).same
    assert decide(f"{filler} {short_a}", f"{short_a} {filler}", 0.99).same  # a rotation still is


def test_relative_dating_is_seen() -> None:
    assert restating.relative("The dentist appointment is tomorrow")
    assert restating.relative("Sarah visited last week")
    assert not restating.relative("Trash day is Monday")


def test_held_out_precision_and_recall_with_the_real_model(embedder: object) -> None:
    """The cross rule of tools/eval_dedupe.py: the threshold chosen on one half, scored on
    the other, both ways; no wrong merge, and recall near the floor measured (0.884 int8 on
    this host: int8 vectors differ a little between CPUs, see test_retrieval_quality)."""
    tuned, sims = sample(PAIRS, cosines(PAIRS, embedder.embed))  # type: ignore[attr-defined]
    (a, sa), (b, sb) = halves(tuned, sims)
    for (tune, ts), (held, hs) in (((a, sa), (b, sb)), ((b, sb), (a, sa))):
        got = score(held, hs, rule(choose(tune, ts)))
        assert got.precision >= 0.99 and got.recall >= 0.86, got
    both = pooled(tuned, sims)  # the two folds at once
    assert both.wrong == 0 and both.recall >= 0.88, both
    shipped = score(tuned, sims, rule(restating.THRESHOLD))
    assert shipped.wrong == 0 and shipped.recall >= 0.88, shipped


# -- the store: writes -------------------------------------------------------------------------------

def test_the_four_ways_of_restating_keep_one_memory(store: MemoryStore) -> None:
    first = store.remember_fact("Sarah likes Italian food", {"source": "chat"})
    again = [store.remember_fact("SARAH  LIKES  ITALIAN  FOOD"), store.remember_fact("Sarah likes Italian food."),
             store.remember_fact("I know that Sarah likes Italian food", {"topic": "food"})]
    assert {m.id for m in again} == {first.id} and len(store) == 1
    kept = store.get(first.id)
    assert kept is not None and kept.content == "Sarah likes Italian food"  # the words first told
    assert kept.metadata["source"] == "chat" and kept.metadata["topic"] == "food"  # merged
    assert kept.metadata[dedupe.COUNT_KEY] == 3 and dedupe.TIME_KEY in kept.metadata
    told = store.remember("sarah likes italian food!", subjects=[])[0]  # the people path: the same rule
    assert told.id == first.id and told.metadata[dedupe.COUNT_KEY] == 4 and len(store) == 1


def test_remember_with_persons_keeps_one_fact_per_person(store: MemoryStore) -> None:
    sarah = store.remember("Sarah is allergic to peanuts", subjects=["Sarah"])[0]
    assert store.remember("I know that Sarah is allergic to peanuts.", subjects=["Sarah"])[0].id == sarah.id
    tom = store.remember("Sarah is allergic to peanuts", subjects=["Tom"])[0]  # about another person
    assert tom.id != sarah.id and len(store) == 2


def test_a_restatement_within_one_batch_is_one_memory(store: MemoryStore) -> None:
    got = store.store_batch([{"content": "Tom is allergic to cats", "metadata": {"a": 1}},
                             {"content": "tom is allergic to cats!", "metadata": {"b": 2}},
                             {"content": "Tom is not allergic to cats"}])
    assert got[0].id == got[1].id != got[2].id and len(store) == 2
    assert got[0].metadata == got[1].metadata and got[0].metadata[dedupe.COUNT_KEY] == 1
    assert got[0].metadata["a"] == 1 and got[0].metadata["b"] == 2


def test_conversation_turns_are_events_never_merged(store: MemoryStore) -> None:
    turns = [store.record_turn("user", "ok"), store.record_turn("user", "ok"), store.record_turn("user", "OK.")]
    assert len({t.id for t in turns}) == 3 and len(store) == 3
    assert len(store.search("ok", memory_type="conversation", min_score=0)) == 3  # nor collapsed on read


@pytest.mark.parametrize("kind", ["context", "fact"])
def test_other_owners_sharing_and_the_switch_keep_their_own_memory(store: MemoryStore, config: Config,
                                                                    embedder: object, kind: str) -> None:
    text = "The user likes jazz"
    alice = store.store(text, kind, owner="alice")
    assert store.store(text + ".", kind, owner="alice").id == alice.id
    assert store.store(text, kind, owner="bob").id != alice.id
    assert store.store(text, kind, owner="alice", shared=True).id != alice.id
    assert store.store(text, kind, {"person": "Tom"}, owner="alice").id != alice.id
    off = config.replace("memory", dedupe=False, path=config.memory.path + "-off")
    with MemoryStore(config=off, embedder=embedder) as plain:
        assert plain.store(text, kind).id != plain.store(text, kind).id


def test_a_restatement_is_found_behind_many_other_users_copies(store: MemoryStore) -> None:
    """The nearest memories of the type are other users' copies of the sentence: the check
    looks further than its first neighbours."""
    mine = store.store("Trash day is Monday", owner="user0")
    for n in range(1, 20):
        store.store("Trash day is Monday", owner=f"user{n}")
    assert store.store("trash day is monday!", owner="user0").id == mine.id and len(store) == 20


@pytest.mark.parametrize("waiting_rows", [2048, 3])  # its float32 copies, or past them the rows gathered
def test_a_restatement_of_a_write_still_waiting_for_the_graph_is_found(config: Config, embedder: object,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       waiting_rows: int) -> None:
    """A store past ``exact_below`` (its type graphs in use): a fact restating one written
    in the same burst (its vector waiting for the graph, searched exactly) or one in the
    graph is merged into it."""
    monkeypatch.setattr(vector_index, "WAITING_ROWS", waiting_rows)
    names = ["Anna", "Ben", "Carla", "Dmitri", "Eve", "Farid", "Greta", "Hugo", "Ines", "Jon"]
    foods = ["pizza", "sushi", "curry", "tacos", "soup", "pasta"]
    with MemoryStore(config=config.replace("search", exact_below=40, exact_threshold=4), embedder=embedder) as store:
        graphed = store.store_batch([{"content": f"{n} likes {f}"} for n in names for f in foods])
        while store.maintain(save_cache=False):
            pass
        assert store._state.vectors.stats()["pending"] == 0
        burst = [store.store(f"{n}'s locker code is {i}{i + 3}{i + 7}") for i, n in enumerate(names)]
        assert store._state.vectors.stats()["pending"] == len(burst)
        assert store.store("Carla's locker code is 259.").id == burst[2].id  # waiting for the graph
        assert store.store("hugo LIKES curry").id == graphed[7 * 6 + 2].id  # in the graph
        assert store.store("Hugo likes rice").id not in {m.id for m in graphed}
        assert len(store) == 60 + 10 + 1


def test_the_word_filter_skips_the_search_only_for_words_no_memory_has(config: Config, embedder: object,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once built (idle time after an open), the filter of kept content words lets a write
    of new words skip the vector search; every restatement is still found: of a memory
    kept before the open, put while the build was under way, written since, or before
    the filter is built."""
    searched: list[str] = []
    search = dedupe.restatement

    def counted(new: Record, *args: Any) -> Any:
        searched.append(new.content)
        return search(new, *args)

    monkeypatch.setattr(dedupe, "restatement", counted)
    monkeypatch.setattr(dedupe, "TOLD_AT_OPEN", 4)  # more: built at idle time
    with MemoryStore(config=config, embedder=embedder) as store:
        before = store.store_batch([{"content": f"Guest {n} likes {f}"} for n in "ABCDEFGH" for f in ("tea", "jam")])
    with MemoryStore(config=config, embedder=embedder) as store:
        told = store._core.told
        assert told is not None and not told.complete and told.may_hold(Record("x", "Nobody", "fact", 0.0, None, {}))
        assert store.store("GUEST C LIKES JAM").id == before[5].id  # before the build: searched
        assert store.maintain(save_cache=False, budget=1) == 8  # 8 of the 16 read
        during = store.store("The attic key is under the blue pot")
        while store.maintain(save_cache=False):
            pass
        assert told.complete
        after = store.store("Mia walks the dog every evening")
        searched.clear()
        assert [store.store(m.content.upper() + "!").id for m in before] == [m.id for m in before]
        assert store.store("the attic key is under the blue pot.").id == during.id
        assert store.store("Every evening Mia walks the dog").id == after.id  # rule 2: the same words moved
        assert len(searched) == 16 + 2
        searched.clear()
        fresh = [store.store("Guest C likes honey"), store.store("The cellar key is under the blue pot")]
        assert searched == [] and len(store) == 16 + 2 + 2 and fresh[0].id != fresh[1].id
        assert store.store("Guest C likes tea", owner="bob").id not in {m.id for m in before}  # searched, another owner
        assert searched == ["Guest C likes tea"]


def test_without_the_model_equal_normalized_texts_are_still_merged(lexical_store: MemoryStore) -> None:
    first = lexical_store.remember_fact("Sarah likes Italian food")
    assert lexical_store.remember_fact("I KNOW THAT SARAH LIKES ITALIAN FOOD!").id == first.id
    assert lexical_store.remember("sarah likes italian food.", subjects=[])[0].id == first.id
    assert lexical_store.remember_fact("Sarah enjoys Italian food").id != first.id  # rule 2 needs vectors
    assert lexical_store.remember_fact("Sarah likes Thai food").id != first.id and len(lexical_store) == 3
    for n in range(40):  # every word of it common: found by the words it shares most with
        lexical_store.store("Trash day is Monday", owner=f"user{n}")
    mine = lexical_store.store("Trash day is Monday", owner="me")
    assert lexical_store.store("TRASH DAY IS MONDAY.", owner="me").id == mine.id and len(lexical_store) == 44


def test_named_notes_and_set_context_values_are_never_merged(store: MemoryStore) -> None:
    note = store.remember("The router password is on the fridge", name="router")[0]
    assert store.remember("The router password is on the fridge")[0].id != note.id
    store.set_context("mood", "happy")
    store.set_context("weather", "happy")
    assert store.get_context("mood") == "happy" and store.get_context("weather") == "happy"


def test_every_contrast_pair_keeps_both_and_the_store_merges_what_the_rule_says(store: MemoryStore,
                                                                                  embedder: object) -> None:
    """Each pair written by its own user (owners keep pairs apart in one store)."""
    sims = cosines(PAIRS, embedder.embed)  # type: ignore[attr-defined]
    for i, (pair, sim) in enumerate(zip(PAIRS, sims, strict=True)):
        first = _store_side(store, pair, i, "a")
        second = _store_side(store, pair, i, "b")
        if not pair.merge and not pair.row.get("still_merged"):  # the marked few: as the rule says, below
            assert first.id != second.id, pair
        elif abs(sim - restating.THRESHOLD) > 0.005:  # bfloat16 storage moves a cosine by ~1e-4
            assert (first.id == second.id) == rule(restating.THRESHOLD)(pair, float(sim)), pair


def _store_side(store: MemoryStore, pair: Pair, i: int, side: str) -> Memory:
    row = pair.row
    owner = f"pair{i}-{row.get(f'owner_{side}', '')}"
    person = row.get(f"person_{side}")
    return store.store(row[side], "fact", {"person": person} if person else None, owner=owner)


# -- the store: reads -------------------------------------------------------------------------------

@pytest.fixture
def copies(config: Config, embedder: object) -> Iterator[MemoryStore]:
    """A store holding copies, written with memory.dedupe off (as before it existed)."""
    with MemoryStore(config=config.replace("memory", dedupe=False), embedder=embedder) as s:
        for text in ("Sarah likes Italian food", "SARAH LIKES ITALIAN FOOD", "Sarah likes Italian food.",
                     "I know that Sarah likes Italian food", "Sarah does not like Thai food",
                     "Every evening Mia walks the dog", "Mia walks the dog every evening"):
            s.remember_fact(text)
        s.store("Sarah likes Italian food", "context")
    with MemoryStore(config=config, embedder=embedder) as s:
        yield s


def test_search_recall_and_context_for_show_no_copies(copies: MemoryStore) -> None:
    hits = copies.search("What food does Sarah like?", limit=5, min_score=0)
    shown = [restating.normalized(h.memory.content) for h in hits]
    assert len(shown) == len(set(shown)) == 4 and len(copies) == 8  # nothing deleted by reading
    recalled = [h.memory.content for h in copies.recall("Sarah Italian food", limit=5)]
    assert recalled.count("Sarah likes Italian food") == 1 and len(recalled) == len(set(map(str.lower, recalled)))
    text = copies.context_for("What food does Sarah like?").text
    assert text.lower().count("sarah likes italian food") == 1


def test_a_superseded_copy_gives_way_to_the_live_memory(store: MemoryStore, config: Config) -> None:
    old = store.remember_fact("The bins go out on Monday")
    new = store.remember_fact("The bins go out on Tuesday")
    store.supersede(old.id, new.id)
    copy = store.store_batch([{"content": "the bins go out on Monday.", "id": "copy"}])[0]  # a new live one
    assert copy.id == "copy"  # the kept one is superseded: not a restatement of it
    hits = store.search("bins Monday", limit=5, min_score=0, include_superseded=True)
    monday = [h.memory.id for h in hits if "monday" in h.memory.content.lower()]
    assert monday == ["copy"]


# -- merging the copies a store holds, and a restart ---------------------------------------------------

def test_dedupe_dry_run_then_merge_keeps_the_oldest_and_history(copies: MemoryStore) -> None:
    before = {m.id: m for m in copies.export_page()[0]}
    planned = copies.dedupe(dry_run=True)
    assert planned["dry_run"] and planned["merged"] == 4 and planned["kept"] == 2 and len(copies) == 8
    oldest = min((m for m in before.values() if m.content == "Sarah likes Italian food"
                  and m.memory_type.value == "fact"), key=lambda m: m.created_at)
    [food] = [m for m in planned["merges"] if m["kept"] == oldest.id]
    assert {c["content"] for c in food["copies"]} == {"SARAH LIKES ITALIAN FOOD", "Sarah likes Italian food.",
                                                      "I know that Sarah likes Italian food"}
    done = copies.dedupe()
    assert not done["dry_run"] and done["merged"] == 4 and len(copies) == 4
    kept = copies.get(oldest.id)
    assert kept is not None and kept.metadata[dedupe.COUNT_KEY] == 3
    assert copies.dedupe(dry_run=True)["merged"] == 0  # nothing left


def test_dedupe_in_steps_is_one_pass_and_lets_a_store_and_a_search_in(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``dedupe`` compares a step of memories at a time under the store lock (and journals
    a frame of merges at a time): the same merges as one pass, and a store and a search
    made meanwhile from another thread are done long before it ends."""
    import threading
    import time

    path = str(tmp_path / "data")
    texts = [f"Guest number {i} sits at table {i % 7}" for i in range(300)]
    with MemoryStore(config=Config().replace("memory", path=path, dedupe=False), embedder=None) as store:
        store.store_batch([{"content": t} for t in texts])
        store.store_batch([{"content": t.upper() + "!"} for t in texts[::3]] + [{"content": t} for t in texts[::5]])
    monkeypatch.setattr(dedupe, "PLAN_STEP", 16)
    monkeypatch.setattr(dedupe, "MERGES_PER_FRAME", 5)
    with MemoryStore(config=Config().replace("memory", path=path), embedder=None) as store:
        state = store._core.state
        one_pass = dedupe.plan(state.records.values(), state.vectors, ["speaker", "person"], time.time())
        planned = store.dedupe(dry_run=True)
        assert planned["merges"] == [m.to_dict() for m in one_pass][: dedupe.REPORTED]
        assert planned["merged"] == 100 + 60 and planned["kept"] == 100 + 60 - 20 and len(store) == 460
        rule = dedupe.same

        def slow(*args: Any) -> dedupe.Decision:  # a slow rule: a long run
            time.sleep(0.002)
            return rule(*args)

        monkeypatch.setattr(dedupe, "same", slow)
        done: dict[str, object] = {}
        worker = threading.Thread(target=lambda: done.update(store.dedupe()), daemon=True)
        worker.start()
        time.sleep(0.05)
        new = store.store("The spare key is in the red box", "fact")
        assert store.search("spare key", limit=1, min_score=0)[0].memory.id == new.id
        assert worker.is_alive() and not done  # both went in while the run went on
        worker.join(timeout=60)
        assert done["merged"] == 160 and len(store) == 300 + 1
    assert OPERATIONS["dedupe"].lane == "background"  # in the daemon: beside the engine thread


def test_a_merge_points_what_a_copy_superseded_at_the_kept_memory(store: MemoryStore, config: Config,
                                                                   embedder: object) -> None:
    with MemoryStore(config=config.replace("memory", dedupe=False, path=config.memory.path + "-h"),
                     embedder=embedder) as s:
        kept = s.remember_fact("The spare key is under the blue flowerpot")
        copy = s.remember_fact("the spare key is under the blue flowerpot")
        older = s.remember_fact("The spare key is in the garage")
        s.supersede(older.id, copy.id)
        s.dedupe()
        assert s.get(copy.id) is None and s.history(older.id)[-1].id == kept.id


def test_a_restart_replays_refreshes_and_merges(config: Config, embedder: object) -> None:
    """Written, then the process dies before any compaction: the journal alone says it all."""
    with MemoryStore(config=config.replace("memory", dedupe=False), embedder=embedder) as s:
        s.remember_fact("Lily's birthday is on 14 October")
        s.remember_fact("LILY'S BIRTHDAY IS ON 14 OCTOBER")
    s = MemoryStore(config=config, embedder=embedder)
    first = s.remember_fact("Tom is allergic to peanuts")
    s.remember_fact("Remember that Tom is allergic to peanuts")
    s.dedupe()
    seen = sorted((m.id, m.content, m.metadata.get(dedupe.COUNT_KEY)) for m in s.export_page()[0])
    abandon(s)
    with MemoryStore(config=config, embedder=embedder) as again:
        assert sorted((m.id, m.content, m.metadata.get(dedupe.COUNT_KEY)) for m in again.export_page()[0]) == seen
        assert len(again) == 2 and again.get(first.id).metadata[dedupe.COUNT_KEY] == 1  # type: ignore[union-attr]


def test_a_search_and_a_store_sent_during_a_long_dedupe_are_answered_before_it(tmp_path: Path) -> None:
    """The daemon runs a dedupe beside its engine thread, the store lock a step at a
    time: a search and a store sent while it runs are answered before it ends."""
    import threading
    import time

    daemon = DaemonProcess(tmp_path, embedding={"enabled": False})
    with MemoryStore(config=daemon.config.replace("memory", dedupe=False), embedder=None) as s:
        for start in range(0, 30_000, 1000):
            s.store_batch([{"content": f"Guest {i} sits at table {i % 97} in room {i % 13}"}
                           for i in range(start, start + 1000)])
    with daemon:
        ended: dict[str, float] = {}

        def dedupe_run() -> None:
            with daemon.client() as c:
                c.dedupe(dry_run=True, timeout=120)
                ended["dedupe"] = time.monotonic()

        worker = threading.Thread(target=dedupe_run, daemon=True)
        started = time.monotonic()
        worker.start()
        with daemon.client() as c:
            time.sleep(0.2)  # the dedupe under way (it reads 30,000 memories: seconds)
            assert c.search("Guest 7 table", limit=1, timeout=30)
            assert c.store("The spare key is in the red box", timeout=30).id
            answered = time.monotonic()
        worker.join(timeout=120)
        assert "dedupe" in ended and answered < ended["dedupe"], (answered - started, ended)


def test_dedupe_command_dry_run_then_real_through_the_daemon(tmp_path: Path) -> None:
    """A words-only daemon (quick to start): copies equal once normalized are merged."""
    daemon = DaemonProcess(tmp_path, embedding={"enabled": False})
    with MemoryStore(config=daemon.config.replace("memory", dedupe=False), embedder=None) as s:
        for text in ("Grandma takes her pills at 8 am", "GRANDMA TAKES HER PILLS AT 8 AM",
                     "Note that Grandma takes her pills at 8 am.", "Grandma takes her pills at 9 am"):
            s.remember_fact(text)
    with daemon:
        dry = run_cli(daemon, "dedupe", "--dry-run")
        assert dry.returncode == 0 and "would merge 2 copies into 1 memory" in dry.stdout, dry.stderr
        assert "GRANDMA TAKES HER PILLS AT 8 AM" in dry.stdout and "9 am" not in dry.stdout
        with daemon.client() as c:
            assert c.stats()["store"]["memories"] == 4
        real = run_cli(daemon, "dedupe", "--json")
        assert real.returncode == 0 and json.loads(real.stdout)["merged"] == 2, real.stderr
        with daemon.client() as c:
            assert c.stats()["store"]["memories"] == 2
    with daemon:  # restarted
        again = run_cli(daemon, "dedupe", "--dry-run", "--json")
        assert json.loads(again.stdout)["merged"] == 0
        with daemon.client() as c:
            assert c.stats()["store"]["memories"] == 2


@pytest.mark.parametrize("changed", ["copy", "kept"])
def test_a_merge_leaves_out_a_memory_superseded_between_the_plan_and_its_frame(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changed: str) -> None:
    """``dedupe`` plans in steps and merges later, the store lock released in between: a
    memory superseded meanwhile (a correction the engine thread made) is no longer one a
    plan would merge, so its merge is left out (the copy and its history kept)."""
    path = str(tmp_path / "data")
    with MemoryStore(config=Config().replace("memory", path=path, dedupe=False), embedder=None) as store:
        kept = store.store("The bins go out on Monday", "fact")
        copy = store.store("the bins go out on Monday.", "fact")
    with MemoryStore(config=Config().replace("memory", path=path), embedder=None) as store:
        assert store.dedupe(dry_run=True)["merged"] == 1
        real = dedupe._Planner.merges
        newer: list[Memory] = []

        def meanwhile(planner: Any, *args: Any) -> list[dedupe.Merge]:
            if not newer:  # between the last step of the plan and the first frame of merges
                newer.append(store.store("The bins go out on Tuesday", "fact"))
                store.supersede(copy.id if changed == "copy" else kept.id, newer[0].id)
            return real(planner, *args)

        monkeypatch.setattr(dedupe._Planner, "merges", meanwhile)
        done = store.dedupe()
        assert done["merged"] == 0 and len(store) == 3
        old = copy if changed == "copy" else kept
        assert [m.id for m in store.history(newer[0].id)] == [old.id, newer[0].id]
        live = kept if changed == "copy" else copy
        assert store.get(live.id).superseded_by is None  # type: ignore[union-attr]
