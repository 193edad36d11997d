"""A memory's text can never become a journal operation (docs/FORMAT.md, "Frames").

Texts reach the journal byte for byte.  An attacker (a guest speaking to the robot) searches,
as the red team did, for valid UTF-8 texts holding a complete frame with the sync mark: a v2
frame with valid CRCs (the journal format before keyed frames), or a frame shaped like a v4
one whose tags they must guess.  The frame inside is ``[["expire", t]]`` with ``t`` in 2038..2071:
applied, it deletes every conversation turn stored before it.  The store then writes such a
turn among acknowledged ones; its frame is torn at many offsets, and its bytes flipped one by
one; after each, open (and ``verify --repair`` where open refuses) must keep every
acknowledged memory but the one whose frame was damaged, and never apply the frame inside.
"""

from __future__ import annotations

import random
import struct
import zlib
from pathlib import Path

import msgpack
import pytest
from store_util import abandon

from reachy_memory import Config, CorruptionError, MemoryStore
from reachy_memory.storage import backup as bk
from reachy_memory.storage import journal as jr
from reachy_memory.storage.files import JOURNAL_FILE

pytestmark = pytest.mark.timeout(240)
TURNS_BEFORE, TURNS_AFTER = 8, 3


def _v2_frame(payload: bytes) -> bytes:
    head = struct.pack("<4sII", jr.FRAME_MARK, len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def _v4_shaped(payload: bytes, rnd: random.Random) -> bytes:
    """A frame shaped like a v4 one (its payload CRC right) with a guessed tag (ASCII, the
    last byte a UTF-8 lead so the payload's continuation bytes decode): the attacker
    cannot know the key."""
    fields = struct.pack("<4sIQQI", jr.FRAME_MARK, len(payload), rnd.randrange(1, 30), rnd.randrange(0, 90),
                         zlib.crc32(payload))
    return fields + bytes(rnd.randrange(0x20, 0x7F) for _ in range(15)) + b"\xf1" + payload


def search(kind: str, seed: int, tries: int = 3_000_000) -> str:
    """A text holding a whole frame of ``kind`` whose payload expires every turn, found by
    varying the expiry time until the frame's bytes, after a "ç" (C3 A7: the mark's first
    byte), are valid UTF-8."""
    rnd = random.Random(seed)
    for _ in range(tries):
        payload = msgpack.packb([["expire", rnd.randrange(0x8000_0000, 0xC000_0000)]])
        frame = _v2_frame(payload) if kind == "v2" else _v4_shaped(payload, rnd)
        for tail in (b"", b"\x80", b"\x80\x80", b"\x80\x80\x80"):
            try:
                return (b"\xc3" + frame + tail).decode("utf-8")
            except UnicodeDecodeError:
                continue
    raise AssertionError("no text found")


@pytest.fixture(scope="module", params=[("v2", 0), ("v2", 1), ("v4", 2)], ids=["v2-a", "v2-b", "v4-guessed"])
def crafted(request: pytest.FixtureRequest) -> str:
    text = search(*request.param)
    assert text.encode()[1:5] == jr.FRAME_MARK
    return f"she said {text} and left"


def _written(config: Config, text: str) -> tuple[list[str], str, bytes, tuple[int, int]]:
    """A store holding turns, the crafted turn, more turns and a fact (all acknowledged,
    ``fsync: always``), crashed; returns the acknowledged ids, the crafted turn's id, the
    journal's bytes and the byte range of the crafted turn's frame."""
    with MemoryStore(config=config, embedder=None) as store:
        ids = [store.record_turn("user", f"turn number {i}").id for i in range(TURNS_BEFORE)]
        bad = store.record_turn("user", text).id
        ids += [store.record_turn("assistant", f"answer number {i}").id for i in range(TURNS_AFTER)]
        ids.append(store.remember_fact("the robot lives in Lyon").id)
        abandon(store)
    path = config.data_dir / JOURNAL_FILE
    data = path.read_bytes()
    assert text.encode() in data  # the text reaches the journal byte for byte, its frame with it
    offsets = jr.read_file(path, jr.JOURNAL).offsets
    at = data.index(text.encode())
    start = max(o for o in offsets if o < at)
    end = min([o for o in offsets if o > at] + [len(data)])
    return ids, bad, data, (start, end)


def _present(config: Config, ids: list[str]) -> set[str]:
    with MemoryStore(config=config, embedder=None) as store:
        return {i for i in ids if store.get(i) is not None}


def _open_or_repair(config: Config, ids: list[str]) -> set[str]:
    """What an open finds; where it refuses, what it finds after ``verify --repair``."""
    try:
        return _present(config, ids)
    except CorruptionError:
        assert not bk.verify(config.data_dir).ok  # refused damage is named
        bk.repair(config.data_dir, config)
        return _present(config, ids)


def _reset(config: Config, data: bytes) -> None:
    for path in config.data_dir.glob("journal.rmj*"):
        path.unlink()
    (config.data_dir / JOURNAL_FILE).write_bytes(data)


def test_a_torn_frame_holding_a_crafted_text_never_applies_the_frame_inside(config: Config, crafted: str) -> None:
    ids, bad, data, (start, end) = _written(config, crafted)
    before = ids[:TURNS_BEFORE]
    for cut in sorted({*range(start + 1, end, 11), end - 1, data.index(crafted.encode()) + 5}):
        _reset(config, data[:cut])
        present = _open_or_repair(config, [*ids, bad])
        assert set(before) <= present, f"cut at {cut}: turns before the crafted one were deleted"
        assert bad not in present and not present - set(before), f"cut at {cut}"


def test_a_flipped_byte_in_a_frame_holding_a_crafted_text_never_applies_the_frame_inside(
        config: Config, crafted: str) -> None:
    ids, bad, data, (start, end) = _written(config, crafted)
    inside = data.index(crafted.encode())
    for at in sorted({*range(start, start + jr.FRAME_OVERHEAD[4]), *range(inside, end, 23)}):
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        _reset(config, bytes(damaged))
        present = _open_or_repair(config, [*ids, bad])
        # only the damaged frame's memory may be missing; the frame inside its text is never applied
        assert present >= set(ids), f"flip at {at}: lost {sorted(set(ids) - present)}"


def test_a_frame_of_another_key_or_out_of_its_place_is_never_read(tmp_path: Path) -> None:
    """At the frame level: a payload holding a genuine frame of another journal (another key:
    an attacker's own store) or a copy of an earlier frame of this one: after the frame
    holding it is damaged, scanning never yields the frame inside."""
    other = jr.journal_chunks({"kind": "journal", "generation": 0}, 0, [(1, [["expire", 4e9]])])[2]
    path = tmp_path / "journal.rmj"
    journal = jr.Journal(path, "always")
    journal.open({"kind": "journal", "generation": 0})
    journal.append([["win", "user", "hello", 1.0]])
    earlier = path.read_bytes()[jr.read_file(path, jr.JOURNAL).offsets[1]:]  # a genuine frame of this file
    journal.append([["win", "user", b"x" + other + b"y" + earlier + b"z", 2.0]])
    journal.append([["win", "user", "after", 3.0]])
    journal.close()
    data = path.read_bytes()
    offsets = jr.read_file(path, jr.JOURNAL).offsets
    for at in range(offsets[2], offsets[2] + jr.FRAME_OVERHEAD[4]):
        damaged = bytearray(data)
        damaged[at] ^= 0x80
        found = jr.scan(path, memoryview(bytes(damaged)), jr.JOURNAL)
        assert [o for o, _ in found.frames] == [offsets[0], offsets[1], offsets[3]], at
        assert found.damaged and found.damaged[0][0] == offsets[2] and found.damaged[0][1] == offsets[3], at
