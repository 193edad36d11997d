"""The search pipeline: :func:`check` the arguments once, then :func:`run` ranks.

:func:`check` refuses every malformed argument (query, memory type, limit,
min_score, mode, ``where``, ``now``, ``about``, ``owner``) before anything is
embedded, and returns a :class:`SearchQuery`; the daemon calls it on its embed thread,
before the query is embedded and queued for the engine.  :func:`run` is the one
function that ranks, under the store lock, changing nothing:

1. the slots it may return: the type and ``where`` mask (:mod:`.filters`), the owner,
   ``about`` and superseded scope (:meth:`.state.MemoryState.scope_mask`);
2. candidates and fused scores, the entity and feedback bonuses (:func:`.ranking.rank`);
3. the time-words bonus (``search.temporal_boost``, :mod:`.temporal`) and the
   neighbour-turn bonus (``search.neighbour_boost``, :func:`.ranking.neighbour_bonus`);
4. best first, down to ``min_score``, leaving out the expired and the decayed, and with
   ``memory.dedupe`` the copies of a fact or context memory shown already (:mod:`.dedupe`);
5. with ``search.diversity``, the head re-ordered by MMR (:func:`.ranking.mmr_order`);
6. results with the names of the persons each is about (:mod:`reachy_memory.people.subjects`).

The caller refreshes the decay clock of the facts returned (:meth:`.core.Core.touch_results`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import tzinfo
from typing import Any

import numpy as np

from reachy_memory.config import Config
from reachy_memory.engine import dedupe, ingest, ranking
from reachy_memory.engine.filters import check_where
from reachy_memory.engine.records import Record
from reachy_memory.engine.state import GROUP, MemoryState
from reachy_memory.engine.temporal import query_window, window_bonus
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, MemoryType, SearchResult, to_epoch
from reachy_memory.people.checks import text_arg
from reachy_memory.people.subjects import about_ids, named_slots, subject_names


@dataclass(frozen=True)
class SearchQuery:
    """A search's arguments, checked by :func:`check` (``memory_type`` as its value,
    ``now`` as epoch seconds or None for the time the search runs)."""

    text: str
    mode: str
    memory_type: str | None = None
    limit: int = SEARCH_LIMIT
    min_score: float = SEARCH_MIN_SCORE
    where: dict[str, Any] | None = None
    now: float | None = None
    about: str | None = None
    owner: str | None = None
    include_superseded: bool = False


def check(config: Config, query: Any, memory_type: Any = None, limit: Any = SEARCH_LIMIT,
          min_score: Any = SEARCH_MIN_SCORE, where: Any = None, *, mode: Any = None, now: Any = None,
          about: Any = None, owner: Any = None, include_superseded: Any = False) -> SearchQuery:
    """The arguments of a search, checked: raises ValidationError / TooLargeError naming the
    first one at fault.  ``mode`` None is ``search.mode``.  Touches no state: any thread."""
    mode = ingest.check_search(query, limit, min_score, mode, config)
    mtype = MemoryType.parse(memory_type).value if memory_type is not None else None
    where = check_where(where)
    at = to_epoch(now) if now is not None else None
    if owner is not None:
        ingest.check_str(owner, "owner")
    if about is not None:
        text_arg(about, "about")
    return SearchQuery(query, mode, mtype, limit, float(min_score), where, at, about, owner,
                       bool(include_superseded))


def run(q: SearchQuery, qvec: np.ndarray | None, state: MemoryState, config: Config, tz: tzinfo,
        at: float) -> list[SearchResult]:
    """The results of ``q`` (``qvec``: its vector, or None) at the time ``at``, best first
    (see the module doc).  Call it holding the store lock; it changes nothing."""
    persons = about_ids(state.people, q.about, q.owner)
    mask = _both(state.fields.mask(q.memory_type, q.where),
                 state.scope_mask(q.owner, persons, q.include_superseded, named_slots(state, persons)))
    slots, scores = _scored(q, qvec, mask, state, config, tz, at)
    diversity = config.search.diversity if q.mode == "hybrid" else 0.0
    want = max(2 * q.limit, ranking.MMR_POOL) if diversity else q.limit
    hits = _shown(q, slots, scores, state, config, at, want)
    if diversity and len(hits) > 2:
        pos = np.array([i for i, _ in hits])
        vectors = state.vectors.unit_rows(slots[pos])
        hits = [hits[k] for k in ranking.mmr_order(scores[pos], vectors, diversity, q.limit)]
    return [SearchResult(rec.memory(), float(scores[i]), subject_names(state.people, rec, q.owner))
            for i, rec in hits[:q.limit]]


def _scored(q: SearchQuery, qvec: np.ndarray | None, mask: np.ndarray | None, state: MemoryState,
            config: Config, tz: tzinfo, at: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidate slots and their scores with every bonus (unordered)."""
    cfg = config.search
    groups = [GROUP[q.memory_type]] if q.memory_type is not None else None

    def text(slot: int) -> str:  # for pseudo-relevance feedback; an expired hit lends nothing
        rec = state.by_slot[slot]
        return "" if rec.expired(at) else rec.content

    slots, scores = ranking.rank(q.text, qvec, mask, q.limit, q.mode, groups, cfg=cfg,
                                 indexes=ranking.Indexes(state.vectors, state.lexical, state.fields, text))
    hybrid = q.mode == "hybrid" and len(slots) > 0
    window = query_window(q.text, at, tz) if hybrid and cfg.temporal_boost else None
    if window is not None:  # most queries name no time: no creation times gathered
        created = np.fromiter((state.by_slot[int(s)].created for s in slots), np.float64, len(slots))
        scores = np.minimum(scores + window_bonus(window, created, cfg.temporal_boost), 1.0)
    if hybrid and cfg.neighbour_boost and len(slots) > 1:
        pool = ranking.top_k(scores, cfg.candidates)
        recs = [state.by_slot[int(s)] for s in slots[pool]]
        bonus = ranking.neighbour_bonus(scores[pool], [r.id for r in recs], [r.follows for r in recs],
                                        cfg.neighbour_boost)
        scores = scores.copy()
        scores[pool] = np.minimum(scores[pool] + bonus, 1.0)
    return slots, scores


def _shown(q: SearchQuery, slots: np.ndarray, scores: np.ndarray, state: MemoryState, config: Config,
           at: float, want: int) -> list[tuple[int, Record]]:
    """(position in ``slots``, record) of the best ``want`` hits at or above ``min_score``,
    best first: neither expired at ``at`` nor, unless ``include_superseded``, decayed; with
    ``memory.dedupe`` one hit for each normalized text of a fact or context memory
    (:func:`.dedupe.collapse_key`): the best scored, or a live one rather than a superseded copy."""
    collapse = config.memory.dedupe
    hits: list[tuple[int, Record] | None] = []
    shown: dict[str, int] = {}  # normalized text -> its hit's position in hits
    count = 0
    for i in np.argsort(-scores, kind="stable"):
        if scores[i] < q.min_score:
            break
        rec = state.by_slot[int(slots[i])]
        if rec.expired(at) or (not q.include_superseded and decayed(rec, at, config)):
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


def decayed(rec: Record, now: float, config: Config) -> bool:
    """Whether ``rec`` has decayed below ``decay.threshold`` at ``now`` (with decay on)."""
    decay = config.decay
    return decay.enabled and rec.decayed(now, decay.rate_per_day, decay.threshold)


def _both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """Two slot masks of possibly different lengths, ANDed (None: no restriction)."""
    if a is None or b is None:
        return b if a is None else a
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))) & np.pad(b, (0, n - len(b)))
