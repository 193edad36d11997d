"""Memories without a vector get one in idle time (``_backfill`` and ``MemoryStore.maintain``).

Before, a memory stored while the model was missing or failing stayed
words-only until someone ran ``reachy-memory reindex``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reachy_memory import MemoryStore
from reachy_memory.engine.backfill import PAUSE_SECONDS, Backfill
from reachy_memory.engine.maintenance import Maintenance
from reachy_memory.engine.records import Record, encode
from reachy_memory.engine.vector_index import BF16_TOLERANCE
from tests.conftest import HashEmbedder
from tests.daemon_util import DaemonProcess, run_cli


def _rec(memory_id: str, created: float, vkey: str | None = None) -> Record:
    return Record(memory_id, f"text {memory_id}", "fact", created, None, {}).replace(vkey=vkey)


def _idle(store: MemoryStore, limit: int = 1000) -> int:
    """Run the daemon's idle upkeep until it has nothing left; returns the steps taken."""
    for step in range(limit):
        if not store.maintain():
            return step
    raise AssertionError("maintain never ran out of work")


# -- the queue ---------------------------------------------------------------------


def test_plan_queues_only_memories_without_the_current_vector_in_stored_order() -> None:
    records = {r.id: r for r in (_rec("new", 3.0), _rec("old", 1.0), _rec("done", 2.0, "m"), _rec("other", 4.0, "x"),
                                 _rec("tie", 3.0))}
    queue = Backfill()
    assert queue.plan(records.values(), "m") == 4  # "other" has a foreign vector: re-embedded too
    # oldest first; "new" and "tie" share a time and keep the table's order
    assert [queue.take(records, "m").id for _ in range(4)] == ["old", "new", "tie", "other"]  # type: ignore[union-attr]
    assert queue.take(records, "m") is None and len(queue) == 0


def test_take_skips_memories_forgotten_or_embedded_meanwhile() -> None:
    records = {r.id: r for r in (_rec("a", 1.0), _rec("b", 2.0), _rec("c", 3.0))}
    queue = Backfill()
    queue.plan(records.values(), "m")
    del records["c"]  # forgotten
    records["b"] = records["b"].replace(vkey="m")  # embedded by a reindex or a rewrite
    assert queue.take(records, "m") is records["a"]
    assert queue.take(records, "m") is None


def test_note_queues_puts_written_without_a_vector_once() -> None:
    queue = Backfill()
    with_vector = ["put", encode(_rec("v", 1.0, "m")), b"\0" * 32]
    without = ["put", encode(_rec("w", 1.0)), None]
    person = {"op": "person", "id": "p1", "name": "Sarah"}  # person ops are maps in the same frames
    queue.note([with_vector, person, without, ["del", "x"], without])  # type: ignore[list-item]
    assert len(queue) == 1
    queue.note([without])  # the same memory written again: still queued once
    assert len(queue) == 1


def test_a_failure_puts_the_memory_back_and_pauses_the_queue() -> None:
    now = [100.0]
    queue = Backfill(clock=lambda: now[0])
    records = {"a": _rec("a", 1.0)}
    queue.plan(records.values(), "m")
    rec = queue.take(records, "m")
    assert rec is not None
    queue.put_back(rec)
    assert len(queue) == 1 and not queue.ready()
    now[0] += PAUSE_SECONDS
    assert queue.ready() and queue.take(records, "m") is rec


# -- the store ---------------------------------------------------------------------


def test_memories_stored_without_a_model_are_embedded_as_storing_would(tmp_path: Path, embedder: Any) -> None:
    """A store used before the model was fetched: its turns get exactly the vectors a
    store with the model would have given them, each with the turn before it."""
    turns = [{"content": text, "memory_type": "conversation"}
             for text in ("Do you like hiking?", "Yes, I go every Sunday with my sister.", "Where do you go?")]
    with MemoryStore(tmp_path / "direct", embedder=embedder) as direct:
        ids = [m.id for m in direct.store_batch(turns)]
        expected = direct._state.vectors.rows(np.arange(3))
    with MemoryStore(tmp_path / "later", embedder=None) as later:
        later.store_batch([t | {"id": i} for t, i in zip(turns, ids, strict=True)])
        assert later.stats()["unembedded"] == 0  # no model: nothing to plan
    with MemoryStore(tmp_path / "later", embedder=embedder) as later:
        assert later.stats()["unembedded"] == 3
        assert later.search("weekend walks in the hills", mode="vector", min_score=0) == []
        assert _idle(later) >= 1
        assert later.stats()["unembedded"] == 0
        got = later._state.vectors.rows(np.array([later._state.records[i].slot for i in ids]))
        assert np.allclose(got, expected, rtol=0, atol=BF16_TOLERANCE)
        assert later.search("weekend walks in the hills", mode="vector", min_score=0)
    with MemoryStore(tmp_path / "later", embedder=embedder) as later:  # the vectors were journaled
        assert later.stats()["unembedded"] == 0 and later.reindex() == 0


def test_a_write_the_model_failed_on_is_embedded_once_it_works(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model = HashEmbedder()
    with MemoryStore(tmp_path, embedder=model) as store:
        model.fail = True
        memory = store.remember_fact("the spare key is under the blue flowerpot")
        assert store.stats()["unembedded"] == 1
        calls = model.calls
        assert store.maintain() == 0 and model.calls == calls + 1  # still failing: tried once, then paused
        assert store.maintain() == 0 and model.calls == calls + 1  # paused: not retried in a loop
        model.fail = False
        monkeypatch.setattr(time, "monotonic", lambda: 1e12)  # the pause is over
        assert store.maintain() == 1 and store.stats()["unembedded"] == 0
        hits = store.search(memory.content, mode="vector", min_score=0)
        assert hits[0].memory.id == memory.id


def test_a_memory_forgotten_before_its_turn_is_not_brought_back(tmp_path: Path, embedder: Any) -> None:
    with MemoryStore(tmp_path, embedder=None) as store:
        kept = store.remember_fact("the robot charges in the hallway")
        gone = store.remember_fact("the old password was tulip")
    with MemoryStore(tmp_path, embedder=embedder) as store:
        store.forget(gone.id)
        _idle(store)
        assert store.get(gone.id) is None and store.get(kept.id) is not None
        assert len(store) == 1 and store.stats()["unembedded"] == 0


# -- the daemon --------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_daemon_started_before_the_model_catches_up_without_reindex(tmp_path: Path) -> None:
    """The first-run mistake: the daemon ran before 'model fetch'.  Restarted with the
    model, it embeds what it stored meanwhile in idle time; no reindex, no stop."""
    first = DaemonProcess(tmp_path, embedding={"enabled": False}).start()
    try:
        with first.client() as c:
            memory = c.store("Sarah is allergic to peanuts", "fact")
    finally:
        first.stop()
    second = DaemonProcess(tmp_path).start()
    try:
        with second.client() as c:
            deadline = time.monotonic() + 30
            while c.stats()["store"]["unembedded"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.stats()["store"]["unembedded"] == 0
            hits = c.search("which foods must she avoid", mode="vector", min_score=0)
            assert [h.memory.id for h in hits] == [memory.id]
    finally:
        second.stop()


def test_vectors_are_committed_sixteen_to_a_frame_and_a_changed_memory_is_requeued() -> None:
    records = {r.id: r for r in (_rec(f"m{i:02}", float(i)) for i in range(20))}
    queue = Backfill()
    queue.plan(records.values(), "k")
    for _ in range(16):
        rec = queue.take(records, "k")
        assert rec is not None and not queue.due()
        queue.hold(rec, b"v")
    assert queue.due() and len(queue) == 20  # 16 held make a frame; held ones still count as waiting
    records["m15"] = records["m15"].replace(content="changed while it was embedded")
    ops = queue.drain(records, "k")
    assert len(ops) == 15 and all(op[1]["vkey"] == "k" and op[2] == b"v" for op in ops)
    assert "m15" not in {op[1]["id"] for op in ops} and len(queue) == 5  # m15 queued again, behind m16-m19
    assert [queue.take(records, "k").id for _ in range(5)] == ["m16", "m17", "m18", "m19", "m15"]  # type: ignore[union-attr]


@pytest.mark.parametrize("after", ["reopen", "forget"])  # the newest turn found again by a pass over the table
def test_a_batch_of_turns_keeps_its_newest_turn_through_a_backfill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   after: str) -> None:
    """Turns of one batch share a time; the table's order breaks the tie when the newest
    turn is found again (a reload, a deletion).  Re-puts moved a turn to the end of the
    table: a backfill frame of 16 out of 20 made turn 15 the newest after a restart, and
    the next turn followed (and was embedded with) it; newest first, it was turn 0."""
    monkeypatch.setattr(Maintenance.backfill_step, "__defaults__", (0.0,))  # a memory a step, as the real model
    with MemoryStore(tmp_path, embedder=None) as store:
        turns = store.store_batch([{"content": f"turn {i}", "memory_type": "conversation"} for i in range(20)])
    with MemoryStore(tmp_path, embedder=HashEmbedder()) as store:
        for _ in range(16):
            store.maintain()
        assert store.stats()["unembedded"] == 4  # one frame of 16 committed
        assert store._state.last_turn.id == turns[-1].id  # type: ignore[union-attr]
        if after == "forget":
            store.forget(turns[-1].id)
            assert store._state.last_turn.id == turns[-2].id  # type: ignore[union-attr]
            return
    with MemoryStore(tmp_path, embedder=HashEmbedder()) as store:  # compacted at close: from the snapshot
        assert store._state.last_turn.id == turns[-1].id  # type: ignore[union-attr]
        following = store.remember_conversation("Where do you go?")
        assert store._state.records[following.id].follows == turns[-1].id


def test_a_frame_that_cannot_be_written_keeps_its_memories_queued(tmp_path: Path) -> None:
    from reachy_memory import StorageFullError

    with MemoryStore(tmp_path, embedder=None) as store:
        for i in range(5):
            store.remember_fact(f"fact number {i}")
    with MemoryStore(tmp_path, embedder=HashEmbedder()) as store:
        real = store._storage.append

        def full_once(ops: list[Any], durable: bool = False, defer: bool = False) -> None:
            store._storage.append = real  # type: ignore[method-assign]
            raise StorageFullError("disk full", path=str(tmp_path))

        store._storage.append = full_once  # type: ignore[method-assign]
        with pytest.raises(StorageFullError):
            _idle(store)
        assert store.stats()["unembedded"] == 5  # queued again (was 0: dropped until the next open)
        assert store.maintain() == 0  # paused after the failure
        store._core.backfill._paused_until = 0.0  # the pause is over
        _idle(store)
        assert store.stats()["unembedded"] == 0
        assert all(r.vkey is not None for r in store._state.records.values())


def test_a_read_only_store_embeds_nothing(tmp_path: Path) -> None:
    """With the journal refusing writes (an fsync failed) every vector would be thrown away."""
    with MemoryStore(tmp_path, embedder=None) as store:
        store.remember_fact("the charger is in the hallway")
    model = HashEmbedder()
    with MemoryStore(tmp_path, embedder=model) as store:
        store._storage.journal.failure = "fsync failed (simulated)"
        assert store.maintain() == 0 and model.calls == 0 and store.stats()["unembedded"] == 1
        store._storage.journal.failure = None


def test_one_text_the_model_fails_on_does_not_hold_up_the_others(tmp_path: Path) -> None:
    class Picky(HashEmbedder):
        def embed(self, texts: list[str]) -> np.ndarray:
            self.fail = any("POISON" in t for t in texts)
            return super().embed(texts)

    with MemoryStore(tmp_path, embedder=None) as store:
        for i in range(5):
            store.remember_fact(f"ordinary fact {i}")
            if i == 1:
                store.remember_fact("POISON: the text the model fails on")  # in the middle of the queue
    with MemoryStore(tmp_path, embedder=Picky()) as store:
        for _ in range(3):  # each pause ends; the poisoned one goes to the back each time
            _idle(store)
            store._core.backfill._paused_until = 0.0
        lacking = [r.content for r in store._state.records.values() if r.vkey is None]
        assert lacking == ["POISON: the text the model fails on"]


# -- a model that appears while the store is open ----------------------------------------------


def test_a_store_opened_without_a_model_adopts_one_and_embeds_what_it_holds(tmp_path: Path, embedder: Any) -> None:
    with MemoryStore(tmp_path, embedder=None) as store:
        memory = store.remember_fact("Sarah is allergic to peanuts")
        assert store.adopt_embedder(embedder)
        assert store.embedder is embedder and store.stats()["unembedded"] == 1
        assert not store.adopt_embedder(embedder)  # once
        _idle(store)
        hits = store.search("which foods must she avoid", mode="vector", min_score=0)
        assert [h.memory.id for h in hits] == [memory.id]
        later = store.remember_fact("Tom plays the cello")  # embedded as it is stored now
        assert store._state.records[later.id].vkey == store._state.current_key
    with MemoryStore(tmp_path, embedder=embedder) as store:  # the model key and vectors were journaled
        assert store.stats()["unembedded"] == 0 and len(store.search("peanuts", mode="vector")) >= 1


@pytest.mark.parametrize("first", [
    HashEmbedder(),  # vectors of another dimension (8)
    "real",  # vectors already there: a restart checks them, adoption does not mix spaces
])
def test_a_store_holding_vectors_does_not_adopt_a_model(tmp_path: Path, embedder: Any, first: Any) -> None:
    with MemoryStore(tmp_path, embedder=embedder if first == "real" else first) as store:
        store.remember_fact("the charger is in the hallway")
    with MemoryStore(tmp_path, embedder=None) as store:
        assert not store.adopt_embedder(embedder)
        assert store.embedder is None and store.stats()["unembedded"] == 0


@pytest.mark.timeout(120)
def test_a_daemon_loads_the_model_when_it_appears_without_a_restart(tmp_path: Path) -> None:
    """The robot booted without the model (no network yet): once 'model fetch' puts the
    weights in place, the running daemon loads them and embeds what it stored meanwhile."""
    import shutil

    from reachy_memory import load_config
    from reachy_memory.embedding.model_files import MODEL_NAME, find_weights

    source = find_weights(load_config())
    assert source is not None
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    daemon = DaemonProcess(tmp_path, embedding={"download_dir": str(downloads), "allow_hub": False}).start()
    try:
        with daemon.client() as c:
            assert c.health()["embedder"]["state"] == "unavailable"
            memory = c.store("Sarah is allergic to peanuts", "fact")
            staged = downloads / ".staged"
            shutil.copytree(source, staged)
            staged.rename(downloads / MODEL_NAME)  # as 'model fetch' puts it in place: whole
            said = run_cli(daemon, "model", "info")  # what a user runs after fetching: it waits and tells
            assert said.returncode == 0 and "the running daemon loaded it" in said.stderr, said.stderr
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (c.health()["embedder"]["state"] != "ready"
                                                   or c.stats()["store"]["unembedded"]):
                time.sleep(0.1)
            assert c.health()["embedder"]["state"] == "ready" and c.stats()["store"]["unembedded"] == 0
            hits = c.search("which foods must she avoid", mode="vector", min_score=0)
            assert [h.memory.id for h in hits] == [memory.id]
    finally:
        daemon.stop()
    assert "embedding model loaded" in daemon.log.read_text()


def test_an_adoption_whose_model_op_cannot_be_written_still_queues_the_memories(tmp_path: Path,
                                                                             embedder: Any) -> None:
    """The backfill used to be planned after the model op: a full disk there left every
    memory words-only until a restart, with stats saying 0 waited."""
    from reachy_memory import StorageFullError

    with MemoryStore(tmp_path, embedder=None) as store:
        store.remember_fact("Sarah is allergic to peanuts")
        real = store._storage.append

        def full_once(ops: list[Any], durable: bool = False, defer: bool = False) -> None:
            store._storage.append = real  # type: ignore[method-assign]
            raise StorageFullError("disk full", path=str(tmp_path))

        store._storage.append = full_once  # type: ignore[method-assign]
        assert store.adopt_embedder(embedder)
        assert store.stats()["unembedded"] == 1
        _idle(store)
        assert store.search("which foods must she avoid", mode="vector", min_score=0)


def test_an_adopted_model_counts_prompt_tokens_with_its_tokenizer(tmp_path: Path, embedder: Any) -> None:
    from reachy_memory.engine.context_text import approximate_tokens

    with MemoryStore(tmp_path, embedder=None) as store:
        store.context_for("What should I cook tonight?")  # caches the estimate used without a model
        assert store._context.token_counter() is approximate_tokens
        assert store.adopt_embedder(embedder)
        assert store._context.token_counter() is not approximate_tokens


def test_a_store_declaring_another_precision_loads_and_adopts_that_one(tmp_path: Path, embedder: Any,
                                                                       fp32_embedder: Any) -> None:
    """An fp32 store with no vector left (all forgotten): the model is loaded in fp32, and an
    int8 model is refused (adopting it made the store refuse to open after a crash)."""
    with MemoryStore(tmp_path, embedder=fp32_embedder) as store:
        store.forget(store.remember_fact("soon forgotten").id)
    with MemoryStore(tmp_path, embedder=None) as store:
        assert store.model_config().embedding.precision == "fp32"
        assert not store.adopt_embedder(embedder) and "another model" in str(store.embedder_error)
        assert store.adopt_embedder(fp32_embedder)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cut_short", [
    "while running",  # the daemon found the files being copied
    "at start",  # the open's own load failed on them: the daemon did not look again
])
def test_a_daemon_retries_weights_that_were_half_copied_once_they_change(tmp_path: Path, cut_short: str) -> None:
    """A model_dir filled by hand: a load of a half-written file failed and the daemon gave up
    until restarted; now it says why in health and tries again when the files change."""
    import shutil

    from reachy_memory import load_config
    from reachy_memory.embedding.model_files import find_weights

    source = find_weights(load_config())
    assert source is not None
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    weights = (source / "model.safetensors").read_bytes()

    def copy_cut_short() -> None:
        for name in ("tokenizer.json", "config.json"):
            shutil.copy(source / name, model_dir / name)
        (model_dir / "model.safetensors").write_bytes(weights[: len(weights) // 2])

    if cut_short == "at start":
        copy_cut_short()
    daemon = DaemonProcess(tmp_path, embedding={"model_dir": str(model_dir)}).start()
    try:
        with daemon.client() as c:
            if cut_short == "while running":
                copy_cut_short()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and "could not be loaded" not in str(c.health()["embedder"]["error"]):
                    time.sleep(0.2)
            assert c.health()["embedder"]["state"] != "ready" and c.health()["embedder"]["error"]
            (model_dir / "model.safetensors").write_bytes(weights)  # the copy finished
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and c.health()["embedder"]["state"] != "ready":
                time.sleep(0.2)
            assert c.health()["embedder"]["state"] == "ready" and c.health()["embedder"]["error"] is None
    finally:
        daemon.stop()


def test_unembedded_counts_only_what_still_waits(tmp_path: Path) -> None:
    """It counted memories forgotten since they were queued, and ones a reindex embedded."""
    with MemoryStore(tmp_path, embedder=None) as store:
        ids = [store.remember_fact(f"fact {i}").id for i in range(5)]
    with MemoryStore(tmp_path, embedder=HashEmbedder()) as store:
        assert store.stats()["unembedded"] == 5
        store.forget(ids[0])
        assert store.stats()["unembedded"] == 4
        assert store.reindex() == 4 and store.stats()["unembedded"] == 0
        assert store.maintain() == 0
