"""Damage to the journal and snapshot, byte by byte: every flip is detected or
recovered, and no acknowledged frame is lost (docs/FORMAT.md, "Frames")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from store_util import abandon

from reachy_memory import Config, CorruptionError, FormatVersionError, MemoryStore
from reachy_memory.storage import backup as bk
from reachy_memory.storage import journal as jr
from reachy_memory.storage.files import JOURNAL_FILE, read_snapshot
from tests.conftest import HashEmbedder


def _frames_file(path: Path, n: int = 4) -> tuple[bytes, list[int]]:
    journal = jr.Journal(path, "always")  # each frame says the ones before it are durable
    journal.open({"kind": "journal", "generation": 0})
    for i in range(1, n):
        journal.append([["put", [f"id{i}", f"text {i}"], None]])
    journal.close()
    return path.read_bytes(), jr.read_file(path, jr.JOURNAL).offsets


def test_every_flipped_journal_byte_is_detected_or_kept(tmp_path: Path) -> None:
    path = tmp_path / "j"
    data, offsets = _frames_file(path)
    frames = jr.read_file(path, jr.JOURNAL).frames
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            result = jr.read_file(path, jr.JOURNAL)
        except (CorruptionError, FormatVersionError):
            continue  # detected: open refuses, nothing changes on disk
        if i < offsets[-1] or result.torn_at is None:
            # header padding only: every frame intact
            assert result.frames == frames, f"flip at {i} changed what was read"
        else:
            # the last frame reads as a torn tail; open copies it aside before cutting it
            assert result.frames == frames[:-1] and result.torn_at == offsets[-1], i


def test_every_flipped_journal_byte_loses_no_frame_after_repair(tmp_path: Path) -> None:
    path = tmp_path / "j"
    data, offsets = _frames_file(path)
    frames = jr.read_file(path, jr.JOURNAL).frames
    ends = [*offsets[1:], len(data)]
    for i in range(offsets[1], offsets[-1]):  # every byte of the frames that have one after them
        damaged = bytearray(data)
        damaged[i] ^= 0xFF
        path.write_bytes(bytes(damaged))
        hit = next(n for n, (a, b) in enumerate(zip(offsets, ends, strict=True)) if a <= i < b)
        jr.repair_file(path, jr.JOURNAL)
        kept = jr.read_file(path, jr.JOURNAL).frames
        kept[0].pop("after")  # rewritten under a new key: it names the journal it replaces
        assert kept == frames[:hit] + frames[hit + 1 :], f"flip at {i}: only frame {hit} may be lost"


def test_every_flipped_snapshot_byte_is_detected(tmp_path: Path, config: Config) -> None:
    with MemoryStore(config=config, embedder=None) as store:
        for i in range(3):
            store.store(f"memory number {i}")
    path = config.data_dir / "snapshot.rms"
    data = path.read_bytes()
    original = read_snapshot(path)
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            got = read_snapshot(path)
        except (CorruptionError, FormatVersionError):
            continue
        assert got["records"] == original["records"] and bytes(got["vectors"]) == bytes(original["vectors"]), i


def test_length_high_byte_flip_mid_journal_refuses_open_and_repair_keeps_the_rest(config: Config) -> None:
    """The issue's reproduction: 0x7f in a middle frame's length high byte was taken for a
    torn tail, and open truncated the journal to 10 of 101 memories."""
    store = MemoryStore(config=config, embedder=None)
    ids = [store.store(f"memory {i}").id for i in range(101)]
    abandon(store)
    path = config.data_dir / JOURNAL_FILE
    offsets = jr.read_file(path, jr.JOURNAL).offsets
    data = bytearray(path.read_bytes())
    data[offsets[11] + 4 + 3] = 0x7F  # the high byte of frame 11's length (after the 4-byte mark)
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptionError):
        MemoryStore(config=config, embedder=None)
    assert path.read_bytes() == bytes(data)  # open changed nothing
    report = bk.verify(config.data_dir)
    assert not report.ok and ids[10] in report.affected  # verify says which memory is hit
    bk.repair(config.data_dir, config)
    with MemoryStore(config=config, embedder=None) as store:
        assert {m for m in ids if store.get(m)} == set(ids) - {ids[10]}
    assert list(config.data_dir.glob("journal.rmj.damaged-*"))  # the original is kept aside


def test_torn_tail_is_set_aside_not_thrown_away(config: Config) -> None:
    store = MemoryStore(config=config, embedder=None)
    store.store("kept")
    abandon(store)
    path = config.data_dir / JOURNAL_FILE
    torn = jr.encode_frame([["put", ["x" * 32, "never acknowledged"], None]])[:-3]
    with open(path, "ab") as fh:
        fh.write(torn)
    with MemoryStore(config=config, embedder=None) as store:
        assert len(store) == 1
    (aside,) = config.data_dir.glob("journal.rmj.torn-*")
    assert aside.read_bytes() == torn


# -- malformed content behind a valid checksum ---------------------------------------------------


def _rewrite_journal_frame(path: Path, change: Any) -> None:
    """Replace the journal's last frame by ``change(frame)``, re-framed with a valid CRC."""
    frames = jr.read_file(path, jr.JOURNAL).frames
    frames[-1] = change(frames[-1])
    path.write_bytes(jr.header(jr.JOURNAL) + b"".join(jr.encode_frame(f) for f in frames))


def _rewrite_snapshot_section(path: Path, index: int, change: Any) -> None:
    """Replace snapshot section ``index`` by ``change(section)``; the file stays well-checksummed."""
    frames = jr.read_file(path, jr.SNAPSHOT, raw=frozenset({2})).frames
    frames[index] = change(frames[index])
    frames[2] = jr.RawBin(bytes(jr.raw_bin(frames[2])))
    jr.write_snapshot(path, frames)


def _first_record(section: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {"records": [{**r, **change} if i == 0 else r for i, r in enumerate(section["records"])]}


@pytest.mark.parametrize(("file", "change"), [
    # journal: each raised a foreign exception from open (a helper's attack)
    ("journal", lambda ops: [[o[0], {**o[1], "metadata": None}, o[2]] for o in ops]),  # AttributeError
    ("journal", lambda ops: [[o[0], o[1], o[2][:15]] for o in ops]),  # a 15-byte vector: ValueError
    ("journal", lambda ops: None),  # a frame that is not a list: TypeError
    ("journal", lambda ops: [[o[0], {**o[1], "created": 2**40}, o[2]] for o in ops]),  # year 36812: opened,
    # then every listing raised ValueError
    # snapshot sections (1 records, 3 lexical, 4 window)
    ("snapshot", (1, lambda s: _first_record(s, type=""))),  # KeyError
    ("snapshot", (1, lambda s: _first_record(s, slot=-923))),  # IndexError
    ("snapshot", (4, lambda s: {"window": None})),  # TypeError
])
def test_malformed_content_with_a_valid_checksum_is_corruption_not_a_foreign_error(
        config: Config, file: str, change: Any) -> None:
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        store.store_batch([{"content": f"fact {i}", "metadata": {"n": i}} for i in range(30)])
        store.compact()
        store.store_batch([{"content": f"later {i}"} for i in range(5)])
        abandon(store)  # keep the journal frame (a clean close would compact it away)
    if file == "journal":
        _rewrite_journal_frame(config.data_dir / JOURNAL_FILE, change)
    else:
        _rewrite_snapshot_section(config.data_dir / "snapshot.rms", *change)
    with pytest.raises(CorruptionError):
        MemoryStore(config=config, embedder=None)
    report = bk.verify(config.data_dir)  # never raises, whatever it finds
    assert not report.ok  # and says what the store refused: verify replays the journal as an open does


@pytest.mark.parametrize("removed", [
    (JOURNAL_FILE,),  # opened without the writes since the last compaction, silently
    (JOURNAL_FILE, "snapshot.rms"),  # opened EMPTY although the previous generation was on disk
])
def test_a_missing_journal_is_refused_reported_and_repaired_only_on_request(
        config: Config, removed: tuple[str, ...]) -> None:
    with MemoryStore(config=config, embedder=HashEmbedder()) as store:
        kept = [m.id for m in store.store_batch([{"content": f"fact {i}"} for i in range(20)])]
        store.compact()
        store.compact()  # a previous generation on disk, holding all 20
        store.store("written after the last compaction")
        abandon(store)
    for name in removed:
        (config.data_dir / name).unlink()
    with pytest.raises(CorruptionError, match="missing"):
        MemoryStore(config=config, embedder=None)
    assert not bk.verify(config.data_dir).ok
    bk.repair(config.data_dir, config)
    with MemoryStore(config=config, embedder=None) as store:  # what the kept files hold
        assert sorted(m.id for m in store.export_page(None, 100)[0]) == sorted(kept)
    assert bk.verify(config.data_dir).ok
