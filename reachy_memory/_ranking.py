"""Hybrid ranking as pure functions over the indexes (no state, no locks, no I/O).

The caller (the store, on the thread that owns the indexes) passes the indexes
in; nothing here changes them.  Scores: vector similarity is the cosine clipped
at 0; lexical relevance is BM25 divided by the query's ceiling; hybrid is their
weighted noisy-OR ``1 - (1 - cos)^(2w) (1 - lex)^(2(1 - w))`` with
``w = search.vector_weight``, plus ``search.entity_boost`` when the query names
the memory's speaker or person (``search.entity_fields``), capped at 1.
The store then adds its priors: time words (``temporal_boost``) and adjacent
turns among the best candidates (``neighbour_boost``, :func:`neighbour_bonus`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._filters import FieldIndex
from .lexical_index import LexicalIndex
from .vector_index import VectorIndex

EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.float64))
_WORDS = re.compile(r"\w+")


@dataclass(frozen=True)
class Indexes:
    """What ranking reads: the vector, lexical and metadata indexes."""

    vectors: VectorIndex
    lexical: LexicalIndex
    fields: FieldIndex


def rank(query: str, qvec: np.ndarray | None, mask: np.ndarray | None, limit: int, mode: str,
         groups: list[int] | None, *, indexes: Indexes, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """Candidate slots and their fused scores (unordered), for ``mode`` hybrid, vector or lexical."""
    n_cand = max(cfg.candidates, 4 * limit)
    vec_q = qvec if mode != "lexical" and indexes.vectors.count > 0 else None
    use_vec = vec_q is not None
    use_lex = mode != "vector" or not use_vec
    vec_slots = indexes.vectors.search(vec_q, n_cand, mask, groups)[0] if vec_q is not None else EMPTY[0]
    lex_slots, lex_scores = indexes.lexical.scores(query, mask) if use_lex else EMPTY
    lex_top = lex_slots[top_k(lex_scores, n_cand)]
    slots = np.unique(np.concatenate([vec_slots, lex_top]))
    if len(slots) == 0:
        return EMPTY
    cos = indexes.vectors.similarity(vec_q, slots) if vec_q is not None else np.zeros(len(slots), np.float32)
    bm25 = lookup(lex_slots, lex_scores, slots)
    scores = fuse(np.maximum(cos, 0.0), bm25, cfg, use_vec=use_vec, use_lex=use_lex)
    if mode == "hybrid":
        scores = np.minimum(scores + entity_bonus(query, slots, indexes.fields, cfg), 1.0)
    return slots, scores


def neighbour_bonus(scores: np.ndarray, ids: list[str], follows: list[str | None], weight: float) -> np.ndarray:
    """``weight`` x the best score among each hit's adjacent turns in the same list.

    ``follows[i]`` is the id of the turn hit ``i`` follows (``Record.follows``), so
    adjacency is known both ways without an index of successors.
    """
    where = {memory_id: i for i, memory_id in enumerate(ids)}
    best = np.zeros(len(scores))
    for i, before in enumerate(follows):
        j = where.get(before) if before is not None else None
        if j is not None:
            best[i] = max(best[i], scores[j])
            best[j] = max(best[j], scores[i])
    return weight * best


def entity_bonus(query: str, slots: np.ndarray, fields: FieldIndex, cfg: Any) -> np.ndarray:
    """``entity_boost`` for memories whose speaker/person the query names."""
    bonus = np.zeros(len(slots))
    if not cfg.entity_boost or not cfg.entity_fields:
        return bonus
    words = set(_WORDS.findall(query.lower()))
    for key in cfg.entity_fields:
        for value, holders in fields.string_values(key).items():
            if value and set(_WORDS.findall(value.lower())) <= words:
                bonus[np.isin(slots, np.fromiter(holders, np.int64, len(holders)))] = cfg.entity_boost
    return bonus


def fuse(cos: np.ndarray, lex: np.ndarray, cfg: Any, *, use_vec: bool, use_lex: bool) -> np.ndarray:
    """One score in [0, 1] from cosine and lexical coverage (see module docs).

    A memory strong on either signal scores high, so ``min_score`` keeps the
    meaning it has for plain cosine similarity.
    """
    if not use_vec:
        return lex
    if not use_lex:
        return cos.astype(np.float64)
    w = cfg.vector_weight
    miss_v = (1.0 - np.clip(cos, 0.0, 0.999)) ** (2 * w)
    miss_l = (1.0 - np.clip(lex, 0.0, 0.999)) ** (2 * (1 - w))
    return 1.0 - miss_v * miss_l


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``scores`` (unordered)."""
    if len(scores) <= k:
        return np.arange(len(scores))
    return np.argpartition(-scores, k - 1)[:k]


def lookup(keys: np.ndarray, values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``values`` at ``wanted`` keys (``keys`` sorted), 0 where absent."""
    out = np.zeros(len(wanted), np.float64)
    if len(keys) == 0:
        return out
    pos = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    hit = keys[pos] == wanted
    out[hit] = values[pos[hit]]
    return out
