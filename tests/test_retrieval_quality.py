"""Retrieval quality guard on the LoCoMo dev set (the full figures live in README)."""

import json
from pathlib import Path

import pytest

from reachy_memory import Config
from tests.conftest import LOCOMO
from tools.eval_locomo import asked_at, built_stores, evaluate, recall, summarise


def one_question(path: Path) -> float:
    """One question's share of a conversation's recall: how much a prior may lose there.

    onnxruntime's int8 kernels sum differently on different CPUs (VNNI's dot-product
    instruction against AVX2's 16-bit intermediate sums), so the vectors, and a ranking
    near a tie, differ a little between hosts: on an AVX-512 VNNI host (2026-11-26) the
    shipped entity weight lost 0.0038 of R@5 on 26.json against the weight at 0 (a part
    of one question's evidence), where the AVX2 host it was tuned on lost nothing. A
    prior that really costs recall loses more than one question."""
    return 1 / len(json.loads(path.read_text())["qa"])


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
    slack = one_question(LOCOMO / "26.json")
    assert with_prior["R@5"] >= without["R@5"] - slack
    assert with_prior["R@10"] >= without["R@10"] - slack


@pytest.mark.skipif(not (LOCOMO / "30.json").exists() or not (LOCOMO / "26.json").exists(),
                    reason="LoCoMo dev set not present")
def test_entity_boost_does_not_lose_recall_on_either_dev_conversation(base_config: Config, embedder: object,
                                                                      tmp_path: Path) -> None:
    # The shipped name-matching weight, against the same stores with it at 0: the
    # cross rule's "no direction loses" (README, issue 12), per conversation.
    assert base_config.search.entity_boost > 0
    for _, store, conv in built_stores([LOCOMO / "26.json", LOCOMO / "30.json"], tmp_path, base_config, embedder):
        with store:
            now = asked_at(conv)
            shipped = summarise(recall(store, conv["qa"], "hybrid", now))["overall"]
            store._config = base_config.replace("search", entity_boost=0.0)
            off = summarise(recall(store, conv["qa"], "hybrid", now))["overall"]
        slack = 1 / len(conv["qa"])  # see one_question
        assert shipped["R@5"] >= off["R@5"] - slack
        assert shipped["R@10"] >= off["R@10"] - slack
