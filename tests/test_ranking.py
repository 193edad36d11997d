"""The pure ranking functions: fusion bounds and monotonicity, top-k, lookup, neighbour bonus."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from reachy_memory import _ranking as ranking
from reachy_memory.config import SearchConfig

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
