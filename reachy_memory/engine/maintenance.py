"""Idle-time upkeep and the reindex: :class:`Maintenance`.

Owns nothing but its schedule: the work it does is on the Core's state (pending
vectors, buried deletions, the graph cache), its backfill queue and its decay clock
refreshes, all through the Core's funnel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import numpy as np

from reachy_memory.engine import ingest
from reachy_memory.engine.backfill import lacking_vector
from reachy_memory.engine.core import Core
from reachy_memory.engine.records import Record, encode
from reachy_memory.errors import ModelError, ReachyMemoryError
from reachy_memory.model import MemoryType
from reachy_memory.storage.files import GRAPH_FILE

log = logging.getLogger(__name__)

TOUCH_FLUSH_SECONDS = 60.0  # decay clock refreshes are journaled at most this often (and on close)
BACKFILL_STEP_SECONDS = 0.004  # one idle step of embedding memories that lack a vector: like an index step


class Maintenance:
    """What the daemon runs between requests (:meth:`maintain`) and ``reindex``."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def maintain(self, budget: int = 256, *, save_cache: bool = True) -> int:
        """Idle-time upkeep (the daemon calls it between requests): finishes a step of
        a mass expiry's index work (:meth:`MemoryState.bury`), inserts a batch of pending
        vectors into the graph, and journals the decay clock refreshes at most once a
        minute; with none of that left, embeds memories that have no vector (a few
        milliseconds' worth, see :mod:`.backfill`), then reads the words of 8 x ``budget``
        kept memories for the write check's filter (once after opening), and then, when ``save_cache``,
        saves one memory type's vector graph to the graph cache if enough of it changed
        since it was cached (a crash then leaves little to insert again; up to ~80 ms
        for a graph of 33k vectors: the daemon asks for it only after some quiet).
        Returns how much it did (vectors inserted, deletions buried, graph nodes marked,
        memories embedded, memories read, graph nodes saved): 0 when nothing is left, or nothing can
        be done yet.  At most once a second it also checks that the data directory and the
        journal are still the ones opened: when they were removed or replaced, the store
        refuses writes from then on (``read_only`` names why; ``health`` says
        ``read_only``), and makes the journal head's last reach durable."""
        core = self._core
        core.require_open()
        with core.lock:
            core.storage.check_files(idle=True)
            if core.touched and time.monotonic() - core.touches_flushed > TOUCH_FLUSH_SECONDS:
                core.flush_touches()
            left = core.state.bury(0)  # how much deletion work waits (none is done by 0)
            buried = left - core.state.bury(budget)
            done = buried + core.state.vectors.maintain(budget)
            return done or self.backfill_step() or self._told_step(8 * budget) or (
                self._cache_step() if save_cache else 0)

    def _told_step(self, budget: int) -> int:
        """Read up to ``budget`` kept memories' words into the write check's filter
        (:class:`.dedupe.Told`: once after opening, ~20 us a memory)."""
        core = self._core
        return core.told.build(core.state.records.values(), budget) if core.told is not None else 0

    def _cache_step(self) -> int:
        """Save one graph to the cache when it is due (:meth:`VectorIndex.cache_step`)."""
        storage = self._core.storage
        if storage.closing:
            return 0  # the closing compaction saves them all
        return self._core.state.vectors.cache_step(self._core.path / GRAPH_FILE, storage.graph_tag(),
                                                   time.monotonic())

    def backfill_step(self, seconds: float = BACKFILL_STEP_SECONDS) -> int:
        """Embed queued memories one at a time for about ``seconds`` (at least one),
        committing their vectors in frames of ``COMMIT_EVERY``; returns how many it embedded.
        Nothing while the journal refuses writes (each vector would be thrown away)."""
        core = self._core
        backfill = core.backfill
        if core.embedder is None or core.storage.failure or not backfill.ready():
            return 0
        key, count = core.state.current_key, 0
        until = time.monotonic() + seconds
        while (rec := backfill.take(core.state.records, key)) is not None:
            vector = core.embed([core.stored_text(rec)])
            if vector is None:
                backfill.put_back(rec)  # the model failed (logged): paused, tried again later
                break
            backfill.hold(rec, vector[0].tobytes())
            count += 1
            if time.monotonic() >= until:
                break
        if backfill.due():
            self._commit_backfill(key)
        return count

    def _commit_backfill(self, key: str | None) -> None:
        backfill = self._core.backfill
        ops = backfill.drain(self._core.state.records, key)
        if not ops:
            return
        try:
            self._core.commit(ops)
        except ReachyMemoryError:
            backfill.failed(ops)  # queued again (paused): not lost until the next open
            raise
        backfill.committed(ops)
        if not len(backfill):
            log.info("embedded the %d memories that had no vector", backfill.embedded)

    def reindex(self, progress: Callable[[int, int], None] | None = None, batch: int = 64) -> int:
        """Re-embed every memory whose vector is not from the current model.

        Each batch is committed on its own, so an interrupted reindex resumes
        where it stopped. Returns how many memories were re-embedded.
        Raises ModelError when there is no usable model.
        """
        core = self._core
        core.require_open()
        if core.embedder is None:
            raise ModelError("reindex needs an embedding model; run 'reachy-memory model fetch'")
        with core.lock:  # the records are read whole: no write may change them meanwhile
            key = core.state.current_key
            todo = lacking_vector(core.state.records.values(), key)
            previous = self._turns_followed(todo)
        for done in range(0, len(todo), batch):
            self.reembed(todo[done : done + batch], previous)
            if progress:
                progress(min(done + batch, len(todo)), len(todo))
        if core.state.model_key != key:
            core.commit([["model", key]])
        with core.lock:
            core.backfill.plan(core.state.records.values(), key)  # what is left: nothing, or written meanwhile
        return len(todo)

    def _turns_followed(self, recs: list[Record]) -> dict[str, Record | None]:
        """The turn each of ``recs`` is embedded with by a reindex: :meth:`Core.turn_before`, with
        the turn stored just before for a turn stored before turns recorded what they
        follow (the backfill has no such fallback).  Under the lock."""
        unlinked = any(r.follows is None and r.type == MemoryType.CONVERSATION.value for r in recs)
        pairwise = self._core.state.previous_turns() if unlinked else None  # sorts every turn: only when needed
        return {r.id: self._core.turn_before(r, pairwise) for r in recs}

    def reembed(self, recs: list[Record], previous: Mapping[str, Record | None]) -> None:
        """Embed ``recs`` again (each with the turn ``previous`` gives it) and commit the vectors
        of those unchanged meanwhile.  Raises ModelError when the model fails."""
        core = self._core
        vectors = core.embed([ingest.context_text(r, previous.get(r.id), core.config) for r in recs])
        if vectors is None:
            raise ModelError("the embedding model failed during reindex; nothing was lost, run it again")
        key = core.state.current_key
        with core.lock:  # one forgotten or changed meanwhile is left as it now is (a rerun embeds a changed one)
            ops = [["put", encode(rec.replace(vkey=key)), vec.astype(np.float32).tobytes()]
                   for rec, vec in zip(recs, vectors, strict=True) if core.state.records.get(rec.id) is rec]
            if ops:
                core.commit(ops)
