"""LexicalIndex: tokenising, BM25 coverage scores, incremental add/remove, snapshot state."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reachy_memory.lexical_index import LexicalIndex, Tokenizer


@pytest.mark.parametrize(
    ("text", "terms"),
    [
        ("The cats are running!", ["cat", "run"]),  # stopwords dropped, stems kept
        ("Sarah's dentist appointment", ["sarah", "dentist", "appoint"]),  # possessive split off
        ("東京", ["東", "京"]),  # CJK runs become characters
        ("", []),  # nothing
    ],
)
def test_terms(text: str, terms: list[str]) -> None:
    assert Tokenizer().terms(text) == terms


def scores(index: LexicalIndex, query: str) -> dict[int, float]:
    slots, values = index.scores(query)
    return dict(zip(slots.tolist(), values.tolist(), strict=True))


def test_scores_rank_and_stay_in_unit_range() -> None:
    index = LexicalIndex()
    index.add(0, "Sarah likes Italian food")
    index.add(1, "Italian is spoken in Italy")
    index.add(2, "the robot charges in the hallway")
    got = scores(index, "what Italian food does Sarah like")
    assert set(got) == {0, 1} and got[0] > got[1]
    assert all(0 < v < 1 for v in got.values())


@pytest.mark.parametrize("b, short_wins", [
    (0.0, False),  # no length normalisation: one "basil" scores the same in a long memory
    (0.3, True),  # the default: a long memory is a little behind
    (1.0, True),  # full normalisation
])
def test_b_sets_how_much_length_counts(b: float, short_wins: bool) -> None:
    index = LexicalIndex()
    index.add(0, "basil")
    index.add(1, "basil grows on the kitchen window sill next to the old radio and the fruit bowl")
    index.add(2, "the robot charges in the hallway")
    slots, values = index.scores("basil", b=b)
    got = dict(zip(slots.tolist(), values.tolist(), strict=True))
    assert (got[0] > got[1]) is short_wins and (got[0] >= got[1])


def test_remove_then_reuse_slot_forgets_old_terms() -> None:
    index = LexicalIndex()
    index.add(0, "apples and pears")
    index.add(1, "bananas")
    index.remove(0, "apples and pears")
    assert scores(index, "apples") == {}
    index.add(0, "cherries")  # slot reuse purges the stale postings
    assert scores(index, "apples") == {} and set(scores(index, "cherries")) == {0}


def test_mask_restricts_results() -> None:
    index = LexicalIndex()
    for slot in range(4):
        index.add(slot, "garden robot")
    mask = np.array([True, False, True, False])
    assert set(index.scores("garden", mask)[0].tolist()) == {0, 2}


def test_state_round_trip_gives_identical_scores() -> None:
    index = LexicalIndex()
    for slot, text in enumerate(["red ball under the sofa", "blue ball", "red car", "a sofa"]):
        index.add(slot, text)
    index.remove(2, "red car")
    restored = LexicalIndex()
    restored.load_state(index.state())
    assert scores(restored, "red ball sofa") == pytest.approx(scores(index, "red ball sofa"))
    restored.add(2, "green ball")  # still incremental after loading
    assert 2 in scores(restored, "ball")


_texts = st.lists(st.sampled_from(["tea", "garden", "piano", "robot", "blue", "train", "the"]), max_size=5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "search", "snapshot"]), st.integers(0, 11), _texts),
                max_size=60))
def test_incremental_index_scores_as_one_built_from_scratch(steps: list[tuple[str, int, list[str]]]) -> None:
    """Adds, removals and reads in any order score exactly as an index built from the live texts."""
    index, live = LexicalIndex(), {}
    for action, slot, words in steps:
        if action == "add" and slot not in live:
            index.add(slot, " ".join(words))
            live[slot] = " ".join(words)
        elif action == "remove" and slot in live:
            index.remove(slot, live.pop(slot))
        elif action == "search":
            index.scores("tea garden piano robot")
        elif action == "snapshot":
            index.state()
    fresh = LexicalIndex()
    for slot, text in live.items():
        fresh.add(slot, text)
    for query in ("tea", "garden piano", "robot blue train tea"):
        (a, x), (b, y) = index.scores(query), fresh.scores(query)
        assert a.tolist() == b.tolist()
        np.testing.assert_allclose(x, y, rtol=1e-12)
    assert all(not p.changes for p in index._postings.values() if p.readable())  # merged once read


def test_postings_keep_only_changes_as_python_objects() -> None:
    index = LexicalIndex()
    for slot in range(500):
        index.add(slot, "tea garden")
    index.scores("tea")
    posting = index._postings["tea"]
    assert not posting.changes and len(posting.slots) == 500  # arrays only once read
    index.remove(3, "tea garden")
    index.add(3, "piano")  # the slot's reuse purges its old postings: one change each, not a dict of all
    assert posting.changes == {3: 0} and len(posting.slots) == 500
    assert 3 not in index.scores("tea")[0].tolist() and len(index.scores("tea")[0]) == 499
