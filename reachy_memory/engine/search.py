"""The search pipeline: checked arguments in, ranked results out.

See :mod:`.ranking` for the scores.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from reachy_memory.engine import dedupe, ingest, ranking
from reachy_memory.engine.records import Record
from reachy_memory.engine.state import GROUP
from reachy_memory.engine.temporal import query_window, window_bonus
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, MemoryType, SearchResult, to_epoch
from reachy_memory.people.subjects import about_ids, named_slots, subject_names

if TYPE_CHECKING:
    from reachy_memory.engine.core import Core


class Search:
    """Searches over a core's state."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               min_score: float = SEARCH_MIN_SCORE, where: dict[str, Any] | None = None, *,
               mode: str | None = None, now: Any = None, about: str | None = None,
               owner: str | None = None, include_superseded: bool = False) -> list[SearchResult]:
        """See :meth:`MemoryStore.search`."""
        self._core.require_open()
        mode = ingest.check_search(query, limit, min_score, mode, self._core.config)
        qvec = self._core.embed_query(query) if mode != "lexical" else None
        return self.search_vector(query, qvec, memory_type, limit, min_score, where, mode=mode, now=now,
                                  about=about, owner=owner, include_superseded=include_superseded)

    def search_vector(self, query: str, qvec: np.ndarray | None, memory_type: MemoryType | str | None = None,
                      limit: int = SEARCH_LIMIT, min_score: float = SEARCH_MIN_SCORE,
                      where: dict[str, Any] | None = None, *,
                      mode: str = "hybrid", now: Any = None, about: str | None = None,
                      owner: str | None = None, include_superseded: bool = False) -> list[SearchResult]:
        """:meth:`search` with the query already embedded (``qvec`` may be None)."""
        core = self._core
        core.require_open()
        state = core.state
        mtype = MemoryType.parse(memory_type).value if memory_type is not None else None
        at = _epoch(now)
        if owner is not None:
            ingest.check_str(owner, "owner")
        with core.lock:
            persons = about_ids(state.people, about, owner)
            mask = _both(state.fields.mask(mtype, where),
                         state.scope_mask(owner, persons, include_superseded, named_slots(state, persons)))
            slots, scores = self._rank(query, qvec, mask, limit, mode, mtype, at)
            diversity = core.config.search.diversity if mode == "hybrid" else 0.0
            want = max(2 * limit, ranking.MMR_POOL) if diversity else limit
            hits = self._best(slots, scores, min_score, want, at, include_superseded)
            if diversity and len(hits) > 2:
                pos = np.array([i for i, _ in hits])
                vectors = state.vectors.unit_rows(slots[pos])
                hits = [hits[k] for k in ranking.mmr_order(scores[pos], vectors, diversity, limit)]
            results = []
            for i, rec in hits[:limit]:
                results.append(SearchResult(rec.memory(), float(scores[i]), subject_names(state.people, rec, owner)))
                core.touch(rec, at)
            return results

    def _best(self, slots: np.ndarray, scores: np.ndarray, min_score: float, want: int, at: float,
              include_superseded: bool) -> list[tuple[int, Record]]:
        """(position in slots, record) of the best ``want`` hits to show, by score: live, not
        decayed (unless ``include_superseded``), and with ``memory.dedupe`` one hit for each
        normalized text of a fact or context memory (:func:`.dedupe.collapse_key`): the best
        scored, or a live one rather than a superseded copy."""
        core, state = self._core, self._core.state
        collapse = core.config.memory.dedupe
        hits: list[tuple[int, Record] | None] = []
        shown: dict[str, int] = {}  # normalized text -> its hit's position in hits
        count = 0
        for i in np.argsort(-scores, kind="stable"):
            if scores[i] < min_score:
                break
            rec = state.by_slot[int(slots[i])]
            if rec.expired(at) or (not include_superseded and core.decayed(rec, at)):
                continue
            key = dedupe.collapse_key(rec.content, rec.type) if collapse else None
            if key is not None and key in shown:
                first = hits[shown[key]]
                if first is None or not first[1].hidden or rec.hidden:
                    continue
                hits[shown[key]], count = None, count - 1  # a superseded copy gives way to the live memory
            if key is not None:
                shown[key] = len(hits)
            hits.append((int(i), rec))
            count += 1
            if count == want:
                break
        return [hit for hit in hits if hit is not None]

    def _rank(self, query: str, qvec: np.ndarray | None, mask: np.ndarray | None,
              limit: int, mode: str, mtype: str | None = None,
              now: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Candidate slots and their fused scores (unordered); see :mod:`.ranking`.
        With ``now``, a hybrid search adds ``search.temporal_boost`` to memories created
        inside the window the query's time words name (:mod:`.temporal`)."""
        cfg, state = self._core.config.search, self._core.state
        groups = [GROUP[mtype]] if mtype is not None else None

        def text(slot: int) -> str:  # for pseudo-relevance feedback; an expired hit lends nothing
            rec = state.by_slot[slot]
            return "" if now is not None and rec.expired(now) else rec.content

        slots, scores = ranking.rank(query, qvec, mask, limit, mode, groups, cfg=cfg,
                                     indexes=ranking.Indexes(state.vectors, state.lexical, state.fields, text))
        window = None
        if mode == "hybrid" and cfg.temporal_boost and now is not None and len(slots):
            window = query_window(query, now, self._core.tz)
        if window is not None:  # most queries name no time: no creation times gathered
            created = np.fromiter((state.by_slot[int(s)].created for s in slots), np.float64, len(slots))
            scores = np.minimum(scores + window_bonus(window, created, cfg.temporal_boost), 1.0)
        if mode == "hybrid" and cfg.neighbour_boost and len(slots) > 1:
            scores = self._with_neighbours(slots, scores)
        return slots, scores

    def _with_neighbours(self, slots: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """``scores`` plus the neighbour-turn prior over the best ``search.candidates``."""
        cfg, state = self._core.config.search, self._core.state
        pool = ranking.top_k(scores, cfg.candidates)
        recs = [state.by_slot[int(s)] for s in slots[pool]]
        bonus = ranking.neighbour_bonus(scores[pool], [r.id for r in recs], [r.follows for r in recs],
                                        cfg.neighbour_boost)
        out = scores.copy()
        out[pool] = np.minimum(out[pool] + bonus, 1.0)
        return out


def _both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """Two slot masks of possibly different lengths, ANDed (None: no restriction)."""
    if a is None or b is None:
        return b if a is None else a
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))) & np.pad(b, (0, n - len(b)))


def _epoch(now: Any) -> float:
    """``now`` (datetime, epoch or None for the current time) as epoch seconds."""
    at = to_epoch(now) if now is not None else None
    return time.time() if at is None else at
