"""LexicalIndex: tokenising, BM25 coverage scores, incremental add/remove, snapshot state."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reachy_memory.engine.lexical_index import LexicalIndex, Tokenizer, index_state


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
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "search", "snapshot"]), st.integers(0, 11), _texts,
                          _texts), max_size=60))
def test_incremental_index_scores_as_one_built_from_scratch(
        steps: list[tuple[str, int, list[str], list[str]]]) -> None:
    """Adds (with a previous-turn field or none), removals and reads in any order score
    exactly as an index built from the live texts."""
    index, live = LexicalIndex(), {}
    for action, slot, words, previous in steps:
        if action == "add" and slot not in live:
            live[slot] = (" ".join(words), " ".join(previous) or None)
            index.add(slot, *live[slot])
        elif action == "remove" and slot in live:
            index.remove(slot, *live.pop(slot))
        elif action == "search":
            index.scores("tea garden piano robot")
        elif action == "snapshot":
            index.state()
    fresh = LexicalIndex()
    for slot, (text, previous) in live.items():
        fresh.add(slot, text, previous)
    for query in ("tea", "garden piano", "robot blue train tea"):
        (a, x), (b, y) = index.scores(query), fresh.scores(query)
        assert a.tolist() == b.tolist()
        np.testing.assert_allclose(x, y, rtol=1e-12)
    assert all(not p.changes for p in index._postings.values() if p.readable())  # merged once read


_docs = st.dictionaries(st.integers(0, 3000), st.tuples(_texts, _texts), max_size=40)


@settings(max_examples=60, deadline=None)
@given(_docs, st.sampled_from([0.0, 0.25, 0.5, 1.0]))
def test_the_flat_builder_gives_the_state_of_an_index_built_by_adding(
        docs: dict[int, tuple[list[str], list[str]]], weight: float) -> None:
    """index_state (the background compaction's builder) writes the postings that adding
    the same documents one by one gives, byte for byte, and the same lengths."""
    rows = [(slot, " ".join(words), " ".join(previous) or None) for slot, (words, previous) in docs.items()]
    added = LexicalIndex(previous_weight=weight)
    for row in rows:
        added.add(*row)
    expected, built = added.state(), index_state(rows, Tokenizer(), weight)
    assert built["terms_f32"] == expected["terms_f32"]
    assert (built["n"], built["previous_weight"]) == (expected["n"], weight)
    a, b = (np.frombuffer(s["doc_len"], np.float32) for s in (expected, built))
    common = min(len(a), len(b))  # sized differently past the last slot, zeros there
    assert a[:common].tolist() == b[:common].tolist() and not a[common:].any() and not b[common:].any()
    loaded = LexicalIndex(previous_weight=weight)
    assert loaded.load_state(built)
    assert scores(loaded, "tea garden robot") == pytest.approx(scores(added, "tea garden robot"))


# -- the previous-turn field (search.previous_turn_weight) ------------------------------

def test_a_previous_turn_word_counts_its_weight() -> None:
    index = LexicalIndex(previous_weight=0.5)
    index.add(0, "I painted a sunrise")  # the word in its own text
    index.add(1, "it was lovely", previous="did you paint a sunrise")  # only in the turn before
    index.add(2, "the robot charges in the hallway")
    got = scores(index, "sunrise")
    assert set(got) == {0, 1} and got[0] > got[1] > 0
    assert index._postings["sunris"].readable()[1].tolist() == [1.0, 0.5]  # BM25F: a fraction of a word
    assert index._doc_len[1] == 1  # "love": the previous turn lends words, not length


def test_a_long_previous_turn_does_not_bury_the_turns_own_words() -> None:
    question = " ".join(f"word{i}" for i in range(150))  # a long turn before a short answer
    plain, fielded = LexicalIndex(), LexicalIndex()
    for index, previous in ((plain, None), (fielded, question)):
        index.add(0, "so that is lasagne", previous)
        index.add(1, "sounds good", previous="so that is lasagne")
        index.add(2, "the robot charges in the hallway")
    assert scores(fielded, "lasagne")[0] == pytest.approx(scores(plain, "lasagne")[0])  # its own word, unchanged
    assert scores(fielded, "lasagne")[0] > scores(fielded, "lasagne")[1] > 0


def test_weight_zero_indexes_own_words_only() -> None:
    index = LexicalIndex(previous_weight=0.0)
    index.add(0, "it was lovely", previous="did you paint a sunrise")
    assert scores(index, "sunrise") == {} and set(scores(index, "lovely")) == {0}


def test_a_removed_turn_takes_its_previous_words_along() -> None:
    index = LexicalIndex()
    index.add(0, "it was lovely", previous="did you paint a sunrise")
    index.remove(0, "it was lovely", previous="did you paint a sunrise")
    index.add(0, "cherries")  # slot reuse: no posting of the old previous field may stay
    assert scores(index, "sunrise") == {} and set(scores(index, "cherries")) == {0}


def test_fractional_frequencies_survive_the_state_and_another_weight_is_refused() -> None:
    index = LexicalIndex(previous_weight=0.5)
    index.add(0, "it was lovely", previous="did you paint a sunrise")
    index.add(1, "a sunrise over the sea")
    restored = LexicalIndex(previous_weight=0.5)
    assert restored.load_state(index.state())
    assert scores(restored, "sunrise paint") == pytest.approx(scores(index, "sunrise paint"))
    other = LexicalIndex(previous_weight=0.25)
    assert not other.load_state(index.state()) and other.n_docs == 0  # the caller re-adds instead


def test_a_state_from_before_previous_fields_loads_under_any_weight() -> None:
    old = {"terms": {"tea": [np.array([0, 2], np.int32).tobytes(), np.array([2, 1], np.uint16).tobytes()]},
           "doc_len": np.array([3, 1, 1], np.float32).tobytes(), "n": 3}
    index = LexicalIndex(previous_weight=0.75)
    assert index.load_state(old)
    assert index._postings["tea"].readable()[1].tolist() == [2.0, 1.0] and index.n_docs == 3


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


def test_numbers_pass_unstemmed_and_uncached_and_the_stem_cache_stays_bounded() -> None:
    """Text with ever-new numbers in it ("topic 4711") filled a 200k-word cache under
    load (0.44 MB/min of daemon RSS); numbers now skip it, other words stay bounded."""
    import snowballstemmer

    stemmer = snowballstemmer.stemmer("english")
    tokenizer = Tokenizer(cache_size=100)
    for i in range(5000):
        number = f"{i:0{1 + i % 6}d}"  # leading zeros too
        assert tokenizer.terms(f"topic {number}") == ["topic", number] == [stemmer.stemWord("topic"),
                                                                            stemmer.stemWord(number)]
    assert len(tokenizer._cache) == 1  # "topic" alone
    words = [f"running{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}x" for i in range(500)]
    assert [tokenizer.terms(w)[0] for w in words] == [stemmer.stemWord(w) for w in words]
    assert len(tokenizer._cache) <= 100


def test_holders_of_a_term_and_about_how_many_there_are() -> None:
    """What the restatement check without a vector reads: the memories holding a word."""
    idx = LexicalIndex()
    idx.add(0, "Sarah likes jazz")
    idx.add(1, "Tom likes tea")
    idx.add(2, "Sarah plays chess")
    assert sorted(idx.holders("sarah").tolist()) == [0, 2] and idx.held_by("sarah") >= 2
    idx.remove(2, "Sarah plays chess")
    assert idx.holders("sarah").tolist() == [0] and idx.holders("nobody").tolist() == []
    assert idx.held_by("nobody") == 0 and idx.held_by("tea") == 1
