import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reachy_memory import CorruptionError, FormatVersionError, StoreLockedError
from reachy_memory.storage import journal as jr

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=50) | st.binary(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(values, min_size=1, max_size=8))
def test_round_trip(tmp_path: Path, frames: list) -> None:
    path = tmp_path / "j"
    path.unlink(missing_ok=True)
    journal = jr.Journal(path, "never")
    journal.open({"head": True})
    for frame in frames:
        journal.append(frame)
    journal.close()
    assert jr.read_file(path, jr.JOURNAL).frames == [{"head": True}, *frames]


big_values = st.dictionaries(st.text(max_size=10), st.lists(values, max_size=80), max_size=3)


@settings(max_examples=60, deadline=None)
@given(obj=values | big_values)
def test_gentle_packing_is_plain_packing(obj: object) -> None:
    """pack_gently (piece by piece, for background snapshots) gives pack's bytes, and a
    Stream packs as the list it produces."""
    assert bytes(jr.pack_gently(obj)) == jr.pack(obj)
    items = obj if isinstance(obj, list) else [obj]
    streamed = jr.pack_gently({"rows": jr.Stream(len(items), iter(items))})
    assert bytes(streamed) == jr.pack({"rows": items})


def test_a_stream_of_the_wrong_length_is_refused() -> None:
    """The array header is written first: a stream that lies about its length would
    write a payload that decodes to something else."""
    with pytest.raises(ValueError, match="of 3 items produced 2"):
        jr.pack_gently({"rows": jr.Stream(3, iter([1, 2]))})


def test_packed_snapshot_frames_read_back(tmp_path: Path) -> None:
    payload = jr.pack_gently({"records": jr.Stream(2, iter([{"a": 1}, {"b": [2, 3]}]))})
    jr.write_snapshot(tmp_path / "s", [{"head": 1}, jr.Packed(payload), {"end": 2}])
    assert jr.read_file(tmp_path / "s", jr.SNAPSHOT).frames == [{"head": 1}, {"records": [{"a": 1}, {"b": [2, 3]}]},
                                                                {"end": 2}]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(values, min_size=2, max_size=5))
def test_torn_tail_at_every_offset_keeps_complete_frames(tmp_path: Path, frames: list) -> None:
    path = tmp_path / "j"
    data = jr.header(jr.JOURNAL) + b"".join(jr.encode_frame(f) for f in frames)
    last = len(jr.encode_frame(frames[-1]))
    for cut in range(len(data) - last, len(data)):
        path.write_bytes(data[:cut])
        journal = jr.Journal(path, "never")
        result = journal.open({})
        journal.close()
        assert result.frames == frames[:-1]
        assert path.stat().st_size == len(data) - last  # the torn bytes were cut away
        # and the journal is appendable again after recovery
        journal = jr.Journal(path, "never")
        journal.open({})
        journal.append("again")
        journal.close()
        assert jr.read_file(path, jr.JOURNAL).frames == [*frames[:-1], "again"]


def _three_frames(path: Path) -> list[int]:
    journal = jr.Journal(path, "always")
    journal.open({"n": 0})
    journal.append({"n": 1})
    journal.append({"n": 2})
    journal.close()
    return jr.read_file(path, jr.JOURNAL).offsets


def test_corruption_mid_file_names_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "j"
    offsets = _three_frames(path)
    data = bytearray(path.read_bytes())
    data[offsets[1] + jr.FRAME_OVERHEAD[jr.JOURNAL_VERSION] + 1] ^= 0xFF  # flip a payload byte of the middle frame
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError) as info:
        jr.read_file(path, jr.JOURNAL)
    assert info.value.offset == offsets[1]
    assert str(path) in str(info.value)


def test_repair_keeps_every_valid_frame_and_moves_damaged_file_aside(tmp_path: Path) -> None:
    path = tmp_path / "j"
    offsets = _three_frames(path)
    data = bytearray(path.read_bytes())
    data[offsets[1] + jr.FRAME_OVERHEAD[jr.JOURNAL_VERSION] + 1] ^= 0xFF  # a payload byte of the middle frame
    path.write_bytes(bytes(data))
    report = jr.repair_file(path, jr.JOURNAL)
    assert report.damaged_at == offsets[1] and report.kept_frames == 2
    assert Path(report.moved_to).read_bytes() == bytes(data)  # nothing thrown away
    assert jr.read_file(path, jr.JOURNAL).frames == [{"n": 0}, {"n": 2}]  # the frame after the damage is kept


@pytest.mark.parametrize(
    "blob",
    [
        b"",  # empty file
        b"XXXX" + b"J\x01\x00\x00",  # wrong magic
        b"RMEMS\x01\x00\x00",  # a snapshot where a journal was expected
        b"RMEMJ\x09\x00\x00",  # a future format version
    ],
)
def test_foreign_files_are_refused(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "j"
    path.write_bytes(blob)
    with pytest.raises(FormatVersionError):
        jr.read_file(path, jr.JOURNAL)


def test_batch_policy_syncs_within_the_window(tmp_path: Path) -> None:
    journal = jr.Journal(tmp_path / "j", "batch", window_ms=1)
    journal.open({})
    journal.append("x")
    assert journal._dirty
    journal._timer.join(timeout=2)  # type: ignore[union-attr]
    assert not journal._dirty
    journal.close()


def test_lock_refuses_a_second_holder(tmp_path: Path) -> None:
    first = jr.DirLock(tmp_path)
    first.acquire()
    with pytest.raises(StoreLockedError) as info:
        jr.DirLock(tmp_path).acquire()
    assert str(os.getpid()) in str(info.value)
    first.release()
    second = jr.DirLock(tmp_path)
    second.acquire()  # free again once released
    second.release()


def test_a_snapshot_whose_frames_fail_midway_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    """Frames are produced while the file is written (a background compaction builds the
    lexical state there): a failure of any kind keeps the old snapshot and its directory clean."""
    jr.write_snapshot(tmp_path / "s", [{"head": 1}, {"end": 0}])
    before = (tmp_path / "s").read_bytes()

    def frames() -> Iterator[object]:
        yield {"head": 2}
        raise ValueError("the lexical state could not be built")

    with pytest.raises(ValueError):
        jr.write_snapshot(tmp_path / "s", frames())
    assert (tmp_path / "s").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s"]
