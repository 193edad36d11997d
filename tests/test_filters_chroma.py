"""``where`` means what it means in ChromaDB: 300 generated filters over 120 memories
with partly missing metadata, answered by ChromaDB once (``tools/record_chroma_filters.py``
recorded the fixture) and by reachy-memory's field index now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reachy_memory.engine.filters import FieldIndex

FIXTURE = Path(__file__).parent / "fixtures" / "chroma_filters.json"


@pytest.fixture(scope="module")
def recorded() -> dict:
    if not FIXTURE.exists():
        pytest.fail(f"{FIXTURE} is missing: run tools/record_chroma_filters.py (see its docstring)")
    return json.loads(FIXTURE.read_text())


def test_every_recorded_filter_selects_what_chromadb_selected(recorded: dict) -> None:
    index = FieldIndex()
    ids = []
    for slot, memory in enumerate(recorded["memories"]):
        index.add(slot, "fact", memory["metadata"])
        ids.append(memory["id"])
    disagreements = []
    for case in recorded["cases"]:
        mask = index.mask(None, case["where"])
        got = sorted(ids[s] for s in range(len(ids)) if mask is None or (s < len(mask) and mask[s]))
        if got != case["ids"]:
            disagreements.append((case["where"], len(got), len(case["ids"])))
    assert not disagreements, f"{len(disagreements)} of {len(recorded['cases'])} differ, e.g. {disagreements[:3]}"
    assert len(recorded["cases"]) == 300 and any(case["ids"] for case in recorded["cases"])
