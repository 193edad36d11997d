"""LexicalIndex: tokenising, BM25 coverage scores, incremental add/remove, snapshot state."""

import numpy as np
import pytest

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
