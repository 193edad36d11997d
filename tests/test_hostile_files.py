"""Backups that did not come from this store (edited by hand, crafted, of a newer
version) with valid checksums: ``verify`` reports them, ``restore`` refuses them and
leaves the store as it was, and none can make a process allocate gigabytes."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import Config, MemoryStore
from reachy_memory.errors import FormatVersionError, StorageError
from reachy_memory.storage import backup as bk
from reachy_memory.storage import journal as jr
from tests.conftest import HashEmbedder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory, base_config: Config) -> list[Any]:
    """The frames of a real backup (memories of each type, a note, persons, a window)."""
    root = tmp_path_factory.mktemp("hostile")
    with MemoryStore(config=base_config.replace("memory", path=str(root / "data")), embedder=HashEmbedder()) as s:
        s.store("Alice likes tea", "fact")
        s.record_turn("user", "hello robot")
        s.record_turn("assistant", "hello human")
        s.set_context("mood", "happy")
        s.remember("Dave is my brother", name="dave-note")
        s.store("a note body", "fact")
        s.backup(root / "base.rms")
    return frames_of(root / "base.rms")


def frames_of(path: Path) -> list[Any]:
    frames = list(jr.read_file(path, jr.SNAPSHOT, raw=frozenset({2})).frames)
    frames[2] = bytes(jr.raw_bin(frames[2]))
    return frames


def written(path: Path, frames: list[Any]) -> Path:
    """``frames`` as a snapshot file with valid checksums (the checksum stops nothing)."""
    jr.write_snapshot(path, [*frames[:2], jr.RawBin(frames[2]), *frames[3:]])
    return path


def crafted(original: list[Any], edit: Callable[[list[Any]], Any], path: Path) -> tuple[Path, list[Any]]:
    """A copy of ``original``'s frames edited by ``edit``, written to ``path``: (the file, its frames)."""
    frames = copy.deepcopy(original)
    edit(frames)
    return written(path, frames), frames


def records(f: list[Any]) -> list[dict[str, Any]]:
    return f[1]["records"]


def _supersede_loop(f: list[Any]) -> None:
    a, b = records(f)[0], records(f)[-1]
    a.update(superseded_by=b["id"], superseded_at=1e9)
    b.update(superseded_by=a["id"], superseded_at=1e9)


# Each opened (or restored) before, then failed at open, in a listing, a search or the
# context window (a foreign exception), or was a state no store makes.
EDITS: dict[str, Callable[[list[Any]], Any]] = {
    "id not text": lambda f: records(f)[0].update(id=5),
    "unknown type": lambda f: records(f)[0].update(type="bogus"),
    "metadata a list": lambda f: records(f)[0].update(metadata=[1]),
    "slot text": lambda f: records(f)[-1].update(slot="x", vkey=None),
    "slot negative": lambda f: records(f)[-1].update(slot=-1, vkey=None),
    "subjects a string": lambda f: records(f)[0].update(subjects="abc"),
    "name a number": lambda f: records(f)[-1].update(name=5),
    "superseded_at text": lambda f: records(f)[0].update(superseded_at="x"),
    "covers_until past 9999": lambda f: records(f)[0].update(covers_until=1e300),
    "shared text": lambda f: records(f)[0].update(shared="yes"),
    "people not a list": lambda f: f[1].update(people=5),
    "unknown person op": lambda f: f[1].update(people=[{"op": "nope"}]),
    "window turn short": lambda f: f[4].update(window=[["user"]]),
    "window time text": lambda f: f[4].update(window=[["user", "hi", "noon"]]),
    "posting past the slots": lambda f: f[3]["lexical"]["terms_f32"].update(tea=[b"\xff\xff\xff\x7f", b"\0\0\x80?"]),
    "posting bytes odd": lambda f: f[3]["lexical"]["terms_f32"].update(tea=[b"\0" * 3, b""]),
    "generation 1.5": lambda f: f[0].update(generation=1.5),
    "generation text": lambda f: f[0].update(generation="1"),
    "dimension text": lambda f: f[0].update(dim="8"),
    "model a number": lambda f: f[0].update(model=5),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_crafted_backup_is_refused_by_verify_and_restore_and_the_store_is_kept(
        original: list[Any], tmp_path: Path, base_config: Config, edit: str) -> None:
    bad, _ = crafted(original, EDITS[edit], tmp_path / "bad.rms")
    report = bk.verify(bad)
    assert not report.ok
    data = tmp_path / "data"
    config = base_config.replace("memory", path=str(data))
    with MemoryStore(config=config, embedder=HashEmbedder()) as s:
        kept = s.store("kept", "fact").id
    before = sorted(p.name for p in data.iterdir())
    with pytest.raises(StorageError, match="does not verify"):
        bk.restore(bad, data, force=True)
    assert sorted(p.name for p in data.iterdir()) == before
    with MemoryStore(config=config, embedder=HashEmbedder()) as s:
        assert s.get(kept) is not None and len(s) == 1


# Links no store makes now, which earlier versions made: the store opens with them and
# verifies, so its backups must restore as they are (noted, not refused).
OLDER_LINKS: dict[str, Callable[[list[Any]], Any]] = {
    "note name twice": lambda f: records(f)[-1].update(name="Dave-Note"),  # an import before its name check
    "superseded by itself": lambda f: records(f)[0].update(superseded_by=records(f)[0]["id"], superseded_at=1e9),
    "supersession loop": _supersede_loop,  # supersede before it refused loops
}


@pytest.mark.parametrize("edit", list(OLDER_LINKS))
def test_a_backup_of_a_store_with_links_an_earlier_version_made_verifies_and_restores(
        original: list[Any], tmp_path: Path, base_config: Config, edit: str) -> None:
    old, frames = crafted(original, OLDER_LINKS[edit], tmp_path / "old.rms")
    report = bk.verify(old)
    assert report.ok and any("earlier version" in note for note in report.notes), report.to_dict()
    data = tmp_path / "data"
    bk.restore(old, data)
    with MemoryStore(config=base_config.replace("memory", path=str(data)), embedder=HashEmbedder()) as s:
        assert len(s) == len(records(frames))


def test_a_backup_whose_records_are_of_a_newer_format_is_a_format_version_error(
        original: list[Any], tmp_path: Path, base_config: Config) -> None:
    frames = copy.deepcopy(original)
    frames[0]["records"] = 3
    bad = written(tmp_path / "newer.rms", frames)
    assert "format 3" in " ".join(bk.verify(bad).problems)
    data = tmp_path / "data"
    data.mkdir()
    written(data / "snapshot.rms", frames)
    with pytest.raises(FormatVersionError):
        MemoryStore(config=base_config.replace("memory", path=str(data)), embedder=None)


def test_an_untouched_backup_still_verifies_restores_and_opens(original: list[Any], tmp_path: Path,
                                                              base_config: Config) -> None:
    good = written(tmp_path / "good.rms", copy.deepcopy(original))
    assert bk.verify(good).ok, bk.verify(good).problems
    bk.restore(good, tmp_path / "data")
    with MemoryStore(config=base_config.replace("memory", path=str(tmp_path / "data")), embedder=HashEmbedder()) as s:
        assert len(s) == len(records(original))
        assert len(s.get_context_window()) == 2


_BOMB = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a regression fails, it cannot eat the machine
    from pathlib import Path
    from reachy_memory import MemoryStore, load_config
    from reachy_memory.storage import backup as bk
    from reachy_memory.errors import CorruptionError
    bad, data = Path(sys.argv[1]), Path(sys.argv[2])
    assert not bk.verify(bad).ok
    try:
        MemoryStore(config=load_config(memory={"path": str(data)}), embedder=None)
    except CorruptionError as exc:
        print("refused:", exc)
""")


@pytest.mark.parametrize("slot", [1 << 26, (1 << 31) - 1])
def test_one_record_slot_of_billions_is_refused_without_allocating_it(
        original: list[Any], tmp_path: Path, slot: int) -> None:
    """A few bytes of a backup (one record's slot) sized arrays and a set at open: 2^26
    took 70 s and gigabytes; 2^31 more than the machine has.  Verify and open refuse it,
    under a 1 GiB address-space cap, in a subprocess, within seconds."""
    frames = copy.deepcopy(original)
    records(frames)[-1].update(slot=slot, vkey=None)
    bad = written(tmp_path / "bomb.rms", frames)
    data = tmp_path / "data"
    data.mkdir()
    written(data / "snapshot.rms", frames)
    done = subprocess.run([sys.executable, "-c", _BOMB, str(bad), str(data)], capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "outside the" in done.stdout
