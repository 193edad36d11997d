"""``reachy-memory import`` of the conversation app's own memory file (``memory.v1.json``):
its facts kept with their ids and times, once however often it is imported, and a malformed
file refused whole (``reachy_memory.storage.app_memory``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_util import DaemonProcess, run_cli

# As the app writes it (memory.py, MemoryFact.to_json): newest first, createdAt in milliseconds.
FACTS = [{"id": "m_1767225600000_k3x9qa", "text": "Prefers replies in French", "createdAt": 1767225600000},
         {"id": "m_1764547200000_a1b2c3", "text": "Has a dog named Mochi", "createdAt": 1764547200000},
         {"id": "m_1761955200000_zz00yy", "text": "Works on a  sailing   blog", "createdAt": 1761955200000.0}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("app-memory"), embedding={"enabled": False}) as d:
        yield d


def _write(path: Path, payload: Any) -> Path:
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload, indent=2), encoding="utf-8")
    return path


def test_a_memory_file_imports_twice_into_one_store_with_each_fact_once(daemon: DaemonProcess,
                                                                        tmp_path: Path) -> None:
    source = _write(tmp_path / "memory.v1.json", {"version": 1, "facts": FACTS})
    for _ in range(2):
        done = run_cli(daemon, "import", str(source))
        assert done.returncode == 0, done.stderr
    with daemon.client() as c:
        for fact in FACTS:
            memory = c.get(fact["id"])
            assert memory is not None and memory.memory_type.value == "fact"
            assert memory.content == " ".join(fact["text"].split())
            assert memory.created_at == datetime.fromtimestamp(fact["createdAt"] / 1000, UTC)
            assert memory.metadata == {"source": "reachy_mini_conversation_app"}
        assert c.stats()["store"]["memories"] == len(FACTS)
        found = c.search("dog", limit=3)
        assert [h.memory.id for h in found][:1] == ["m_1764547200000_a1b2c3"]


@pytest.mark.parametrize(("payload", "says"), [
    ("{not json", "not JSON"),
    ({"version": 2, "facts": FACTS}, "memory file version 2; this import reads version 1"),
    ({"version": 1, "facts": [FACTS[0], {"id": "m_2", "text": "Likes tea"}]},
     "fact 2: createdAt must be milliseconds since 1970, got None"),
    ({"version": 1, "facts": [FACTS[0], {**FACTS[1], "text": "  "}]}, "fact 2: text must be a non-empty string"),
    ({"version": 1, "facts": [FACTS[0], {**FACTS[1], "id": FACTS[0]["id"]}]}, "fact 2: id 'm_1767225600000_k3x9qa' "
                                                                              "appears twice"),
    ({"version": 1, "facts": [FACTS[0], {**FACTS[1], "pinned": True}]}, "fact 2: fields this import does not know"),
    ({"version": 1, "facts": [FACTS[0], "Likes tea"]}, "fact 2: not an object with id, text and createdAt"),
    ({"version": 1, "facts": [{**FACTS[0], "createdAt": True}]}, "fact 1: createdAt must be milliseconds"),
    ({"version": 1, "facts": [{**FACTS[0], "id": "m 1"}]}, "holds ' '"),
])
def test_a_malformed_file_is_refused_whole(tmp_path: Path, payload: Any, says: str) -> None:
    with DaemonProcess(tmp_path, embedding={"enabled": False}) as fresh:
        source = _write(tmp_path / "memory.v1.json", payload)
        done = run_cli(fresh, "import", str(source))
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        with fresh.client() as c:
            assert c.stats()["store"]["memories"] == 0  # nothing half-imported


def test_an_empty_memory_file_imports_nothing(daemon: DaemonProcess, tmp_path: Path) -> None:
    done = run_cli(daemon, "import", str(_write(tmp_path / "memory.v1.json", {"version": 1, "facts": []})))
    assert done.returncode == 0 and "imported 0 people and 0 memories" in done.stderr, done.stderr
