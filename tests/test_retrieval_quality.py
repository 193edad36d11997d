"""Retrieval quality guard on one LoCoMo conversation (the full figures live in README)."""

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
