"""Forgetting reaches every file of the data directory within 10 seconds (storage/purge.py).

Texts carry unique markers; after a forget (by id), an expiry sweep, a window cleared
or a person deleted, every byte of every file under the data directory (hidden and
temp files, set-aside copies, graph caches, subdirectories) is read until none holds
a removed marker, while every kept marker is still found, in process and through a
real daemon.  A power cut at every fsync across a purge loses nothing acknowledged and
brings nothing back; backups made before are named and rewritten.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

from reachy_memory import Config, MemoryStore, MemoryType, ValidationError
from reachy_memory.engine.vector_index import to_bf16
from reachy_memory.storage import backup as bk
from reachy_memory.storage import purge as pg
from tests.daemon_util import DaemonProcess
from tests.store_util import abandon
from tests.test_power_cut import recording

DEADLINE = 10.0  # seconds from the acknowledgment: the promise


class DigestEmbedder:
    """Deterministic vectors, distinct for distinct texts (so a forgotten memory's vector is its own)."""

    dim = 8

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = [np.random.default_rng(int.from_bytes(hashlib.blake2b(t.encode()).digest()[:8], "little"))
                .standard_normal(self.dim) for t in texts]
        out = np.array(rows, np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def mark(i: int) -> str:
    return f"QZ{i:05d}XJ"


def text(i: int) -> str:
    return f"the secret {mark(i)} is hidden under the old stairs"


def every_file(directory: Path) -> Iterator[Path]:
    for root, _, names in os.walk(directory):
        for name in names:
            yield Path(root) / name


def holders(directory: Path, needles: Iterable[bytes]) -> dict[bytes, list[str]]:
    """Each needle -> the files under ``directory`` whose bytes hold it."""
    wanted = list(needles)
    found: dict[bytes, list[str]] = {n: [] for n in wanted}
    for path in every_file(directory):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed while listed (a compaction's temp file)
            continue
        for needle in wanted:
            if needle in data:
                found[needle].append(str(path.relative_to(directory)))
    return found


def wait_clean(directory: Path, gone: Iterable[bytes], since: float, deadline: float = DEADLINE) -> float:
    """Wait until no file holds any of ``gone``; returns the seconds since ``since``. Fails after ``deadline``."""
    gone = list(gone)
    while True:
        left = {n: f for n, f in holders(directory, gone).items() if f}
        took = time.monotonic() - since
        if not left:
            return took
        assert took < deadline, f"still on disk after {took:.1f} s: {left}"
        time.sleep(0.1)


def markers(ids: Iterable[int]) -> list[bytes]:
    return [mark(i).encode() for i in ids]


def vector_bytes(i: int) -> list[bytes]:
    """The forms a memory's vector takes on disk: float32 (journal), bf16 (snapshot), bf16 widened
    to float32 (graph cache)."""
    vec = DigestEmbedder().embed([text(i)])[0]
    bf16 = to_bf16(vec)
    return [vec.tobytes(), bf16.tobytes(), (bf16.astype(np.uint32) << 16).tobytes()]


@pytest.fixture
def cfg(config: Config) -> Config:
    """Graphs from 8 memories on (so the graph cache is written and must be purged too)."""
    return config.replace("search", exact_below=8, exact_threshold=4)


def _plant_side_files(data: Path) -> None:
    """What a crash, a repair, a restore and an unfinished write leave in a data directory."""
    journal = (data / "journal.rmj").read_bytes()
    cut = journal.rindex(mark(34).encode()) + 5  # a torn tail: the write cut inside a text
    (data / "journal.rmj.torn-1700000000").write_bytes(journal[:cut])
    shutil.copyfile(data / "snapshot.prev.rms", data / "snapshot.rms.damaged-1700000001")
    shutil.copyfile(data / "snapshot.rms", data / "snapshot.rms.before-restore-1700000002")
    shutil.copyfile(data / "snapshot.rms", data / ".snapshot.rms.tmp-99999-1")  # a dead writer's temp file
    (data / "old").mkdir()
    (data / "old" / "notes.txt").write_text(f"copied by hand: {text(3)} and {text(4)}\n")


def test_forgotten_texts_and_vectors_leave_every_file_within_ten_seconds(cfg: Config) -> None:
    data = Path(cfg.memory.path)
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        ids = [store.store(text(i)).id for i in range(20)]
        store.compact(full=True)  # generation 1, with a graph cache
        ids += [store.store(text(i)).id for i in range(20, 30)]
        store.compact(full=True)  # generation 2: 0..19 also in the previous generation
        ids += [store.store(text(i)).id for i in range(30, 40)]  # only in the journal
        assert (data / "vectors.hnsw.meta").exists()
        _plant_side_files(data)
        gone = [0, 3, 4, 7, 11, 19, 22, 25, 29, 31, 34, 38]
        kept = [i for i in range(40) if i not in gone]
        assert all(holders(data, markers(gone)).values())  # each is on disk before
        acknowledged = time.monotonic()
        for i in gone:
            assert store.forget(ids[i])
        took = wait_clean(data, [*markers(gone), *(v for i in gone for v in vector_bytes(i))], acknowledged)
        on_disk = holders(data, markers(kept))
        assert all("snapshot.rms" in files for files in on_disk.values()), on_disk
        assert not (data / ".snapshot.rms.tmp-99999-1").exists()
        assert (data / "journal.rmj.torn-1700000000").exists()  # set-aside copies stay, redacted
        assert mark(3).encode() not in (data / "old" / "notes.txt").read_bytes()
        assert store.get(ids[5]).content == text(5)
        assert store.stats()["purge"]["pending"] is False
    print(f"clean after {took:.2f} s")
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:  # reopened: the rest, nothing back
        assert sorted(m.content for m in (store.get(ids[i]) for i in kept) if m) == sorted(text(i) for i in kept)
        assert all(store.get(ids[i]) is None for i in gone)
    gone_vectors = [v for i in gone for v in vector_bytes(i)]  # the graph cache saved at close is scrubbed
    assert not any(holders(data, gone_vectors).values())
    assert all(holders(data, [vector_bytes(i)[1] for i in kept]).values())  # kept vectors are in the snapshot


def test_expiry_sweeps_purge_the_same_way(cfg: Config) -> None:
    data = Path(cfg.memory.path)
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        for i in range(10):
            store.store(text(i), MemoryType.CONVERSATION)
            store.store(text(100 + i), MemoryType.FACT)
        store.compact()
        acknowledged = time.monotonic()
        assert store.cleanup_expired(now=time.time() + 400 * 86400) == 10  # the daemon's hourly sweep
        took = wait_clean(data, markers(range(10)), acknowledged)
        assert all(holders(data, markers(range(100, 110))).values())
    assert took < DEADLINE


def test_a_cleared_window_and_a_deleted_person_leave_the_disk(cfg: Config) -> None:
    data = Path(cfg.memory.path)
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        store.add_to_context_window("user", text(1))
        person = store.add_person("Zorblaxina")
        store.store(text(2))
        store.compact()
        acknowledged = time.monotonic()
        store.clear_context_window()
        assert store.delete_person(person.id)
        wait_clean(data, [mark(1).encode(), b"Zorblaxina"], acknowledged)
        assert all(holders(data, [mark(2).encode()]).values())


def test_forgetting_a_person_purges_their_memories_and_their_name(cfg: Config) -> None:
    data = Path(cfg.memory.path)
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        store.remember(f"Zorblaxina likes {mark(1)} tea", subjects=["Zorblaxina"])
        store.remember(f"Zorblaxina and Sarah planted {mark(2)} roses", subjects=["Zorblaxina", "Sarah"])
        store.remember(f"Sarah reads {mark(3)} novels", subjects=["Sarah"])
        store.compact()
        acknowledged = time.monotonic()
        counts = store.forget_person("Zorblaxina")
        assert counts["memories_deleted"] == 1, counts
        wait_clean(data, [mark(1).encode(), b"Zorblaxina"], acknowledged)
        assert all(holders(data, markers([2, 3])).values())  # the memory about both stays, without the name


def test_a_burst_of_forgets_costs_one_purge(cfg: Config) -> None:
    data = Path(cfg.memory.path)
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        ids = [m.id for m in store.store_batch([{"content": text(i)} for i in range(60)])]
        store.compact()
        before = store.stats()["generation"]
        acknowledged = time.monotonic()
        for memory_id in ids[:40]:
            store.forget(memory_id)
            time.sleep(0.01)
        wait_clean(data, markers(range(40)), acknowledged)
        _wait_purged(store)
        stats = store.stats()
        assert stats["purge"]["purges"] == 1
        assert stats["generation"] - before == 2  # two compactions for the whole burst


def test_a_crash_before_or_inside_the_purge_is_finished_by_the_next_open(cfg: Config) -> None:
    data = Path(cfg.memory.path)
    store = MemoryStore(config=cfg, embedder=DigestEmbedder())
    ids = [store.store(text(i)).id for i in range(12)]
    store.compact()
    store.forget(ids[0])
    abandon(store)  # before the purge began: the forget is only in the journal
    store = MemoryStore(config=cfg, embedder=DigestEmbedder())
    acknowledged = time.monotonic()
    wait_clean(data, markers([0]), acknowledged)
    _wait_purged(store)
    store.forget(ids[1])  # the purge waits PURGE_DELAY (1 s) for more: it has not begun when the crash comes
    store._storage.compact()  # the first compaction of its purge, then a crash
    assert pg.ForgottenRegister(data).pending
    abandon(store)
    assert holders(data, markers([1]))[mark(1).encode()]  # the previous generation still holds it
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        acknowledged = time.monotonic()
        wait_clean(data, markers([0, 1]), acknowledged)
        assert all(store.get(i) is not None for i in ids[2:])
    assert not pg.ForgottenRegister(data).pending
    assert set(pg.ForgottenRegister(data).memories) == {ids[0], ids[1]}  # ids only, never a text
    assert b"hidden under" not in (data / pg.FORGOTTEN_FILE).read_bytes()


def _wait_purged(store: MemoryStore) -> None:
    deadline = time.monotonic() + DEADLINE
    while store.stats()["purge"]["pending"]:
        assert time.monotonic() < deadline, "the purge did not finish"
        time.sleep(0.05)


def test_a_power_cut_at_every_fsync_across_a_purge_loses_nothing_and_brings_nothing_back(
        cfg: Config, tmp_path: Path) -> None:
    data = Path(cfg.memory.path)
    acked_forgets: list[tuple[int, int]] = []  # (acknowledged ops when the forget returned, marker)
    with recording(data) as rec, MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        ids = {}
        for i in range(16):
            ids[i] = store.store(text(i)).id
            rec.ack()
        store.compact(full=True)
        for i in range(16, 20):
            ids[i] = store.store(text(i)).id
            rec.ack()
        for i in (1, 5, 9, 17):
            store.forget(ids[i])
            rec.ack()
            acked_forgets.append((rec.acked, i))
        _wait_purged(store)
    purging = [d for d in rec.disks if d.acked == 24]  # cut points after the last forget: inside its purge
    assert len(rec.disks) > 40 and len(purging) > 10, (len(rec.disks), len(purging))
    for n, disk in enumerate(rec.disks):
        where = tmp_path / f"cut-{n}"
        _write(where, disk.files)
        forgotten = [i for acked, i in acked_forgets if acked <= disk.acked]
        _check_cut(where, cfg, ids, disk.acked, forgotten, disk.label)
        if disk not in purging[::8]:
            continue
        _write(where := tmp_path / f"cut-{n}-again", disk.files)  # a second cut while that open purges
        with recording(where) as again:
            MemoryStore(config=cfg.replace("memory", path=str(where)), embedder=DigestEmbedder()).close()
        for m, second in enumerate(again.disks):
            _write(tmp_path / f"cut-{n}-{m}", second.files)
            _check_cut(tmp_path / f"cut-{n}-{m}", cfg, ids, disk.acked, forgotten, f"{disk.label}, then {second.label}")


def _write(where: Path, files: dict[str, bytes]) -> None:
    where.mkdir(mode=0o700)
    for name, content in files.items():
        (where / name).write_bytes(content)


def _check_cut(where: Path, cfg: Config, ids: dict[int, str], acked: int, forgotten: list[int], label: str) -> None:
    """Open the store a power cut left: every acknowledged memory there, no forgotten one back;
    once closed (which finishes the purge), no file holds a forgotten text."""
    kept = [i for i in range(min(acked, 20)) if i not in (1, 5, 9, 17)]  # the first 20 acknowledgments: stores
    with MemoryStore(config=cfg.replace("memory", path=str(where)), embedder=DigestEmbedder()) as store:
        missing = [i for i in kept if (m := store.get(ids[i])) is None or m.content != text(i)]
        back = [i for i in forgotten if store.get(ids[i]) is not None]
        assert (missing, back) == ([], []), f"after a power cut at {label}"
    left = {n: f for n, f in holders(where, markers(forgotten)).items() if f}
    assert not left, f"after a power cut at {label}: {left}"


def test_backups_made_before_are_named_and_purged(cfg: Config, tmp_path: Path) -> None:
    backups = tmp_path / "backups"
    backups.mkdir()
    with MemoryStore(config=cfg, embedder=DigestEmbedder()) as store:
        ids = [store.store(text(i)).id for i in range(10)]
        turn = store.store(text(50), MemoryType.CONVERSATION)
        store.remember(f"Zorblaxina likes {mark(60)} tea", subjects=["Zorblaxina"])
        store.remember(f"Sarah and Zorblaxina sang {mark(61)}", subjects=["Sarah", "Zorblaxina"])
        before = Path(store.backup(backups / "before.rms")["path"])
        store.forget(ids[0])
        store.forget_person("Zorblaxina")
        after = Path(store.backup(backups / "after.rms")["path"])
        assert [b["path"] for b in store.forgotten_in_backups([ids[0]])] == [str(before)]
        assert store.forgotten_in_backups([ids[1]]) == []  # not forgotten
        assert [b["path"] for b in store.forgotten_in_backups()] == [str(before)]
        assert mark(0).encode() in before.read_bytes()
        assert store.forgotten_in_backups()[0]["persons"] == 1
        done = {r["path"]: r for r in store.purge_backups()}
        assert done[str(before)]["removed"] == 2 and done[str(before)]["persons"] == 1, done
        assert done[str(after)]["bytes"] == 0
        assert not any(n in before.read_bytes() for n in [mark(0).encode(), mark(60).encode(), b"Zorblaxina"])
        assert mark(61).encode() in before.read_bytes()  # about Sarah too: kept, without the name
        assert mark(1).encode() in before.read_bytes() and mark(50).encode() in before.read_bytes()
        assert store.forgotten_in_backups() == []
        assert bk.verify(before).ok
        copied = tmp_path / "copied.rms"  # a backup the store did not write (copied before the forget)
        shutil.copyfile(before, copied)
        assert store.purge_backups([str(copied)])[0]["bytes"] == 0
        with pytest.raises(ValidationError, match="inside the data directory"):
            store.purge_backups([str(Path(cfg.memory.path) / "snapshot.rms")])
    result, _ = pg.purge_backup(before, cfg, [], [], now=turn.expires_at.timestamp() + 1)  # the turn expired
    assert result["removed"] == 1 and mark(50).encode() not in before.read_bytes()
    restored = tmp_path / "restored"
    bk.restore(before, restored)
    with MemoryStore(config=cfg.replace("memory", path=str(restored)), embedder=DigestEmbedder()) as store:
        assert store.get(ids[0]) is None and store.get(ids[1]) is not None


def test_side_file_redaction_finds_whole_texts_prefixes_and_torn_ends() -> None:
    texts = ["a long secret sentence about the neighbours", "tiny"]
    data = (b"xx" + texts[0].encode() + b"yy" + texts[0][:12].encode() + b"!" + b"tiny" + b"zz"
            + texts[0][:5].encode())
    spans = sorted(pg.text_spans(data, texts))
    out = bytearray(data)
    for start, end in spans:
        out[start:end] = bytes(end - start)
    assert out == (b"xx" + bytes(len(texts[0])) + b"yy" + bytes(12) + b"!" + bytes(4) + b"zz" + bytes(5))
    assert pg.text_spans(b"no secret here", ["ok"]) == []  # under MIN_TEXT bytes: not searched for


# -- through a real daemon ---------------------------------------------------------------------


def _cli(d: DaemonProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "reachy_memory.cli", "--config", str(d.config_path), *argv],
                          capture_output=True, text=True, timeout=60, env=env)


def test_a_daemon_purges_within_ten_seconds_also_after_a_kill(tmp_path: Path) -> None:
    backups = tmp_path / "backups"
    backups.mkdir()
    with DaemonProcess(tmp_path, embedding={"enabled": False}) as d, d.client() as c:
        ids = [c.store(text(i)).id for i in range(30)]
        c.compact()
        ids += [c.store(text(i)).id for i in range(30, 40)]
        backup = Path(c.backup(str(backups) + "/")["path"])
        out = _cli(d, "forget", ids[0])
        acknowledged = time.monotonic()
        assert out.returncode == 0 and str(backup) in out.stdout and "--purge-forgotten" in out.stdout, out
        gone = [0, 2, 8, 31, 35]
        for i in gone[1:]:
            assert c.forget(ids[i])
        took = wait_clean(d.data, markers(gone), acknowledged)
        assert all(holders(d.data, markers([1, 3, 30, 39])).values())
        c.forget(ids[4])  # acknowledged, then the daemon is killed before it purges
        d.kill()
        d.start()
        restarted = time.monotonic()
        wait_clean(d.data, markers([*gone, 4]), restarted)
        assert c.get(ids[4]) is None and c.get(ids[5]) is not None
        assert mark(0).encode() in backup.read_bytes()
        out = _cli(d, "backup", "--purge-forgotten")
        assert out.returncode == 0 and "6 memories" in out.stdout, out
        assert not any(m in backup.read_bytes() for m in markers([*gone, 4]))
        assert mark(1).encode() in backup.read_bytes()
        assert c.forgotten_in_backups() == []
    print(f"daemon: clean after {took:.2f} s")
