"""Retrieval quality guard on the LoCoMo dev set (the full figures live in README)."""

import pytest

from reachy_memory import Config
from tests.conftest import LOCOMO
from tools.eval_locomo import evaluate


@pytest.mark.skipif(not (LOCOMO / "30.json").exists(), reason="LoCoMo dev set not present")
def test_hybrid_beats_each_retriever_alone(base_config: Config, embedder: object) -> None:
    summary = evaluate([LOCOMO / "30.json"], base_config, embedder)
    hybrid, lexical, vector = (summary[m]["overall"] for m in ("hybrid", "lexical", "vector"))
    assert hybrid["R@5"] > max(lexical["R@5"], vector["R@5"])
    assert hybrid["R@10"] >= 0.65


@pytest.mark.skipif(not (LOCOMO / "26.json").exists(), reason="LoCoMo dev set not present")
def test_temporal_prior_does_not_lose_recall(base_config: Config, embedder: object) -> None:
    # 26.json holds the dev questions with time words ("camping in June");
    # the floor is the same run with the prior off, not a stored number.
    assert base_config.search.temporal_boost > 0
    off = base_config.replace("search", temporal_boost=0.0)
    with_prior = evaluate([LOCOMO / "26.json"], base_config, embedder)["hybrid"]["overall"]
    without = evaluate([LOCOMO / "26.json"], off, embedder)["hybrid"]["overall"]
    assert with_prior["R@5"] >= without["R@5"]
    assert with_prior["R@10"] >= without["R@10"]
