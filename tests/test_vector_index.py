"""VectorIndex: exact and graph paths agree, filters, groups, pending, the cache."""

import errno
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reachy_memory.engine import vector_index
from reachy_memory.engine.vector_index import VectorIndex, to_bf16, widen


def unit(rng: np.random.Generator, n: int, dim: int = 16) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def rounded(vectors: np.ndarray) -> np.ndarray:
    """``vectors`` as the index keeps them (bfloat16, widened back to float32)."""
    return widen(to_bf16(vectors))


def stored(vi: VectorIndex) -> np.ndarray:
    """Every row of the index's matrix as float32."""
    return widen(vi.matrix)


def filled(n: int = 600, **kw: int) -> tuple[VectorIndex, np.ndarray]:
    rng = np.random.default_rng(0)
    vi = VectorIndex(16, exact_below=kw.pop("exact_below", 50), exact_threshold=kw.pop("exact_threshold", 20), **kw)
    vectors = unit(rng, n)
    for slot, v in enumerate(vectors):
        vi.add(slot, v, group=slot % 3)
    return vi, vectors


def assert_counts_consistent(vi: VectorIndex) -> None:
    """The kept per-group counts equal a recount."""
    for group, count in vi._in_graph_count.items():
        assert count == int(np.count_nonzero(vi.in_graph & (vi.group == group)))


def brute(vectors: np.ndarray, q: np.ndarray, allowed: np.ndarray, k: int) -> set[int]:
    sims = vectors @ q
    sims[~allowed] = -np.inf
    return set(np.argsort(-sims)[:k].tolist())


@pytest.mark.parametrize(
    ("flush", "selector"),
    [
        (False, None),  # everything pending: exact over pending
        (True, None),  # everything in the graphs
        (True, "group1"),  # filter on one group, searched in that group's graph only
        (True, "half"),  # a filter keeping half of the slots, across groups
        (True, "few"),  # a small filter: exact path
    ],
)
def test_search_matches_brute_force(flush: bool, selector: str | None) -> None:
    vi, vectors = filled()
    if flush:
        vi.flush()
    slots = np.arange(len(vectors))
    allowed = {None: np.ones(len(vectors), bool), "group1": slots % 3 == 1,
               "half": slots % 2 == 0, "few": slots < 15}[selector]
    mask = None if selector is None else allowed
    groups = [1] if selector == "group1" else None
    hits = recall = 0
    for q in unit(np.random.default_rng(1), 30):
        got = set(vi.search(q, 10, mask, groups)[0].tolist())
        want = brute(vectors, q, allowed, 10)
        hits += len(got & want)
        recall += len(want)
        assert got <= set(np.flatnonzero(allowed).tolist())
    assert hits / recall >= 0.95


@pytest.mark.parametrize("flushed", [0, 300, 600])  # all pending, part in the graphs, all in them
def test_nearest_finds_a_groups_own_vectors_and_changes_nothing(flushed: int) -> None:
    """The write-time restatement check: one group, graph and pending vectors, and no
    catch-up insertion (a search makes some when many vectors wait)."""
    vi, vectors = filled(exact_threshold=5)
    vi.flush(flushed)
    pending = set(vi.pending)
    for slot in (1, 4, 301, 598):  # group 1 (slot % 3), from the graph or the pending set
        got, sims = vector_index.nearest(vi, vectors[slot], 5, 1, ef=16)
        assert got[0] == slot and sims[0] > 0.99 and all(s % 3 == 1 for s in got.tolist())
    assert vi.pending == pending
    small = VectorIndex(16, exact_below=1000)  # no graph at this size: the group's rows exactly
    small.add(0, vectors[0], group=0)
    small.add(1, vectors[0], group=2)
    assert vector_index.nearest(small, vectors[0], 5, 2)[0].tolist() == [1]
    assert len(vector_index.nearest(small, vectors[0], 5, 1)[0]) == 0


@pytest.mark.parametrize("waiting_rows", [2048, 7])  # the float32 copies hold them all, or overflow
def test_nearest_sees_pending_vectors_through_every_change(monkeypatch: pytest.MonkeyPatch, waiting_rows: int) -> None:
    """The pending vectors nearest compares a query with exactly (the write-time check):
    added, replaced, removed, inserted in part, and past what its float32 copies hold, the
    same top k (slots and cosines) as a brute-force pass over the group's pending rows."""
    monkeypatch.setattr(vector_index, "WAITING_ROWS", waiting_rows)
    rng = np.random.default_rng(3)
    vi, vectors = filled(120, exact_threshold=5)
    vectors = np.vstack([vectors, unit(rng, 30)])
    vi.flush(60)  # 60 in the graphs, 60 waiting
    for slot in (62, 75):  # replaced while waiting
        vectors[slot] = unit(rng, 1)[0]
        vi.add(slot, vectors[slot], group=slot % 3)
    vi.remove(64)
    vi.remove_many(np.array([65, 66, 3]))
    vi.add(5, vectors[5], group=0)  # a graph node replaced: waiting again, in another group
    groups = np.arange(150) % 3
    groups[5] = 0
    for burst in range(3):
        vi.flush(7)
        for slot in range(120 + 10 * burst, 130 + 10 * burst):  # a burst of writes
            vi.add(slot, vectors[slot], group=int(groups[slot]))
        for q in list(vectors[[1, 5, 62, 75, 121, 129 + 10 * burst]]) + list(unit(rng, 8)):
            for group in (0, 1, 2):
                waiting = np.array(sorted(s for s in vi.pending if groups[s] == group), np.int64)
                sims = rounded(vectors[waiting]) @ q
                best = np.argsort(-sims)[:4]
                got, got_sims = vi._waiting.nearest(vi, q, 4, group)
                assert got.tolist() == waiting[best].tolist()
                assert np.allclose(got_sims, sims[best], atol=1e-6)
                top, _ = vector_index.nearest(vi, q, 4, group, ef=16)
                assert all(groups[s] == group for s in top.tolist())
                assert len(waiting) == 0 or sims[best[0]] < 0.99 or top[0] == waiting[best[0]]
    assert vi._waiting.complete == (waiting_rows > len(vi.pending))


def test_removed_and_replaced_slots() -> None:
    vi, vectors = filled()
    vi.flush()
    q = vectors[5]
    assert vi.search(q, 1)[0][0] == 5
    vi.remove(5)
    assert 5 not in vi.search(q, 10)[0]
    vi.add(5, -q, group=2)  # slot reuse with a different vector and group
    vi.flush()
    assert 5 not in vi.search(q, 10)[0] and vi.search(-q, 1)[0][0] == 5
    assert_counts_consistent(vi)


def test_k_larger_than_population_does_not_raise() -> None:
    vi, vectors = filled(n=60)
    vi.flush()
    slots, sims = vi.search(vectors[0], 500)
    assert len(slots) == 60 and np.all(np.diff(sims) <= 1e-6)


def reopened(tmp_path: Path, saved_tag: str, wanted_tag: str) -> tuple[VectorIndex, np.ndarray]:
    """A fresh index over the same vectors, loading a graph cache saved under ``saved_tag``."""
    vi, vectors = filled()
    vi.flush()
    path = tmp_path / "g.hnsw"
    vi.save_graph(path, saved_tag)
    again = VectorIndex(16, exact_below=50, exact_threshold=20)
    again.load_vectors(vi.vector_bytes(), vi.alive[: len(vectors)], vi.group[: len(vectors)], "bf16")
    again.load_graph(path, wanted_tag)
    return again, vectors


def test_graph_cache_round_trip_and_touched_slots(tmp_path: Path) -> None:
    again, vectors = reopened(tmp_path, "t1", "t1")
    again.remove(7)  # changes while the cache loads must win over the cache
    again.add(8, -vectors[8], group=2)
    assert again._adopt_loaded(wait=True)
    assert again.pending == {8}
    assert_counts_consistent(again)
    assert 7 not in again.search(vectors[7], 10)[0]
    assert again.search(-vectors[8], 1)[0][0] == 8


def _changed_since_the_cache(vi: VectorIndex, vectors: np.ndarray) -> set[int]:
    """What a store does between its last clean close and a crash; returns the live
    slots whose vector a cache saved before cannot hold."""
    vi.remove(7)  # forgotten
    vi.remove(8)
    vi.add(8, -vectors[8], group=2)  # slot reused by another memory
    vi.add(9, vectors[9], group=(9 % 3 + 1) % 3)  # the same vector in another group
    for slot, vector in zip(range(600, 620), unit(np.random.default_rng(9), 20), strict=True):
        vi.add(slot, vector, group=slot % 3)  # new memories
    return {8, 9, *range(600, 620)}


def test_an_older_cache_keeps_its_right_nodes_and_only_the_rest_is_inserted(tmp_path: Path) -> None:
    """A cache saved before the last writes (a crash since the last clean close) is
    reused: its nodes whose slot still holds their vector are kept, the rest marked
    deleted, and only the changed and new slots wait to be inserted (it was thrown
    away, and the whole graph rebuilt: 5 s of idle CPU at 10k memories, a minute at 100k)."""
    vi, vectors = filled()
    vi.flush()
    vi.save_graph(tmp_path / "g.hnsw", "generation 1")
    changed = _changed_since_the_cache(vi, vectors)
    again = VectorIndex(16, exact_below=50, exact_threshold=20)
    again.load_vectors(vi.vector_bytes(), vi.alive[:620], vi.group[:620], "bf16")
    again.load_graph(tmp_path / "g.hnsw", "generation 2")
    assert again._adopt_loaded(wait=True)
    assert again.pending == changed
    assert_counts_consistent(again)
    again.flush()
    live = np.flatnonzero(again.alive)
    for group, graph in again._graphs.items():  # no node keeps a vector its slot no longer holds
        held = again._members(group, None)
        assert np.allclose(graph.get_items(held), again.rows(held), rtol=0, atol=1e-7)
    assert all(again.search(again.rows(np.array([s]))[0], 1)[0][0] == s for s in live.tolist())
    assert 7 not in again.search(vectors[7], 10)[0]
    assert 9 in again.search(vectors[9], 1, groups=[(9 % 3 + 1) % 3])[0]
    assert 9 not in again.search(vectors[9], 10, groups=[0])[0]


@pytest.mark.parametrize("damage", [
    "no node lists",  # a cache saved before node lists: taken only when it matches the snapshot
    "short list",  # group 0: fewer fingerprints than slots
    "not bytes",  # group 0: a list of the wrong type
])
def test_an_older_cache_that_cannot_tell_its_right_nodes_is_rebuilt(tmp_path: Path, damage: str) -> None:
    vi, vectors = filled()
    vi.flush()
    path = tmp_path / "g.hnsw"
    vi.save_graph(path, "generation 1")
    meta = vector_index._read_meta(path)
    assert meta is not None
    if damage == "no node lists":
        del meta["nodes"]
    else:
        slots, prints, _ = meta["nodes"][0]
        short = [slots, prints[:-8], vector_index._list_crc(slots, prints[:-8])]  # with a right checksum
        meta["nodes"][0] = short if damage == "short list" else [1, 2]
    vector_index._write_meta(path, meta)
    changed = _changed_since_the_cache(vi, vectors)
    again = VectorIndex(16, exact_below=50, exact_threshold=20)
    again.load_vectors(vi.vector_bytes(), vi.alive[:620], vi.group[:620], "bf16")
    again.load_graph(path, "generation 2")
    assert again._adopt_loaded(wait=True)
    group0 = set(np.flatnonzero(again.alive & (again.group == 0)).tolist())
    if damage == "no node lists":
        assert len(again.pending) == again.count and not again._graphs  # every vector inserted afresh
    else:  # only group 0's list is bad: its graph is rebuilt, the others kept (groups stand alone)
        assert sorted(again._graphs) == [1, 2] and group0 <= again.pending
        assert again.pending - group0 == {slot for slot in changed if again.group[slot] != 0}
        assert_counts_consistent(again)


def test_a_node_list_damaged_on_disk_is_not_trusted(tmp_path: Path) -> None:
    """The node list decides which nodes are marked deleted, so it is checksummed like
    the graphs: one flipped bit turning slot 40 into 41 left 40's node live while its
    memory had been forgotten since the save, and searches returned it."""
    vi, vectors = filled()
    vi.flush()
    path = tmp_path / "g.hnsw"
    vi.save_graph(path, "generation 1")
    meta_file = tmp_path / "g.hnsw.meta"
    raw = bytearray(meta_file.read_bytes())
    meta = vector_index._read_meta(path)
    assert meta is not None
    at = raw.find(bytes(meta["nodes"][0][0])) + 8 * 10 + 1  # group 0's 11th node: slot 30 (0, 3, ...)
    assert raw[at - 1] == 30
    raw[at - 1] ^= 1  # slot 31, of group 1: right, in the wrong graph
    meta_file.write_bytes(bytes(raw))
    vi.remove(30)  # forgotten after the save
    again = VectorIndex(16, exact_below=50, exact_threshold=20)
    again.load_vectors(vi.vector_bytes(), vi.alive[:600], vi.group[:600], "bf16")
    again.load_graph(path, "generation 2")
    assert again._adopt_loaded(wait=True)
    again.flush()
    assert 30 not in again.search(vectors[30], 10)[0]
    assert 30 not in again.search(vectors[30], 10, groups=[0])[0]


@pytest.mark.parametrize("dim", [
    384,  # the model's: four components a 64-bit word
    6,  # not a multiple of 4: one component a word
])
def test_fingerprints_tell_rows_apart(dim: int) -> None:
    rng = np.random.default_rng(4)
    bits = to_bf16(unit(rng, 2000, dim))
    prints = vector_index.fingerprints(bits)
    assert len(set(prints.tolist())) == 2000  # no two of 2,000 rows share one
    one_bit = bits.copy()
    one_bit[:, 5] ^= 1  # the smallest change of one component
    top_bit = bits.copy()
    top_bit[:, 3] ^= 0x8000  # the largest shift inside a word: still never a collision
    assert not np.any(vector_index.fingerprints(top_bit) == prints)
    assert not np.any(vector_index.fingerprints(one_bit) == prints)
    assert np.array_equal(vector_index.fingerprints(bits.copy()), prints)  # the same rows, the same prints


def test_a_cache_of_another_dimension_is_not_loaded(tmp_path: Path) -> None:
    """A model of another size, then a crash: the cache of the old model lists nodes
    whose fingerprints cannot match, but hnswlib loads a graph of another dimension
    without a word, and inserting our longer vectors into it overwrote its labels
    (searches then returned slots like -4.8e18)."""
    vi, _ = filled()
    vi.flush()
    path = tmp_path / "g.hnsw"
    vi.save_graph(path, "generation 1:model-16")
    wide = VectorIndex(32, exact_below=50, exact_threshold=20)
    vectors = unit(np.random.default_rng(5), 600, 32)
    for slot, vector in enumerate(vectors):
        wide.add(slot, vector, group=slot % 3)
    again = VectorIndex(32, exact_below=50, exact_threshold=20)
    again.load_vectors(wide.vector_bytes(), wide.alive[:600], wide.group[:600], "bf16")
    again.load_graph(path, "generation 2:model-32")
    assert again._adopt_loaded(wait=True)
    assert not again._graphs and len(again.pending) == again.count  # rebuilt, as for any unusable cache
    again.flush()
    for group, graph in again._graphs.items():
        held = again._members(group, None)
        assert np.array_equal(graph.get_items(held), again.rows(held))
    assert all(again.search(vectors[s], 1)[0][0] == s for s in range(0, 600, 7))


def test_a_cached_graph_whose_nodes_all_changed_is_built_afresh(tmp_path: Path) -> None:
    """A reindex (another model of the same size), then a crash: every node of the old
    cache is stale, and its slots live again with new vectors.  Adopting it made every
    insertion an update in place of a deleted node, which hnswlib does 7-17x slower
    than inserting (it repairs the node's neighbourhood: 34.9 s against 2.0 s for 5,000
    vectors of 384 dimensions here), and a search catching up took ~100 ms instead of
    4-8.  A group whose graph keeps too little for its updates is built afresh; the
    others keep their graph."""
    vi, vectors = filled()
    vi.flush()
    path = tmp_path / "g.hnsw"
    vi.save_graph(path, "generation 1:model a")
    group0 = np.flatnonzero(vi.group[:600] == 0)
    for slot, vector in zip(group0.tolist(), unit(np.random.default_rng(6), len(group0)), strict=True):
        vi.add(slot, vector, group=0)  # re-embedded by the new model
    vi.add(1, -vectors[1], group=1)  # one change elsewhere: that graph is still worth keeping
    again = VectorIndex(16, exact_below=50, exact_threshold=20)
    again.load_vectors(vi.vector_bytes(), vi.alive[:600], vi.group[:600], "bf16")
    again.load_graph(path, "generation 2:model b")
    assert again._adopt_loaded(wait=True)
    assert sorted(again._graphs) == [1, 2]
    assert again.pending == {1, *group0.tolist()}
    assert_counts_consistent(again)
    again.flush()
    for group, graph in again._graphs.items():
        held = again._members(group, None)
        assert np.array_equal(graph.get_items(held), again.rows(held))
    assert len(again._graphs[0].get_ids_list()) == len(group0)  # a fresh graph: no deleted nodes


def test_saving_skips_a_large_pending_set_instead_of_stalling(tmp_path: Path) -> None:
    vi, _ = filled()  # 600 pending, far above 4 x exact_threshold
    vi.save_graph(tmp_path / "g.hnsw", "t")
    assert not list(tmp_path.iterdir()) and len(vi.pending) == 600
    vi.maintain(budget=1000)
    vi.save_graph(tmp_path / "g.hnsw", "t")
    assert (tmp_path / "g.hnsw.meta").exists() and not vi.pending


def test_the_scan_memo_never_serves_a_changed_matrix() -> None:
    """Searches of one query reuse one matrix product; any change must invalidate it."""
    rng = np.random.default_rng(5)
    vi = VectorIndex(16)
    vectors = rng.standard_normal((40, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for slot, v in enumerate(vectors):
        vi.add(slot, v)
    query = vectors[0].copy()
    assert vi.search(query, 1)[0][0] == 0
    vi.remove(0)  # the best match goes ...
    assert vi.search(query, 1)[0][0] != 0
    vi.add(40, query)  # ... and an exact copy arrives in a new slot
    assert vi.search(query, 1)[0][0] == 40
    mask = np.zeros(41, bool)
    mask[:20] = True
    slots, _ = vi.search(query, 3, mask)  # a filtered search of the same query reuses the product
    assert set(slots.tolist()) <= set(range(1, 20))


@pytest.mark.parametrize("settled", [
    0,  # every removed node still unmarked in its graph: searches must filter them
    100,  # some marked, some not
    None,  # all marked
])
def test_a_mass_removal_is_never_returned_and_leaves_the_rest_findable(settled: int | None) -> None:
    vi, vectors = filled(900)
    vi.flush()
    gone = np.flatnonzero(np.arange(900) % 3 != 1)  # groups 0 and 2 entirely: 600 slots
    vi.remove_many(gone)
    assert vi.count == 300 and vi.stats()["unmarked"] == 600
    vi.settle(settled)
    alive = np.ones(900, bool)
    alive[gone] = False
    hits = 0
    for q in unit(np.random.default_rng(2), 30):
        got = vi.search(q, 10)[0].tolist()
        assert len(got) == 10 and not set(got) & set(gone.tolist())
        hits += len(set(got) & brute(vectors, q, alive, 10))
    assert hits / 300 >= 0.95
    assert_counts_consistent(vi) if settled is None else None


def test_a_saved_graph_holds_no_node_of_a_mass_removal(tmp_path: Path) -> None:
    vi, vectors = filled(900, exact_below=0)
    vi.flush()
    vi.remove_many(np.arange(0, 900, 2))
    vi.save_graph(tmp_path / "g.hnsw", "t")
    assert vi.stats()["unmarked"] == 0
    again = VectorIndex(16, exact_below=0, exact_threshold=20)
    again.load_vectors(vectors.tobytes(), vi.alive[:900], vi.group[:900], "f32")  # a pre-bf16 snapshot
    again.load_graph(tmp_path / "g.hnsw", "t")
    assert again._adopt_loaded(wait=True) and not again.pending  # the cache was taken
    for q in unit(np.random.default_rng(3), 10):
        assert all(slot % 2 for slot in again.search(q, 10)[0].tolist())


def test_a_removed_slot_reused_before_settling_is_searched_with_its_new_vector() -> None:
    vi, vectors = filled(900)
    vi.flush()
    vi.remove_many(np.arange(300))
    vi.add(5, -vectors[5], group=1)
    vi.flush()
    assert vi.search(-vectors[5], 1)[0][0] == 5 and 5 not in vi.search(vectors[5], 10)[0]
    assert vi.settle() == 0
    assert_counts_consistent(vi)


def test_an_exact_search_over_several_gather_steps_equals_brute_force() -> None:
    vi, vectors = filled(2 * 1024 + 37)  # three steps of the reused gather buffer, the last partial
    q = unit(np.random.default_rng(4), 1)[0]
    slots = np.arange(len(vectors))[::-1].copy()  # any order
    got, sims = vi.exact(q, slots, 25)
    want = rounded(vectors) @ q
    assert got.tolist() == np.argsort(-want, kind="stable")[:25].tolist()
    assert np.allclose(sims, want[got], atol=1e-6)


def test_the_matrix_grows_in_place_and_keeps_every_row() -> None:
    """Growing resizes the matrix's own mapping (no second copy) and keeps the rows."""
    vi, vectors = filled(1024)
    mapping = vi._map
    extra = unit(np.random.default_rng(1), 3000)
    for slot, v in enumerate(extra, start=1024):
        vi.add(slot, v)
    assert len(vi.matrix) >= 4024 and vi._map is mapping  # resized, not replaced
    np.testing.assert_array_equal(stored(vi)[:1024], rounded(vectors))
    np.testing.assert_array_equal(stored(vi)[1024:4024], rounded(extra))
    assert not vi.matrix[4024:].any()  # new rows read as zeros


def test_growing_while_a_snapshot_holds_a_view_copies_and_leaves_the_view_intact() -> None:
    vi, vectors = filled(1024)
    held = vi.vector_bytes()  # what a background snapshot writes from
    before = bytes(held)
    for slot, v in enumerate(unit(np.random.default_rng(2), 2000), start=1024):
        vi.add(slot, v)
    assert bytes(held) == before  # the snapshot's rows are untouched by the growth
    np.testing.assert_array_equal(stored(vi)[:1024], rounded(vectors))
    del held
    mapping = vi._map
    for slot, v in enumerate(unit(np.random.default_rng(3), 5000), start=3024):
        vi.add(slot, v)
    assert vi._map is mapping  # no view held any more: in place again


def test_loading_copies_the_rows_and_gives_the_snapshot_buffer_back(tmp_path: Path) -> None:
    from reachy_memory.storage import journal as jr

    rows = unit(np.random.default_rng(4), 5000)  # 320 KB: many pages to give back
    path = tmp_path / "raw"
    path.write_bytes(b"x" * 100 + rows.tobytes() + b"y" * 100)  # unaligned like a frame
    buffer = jr.read_bytes(path)
    source = buffer[100 : 100 + rows.nbytes]
    vi = VectorIndex(16)
    vi.load_vectors(source, np.ones(5000, bool), np.zeros(5000, np.int8), "f32")
    np.testing.assert_array_equal(stored(vi), rounded(rows))
    released = np.frombuffer(buffer, np.uint8)
    assert not released[4096 : 4096 * 70].any()  # whole pages inside the rows read as zeros now
    assert bytes(buffer[:100]) == b"x" * 100 and bytes(buffer[-100:]) == b"y" * 100  # the rest is kept
    assert vi.search(rows[7], 1)[0][0] == 7


def test_loading_from_plain_bytes_copies_and_gives_nothing_back() -> None:
    rows = unit(np.random.default_rng(5), 40)
    data = bytearray(rows.tobytes())
    vi = VectorIndex(16)
    vi.load_vectors(memoryview(data), np.ones(40, bool), np.zeros(40, np.int8), "f32")
    assert bytes(data) == rows.tobytes()
    np.testing.assert_array_equal(stored(vi), rounded(rows))


class _NoRemap(mmap.mmap):
    """An anonymous mapping as on a platform without mremap (macOS): CPython's resize
    raises SystemError there."""

    def resize(self, newsize: int) -> None:
        raise SystemError("mmap: resizing not available--no mremap()")


class _NoRoom(mmap.mmap):
    def resize(self, newsize: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")


def _mapped_by(kind: type[mmap.mmap]) -> Callable[[int], mmap.mmap]:
    return lambda nbytes: kind(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)


def test_growing_where_mappings_cannot_be_resized_copies_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vector_index, "big_buffer", _mapped_by(_NoRemap))
    vi, vectors = filled(1024)
    extra = unit(np.random.default_rng(6), 1500)
    for slot, v in enumerate(extra, start=1024):
        vi.add(slot, v)  # raised SystemError (after the journal append, in the store) at each growth
    assert len(vi.matrix) == len(vi.alive) >= 2524
    np.testing.assert_array_equal(stored(vi)[:2524], rounded(np.concatenate([vectors, extra])))
    assert vi.search(extra[3], 1)[0].tolist() == [1027]


def test_a_failed_growth_raises_memory_error_and_leaves_the_index_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vector_index, "big_buffer", _mapped_by(_NoRoom))
    vi, vectors = filled(1024)
    with pytest.raises(MemoryError):
        vi.add(1024, vectors[0])
    assert vi.matrix.shape == (1024, 16) and len(vi.alive) == len(vi.in_graph) == len(vi.group) == 1024
    np.testing.assert_array_equal(stored(vi), rounded(vectors))
    assert vi.count == 1024 and vi.search(vectors[9], 1)[0].tolist() == [9]


def test_release_pages_touches_only_our_own_contiguous_buffers(tmp_path: Path) -> None:
    import mmap

    from reachy_memory._threads import big_buffer, release_pages

    other = mmap.mmap(-1, 3 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)  # an anonymous map not made by big_buffer
    other[:] = b"\x01" * len(other)
    release_pages(memoryview(other))
    assert other[:] == b"\x01" * len(other)
    ours = big_buffer(3 * mmap.PAGESIZE)
    ours[:] = b"\x02" * len(ours)
    release_pages(memoryview(ours)[::2])  # not contiguous: left alone, no error
    release_pages(memoryview(ours)[:0])  # empty
    assert ours[:] == b"\x02" * len(ours)
    release_pages(memoryview(ours)[1 : 2 * mmap.PAGESIZE + 1])  # only page 1 lies wholly inside
    assert ours[: mmap.PAGESIZE] == b"\x02" * mmap.PAGESIZE
    assert ours[mmap.PAGESIZE : 2 * mmap.PAGESIZE] == bytes(mmap.PAGESIZE)
    assert ours[2 * mmap.PAGESIZE :] == b"\x02" * mmap.PAGESIZE


def test_loading_a_block_with_a_partial_row_keeps_the_whole_rows() -> None:
    rows = unit(np.random.default_rng(6), 3)
    vi = VectorIndex(16)
    for fmt, block in (("f32", rows.tobytes()), ("bf16", to_bf16(rows).tobytes())):
        vi.load_vectors(memoryview(bytearray(block + b"\x00" * 10)), np.ones(3, bool), np.zeros(3, np.int8), fmt)
        np.testing.assert_array_equal(stored(vi), rounded(rows))


def test_each_graph_is_sized_to_its_own_group_not_to_every_slot(tmp_path: Path) -> None:
    vi = VectorIndex(16, exact_below=50, exact_threshold=20)
    vectors = unit(np.random.default_rng(7), 5000)
    for slot, v in enumerate(vectors):
        vi.add(slot, v, group=0 if slot < 4990 else 1)  # a big group and a small one
    vi.flush()
    big, small = vi._graphs[0], vi._graphs[1]
    assert big.element_count == 4990 and big.get_max_elements() >= 4990
    assert small.element_count == 10 and small.get_max_elements() <= 1024  # not 5,000+ places
    vi.save_graph(tmp_path / "g", "tag")
    loaded = VectorIndex(16, exact_below=50, exact_threshold=20)
    for slot, v in enumerate(vectors):
        loaded.add(slot, v, group=0 if slot < 4990 else 1)
    loaded.pending.clear()  # as after a snapshot load: the cached graphs bring them
    loaded.pending.update(range(5000))
    loaded.load_graph(tmp_path / "g", "tag")
    loaded._adopt_loaded(wait=True)
    extra = unit(np.random.default_rng(8), 600)
    for slot, v in enumerate(extra, start=5000):
        loaded.add(slot, v, group=1)  # the small graph grows past its saved size
    loaded.flush()
    assert loaded._graphs[1].element_count == 610
    assert loaded.search(extra[5], 1, groups=[1])[0][0] == 5005


@settings(max_examples=200, deadline=None)
@given(values=hnp.arrays(np.float32, st.integers(1, 64),
                         elements=st.floats(-2.0**100, 2.0**100, allow_nan=False, width=32)))
def test_bf16_rounds_to_the_nearest_and_widens_exactly(values: np.ndarray) -> None:
    bits = to_bf16(values)
    kept, exact = widen(bits).astype(np.float64), values.astype(np.float64)
    error = np.abs(kept - exact)
    for step in (1, -1):  # the bf16 values next to the kept one (NaN past zero: no rival)
        rival = widen((bits.astype(np.int32) + step).astype(np.uint16)).astype(np.float64)
        assert np.all(error <= np.nan_to_num(np.abs(rival - exact), nan=np.inf))
    normal = np.abs(exact) > 2.0**-100
    assert np.all(error[normal] <= np.abs(exact[normal]) * 2.0**-8)  # half a unit in the last of 8 bits
    np.testing.assert_array_equal(to_bf16(kept), bits)  # a kept value rounds to itself


def test_bf16_ties_round_to_even() -> None:
    halfway = np.array([0x3F808000, 0x3F818000], np.uint32).view(np.float32)  # 1.0 + half a bf16 step, and the next
    assert to_bf16(halfway).tolist() == [0x3F80, 0x3F82]  # down to the even 0x3F80, up to the even 0x3F82


def _crashed_copy(vi: VectorIndex, path: Path) -> VectorIndex:
    """A fresh index over ``vi``'s vectors (as a reopen after a crash has them), loading
    the graph cache at ``path``, adopted."""
    top = len(vi.vector_bytes()) // vi.row_bytes  # as a snapshot holds them (not every slot: the
    again = VectorIndex(16, exact_below=50, exact_threshold=20)  # matrix would not grow past them)
    again.load_vectors(vi.vector_bytes(), vi.alive[:top], vi.group[:top], "bf16")
    again.load_graph(path, "after a crash")
    assert again._adopt_loaded(wait=True)
    return again


def _save_due(vi: VectorIndex, path: Path, now: float = 0.0) -> list[int]:
    """Idle-time cache steps until none is due; the nodes each one saved."""
    saved = []
    while (nodes := vi.cache_step(path, "t", now)) and len(saved) < 10:
        saved.append(nodes)
    return saved


@pytest.fixture
def small_cache_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of 200 nodes: a save is due after 16 changes (256 by default)."""
    monkeypatch.setattr(vector_index, "CACHE_MIN_CHANGES", 16)


@pytest.mark.usefixtures("small_cache_steps")
def test_idle_time_caches_each_changed_graph_so_a_crash_keeps_it(tmp_path: Path) -> None:
    """A store never closed cleanly (a robot switched off at the plug) had no graph
    cache at all, and each crash left the whole graph to rebuild in idle time (221 s
    of CPU at 100k memories here).  Idle time now saves each group's graph once
    enough of it changed; after a crash only what changed since is inserted."""
    vi, vectors = filled()
    path = tmp_path / "g.hnsw"
    assert _save_due(vi, path) == []  # nothing inserted yet: nothing to save
    vi.maintain(budget=1000)
    assert _save_due(vi, path) == [200, 200, 200]  # one group a step
    changed = _changed_since_the_cache(vi, vectors)  # 2 removals, 22 new or moved: under 16 a group
    vi.maintain(budget=1000)
    assert _save_due(vi, path) == []
    again = _crashed_copy(vi, path)
    assert again.pending == changed
    assert_counts_consistent(again)
    again.flush()
    assert 7 not in again.search(vectors[7], 10)[0]
    assert all(again.search(again.rows(np.array([s]))[0], 1)[0][0] == s for s in np.flatnonzero(again.alive))


@pytest.mark.usefixtures("small_cache_steps")
def test_idle_saves_wait_for_pending_and_unmarked_nodes(tmp_path: Path) -> None:
    """A graph is saved only when it holds exactly the live nodes its list names:
    not while vectors wait to be inserted or deleted nodes wait to be marked."""
    vi, _ = filled()
    vi.maintain(budget=590)  # 10 still pending
    assert _save_due(vi, tmp_path / "g.hnsw") == []
    vi.maintain(budget=1000)
    vi.remove_many(np.arange(0, 60, 3))  # 20 of group 0, marked deleted later (settle)
    assert _save_due(vi, tmp_path / "g.hnsw") == []
    vi.settle()
    assert _save_due(vi, tmp_path / "g.hnsw") == [180, 200, 200]


@pytest.mark.usefixtures("small_cache_steps")
def test_a_group_saved_after_its_meta_was_not_kept_alone_is_rebuilt(tmp_path: Path) -> None:
    """A crash between an idle save's graph rename and its meta write leaves a graph
    its meta's checksum does not match: that group is rebuilt, the others kept (a
    group that failed used to throw the whole cache away)."""
    vi, vectors = filled()
    path = tmp_path / "g.hnsw"
    vi.maintain(budget=1000)
    _save_due(vi, path)
    meta_before = (tmp_path / "g.hnsw.meta").read_bytes()
    for slot in range(0, 90, 3):  # 30 changes to group 0
        vi.add(slot, -vectors[slot], group=0)
    vi.maintain(budget=1000)
    assert _save_due(vi, path) == [200]
    (tmp_path / "g.hnsw.meta").write_bytes(meta_before)  # the crash: the new graph, the old meta
    again = _crashed_copy(vi, path)
    assert sorted(again._graphs) == [1, 2]
    assert again.pending == set(np.flatnonzero(again.alive & (again.group == 0)).tolist())
    again.flush()
    assert all(again.search(again.rows(np.array([s]))[0], 1)[0][0] == s for s in range(0, 600, 7))


@pytest.mark.usefixtures("small_cache_steps")
def test_a_failed_idle_save_is_tried_again_later_not_at_every_step(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    vi, _ = filled()
    vi.maintain(budget=1000)
    path = tmp_path / "gone" / "g.hnsw"  # its folder does not exist: every save fails
    assert vi.cache_step(path, "t", 100.0) == 0
    assert "could not save the vector graph cache" in caplog.text
    caplog.clear()
    assert vi.cache_step(path, "t", 100.0 + vector_index.CACHE_RETRY_SECONDS / 2) == 0
    assert not caplog.text  # not tried: a failing disk is not hit every 50 ms
    path.parent.mkdir()
    assert vi.cache_step(path, "t", 101.0 + vector_index.CACHE_RETRY_SECONDS) == 200
    assert (tmp_path / "gone" / "g.hnsw.meta").exists()


@pytest.mark.parametrize(("changes", "due"), [
    (15, False),  # under CACHE_MIN_CHANGES (16 here)
    (16, True),  # CACHE_MIN_CHANGES, above a twentieth of 200
])
@pytest.mark.usefixtures("small_cache_steps")
def test_an_idle_save_is_due_after_enough_changes(tmp_path: Path, changes: int, due: bool) -> None:
    vi, _ = filled()
    path = tmp_path / "g.hnsw"
    vi.maintain(budget=1000)
    _save_due(vi, path)
    for slot in range(1, 1 + 3 * changes, 3):  # group 1: each forgotten slot is a node marked deleted
        vi.remove(slot)
    vi.settle()
    assert (vi.cache_step(path, "t", 0.0) == 200 - changes) is due


class _ShortSaving:
    """A graph whose file comes out short, as hnswlib leaves it on a full disk: it writes
    through a std::ofstream and never checks it, so save_index returns as if whole."""

    def __init__(self, graph: object) -> None:
        self._graph = graph

    def __getattr__(self, name: str) -> object:
        return getattr(self._graph, name)

    def save_index(self, path: str) -> None:
        self._graph.save_index(path)  # type: ignore[attr-defined]
        os.truncate(path, os.path.getsize(path) // 2)  # what fitted before the disk was full


@pytest.mark.parametrize("save", [
    "idle",  # cache_step, in idle time: tried again CACHE_RETRY_SECONDS later
    "close",  # save_graph, at a clean close or an explicit compaction
])
@pytest.mark.usefixtures("small_cache_steps")
def test_a_graph_written_short_by_a_full_disk_is_not_taken_for_saved(tmp_path: Path, save: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A full disk cut the graph file short without a word from hnswlib: it was checksummed
    as it was and renamed over the group's good cached graph (that group was rebuilt
    whole after the next crash), the save was counted as done (not tried again), and the
    short file kept the last of the disk's space, which the journal needs."""
    vi, _ = filled()
    path = tmp_path / "g.hnsw"
    vi.maintain(budget=1000)
    assert _save_due(vi, path) == [200, 200, 200]
    good = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for slot, vector in zip(range(600, 660, 3), unit(np.random.default_rng(9), 20), strict=True):
        vi.add(slot, vector, group=0)  # 20 new memories of group 0: due again
    vi.maintain(budget=1000)
    vi._graphs[0] = _ShortSaving(vi._graphs[0])  # type: ignore[assignment]
    if save == "idle":
        assert vi.cache_step(path, "t", 1000.0) == 0
        assert vi.cache_step(path, "t", 1001.0) == 0  # not hit again at once
    else:
        vi.save_graph(path, "t")
    assert "could not save the vector graph cache" in caplog.text
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == good  # the old cache whole, no temp file
    assert vi._changed[0] == 20  # still due
    again = _crashed_copy(vi, path)
    assert sorted(again._graphs) == [0, 1, 2]  # group 0's old graph: only the 20 new ones to insert
    assert again.pending == set(range(600, 660, 3))


@pytest.mark.parametrize(("damage", "kept"), [
    ("groups a list", []),  # a meta that decodes, in the wrong shape: read as no cache
    ("groups nil", []),
    ("nodes a list", []),  # was read by position, then the idle save's merge raised TypeError
    ("a group named by text", [0, 1, 2]),  # that entry is left out, the real groups kept
])
@pytest.mark.usefixtures("small_cache_steps")
def test_a_cache_meta_of_the_wrong_shape_is_not_a_crash(tmp_path: Path, damage: str, kept: list[int],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta has no checksum of its own: one that decodes to another shape raised
    TypeError out of the next idle save (through maintain: the daemon's engine thread
    died), and AttributeError or ValueError in the loader thread, losing every group."""
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    vi, _ = filled()
    path = tmp_path / "g.hnsw"
    vi.maintain(budget=1000)
    vi.save_graph(path, "t")
    meta = vector_index._read_meta(path)
    assert meta is not None
    groups = meta["groups"]
    meta.update({"groups a list": {"groups": list(groups.values())}, "groups nil": {"groups": None},
                 "nodes a list": {"nodes": list(meta["nodes"].values())},
                 "a group named by text": {"groups": {**groups, "x": 1}}}[damage])
    vector_index._write_meta(path, meta)
    again = _crashed_copy(vi, path)
    assert sorted(again._graphs) == kept and not died
    for slot, vector in zip(range(600, 660, 3), unit(np.random.default_rng(9), 20), strict=True):
        again.add(slot, vector, group=0)  # enough changes to group 0 for an idle save
    again.maintain(budget=1000)
    assert again.cache_step(path, "t", 0.0) > 0
    latest = _crashed_copy(again, path)
    others = set(np.flatnonzero(latest.alive & (latest.group != 0)).tolist())
    if kept:  # group 0 saved again, the others as they were
        assert sorted(latest._graphs) == [0, 1, 2] and not latest.pending
    else:  # one group a step: group 0 (220 new nodes) went first
        assert sorted(latest._graphs) == [0] and latest.pending == others
    assert_counts_consistent(latest)


def test_a_cached_graph_is_checked_in_pieces_not_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader read each cached graph whole to checksum it (55 MB of RSS for a graph
    of 33k vectors, at every open); it now reads it in pieces, and still adopts it."""
    vi, _ = filled()
    vi.flush()
    vi.save_graph(tmp_path / "g.hnsw", "t")
    reads: list[int] = []
    real_open = open

    def recording_open(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        fh = real_open(file, mode, *args, **kw)
        if "b" in mode and str(file).startswith(str(tmp_path / "g.hnsw.")):
            read = fh.read
            fh = _Recording(fh, lambda n=-1: reads.append(n) or read(n))
        return fh

    monkeypatch.setattr("builtins.open", recording_open)
    again = _crashed_copy(vi, tmp_path / "g.hnsw")
    assert sorted(again._graphs) == [0, 1, 2] and not again.pending
    assert reads and all(0 < n <= vector_index.CRC_STEP for n in reads)  # never "the rest, whole"


class _Recording:
    """A file whose read() is replaced (file objects' methods cannot be patched)."""

    def __init__(self, fh: Any, read: Callable[..., bytes]) -> None:
        self._fh, self.read = fh, read

    def __enter__(self) -> "_Recording":
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)
