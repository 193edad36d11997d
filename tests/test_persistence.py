"""Generations, compaction crashes, lost or damaged snapshots, the v1 format,
backup targets and file modes (docs/FORMAT.md, "Generations and compaction")."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HashEmbedder
from store_util import BAD_DATA_DIRS, abandon, bad_data_dir

from reachy_memory import (
    ClosedError,
    Config,
    ConfigError,
    CorruptionError,
    FormatVersionError,
    MemoryStore,
    ReachyMemoryError,
    StorageError,
    StorageFullError,
    ValidationError,
)
from reachy_memory.engine import lexical_index
from reachy_memory.engine import state as _state
from reachy_memory.engine.vector_index import BF16_TOLERANCE
from reachy_memory.storage import backup as bk
from reachy_memory.storage import files
from reachy_memory.storage import journal as jr
from reachy_memory.storage import restore as swap

FIXTURE_V1 = Path(__file__).parent / "fixtures" / "v1_store"


class Crash(BaseException):
    """Stands for a power cut in the middle of a compaction step."""


def _two_generations(config: Config) -> list[str]:
    """50 memories folded into a snapshot, then 51 more in the journal; a crash."""
    store = MemoryStore(config=config, embedder=None)
    ids = [store.store(f"first generation {i}").id for i in range(50)]
    store.compact()
    ids += [store.store(f"second generation {i}").id for i in range(51)]
    abandon(store)
    return ids


def _present(config: Config, ids: list[str]) -> int:
    with MemoryStore(config=config, embedder=None) as store:
        return sum(store.get(i) is not None for i in ids)


def test_missing_snapshot_refuses_open_and_repair_rebuilds_everything(config: Config) -> None:
    ids = _two_generations(config)
    journal = (config.data_dir / "journal.rmj").read_bytes()
    (config.data_dir / "snapshot.rms").unlink()
    with pytest.raises(CorruptionError, match="verify --repair"):
        MemoryStore(config=config, embedder=None)
    assert (config.data_dir / "journal.rmj").read_bytes() == journal  # never rewritten
    assert not bk.verify(config.data_dir).ok
    bk.repair(config.data_dir, config)
    assert _present(config, ids) == 101
    assert bk.verify(config.data_dir).ok


def test_damaged_snapshot_is_rebuilt_from_the_previous_generation(config: Config) -> None:
    ids = _two_generations(config)
    path = config.data_dir / "snapshot.rms"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError):
        MemoryStore(config=config, embedder=None)
    bk.repair(config.data_dir, config)
    assert _present(config, ids) == 101
    (aside,) = config.data_dir.glob("snapshot.rms.damaged-*")
    assert aside.read_bytes() == bytes(data)  # kept, not deleted


@pytest.mark.parametrize("step", [
    "write_next_journal",  # before anything: the old generation stays in force
    "write_snapshot_keeping_previous",  # the new snapshot never became durable
    "switch_journals",  # the new snapshot is durable, the journal not yet retired
])
def test_a_crash_at_each_compaction_step_loses_nothing(config: Config, monkeypatch: pytest.MonkeyPatch,
                                                        step: str) -> None:
    store = MemoryStore(config=config, embedder=None)
    ids = [store.store(f"memory {i}").id for i in range(20)]
    store.compact()
    ids += [store.store(f"later {i}").id for i in range(5)]

    def crash(*_: object, **__: object) -> None:
        raise Crash

    monkeypatch.setattr(files, step, crash)
    with pytest.raises(Crash):
        store.compact()
    monkeypatch.undo()
    abandon(store)
    assert _present(config, ids) == 25


def test_a_crash_between_the_journal_renames_loses_nothing(config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(config=config, embedder=None)
    ids = [store.store(f"memory {i}").id for i in range(10)]

    def half_switch(directory: Path) -> None:
        os.replace(directory / files.JOURNAL_FILE, directory / files.PREV_JOURNAL_FILE)
        raise Crash

    monkeypatch.setattr(files, "switch_journals", half_switch)
    with pytest.raises(Crash):
        store.compact()
    monkeypatch.undo()
    abandon(store)
    assert not (config.data_dir / "journal.rmj").exists()
    assert _present(config, ids) == 10


def test_a_journal_older_than_the_snapshot_is_moved_not_rewritten(config: Config,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(config=config, embedder=None)
    ids = [store.store(f"memory {i}").id for i in range(10)]
    old_journal = (config.data_dir / "journal.rmj").read_bytes()
    monkeypatch.setattr(files, "switch_journals", lambda d: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        store.compact()
    monkeypatch.undo()
    abandon(store)
    assert _present(config, ids) == 10
    assert (config.data_dir / "journal.prev.rmj").read_bytes() == old_journal


def test_a_v1_store_opens_and_migrates(tmp_path: Path, base_config: Config) -> None:
    data = tmp_path / "v1"
    shutil.copytree(FIXTURE_V1, data)
    # the fixture's window is from 2026-09: shown whatever its age (the window's ageing is tested in test_store)
    cfg = base_config.replace("memory", path=str(data), timezone="UTC", context_window_max_age_minutes=0)
    expected = {"f0", "f1", "f2", "f3", "f4", "c0", "c1", "x0"}
    for _ in range(2):  # as written by the old code, then after the v2 compaction on close
        with MemoryStore(config=cfg, embedder=HashEmbedder()) as store:
            held = store.stats()  # the turns and contexts of 2026-09 have expired since: held until the sweep
            assert held["memories"] + held["expired_unswept"] == 8
            assert all(store.get(i, now=1_790_000_040) for i in expected)
            assert store.get("f5") is None  # forgotten in the v1 journal
            assert [t["content"] for t in store.get_context_window()] == ["hello there", "hi!", "how are you"]
            assert store.search("fact number 3 about tea", limit=1, min_score=0)[0].memory.id == "f3"
            assert store.stats()["index"]["vectors"] == 8
    assert (data / "snapshot.rms").read_bytes()[5] == jr.SNAPSHOT_VERSION
    snapshot = files.read_snapshot(data / "snapshot.rms")
    assert snapshot["records"] and all(isinstance(r, dict) for r in snapshot["records"])  # record format 2


@pytest.mark.parametrize("name", [
    "LOCK",  # a second daemon could then open the same data dir
    "journal.rmj",  # the next acknowledged writes would go to an unlinked file
    "snapshot.rms",
    ".",  # the data directory itself (a timestamped file inside it)
    "sub/backup.rms",  # anything below it
])
def test_backup_into_the_data_dir_is_refused(config: Config, name: str) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.store("precious")
        (config.data_dir / "sub").mkdir(mode=0o700)
        before = {p.name: p.read_bytes() for p in config.data_dir.iterdir() if p.is_file()}
        with pytest.raises(ValidationError):
            store.backup(config.data_dir / name)
        assert {p.name: p.read_bytes() for p in config.data_dir.iterdir() if p.is_file()} == before
        assert store.store("still writable").id


def test_backup_target_rules(tmp_path: Path, config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.store("precious")
        other = tmp_path / "notes.txt"
        other.write_text("not a backup")
        with pytest.raises(ValidationError):
            store.backup(other)  # an existing file that is not a backup
        assert other.read_text() == "not a backup"
        (tmp_path / "link.rms").symlink_to(tmp_path / "elsewhere.rms")
        with pytest.raises(ValidationError):
            store.backup(tmp_path / "link.rms")
        with pytest.raises(ValidationError):
            store.backup(f"{tmp_path}/missing-dir/")  # a directory that does not exist
        (tmp_path / "backups").mkdir()
        info = store.backup(tmp_path / "backups")
        assert Path(info["path"]).parent == tmp_path / "backups" and bk.verify(info["path"]).ok
        assert store.backup(info["path"])["path"] == info["path"]  # an old backup may be replaced
        assert store.backup(other, force=True)["memories"] == 1


class _HeldBackup:
    """A backup whose file write waits until released: what a long backup (100k memories
    on an SD card, seconds) looks like to the threads around it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: MemoryStore, target: Path) -> None:
        self.writing, self.release, self.result = threading.Event(), threading.Event(), {}
        real = jr.write_snapshot

        def held(path: Path, frames: Any, *args: Any, **kwargs: Any) -> int:
            if path == target:
                self.writing.set()
                assert self.release.wait(20)
            return real(path, frames, *args, **kwargs)

        monkeypatch.setattr(jr, "write_snapshot", held)
        self.thread = threading.Thread(target=self._take, args=(store, target), daemon=True)
        self.thread.start()
        assert self.writing.wait(10), "the backup never started writing"

    def _take(self, store: MemoryStore, target: Path) -> None:
        try:
            self.result.update(store.backup(target))
        except ClosedError as exc:  # abandoned: the store began closing
            self.result["error"] = exc

    def finish(self) -> dict[str, Any]:
        self.release.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.result


@pytest.mark.timeout(60)
def test_a_backup_being_written_holds_up_no_write_or_search_and_keeps_its_moment(
        config: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The store lock is taken only to freeze the state and to thaw it: while the file is
    written, writes, deletes and searches go on (before, the whole write held the lock: at
    100k memories ~1.2 s of a daemon's engine, every search waiting), and the backup holds
    the store as it was when asked for, vectors included (a slot freed meanwhile is not
    reused under the writer's feet)."""
    emb = HashEmbedder()
    store = MemoryStore(config=config, embedder=emb)
    before = store.store_batch([{"content": f"fact {i}"} for i in range(50)])
    rows = {m.id: store._state.vectors.matrix[store._state.records[m.id].slot].copy() for m in before}
    held = _HeldBackup(monkeypatch, store, tmp_path / "b.rms")
    meanwhile: list[Any] = []

    def use() -> None:
        assert store.forget(before[0].id)
        meanwhile.extend(store.store_batch([{"content": f"late {i}"} for i in range(30)]))
        meanwhile.append(store.search("fact 7", limit=3))

    user = threading.Thread(target=use, daemon=True)
    user.start()
    user.join(10)
    waited = user.is_alive()
    info = held.finish()
    user.join(10)
    assert not waited, "a write or a search waited for the backup being written"
    assert len(meanwhile) == 31 and meanwhile[-1], "the writes and the search did not all finish"
    assert info["memories"] == 50 and bk.verify(info["path"]).ok
    abandon(store)
    bk.restore(info["path"], tmp_path / "restored")
    with MemoryStore(config=config.replace("memory", path=str(tmp_path / "restored")), embedder=emb) as back:
        assert sorted(back._state.records) == sorted(rows)  # the deleted one in, the late ones out
        matrix = back._state.vectors.matrix
        assert all(np.array_equal(matrix[back._state.records[i].slot], v) for i, v in rows.items())
        assert back.search("fact 7", limit=1)[0].memory.content == "fact 7"


@pytest.mark.timeout(60)
def test_close_waits_for_a_backup_to_let_go_of_its_view_and_refuses_new_ones(
        config: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    store = MemoryStore(config=config, embedder=None)
    store.store_batch([{"content": f"fact {i}"} for i in range(20)])
    held = _HeldBackup(monkeypatch, store, tmp_path / "b.rms")
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(0.3)
    waited = closer.is_alive()  # the frozen view must outlive the write
    with pytest.raises(ClosedError):
        store.backup(tmp_path / "c.rms")  # closing: refused at once, not queued behind the lock
    info = held.finish()
    closer.join(10)
    assert waited and not closer.is_alive()
    assert isinstance(info["error"], ClosedError)  # abandoned at its first chunk
    assert not (tmp_path / "b.rms").exists() and not (tmp_path / "c.rms").exists()
    with pytest.raises(ClosedError):
        store.backup(tmp_path / "c.rms")


@pytest.mark.timeout(60)
def test_a_retention_change_during_a_backup_leaves_the_backup_at_its_moment(
        config: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A ``ttl`` op sets the turns' expiries in place, the one change made to placed
    records, so the frozen view's records see it: a backup written meanwhile held the
    new expiries (some of them, for a change that lands mid-write), a store that never
    existed, and nothing after it in a journal puts it right.  Restored, the turn
    alive when the backup was asked for was expired and swept with the next cleanup."""
    now = time.time()
    store = MemoryStore(config=config, embedder=None)  # 30 days
    old, recent = store.store_batch([
        {"content": "chat about kites", "memory_type": "conversation", "created_at": now - 20 * 86400},
        {"content": "chat about trains", "memory_type": "conversation", "created_at": now - 2 * 86400}])
    held = _HeldBackup(monkeypatch, store, tmp_path / "b.rms")
    store._config = config.replace("memory", conversation_ttl_days=7)
    assert store.apply_retention()["deleted"] == 1  # the kites chat: 20 days old, past a 7-day life
    info = held.finish()
    assert info["memories"] == 2
    abandon(store)
    bk.restore(info["path"], tmp_path / "restored")
    with MemoryStore(config=config.replace("memory", path=str(tmp_path / "restored")), embedder=None) as back:
        assert back.get(old.id) == old and back.get(recent.id) == recent  # expiries as they were: 30 days


def test_a_backup_tells_its_progress_in_bytes_written(config: Config, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing counts ending at the file's size, told through the vector block too (written
    in RAW_PIECE views: as one 77 MB chunk at 100k memories, nothing moved during it)."""
    monkeypatch.setattr(jr, "RAW_PIECE", 4096)
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        store.store_batch([{"content": f"fact {i}"} for i in range(300)])
        vector_bytes = len(store._state.vectors.vector_bytes())
        seen: list[int] = []
        info = store.backup(tmp_path / "b.rms", progress=seen.append)
    assert seen == sorted(seen) and seen[0] > 0  # piece by piece, growing
    assert len(seen) > vector_bytes // 4096 + 3  # the vector block in pieces
    assert seen[-1] == info["bytes"] == (tmp_path / "b.rms").stat().st_size
    assert bk.verify(info["path"]).ok


@pytest.mark.timeout(60)
def test_closing_abandons_a_backup_being_written(config: Config, tmp_path: Path) -> None:
    """A robot shutting down does not wait for a backup (tens of seconds at 100k
    memories on an SD card, and systemd kills a daemon still closing after 90 s): the
    backup stops at its next chunk, its caller gets ClosedError, no file is left."""
    store = MemoryStore(config=config, embedder=HashEmbedder())
    store.store_batch([{"content": f"fact {i}"} for i in range(300)])
    writing, go_on, outcome = threading.Event(), threading.Event(), []

    def slow(written: int) -> None:
        writing.set()
        assert go_on.wait(20)

    def take() -> None:
        try:
            outcome.append(store.backup(tmp_path / "b.rms", progress=slow))
        except ClosedError as exc:
            outcome.append(exc)

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert writing.wait(10)
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    deadline = time.monotonic() + 10
    while not store._storage.closing and time.monotonic() < deadline:
        time.sleep(0.001)
    go_on.set()  # the next chunk sees the store closing
    taker.join(10)
    closer.join(10)
    assert not closer.is_alive() and len(outcome) == 1 and isinstance(outcome[0], ClosedError)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "data") == []  # no backup, no temp file
    with MemoryStore(config=config, embedder=None) as again:
        assert len(again) == 300


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["records", "lexical"])
def test_closing_abandons_a_backup_between_its_chunks_too(
        config: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, phase: str) -> None:
    """The records are packed, and the lexical state is built from them, between two of
    the file's chunks (at 100k memories most of a backup's time: 1.7 -> 7.9 s with the
    rebuild): closing stops the backup there too, within a few hundred records, rather
    than after the whole phase (a daemon stopping then waited for all of it)."""
    store = MemoryStore(config=config, embedder=None)
    for start in range(0, 3000, 1000):
        store.store_batch([{"content": f"fact number {i} about the river"} for i in range(start, start + 1000)])
    module, name = (_state, "_snapshot_row") if phase == "records" else (lexical_index, "_frequencies")
    real, in_phase, closing, after = getattr(module, name), threading.Event(), threading.Event(), []

    def step(*args: Any) -> Any:
        in_phase.set()
        assert closing.wait(20)
        after.append(1)  # a record handled once closing began
        return real(*args)

    monkeypatch.setattr(module, name, step)
    outcome: list[Any] = []
    taker = threading.Thread(target=lambda: outcome.append(_outcome(store.backup, tmp_path / "b.rms")), daemon=True)
    taker.start()
    assert in_phase.wait(10), f"the backup never reached its {phase}"
    store.begin_closing()
    closing.set()
    taker.join(20)
    handled = len(after)
    monkeypatch.setattr(module, name, real)
    assert not taker.is_alive() and isinstance(outcome[0], ClosedError), outcome
    assert handled <= 300, f"{handled} of 3000 records went on after closing began"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "data") == []
    store.close()
    with MemoryStore(config=config, embedder=None) as again:
        assert len(again) == 3000


def _outcome(call: Any, *args: Any) -> Any:
    """What ``call(*args)`` returns, or the ReachyMemoryError it raises."""
    try:
        return call(*args)
    except ReachyMemoryError as exc:
        return exc


def test_overlapping_background_jobs_give_back_the_switch_interval() -> None:
    """A backup and a compaction each shorten the interpreter's switch interval, and end
    in either order: the last one out restores it (each restoring what it found left the
    short interval for good when they ended in the order they began)."""
    from reachy_memory.storage.generations import _short_gil_slices

    found = sys.getswitchinterval()
    # From Python's default: a store another test of this worker closed while a race test's
    # frequent switching was on may have left the interval shorter than the jobs' own.
    sys.setswitchinterval(original := 0.005)
    try:
        first, second = _short_gil_slices(), _short_gil_slices()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert sys.getswitchinterval() < original  # one job still runs
        second.__exit__(None, None, None)
        assert sys.getswitchinterval() == original
    finally:
        sys.setswitchinterval(found)


def test_a_switch_interval_set_by_another_part_of_the_process_during_a_job_is_kept() -> None:
    """A job gives back the interval it found only if the interval is still its own: one a
    caller set meanwhile (a test's frequent switching, an app's tuning) stays theirs."""
    from reachy_memory.storage.generations import _short_gil_slices

    found = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        job = _short_gil_slices()
        job.__enter__()
        sys.setswitchinterval(0.002)  # the caller's, while the job runs
        job.__exit__(None, None, None)
        assert sys.getswitchinterval() == 0.002
    finally:
        sys.setswitchinterval(found)


@pytest.mark.timeout(20)
def test_a_fifo_as_backup_target_is_refused_not_waited_on(tmp_path: Path, config: Config) -> None:
    fifo = tmp_path / "pipe.rms"
    os.mkfifo(fifo)  # opening it to read its head waited for a writer forever
    with pytest.raises(ValidationError, match="not a reachy-memory backup"):
        bk.backup_target(fifo, config.data_dir)
    with MemoryStore(config=config, embedder=None) as store:
        store.store("precious")
        with pytest.raises(ValidationError):
            store.backup(fifo)
        assert bk.verify(store.backup(fifo, force=True)["path"]).ok  # --force replaces it with a file


def test_files_are_private_whatever_the_umask(tmp_path: Path, base_config: Config) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)  # an existing, too open data dir
    old = os.umask(0o022)
    try:
        # exact_below 4: the graph cache is written too (hnswlib made it 0644)
        cfg = base_config.replace("memory", path=str(data)).replace("search", exact_below=4)
        with MemoryStore(config=cfg, embedder=HashEmbedder()) as store:
            store.store_batch([{"content": f"private {i}"} for i in range(20)])
            store.compact()
    finally:
        os.umask(old)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert any(p.name.startswith("vectors.hnsw") for p in data.iterdir())
    for path in data.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path.name


def test_built_models_live_in_the_shared_cache_not_the_data_dir(tmp_path: Path) -> None:
    from reachy_memory import load_config
    from reachy_memory.embedding.model_files import cache_dir

    first = load_config(memory={"path": str(tmp_path / "a")})
    second = load_config(memory={"path": str(tmp_path / "b")})
    assert cache_dir(first) == cache_dir(second)
    assert tmp_path not in cache_dir(first).parents


def _as_float32_snapshot(path: Path, vectors: dict[str, np.ndarray]) -> None:
    """Rewrite the snapshot at ``path`` as a version before bf16 wrote it: a file of
    format 2, a float32 vector block (``vectors``: memory id -> the embedder's own
    vector) and no ``vector_format`` in its head."""
    snap = files.read_snapshot(path)
    head = {k: v for k, v in snap.items()
            if k not in ("records", "people", "vectors", "lexical", "window", "vector_format")}
    block = np.zeros((max(r["slot"] for r in snap["records"]) + 1, snap["dim"]), np.float32)
    for row in snap["records"]:
        block[row["slot"]] = vectors[row["id"]]
    _rewrite(path, head, snap, block.tobytes(), version=2)


def _rewrite(path: Path, head: dict[str, Any], snap: dict[str, Any], block: bytes, version: int) -> None:
    jr.write_snapshot(path, [head, {"records": snap["records"], "people": snap["people"]}, jr.RawBin(block),
                             {"lexical": snap["lexical"]}, {"window": snap["window"]}, {"end": len(snap["records"])}],
                      version)


def test_a_float32_snapshot_of_an_earlier_version_opens_verifies_and_is_rewritten_as_bf16(config: Config) -> None:
    texts = [f"memory number {i} about {word}" for i, word in enumerate(["tea", "chess", "rain", "piano"] * 5)]
    embedder = HashEmbedder()
    with MemoryStore(config=config, embedder=embedder) as store:
        ids = [m.id for m in store.store_batch([{"content": t} for t in texts])]
    original = dict(zip(ids, embedder.embed(texts), strict=True))
    path = config.data_dir / files.SNAPSHOT_FILE
    _as_float32_snapshot(path, original)
    assert bk.verify(config.data_dir).ok  # the old format still verifies
    with MemoryStore(config=config, embedder=embedder) as store:
        for memory_id, vector in original.items():
            kept = store._state.vectors.rows(store._state.records[memory_id].slot)
            assert np.allclose(kept, vector, rtol=0, atol=BF16_TOLERANCE) and not np.array_equal(kept, 0 * kept)
        hit = store.search(texts[6], limit=1, mode="vector")[0]
        assert hit.memory.id == ids[6] and hit.score > 0.99
        store.compact()
    rewritten = files.read_snapshot(path)
    assert rewritten["vector_format"] == "bf16" and len(rewritten["vectors"]) == len(texts) * HashEmbedder.dim * 2
    assert bk.verify(config.data_dir).ok


@pytest.mark.parametrize(("fmt", "scale", "shown"), [
    ("bf16", 2.0, "norm 2.0"),  # what this version writes; a stray write or a wrong decoding
    ("f32", 2.0, "norm 2.0"),  # what earlier versions wrote
    ("f32", float("nan"), "norm nan"),  # NaN compares false with any bound: it passed before
    ("bf16", 1.01, "vector norm 1.0"),  # past bf16's own rounding (2^-8)
    ("f32", 1.002, "vector norm 1.0020"),  # inside bf16's rounding but not float32's: a float32 block keeps its 1e-3
])
def test_verify_flags_a_vector_that_is_not_a_unit_vector(config: Config, fmt: str, scale: float, shown: str) -> None:
    embedder = HashEmbedder()
    with MemoryStore(config=config, embedder=embedder) as store:
        ids = [store.store(f"fact {i}").id for i in range(3)]
    path = config.data_dir / files.SNAPSHOT_FILE
    vectors = dict(zip(ids, embedder.embed([f"fact {i}" for i in range(3)]), strict=True))
    vectors[ids[1]] = scale * vectors[ids[1]]
    _as_float32_snapshot(path, vectors)
    if fmt == "bf16":
        with MemoryStore(config=config, embedder=None) as store:  # opened without a model: vectors kept as read
            store.compact()
        assert files.read_snapshot(path)["vector_format"] == "bf16"
    report = bk.verify(config.data_dir)
    assert not report.ok and any(ids[1] in problem and shown in problem for problem in report.problems)
    assert report.vectors == 2  # the other two pass


def test_snapshots_are_files_of_format_3_that_a_reader_of_1_and_2_refuses(config: Config,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier reachy-memory (versions 1 and 2) would read the bf16 block as float32
    rows: garbage vectors under the current model's key. It must refuse instead."""
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        store.store("a fact")
    path = config.data_dir / files.SNAPSHOT_FILE
    assert path.read_bytes()[:6] == b"RMEMS\x03"
    monkeypatch.setattr(jr, "READABLE", {jr.JOURNAL: (1, 2, 4), jr.SNAPSHOT: (1, 2)})  # 9c248a7 and before: 1, 2
    with pytest.raises(FormatVersionError, match="format version 3"):
        MemoryStore(config=config, embedder=HashEmbedder())


@pytest.mark.parametrize("fmt", [
    "f16",  # a format name this version does not know
    3,  # not a name at all
    None,  # present but empty
    ["bf16"],  # unhashable: raised TypeError from open and from verify
])
def test_a_snapshot_naming_an_unknown_vector_format_is_refused_and_left_alone(config: Config, fmt: Any) -> None:
    """Read in a wrong format the vectors would be garbage; not read, they would be
    lost at the next compaction (their records still name the model, so reindex skips them)."""
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        store.store_batch([{"content": f"fact {i}"} for i in range(5)])
    path = config.data_dir / files.SNAPSHOT_FILE
    snap = files.read_snapshot(path)
    head = {k: v for k, v in snap.items() if k not in ("records", "people", "vectors", "lexical", "window")}
    _rewrite(path, head | {"vector_format": fmt}, snap, bytes(snap["vectors"]), version=3)
    before = path.read_bytes()
    with pytest.raises(FormatVersionError, match="vector block in format"):
        MemoryStore(config=config, embedder=HashEmbedder())
    report = bk.verify(config.data_dir)
    assert not report.ok and any("vector block in format" in problem for problem in report.problems)
    assert path.read_bytes() == before


def test_verify_counts_a_store_never_compacted_from_its_journal(config: Config) -> None:
    """A crash before the first compaction leaves only the journal: verify said 'memories 0'."""
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        ids = [m.id for m in store.store_batch([{"content": f"fact {i}"} for i in range(12)])]
        store.store("one more note")
        store.forget(ids[0])
        abandon(store)
    assert not (config.data_dir / "snapshot.rms").exists()
    report = bk.verify(config.data_dir)
    assert report.ok and (report.memories, report.vectors) == (12, 12)
    assert any("counted from the journal" in note for note in report.notes)


def test_verify_counts_the_journal_after_the_snapshot(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        ids = [m.id for m in store.store_batch([{"content": f"fact {i}"} for i in range(5)])]
        store.compact()
        store.store_batch([{"content": f"later {i}"} for i in range(3)])
        store.forget(ids[1])
        abandon(store)
    report = bk.verify(config.data_dir)
    assert report.ok and (report.memories, report.vectors) == (7, 0)  # 5 + 3 - 1, none embedded


def test_verify_writes_nothing_and_still_sees_a_live_store(config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("the charger is in the hallway")
        lock = config.data_dir / "LOCK"
        held = lock.read_bytes()
        report = bk.verify(config.data_dir)
        assert any("open in a running daemon" in note for note in report.notes)
        assert lock.read_bytes() == held
        abandon(store)
    lock.write_bytes(b"4242\n")  # what a killed daemon left
    bk.verify(config.data_dir)
    assert lock.read_bytes() == b"4242\n"  # verify used to write its own pid there
    lock.unlink()
    assert not any("running" in note for note in bk.verify(config.data_dir).notes) and not lock.exists()


def test_verify_takes_the_vectors_dimension_from_the_journal_after_a_model_less_snapshot(config: Config) -> None:
    """A snapshot written without a model records the default dimension; the vectors
    journaled after it (another model's) failed verify although the store opened."""
    with MemoryStore(config=config, embedder=None) as store:
        store.remember_fact("stored before any model")
        store.compact()
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:  # 8 dimensions
        store.remember_fact("stored with one")
        abandon(store)
    report = bk.verify(config.data_dir)
    assert report.ok and report.memories == 2, report.to_dict()


def test_restores_within_one_second_keep_every_store_they_replace(tmp_path: Path, config: Config,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    backups = []
    for name in ("one", "two"):
        with MemoryStore(config=config.replace("memory", path=str(tmp_path / name)), embedder=None) as other:
            other.store(f"backup {name}")
            backups.append(other.backup(tmp_path / f"{name}.rms")["path"])
    ids = _two_generations(config)  # the original: snapshot, journal and the previous generation
    monkeypatch.setattr("time.time", lambda: 1_800_000_000.0)  # both restores in the same second
    bk.restore(backups[0], config.data_dir, force=True)
    assert files.previous_generation_kept(config.data_dir) == []  # moved too: not the restored store's
    bk.restore(backups[1], config.data_dir, force=True)
    aside = sorted(config.data_dir.glob("*.before-restore-*"))
    assert len(aside) == 6  # the original's 3 files and its head, the first restore's 2: none renamed over another
    assert sorted(bk.verify(p).memories for p in aside if p.name.startswith("snapshot.rms")) == [1, 50]
    original = tmp_path / "original"  # put back by hand (the first names moved are the original's): whole
    original.mkdir(mode=0o700)
    for path in aside:
        if path.name.endswith("-1800000000"):
            os.replace(path, original / path.name.removesuffix(".before-restore-1800000000"))
    assert _present(config.replace("memory", path=str(original)), ids) == len(ids)


@pytest.mark.parametrize("name, is_store_file", [
    ("snapshot.rms", True),  # the generations
    ("journal.prev.rmj", True),
    ("vectors.hnsw", True),  # graph cache: base name, a group, its meta
    ("vectors.hnsw.2", True),
    ("vectors.hnsw.meta", True),
    ("vectors.hnsw.2.before-restore-1800000000", False),  # set aside by an earlier restore
    ("vectors.hnsw.meta.before-restore-1800000000.1", False),
    ("snapshot.rms.before-restore-1800000000", False),
    ("snapshot.rms.restoring", False),  # a restore's staged copy
    (".vectors.hnsw.0.tmp-42", False),  # a graph save's temp file
    ("LOCK", False),
])
def test_a_restore_sets_aside_only_the_live_stores_files(tmp_path: Path, name: str, is_store_file: bool) -> None:
    """A prefix test took an earlier restore's set-aside graph files for the store's:
    each restore renamed them again under one more suffix."""
    (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in swap.store_files(tmp_path)] == ([name] if is_store_file else [])


@pytest.mark.parametrize("fails", [1, 2, 3])  # staging the backup's copy; the new journal; the intent
def test_a_restore_that_fails_puts_the_store_it_replaced_back(tmp_path: Path, config: Config,
                                                              monkeypatch: pytest.MonkeyPatch, fails: int) -> None:
    with MemoryStore(config=config.replace("memory", path=str(tmp_path / "other")), embedder=None) as other:
        other.store("backup")
        backup = other.backup(tmp_path / "other.rms")["path"]
    ids = _two_generations(config)
    before = sorted(p.name for p in config.data_dir.iterdir())
    real, calls = jr.write_atomic, {"n": 0}

    def full(path: Path, *args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] == fails:
            raise StorageFullError(f"cannot write {path}: the disk is full", path=str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(jr, "write_atomic", full)
    with pytest.raises(StorageFullError):
        bk.restore(backup, config.data_dir, force=True)
    monkeypatch.undo()
    # every file moved aside: the directory opened as a new, empty store
    assert sorted(p.name for p in config.data_dir.iterdir()) == before
    assert _present(config, ids) == len(ids)


def test_a_restore_that_fails_after_its_intent_is_finished_by_the_next_open(tmp_path: Path, config: Config,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    with MemoryStore(config=config.replace("memory", path=str(tmp_path / "other")), embedder=None) as other:
        kept = other.store("the backup's memory").id
        backup = other.backup(tmp_path / "other.rms")["path"]
    ids = _two_generations(config)
    real, calls = swap._rename, {"n": 0}

    def failing(directory: Path, src: str, dst: str) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # one old file set aside, the rest not
            raise StorageError(f"cannot rename {src}: I/O error", path=str(directory))
        real(directory, src, dst)

    monkeypatch.setattr(swap, "_rename", failing)
    with pytest.raises(StorageError, match="finishes it"):
        bk.restore(backup, config.data_dir, force=True)
    monkeypatch.undo()
    assert (config.data_dir / files.RESTORE_INTENT_FILE).exists()  # decided: never a mix, never undone halfway
    assert _present(config, [kept, *ids]) == 1
    assert not swap.pending(config.data_dir)


@pytest.mark.parametrize("intent", ["torn", "forged"])  # forged: names a file not the store's (nothing renamed)
def test_an_unreadable_restore_intent_refuses_open_and_changes_nothing(config: Config, intent: str) -> None:
    ids = _two_generations(config)
    path = config.data_dir / files.RESTORE_INTENT_FILE
    frame = jr.encode_frame({"kind": "restore", "moves": [["../x", "x.before-restore-1"]]})
    path.write_bytes(jr.header(jr.JOURNAL) + (frame if intent == "forged" else frame[:-3]))
    before = sorted(p.name for p in config.data_dir.iterdir())
    with pytest.raises(CorruptionError, match="intent is unreadable"):
        MemoryStore(config=config, embedder=None)
    report = bk.verify(config.data_dir)
    assert not report.ok and "intent is unreadable" in report.problems[0]
    assert sorted(p.name for p in config.data_dir.iterdir()) == before
    path.unlink()
    assert _present(config, ids) == len(ids)


@pytest.mark.parametrize(("kind", "says"), BAD_DATA_DIRS)
def test_a_data_dir_the_store_cannot_use_is_a_config_error(tmp_path: Path, kind: str, says: str) -> None:
    """Opening a store there, and restoring a backup there (a raw FileExistsError or
    NotADirectoryError before), both say what is wrong with the configured path."""
    with MemoryStore(tmp_path / "good", config=Config(), embedder=None) as good:
        good.store("kept in the backup")
        backup = Path(good.backup(tmp_path / "b.rms")["path"])
    with bad_data_dir(kind, tmp_path) as path:
        for attempt in (lambda: MemoryStore(path, config=Config(), embedder=None), lambda: bk.restore(backup, path)):
            with pytest.raises(ConfigError, match=says) as err:
                attempt()
            assert err.value.key == "memory.path" and str(path) in err.value.message  # type: ignore[attr-defined]
            assert not path.is_dir() or not any(path.iterdir())  # nothing made there


@pytest.mark.parametrize("installed", [0, 1])  # the restore cut before any install; after the snapshot's
def test_a_store_an_older_version_wrote_after_a_restore_was_cut_short_is_not_overwritten(
        tmp_path: Path, config: Config, monkeypatch: pytest.MonkeyPatch, installed: int) -> None:
    """An older reachy-memory knows no ``restore.intent``: with the old store set aside and
    the backup not (wholly) installed, it opened the directory as a store of its own and
    acknowledged writes there.  The roll-forward renamed the staged copies over those
    files: the writes were gone without a word.  Now the open refuses and keeps them."""
    with MemoryStore(config=config.replace("memory", path=str(tmp_path / "other")), embedder=None) as other:
        other.store("the backup's memory")
        backup = other.backup(tmp_path / "other.rms")["path"]
    _two_generations(config)
    real = swap._rename
    done = {"installs": 0}

    def cut(directory: Path, src: str, dst: str) -> None:
        if src.endswith(".restoring"):
            if done["installs"] == installed:
                raise StorageError(f"cannot rename {src}: power cut", path=str(directory))
            done["installs"] += 1
        real(directory, src, dst)

    monkeypatch.setattr(swap, "_rename", cut)
    with pytest.raises(StorageError, match="finishes it"):
        bk.restore(backup, config.data_dir, force=True)
    monkeypatch.setattr(swap, "settle", lambda directory: None)  # an older version: no restore to settle
    with MemoryStore(config=config, embedder=None) as older:
        written = older.store("acknowledged by the older version").id
    monkeypatch.undo()
    with pytest.raises(CorruptionError, match="restore"):
        MemoryStore(config=config, embedder=None)
    (config.data_dir / files.RESTORE_INTENT_FILE).unlink()  # what the error says to do to keep them
    with MemoryStore(config=config, embedder=None) as store:
        assert store.get(written) is not None
