"""The ranking functions: fusion bounds and monotonicity, top-k, lookup, neighbour bonus,
pseudo-relevance feedback."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reachy_memory import Config, ConfigError, MemoryStore, load_config
from reachy_memory.config import SearchConfig
from reachy_memory.engine import ranking
from reachy_memory.engine.lexical_index import Tokenizer
from tests.conftest import HashEmbedder

unit = st.floats(0.0, 1.0, allow_nan=False)


@given(cos=unit, lex=unit, w=unit, more=st.floats(0.0, 0.5))
def test_hybrid_fusion_is_bounded_and_rises_with_either_signal(cos: float, lex: float, w: float, more: float) -> None:
    cfg = SearchConfig(vector_weight=w)

    def score(c: float, x: float) -> float:
        return float(ranking.fuse(np.array([c]), np.array([x]), cfg, use_vec=True, use_lex=True)[0])

    base = score(cos, lex)
    assert 0.0 <= base <= 1.0
    assert score(min(cos + more, 1.0), lex) >= base - 1e-12  # more similar never ranks lower
    assert score(cos, min(lex + more, 1.0)) >= base - 1e-12  # more words in common never ranks lower


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50), st.integers(1, 60))
def test_top_k_keeps_the_largest(scores: list[float], k: int) -> None:
    arr = np.array(scores)
    picked = ranking.top_k(arr, k)
    assert len(picked) == min(k, len(arr))
    assert sorted(arr[picked].tolist(), reverse=True) == sorted(arr.tolist(), reverse=True)[: len(picked)]


@given(st.dictionaries(st.integers(0, 1000), st.floats(0, 10, allow_nan=False), max_size=30),
       st.lists(st.integers(0, 1000), max_size=30))
def test_lookup_finds_present_keys_and_zero_elsewhere(table: dict[int, float], wanted: list[int]) -> None:
    keys = np.array(sorted(table), np.int64)
    values = np.array([table[k] for k in keys], np.float64)
    got = ranking.lookup(keys, values, np.array(wanted, np.int64))
    assert got.tolist() == [table.get(w, 0.0) for w in wanted]


@given(scores=st.lists(unit, min_size=1, max_size=12), data=st.data())
def test_neighbour_bonus_is_weight_times_the_best_adjacent_score(scores: list[float], data: st.DataObject) -> None:
    ids = [f"m{i}" for i in range(len(scores))]
    follows = [data.draw(st.sampled_from([None, *ids[:i]])) for i in range(len(ids))]  # a turn follows an older one
    got = ranking.neighbour_bonus(np.array(scores), ids, follows, 0.5)
    for i in range(len(ids)):
        adjacent = [j for j in range(len(ids)) if follows[i] == ids[j] or follows[j] == ids[i]]
        assert got[i] == 0.5 * max((scores[j] for j in adjacent), default=0.0)


# -- pseudo-relevance feedback (search.feedback_weight) ------------------------------

TURNS = [
    "Caroline: I went to the LGBTQ support group yesterday, it was so powerful",
    "Melanie: painting a sunset with my kids this weekend",
    "Caroline: the pride parade was powerful, so many LGBTQ families",  # no word of the query
    "Melanie: we went camping by the lake",
    "Caroline: researching adoption agencies this month",
]


def _search(store: MemoryStore, query: str, weight: float, **kwargs: Any) -> list[str]:
    store._config = store.config.replace("search", feedback_weight=weight)
    return [h.memory.content for h in store.search(query, min_score=0, limit=5, **kwargs)]


def test_expansion_keeps_new_content_words_only() -> None:
    terms = Tokenizer().terms
    words = ranking.expansion("Where did Caroline go to the support group?",
                              ["Caroline: I went to the LGBTQ support groups, so powerful"], terms)
    assert words == ["went", "lgbtq", "powerful"]  # "groups" stems to a query term; stopwords go


def test_expansion_is_bounded() -> None:
    text = " ".join(f"word{i}" for i in range(3 * ranking.FEEDBACK_TERMS))
    assert len(ranking.expansion("query", [text], Tokenizer().terms)) == ranking.FEEDBACK_TERMS
    # Only the start of a long memory is read: its cost does not grow with its length.
    long = "the " * (ranking.FEEDBACK_CHARS // 4) + "zebra"
    assert ranking.expansion("query", [long, "giraffe"], Tokenizer().terms) == ["giraffe"]


def test_feedback_brings_in_a_turn_that_shares_words_with_the_top_hit(tmp_path: Path) -> None:
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=None) as store:
        store.store_batch([{"content": t, "memory_type": "conversation"} for t in TURNS])
        assert TURNS[2] not in _search(store, "support group", 0.0)  # lexical only: no shared word
        with_feedback = _search(store, "support group", 0.3)
        assert with_feedback[0] == TURNS[0]  # the query's own match stays first
        assert TURNS[2] in with_feedback
        assert with_feedback.index(TURNS[2]) < with_feedback.index(TURNS[4])  # LGBTQ, powerful > Caroline


def test_feedback_respects_the_type_filter(tmp_path: Path) -> None:
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=None) as store:
        store.store_batch([{"content": t, "memory_type": "conversation"} for t in TURNS[:2]])
        store.store("LGBTQ pride is powerful", "fact")
        assert "LGBTQ pride is powerful" in _search(store, "support group", 0.3)
        assert "LGBTQ pride is powerful" not in _search(store, "support group", 0.3, memory_type="conversation")


def test_feedback_at_zero_is_the_plain_ranking(tmp_path: Path) -> None:
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=HashEmbedder()) as store:
        store.store_batch([{"content": t, "memory_type": "conversation"} for t in TURNS])
        state = store._state
        qvec = store.embed_query("support group")
        plain = ranking.Indexes(state.vectors, state.lexical, state.fields)  # no text: feedback impossible
        with_text = ranking.Indexes(state.vectors, state.lexical, state.fields, lambda s: state.by_slot[s].content)

        def ranked(indexes: ranking.Indexes, weight: float) -> dict[int, float]:
            cfg = SearchConfig(feedback_weight=weight)
            slots, scores = ranking.rank("support group", qvec, None, 5, "hybrid", None, indexes=indexes, cfg=cfg)
            return dict(zip(slots.tolist(), scores.tolist(), strict=True))

        assert ranked(with_text, 0.0) == ranked(plain, 0.0)
        assert ranked(with_text, 0.3) != ranked(plain, 0.3)  # the comparison can fail


@pytest.mark.parametrize("setting", ["feedback_weight", "diversity"])  # the knobs the cross rule kept off
@pytest.mark.parametrize("value", [-0.1, 1.5, "high"])  # below, above the range; not a number
def test_off_by_default_knobs_are_validated(setting: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"search\.{setting}"):
        load_config(search={setting: value})


@pytest.mark.parametrize("setting", ["feedback_weight", "diversity"])
def test_off_by_default_knobs_default_off_and_can_be_set(setting: str) -> None:
    # Off until the cross rule says otherwise (README, issue 12).
    assert getattr(load_config().search, setting) == 0.0
    assert getattr(load_config(search={setting: 0.2}).search, setting) == 0.2


# -- name matching (search.entity_boost) ---------------------------------------------

def _own_words_only(tmp_path: Path) -> Config:
    """A store whose turns are indexed by their own words: the second of two turns would
    otherwise also hold the first's (search.previous_turn_weight) and outscore it."""
    return Config().replace("memory", path=str(tmp_path)).replace("search", previous_turn_weight=0.0)


@pytest.mark.parametrize(("query", "lifted"), [
    ("what did Caroline paint", True),  # names the speaker of the second turn
    ("what did caroline's friend paint", True),  # any case; the possessive is a separate word
    ("what did Carol paint", False),  # a different name is no match
    ("what did Mary paint", False),  # only part of "Mary Ann": every word of the name is needed
])
def test_entity_boost_lifts_turns_of_the_named_speaker(tmp_path: Path, query: str, lifted: bool) -> None:
    # Two turns with the same words; only the speaker metadata tells them apart.
    turns = [{"content": "I painted a sunset", "metadata": {"speaker": "Mary Ann"}},
             {"content": "I painted a sunset", "metadata": {"speaker": "Caroline"}}]
    with MemoryStore(config=_own_words_only(tmp_path), embedder=None) as store:
        store.store_batch([{**t, "memory_type": "conversation"} for t in turns])
        store._config = store.config.replace("search", entity_boost=0.06)
        hits = store.search(query, min_score=0, limit=2)
        first = hits[0].memory.metadata["speaker"]
        assert (first == "Caroline" and hits[0].score > hits[1].score) == lifted


def test_entity_boost_zero_scores_every_speaker_alike(tmp_path: Path) -> None:
    turns = [{"content": "I painted a sunset", "metadata": {"speaker": s}} for s in ("Mary Ann", "Caroline")]
    with MemoryStore(config=_own_words_only(tmp_path), embedder=None) as store:
        store.store_batch([{**t, "memory_type": "conversation"} for t in turns])
        store._config = store.config.replace("search", entity_boost=0.0)
        assert len({h.score for h in store.search("what did Caroline paint", min_score=0)}) == 1


def test_an_expired_hit_lends_no_words(tmp_path: Path) -> None:
    # The conversation turn matches the query and expires after 30 days; the fact
    # shares only its other words.  Past the expiry the turn is not shown, and it
    # must not pull its neighbours in by the words it held either.
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=None) as store:
        turn = store.store("I went to the LGBTQ support group, it was powerful", "conversation")
        store.store("LGBTQ pride is powerful", "fact")
        later = turn.created_at + timedelta(days=40)
        assert "LGBTQ pride is powerful" in _search(store, "support group", 0.3)
        assert _search(store, "support group", 0.3, now=later) == []


# -- result diversity (search.diversity, maximal marginal relevance) -----------------

def _unit(*rows: list[float]) -> np.ndarray:
    out = np.array(rows, np.float32)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


@given(st.lists(unit, min_size=1, max_size=15), st.integers(0, 2**32 - 1))
def test_mmr_at_zero_diversity_keeps_the_score_order(scores: list[float], seed: int) -> None:
    ordered = np.array(sorted(scores, reverse=True))
    vectors = _unit(*np.random.default_rng(seed).standard_normal((len(scores), 4)).tolist())
    assert ranking.mmr_order(ordered, vectors, 0.0, len(ordered)).tolist() == list(range(len(scores)))


def test_mmr_drops_a_near_duplicate_of_the_top_hit_below_a_distinct_hit() -> None:
    scores = np.array([0.9, 0.85, 0.8, 0.3])
    vectors = _unit([1, 0, 0], [0.99, 0.1, 0], [0, 1, 0], [0, 0, 0])  # the last has no vector

    def order(diversity: float, k: int = 4) -> list[int]:
        return ranking.mmr_order(scores, vectors, diversity, k).tolist()

    assert order(0.0) == [0, 1, 2, 3]
    assert order(0.03) == [0, 1, 2, 3]  # 0.05 apart: a mild rule keeps the duplicate second
    assert order(0.5) == [0, 2, 1, 3]
    # Strong enough, even the vector-less hit (like nothing) passes the near-duplicate.
    assert order(0.9) == [0, 2, 3, 1]
    assert order(0.9, k=2) == [0, 2]  # only the head the caller shows is computed


TOPICS = ("pottery", "camping", "painting")


class TopicEmbedder:
    """One axis per topic word a text holds (plus a little of a shared axis): turns on the
    same topic are near-duplicates, turns on different topics are orthogonal."""

    dim = len(TOPICS) + 1

    def embed(self, texts: list[str]) -> np.ndarray:
        return _unit(*[[float(t in text.lower()) for t in TOPICS] + [0.1] for text in texts])


DIVERSE = [
    "Melanie: pottery class today, my pottery bowl came out great",
    "Melanie: back at pottery class, another pottery bowl",
    "Melanie: we went camping by the lake with the kids",
    "Melanie: painting a sunset this weekend",
]


def _diverse(store: MemoryStore, diversity: float, mode: str = "hybrid", limit: int = 3) -> list[tuple[str, float]]:
    store._config = store.config.replace("search", diversity=diversity)
    query = "What does Melanie do, pottery class or camping?"
    return [(h.memory.content, h.score) for h in store.search(query, min_score=0, limit=limit, mode=mode)]


def test_diversity_reorders_the_store_results_and_keeps_their_scores(tmp_path: Path) -> None:
    pottery, camping = set(DIVERSE[:2]), DIVERSE[2]
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=TopicEmbedder()) as store:
        store.store_batch([{"content": t, "memory_type": "fact"} for t in DIVERSE])
        plain = _diverse(store, 0.0, limit=4)
        assert {c for c, _ in plain[:2]} == pottery and plain[2][0] == camping  # by score: pottery twice first
        assert [s for _, s in plain] == sorted((s for _, s in plain), reverse=True)
        diverse = _diverse(store, 0.9, limit=4)
        assert diverse[0] == plain[0]  # the best hit stays first
        assert [c for c, _ in diverse[1:3]] == [camping, DIVERSE[3]]  # the other topics before the duplicate
        assert diverse[3][0] in pottery
        assert sorted(diverse) == sorted(plain)  # same hits, each with its own relevance (not the MMR objective)
        assert diverse[2][1] < diverse[3][1]  # so the list is no longer sorted by score
        assert _diverse(store, 0.9, mode="lexical") == _diverse(store, 0.0, mode="lexical")  # hybrid only


def test_diversity_can_bring_a_hit_from_below_the_limit(tmp_path: Path) -> None:
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=TopicEmbedder()) as store:
        store.store_batch([{"content": t, "memory_type": "fact"} for t in DIVERSE])
        assert DIVERSE[2] not in [c for c, _ in _diverse(store, 0.0, limit=2)]
        assert [c for c, _ in _diverse(store, 0.9, limit=2)][1] == DIVERSE[2]


def _ranked_by_b(store: MemoryStore, query: str, b: float, feedback: float) -> dict[str, float]:
    """Scores by content of the store's ranking with ``search.bm25_b`` = b (through ``rank``)."""
    state = store._state
    indexes = ranking.Indexes(state.vectors, state.lexical, state.fields, lambda s: state.by_slot[s].content)
    cfg = SearchConfig(bm25_b=b, feedback_weight=feedback, entity_boost=0.0)
    slots, scores = ranking.rank(query, None, None, 5, "hybrid", None, indexes=indexes, cfg=cfg)
    return {state.by_slot[int(s)].content: float(x) for s, x in zip(slots, scores, strict=True)}


SHORT, LONG = "basil", "basil grows on the kitchen window sill next to the old radio and the fruit bowl"


@pytest.mark.parametrize(("query", "feedback"), [
    ("basil", 0.0),  # the BM25 pass reads search.bm25_b
    ("pesto", 0.5),  # so does the feedback pass: "pesto" finds only the recipe, whose word "basil" finds the rest
])
def test_the_ranking_applies_the_configured_bm25_b(tmp_path: Path, query: str, feedback: float) -> None:
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=None) as store:
        store.store_batch([{"content": t, "memory_type": "fact"}
                           for t in (SHORT, LONG, "pesto recipe with basil", "the robot charges in the hallway")])
        flat, full = _ranked_by_b(store, query, 0.0, feedback), _ranked_by_b(store, query, 1.0, feedback)
    assert flat[SHORT] == pytest.approx(flat[LONG])  # b 0: length does not count
    assert full[SHORT] > full[LONG] + 0.01  # b 1: the long memory falls behind
