"""Record ChromaDB's answers to generated ``where`` filters, as a test fixture.

The spec's design stores memories in ChromaDB, so users bring Chroma-style
filters.  This script makes 120 memories with generated metadata (some keys
missing on purpose) and 300 generated filters (``$eq $ne $gt $gte $lt $lte $in
$nin $and $or``, nested), asks ChromaDB's ``collection.get(where=...)`` which ids
match each, and writes everything to ``tests/fixtures/chroma_filters.json``.
``tests/test_filters_chroma.py`` replays the fixture against reachy-memory, so
the suite never needs ChromaDB installed.

Run it in a separate venv that has ChromaDB (it is not a dependency):

    python -m venv /tmp/chroma && /tmp/chroma/bin/pip install chromadb==1.5.9 pyyaml
    PYTHONPATH=. /tmp/chroma/bin/python tools/record_chroma_filters.py
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chroma_filters.json"
COLORS = ["red", "green", "blue", "amber"]
SPEAKERS = ["alex", "sarah", "sam"]


def memories(rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for i in range(120):
        meta: dict[str, Any] = {}
        if rng.random() < 0.8:
            meta["n"] = rng.randint(0, 20)
        if rng.random() < 0.7:
            meta["color"] = rng.choice(COLORS)
        if rng.random() < 0.6:
            meta["score"] = round(rng.uniform(0, 1), 2)
        if rng.random() < 0.5:
            meta["done"] = rng.random() < 0.5
        if rng.random() < 0.7:
            meta["speaker"] = rng.choice(SPEAKERS)
        out.append({"id": f"m{i:03d}", "content": f"memory number {i}", "metadata": meta or {"k": 0}})
    return out


def leaf(rng: random.Random) -> dict[str, Any]:
    key = rng.choice(["n", "color", "score", "done", "speaker"])
    if key in ("n", "score"):
        value = rng.randint(0, 20) if key == "n" else round(rng.uniform(0, 1), 2)
        op = rng.choice(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"])
        if op in ("$in", "$nin"):
            pool = range(0, 21) if key == "n" else [0.1, 0.25, 0.5, 0.75]
            return {key: {op: rng.sample(list(pool), 3)}}
        return {key: {op: value}}
    if key == "done":
        return {key: {rng.choice(["$eq", "$ne"]): rng.random() < 0.5}}
    values = COLORS if key == "color" else SPEAKERS
    op = rng.choice(["$eq", "$ne", "$in", "$nin"])
    if op in ("$in", "$nin"):
        return {key: {op: rng.sample(values, 2)}}
    return {key: {op: rng.choice(values)}}


def where(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    if depth >= 2 or rng.random() < 0.5:
        return leaf(rng)
    return {rng.choice(["$and", "$or"]): [where(rng, depth + 1) for _ in range(rng.randint(2, 3))]}


def main() -> None:
    import chromadb

    rng = random.Random(2026)
    mems = memories(rng)
    filters = [where(rng) for _ in range(300)]
    with tempfile.TemporaryDirectory() as tmp:
        client = chromadb.PersistentClient(path=tmp)
        col = client.create_collection("memories")
        col.add(ids=[m["id"] for m in mems], documents=[m["content"] for m in mems],
                metadatas=[m["metadata"] for m in mems], embeddings=[[float(i), 1.0] for i in range(len(mems))])
        answers = [sorted(col.get(where=f)["ids"]) for f in filters]
    OUT.write_text(json.dumps({"chromadb": chromadb.__version__, "memories": mems,
                               "cases": [{"where": f, "ids": a} for f, a in zip(filters, answers, strict=True)]},
                              indent=1))
    print(f"wrote {len(filters)} filters over {len(mems)} memories to {OUT}")


if __name__ == "__main__":
    main()
