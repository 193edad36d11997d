"""Hybrid ranking as pure functions over the indexes (no state, no locks, no I/O).

The search pipeline (:func:`.search.run`, on the thread that owns the indexes) passes
the indexes in; nothing here changes them.  Scores: vector similarity is the cosine clipped
at 0; lexical relevance is BM25 divided by the query's ceiling; hybrid is their
weighted noisy-OR ``1 - (1 - cos)^(2w) (1 - lex)^(2(1 - w))`` with
``w = search.vector_weight``, plus ``search.entity_boost`` when the query names
the memory's speaker or person (``search.entity_fields``), capped at 1.
With ``search.feedback_weight`` > 0 a hybrid search also runs a second,
pseudo-relevance-feedback pass (:func:`feedback_scores`): the words of the
best ``FEEDBACK_DOCS`` lexical hits that the query does not already hold
form a BM25 query of their own, its best matches join the candidates, and every
candidate gains ``feedback_weight`` x that relevance (capped at 1).
:func:`.search.run` then adds the priors: time words (``temporal_boost``) and adjacent
turns among the best candidates (``neighbour_boost``, :func:`neighbour_bonus`),
sorts by score and, with ``search.diversity`` > 0, re-orders the head of the list
by maximal marginal relevance (:func:`mmr_order`); scores are never changed by it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from reachy_memory.engine.filters import FieldIndex
from reachy_memory.engine.lexical_index import LexicalIndex
from reachy_memory.engine.vector_index import VectorIndex

EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.float64))
_WORDS = re.compile(r"\w+")
# Pseudo-relevance feedback: how many of the best lexical hits lend their words (RM3 uses a
# handful; conversation turns are short) and a bound on the expansion's length,
# which bounds the second pass's cost (one BM25 query of at most this many terms).
FEEDBACK_DOCS = 3
FEEDBACK_TERMS = 20
FEEDBACK_CHARS = 2000  # of each hit's text: a long memory (up to max_content_chars) costs no more
# Diversity (MMR) re-orders the best max(2 x limit, MMR_POOL) hits, no more.
MMR_POOL = 20


@dataclass(frozen=True)
class Indexes:
    """What ranking reads: the vector, lexical and metadata indexes."""

    vectors: VectorIndex
    lexical: LexicalIndex
    fields: FieldIndex
    # A slot's text for pseudo-relevance feedback ("" hides it); None: no feedback.
    text: Callable[[int], str] | None = None


def rank(query: str, qvec: np.ndarray | None, mask: np.ndarray | None, limit: int, mode: str,
         groups: list[int] | None, *, indexes: Indexes, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """Candidate slots and their fused scores (unordered), for ``mode`` hybrid, vector or lexical."""
    n_cand = max(cfg.candidates, 4 * limit)
    vec_q = qvec if mode != "lexical" and indexes.vectors.count > 0 else None
    use_vec = vec_q is not None
    use_lex = mode != "vector" or not use_vec
    vec_slots = indexes.vectors.search(vec_q, n_cand, mask, groups)[0] if vec_q is not None else EMPTY[0]
    lex_slots, lex_scores = indexes.lexical.scores(query, mask, cfg.bm25_b) if use_lex else EMPTY
    pools = [vec_slots, lex_slots[top_k(lex_scores, n_cand)]]
    feedback = EMPTY
    if mode == "hybrid" and cfg.feedback_weight and indexes.text is not None:
        best = top_k(lex_scores, FEEDBACK_DOCS)
        best = lex_slots[best[np.argsort(-lex_scores[best], kind="stable")]]
        feedback = feedback_scores(query, [indexes.text(int(s)) for s in best], mask, indexes.lexical, cfg.bm25_b)
        pools.append(feedback[0][top_k(feedback[1], n_cand)])  # turns only feedback finds are candidates too
    slots = np.unique(np.concatenate(pools))
    if len(slots) == 0:
        return EMPTY
    cos = indexes.vectors.similarity(vec_q, slots) if vec_q is not None else np.zeros(len(slots), np.float32)
    bm25 = lookup(lex_slots, lex_scores, slots)
    scores = fuse(np.maximum(cos, 0.0), bm25, cfg, use_vec=use_vec, use_lex=use_lex)
    if mode == "hybrid":
        bonus = entity_bonus(query, slots, indexes.fields, cfg) + cfg.feedback_weight * lookup(*feedback, slots)
        scores = np.minimum(scores + bonus, 1.0)
    return slots, scores


def feedback_scores(query: str, texts: list[str], mask: np.ndarray | None,
                    lexical: LexicalIndex, b: float) -> tuple[np.ndarray, np.ndarray]:
    """(sorted slots, relevance in [0, 1]) for the BM25 query made of the words of
    ``texts`` (the best lexical hits, best first) that the query lacks (:func:`expansion`).

    BM25's idf does the term weighting: words rare in the store (a place, a hobby)
    dominate the second pass, words every turn holds (a speaker's name) barely count.
    """
    words = expansion(query, texts, lexical.tokenizer.terms)
    return lexical.scores(" ".join(words), mask, b) if words else EMPTY


def expansion(query: str, texts: list[str], terms: Callable[[str], list[str]]) -> list[str]:
    """Distinct non-stopword words of ``texts`` (in order, at most ``FEEDBACK_TERMS``, read
    from the first ``FEEDBACK_CHARS`` of each) whose terms the query does not hold."""
    asked = set(terms(query))
    out: dict[str, None] = {}
    seen: set[str] = set()
    for word in (m.group() for text in texts for m in _WORDS.finditer(text[:FEEDBACK_CHARS].lower())):
        if word in seen:
            continue
        seen.add(word)
        stems = terms(word)
        if stems and asked.isdisjoint(stems):
            out[word] = None
            if len(out) == FEEDBACK_TERMS:
                break
    return list(out)


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


def mmr_order(scores: np.ndarray, vectors: np.ndarray, diversity: float, k: int) -> np.ndarray:
    """The first ``k`` positions of ``scores`` in maximal-marginal-relevance order
    (Carbonell & Goldstein 1998).

    Greedy: next = argmax over the rest of ``score_i - diversity x max_j cos(v_i, v_j)``
    over the positions j already taken, the cosine clipped at 0 (``vectors``: unit rows,
    a zero row where a memory has no vector, so it resembles nothing).  Ties go to the
    earlier position, so with ``diversity`` 0 the order is by score, stable.  Only the
    order is returned: the caller keeps each memory's own score.  The store passes its
    best hits already sorted by score (:meth:`MemoryStore.search_vector`), so only the
    head of its list is re-ordered and nothing ranked below that pool moves up.
    """
    sims = diversity * np.maximum(vectors @ vectors.T, 0.0)
    penalty, gain = np.zeros(len(scores)), scores.astype(np.float64)
    order: list[int] = []
    for _ in range(min(k, len(scores))):  # few numpy calls a step: ~50 us for 10 of 20
        order.append(int(gain.argmax()))
        np.maximum(penalty, sims[order[-1]], out=penalty)
        gain = scores - penalty
        gain[order] = -np.inf
    return np.array(order, np.int64)


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
