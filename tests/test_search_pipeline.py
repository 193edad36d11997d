"""One search pipeline: every argument is checked once, before the query is embedded
(in-process and in the daemon, on its embed thread), and one function ranks."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reachy_memory import Config, MemoryClient, MemoryStore
from reachy_memory.daemon.server import Daemon
from reachy_memory.engine.filters import check_where
from reachy_memory.engine.search import SearchQuery
from reachy_memory.errors import ValidationError
from tests.conftest import HashEmbedder

WAIT = 20.0
BAD: list[dict[str, Any]] = [
    {"where": {"$foo": 1}},
    {"where": {"kind": {"$gt": "x"}}},
    {"where": {"kind": {"$in": 3}}},
    {"where": {"kind": {"$eq": 1, "$ne": 2}}},
    {"where": {"$and": []}},
    {"where": {"$or": [{}]}},
    {"where": ["kind"]},
    {"where": {"kind": {"$eq": [1, 2]}}},
    {"limit": 0},
    {"limit": "3"},
    {"min_score": "high"},
    {"min_score": float("nan")},
    {"mode": "fuzzy"},
    {"memory_type": "dream"},
    {"owner": 5},
    {"about": "   "},
    {"now": "yesterday"},
]


class RecordingEmbedder(HashEmbedder):
    """Remembers every text it was asked to embed."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        self.lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        with self.lock:
            self.texts.extend(texts)
        return super().embed(texts)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config().replace("memory", path=str(tmp_path / "data"))


@pytest.fixture
def store(config: Config) -> Iterator[tuple[MemoryStore, RecordingEmbedder]]:
    embedder = RecordingEmbedder()
    with MemoryStore(config=config, embedder=embedder) as s:
        s.store_batch([{"content": f"the kettle is in room {i}", "metadata": {"kind": i % 3}} for i in range(6)])
        embedder.texts.clear()
        yield s, embedder


@pytest.mark.parametrize("bad", BAD, ids=[f"{k}={v!r}" for case in BAD for k, v in case.items()])
def test_a_malformed_argument_is_refused_before_the_query_is_embedded(
        store: tuple[MemoryStore, RecordingEmbedder], bad: dict[str, Any]) -> None:
    s, embedder = store
    (name, _), = bad.items()
    with pytest.raises(ValidationError) as refused:
        s.search("where is the kettle", **bad)
    assert refused.value.fields["field"] == name  # the argument at fault is named
    with pytest.raises(ValidationError):
        s.check_search("where is the kettle", **bad)  # the daemon's embed thread calls this one
    assert embedder.texts == []  # nothing was embedded for a search that was refused
    s.search("where is the kettle")  # a good one is embedded, once
    assert embedder.texts == ["where is the kettle"]


def test_context_for_checks_its_limits_before_embedding(store: tuple[MemoryStore, RecordingEmbedder]) -> None:
    s, embedder = store
    for bad in ({"max_memories": -1}, {"max_messages": "5"}, {"min_similarity": "x"}, {"owner": 3}):
        with pytest.raises(ValidationError):
            s.context_for("where is the kettle", **bad)
    assert embedder.texts == []
    s.context_for("where is the kettle")
    assert embedder.texts == ["where is the kettle"]  # one embedding serves its three searches


def test_a_checked_search_ranks_as_search_does(store: tuple[MemoryStore, RecordingEmbedder]) -> None:
    s, embedder = store
    query = s.check_search("kettle room", where={"kind": {"$in": [0, 2]}}, limit=3, min_score=0.0)
    assert isinstance(query, SearchQuery) and query.mode == s.config.search.mode and embedder.texts == []
    checked = s.search_checked(query, s.embed_query(query.text))
    direct = s.search("kettle room", where={"kind": {"$in": [0, 2]}}, limit=3, min_score=0.0)
    assert [(h.memory.id, h.score) for h in checked] == [(h.memory.id, h.score) for h in direct]
    assert len(checked) == 3 and all(h.memory.metadata["kind"] in (0, 2) for h in checked)


def test_every_filter_chromadb_answered_passes_the_check() -> None:
    """The check refuses nothing the index can evaluate (the 300 recorded ChromaDB filters)."""
    cases = json.loads((Path(__file__).parent / "fixtures" / "chroma_filters.json").read_text())["cases"]
    assert len(cases) == 300
    for case in cases:
        assert check_where(case["where"]) == case["where"]


@pytest.fixture
def served(config: Config, tmp_path: Path) -> Iterator[tuple[Daemon, RecordingEmbedder]]:
    """A daemon with a recording embedder, serving on a thread of this process."""
    embedder = RecordingEmbedder()
    store = MemoryStore(config=config, embedder=embedder)
    store.store_batch([{"content": "the kettle is in the kitchen", "metadata": {"kind": 1}}])
    embedder.texts.clear()
    daemon = Daemon(config, store=store, endpoint=f"ipc://{tmp_path}/run/m.sock", clock_sync=lambda: None)
    thread = threading.Thread(target=daemon.serve, daemon=True)
    thread.start()
    try:
        yield daemon, embedder
    finally:
        daemon.stop()
        thread.join(WAIT)
        assert not thread.is_alive()


def test_the_daemon_refuses_a_malformed_search_before_embedding_it(served: tuple[Daemon, RecordingEmbedder]) -> None:
    daemon, embedder = served
    with MemoryClient(daemon.endpoint, config=daemon.config, timeout=WAIT) as c:
        for bad in ({"where": {"$foo": 1}}, {"where": {"kind": {"$gt": "x"}}}, {"memory_type": "dream"},
                    {"mode": "fuzzy"}, {"about": " "}):
            with pytest.raises(ValidationError):
                c.search("where is the kettle", **bad)
        assert embedder.texts == []
        hits = c.search("where is the kettle", where={"kind": 1})
        assert [h.memory.content for h in hits] == ["the kettle is in the kitchen"]
        assert embedder.texts == ["where is the kettle"]
