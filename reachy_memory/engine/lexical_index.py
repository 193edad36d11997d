"""Incremental BM25 index over memory contents.

Text is lower-cased, split on Unicode word characters (CJK runs into single
characters), English stopwords are dropped and the rest stemmed (Snowball).
A document may carry a second field, the text of the conversation turn it
follows, whose words each count ``previous_weight`` of one of its own in the
term frequencies; the document's length is its own words'.
Postings are copy-on-write: loaded from a snapshot as numpy arrays, turned into
a dict only for the terms a change touches, so neither opening nor adding or
removing a memory rebuilds the index.  Removal is a tombstone (``doc_len`` 0);
the stale postings of a slot are purged when the slot is reused or at the next
snapshot.
"""

from __future__ import annotations

import math
import re
import threading
from array import array
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import snowballstemmer

from reachy_memory.config import SearchConfig

_WORD = re.compile(r"\w+", re.UNICODE)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
STOPWORDS = frozenset(
    """
    a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has
    have having he her here hers herself him himself his how i if in into is it its itself just me
    more most my myself no nor not now of off on once only or other our ours ourselves out over own
    same she should so some such than that the their theirs them themselves then there these they
    this those through to too under until up very was we were what when where which while who whom
    why will with would you your yours yourself yourselves s t d ll m re ve y don didn doesn isn
    wasn aren weren hasn haven hadn won wouldn shouldn couldn mustn let us also
    """.split()
)
K1 = 1.2
B = SearchConfig.bm25_b  # length normalisation's default; the store passes search.bm25_b
PREVIOUS_WEIGHT = SearchConfig.previous_turn_weight  # the default; the store passes its configured one
_NO_SLOTS = np.zeros(0, np.int64)
_NO_TFS = np.zeros(0, np.float32)


# Words the stem cache holds before it starts afresh: ~90 bytes each, so 4.5 MB at
# most.  It was 200k (18 MB), and a daemon storing text with numbers in it
# ("topic 4711") filled it at 0.44 MB/min under tools/bench_daemon.py's load:
# all of that run's RSS creep.  A household's words fit many times over.
STEM_CACHE_SIZE = 50_000


class Tokenizer:
    """Text -> BM25 terms, with a bounded stem cache (stemming dominates cost).
    Thread-safe: the engine and a background compaction share one."""

    def __init__(self, cache_size: int = STEM_CACHE_SIZE) -> None:
        self._stemmer = snowballstemmer.stemmer("english")
        self._stemming = threading.Lock()
        self._cache: dict[str, str] = {}
        self._cache_size = cache_size

    def terms(self, text: str) -> list[str]:
        """The stemmed, stopword-free terms of ``text`` in order."""
        out: list[str] = []
        for word in _WORD.findall(text.lower()):
            if _CJK.search(word):
                out.extend(ch for ch in word if not ch.isspace())
            elif word not in STOPWORDS:
                out.append(self._stem(word))
        return out

    def _stem(self, word: str) -> str:
        if word.isascii() and word.isdigit():
            return word  # Snowball leaves numbers as they are: neither stemmed nor cached
        stem = self._cache.get(word)
        if stem is None:
            with self._stemming:  # the Snowball stemmer keeps the word it works on in itself
                stem = self._stemmer.stemWord(word)
            if len(self._cache) >= self._cache_size:
                self._cache.clear()  # bounded memory beats a perfect LRU here
            self._cache[word] = stem
        return stem


class _Posting:
    """Slots holding a term and their term frequencies: two arrays, plus the changes
    made since they were built (``slot -> tf``, 0 for a removal), merged in when the
    posting is next read.  Only the changes are Python objects: a dict of every entry
    (the way before) cost ~70 bytes an entry, 4.4 MB of a 10k-memory daemon's heap
    after 2,000 stores had turned 405 postings into dicts."""

    __slots__ = ("changes", "slots", "tfs")

    def __init__(self, arrays: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        slots, tfs = arrays if arrays is not None else (_NO_SLOTS, _NO_TFS)
        self.slots: np.ndarray = slots
        self.tfs: np.ndarray = tfs
        self.changes: dict[int, float] = {}

    def set(self, slot: int, tf: float) -> None:
        """``slot`` holds the term ``tf`` times (0: not at all)."""
        self.changes[slot] = tf

    def empty(self) -> bool:
        """True when no slot holds the term (cheap: decided without merging when possible)."""
        if len(self.slots) > len(self.changes) or any(self.changes.values()):
            return False
        return len(self.readable()[0]) == 0

    def readable(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, term frequencies) with every change merged in."""
        if self.changes:
            changed = np.fromiter(self.changes, np.int64, len(self.changes))
            counts = np.fromiter(self.changes.values(), np.float32, len(self.changes))
            keep = ~np.isin(self.slots, changed)
            self.slots = np.concatenate([self.slots[keep], changed[counts > 0]])
            self.tfs = np.concatenate([self.tfs[keep], counts[counts > 0]])
            self.changes = {}
        return self.slots, self.tfs


class LexicalIndex:
    """BM25 over slots; the caller owns slot allocation.  ``previous_weight`` is what a
    word of a document's previous-turn field counts (fixed for the index's life)."""

    def __init__(self, tokenizer: Tokenizer | None = None, previous_weight: float = PREVIOUS_WEIGHT) -> None:
        self.tokenizer = tokenizer or Tokenizer()
        self.previous_weight = previous_weight
        self._postings: dict[str, _Posting] = {}
        self._doc_len = np.zeros(0, np.float32)
        self._stale: dict[int, str] = {}
        self.n_docs = 0
        self._total_len = 0.0

    @property
    def term_count(self) -> int:
        """How many distinct terms have postings (stale ones included until purged)."""
        return len(self._postings)

    def _grow(self, slot: int) -> None:
        if slot >= len(self._doc_len):
            size = max(slot + 1, len(self._doc_len) * 2, 1024)
            grown = np.zeros(size, np.float32)
            grown[: len(self._doc_len)] = self._doc_len
            self._doc_len = grown

    def add(self, slot: int, text: str, previous: str | None = None) -> None:
        """Index ``text`` under ``slot`` (which must be free), with the words of
        ``previous`` (the turn it follows) at ``previous_weight`` each."""
        self._grow(slot)
        if slot in self._stale:
            self._purge(slot, self._stale.pop(slot))
        tfs, length = _frequencies(self.tokenizer, text, previous, self.previous_weight)
        for term, tf in tfs.items():
            posting = self._postings.get(term)
            if posting is None:
                posting = self._postings[term] = _Posting()
            posting.set(slot, tf)
        self._doc_len[slot] = length
        self.n_docs += 1
        self._total_len += float(self._doc_len[slot])

    def remove(self, slot: int, text: str, previous: str | None = None) -> None:
        """Tombstone ``slot`` (``text`` and ``previous`` as added); its postings are purged lazily."""
        if slot >= len(self._doc_len) or self._doc_len[slot] == 0:
            return
        self.n_docs -= 1
        self._total_len -= float(self._doc_len[slot])
        self._doc_len[slot] = 0
        self._stale[slot] = _both(text, previous)

    def hide(self, slots: np.ndarray) -> None:
        """:meth:`remove` for many slots at once (a mass expiry), without their texts:
        each is passed later to :meth:`bury`, before the slot is reused."""
        slots = slots[slots < len(self._doc_len)]
        lengths = self._doc_len[slots]
        self.n_docs -= int(np.count_nonzero(lengths))
        self._total_len -= float(lengths.sum(dtype=np.float64))
        self._doc_len[slots] = 0

    def bury(self, slot: int, text: str, previous: str | None = None) -> None:
        """The texts of a slot of :meth:`hide` (as added): its postings are purged lazily."""
        self._stale[slot] = _both(text, previous)

    def _purge(self, slot: int, text: str) -> None:
        for term in set(self.tokenizer.terms(text)):
            posting = self._postings.get(term)
            if posting is not None:
                posting.set(slot, 0)
                if posting.empty():
                    del self._postings[term]

    def held_by(self, term: str) -> int:
        """About how many slots hold ``term`` (a stemmed term): at least as many as do (its
        changes not yet merged are counted, not read)."""
        posting = self._postings.get(term)
        return 0 if posting is None else len(posting.slots) + len(posting.changes)

    def holders(self, term: str) -> np.ndarray:
        """The live slots holding ``term`` (a stemmed term)."""
        posting = self._postings.get(term)
        if posting is None:
            return _NO_SLOTS
        slots = posting.readable()[0]
        return slots[self._doc_len[slots] > 0]

    def scores(self, query: str, mask: np.ndarray | None = None, b: float = B) -> tuple[np.ndarray, np.ndarray]:
        """(sorted slots, relevance in [0, 1]) for live slots matching a query term and ``mask``.

        Relevance is BM25 divided by the query's ceiling, the score of a
        document holding every query term with saturated frequency, so it reads
        as "how much of the query this memory covers", comparable across stores.
        """
        empty = (np.zeros(0, np.int64), np.zeros(0, np.float64))
        terms = set(self.tokenizer.terms(query))
        if not terms or self.n_docs == 0:
            return empty
        avg = self._total_len / self.n_docs
        ceiling = 0.0
        idx_parts, w_parts = [], []
        for term in terms:
            posting = self._postings.get(term)
            slots, tfs = posting.readable() if posting is not None else (_NO_SLOTS, _NO_TFS)
            dl = self._doc_len[slots]
            df = int(np.count_nonzero(dl > 0))
            idf = math.log(1.0 + (self.n_docs - df + 0.5) / (df + 0.5))
            ceiling += idf * (K1 + 1)
            live = dl > 0 if mask is None else (dl > 0) & _take(mask, slots)
            if live.any():
                tf, dl = tfs[live], dl[live]
                idx_parts.append(slots[live])
                w_parts.append(idf * tf * (K1 + 1) / (tf + K1 * (1 - b + b * dl / avg)))
        if not idx_parts:
            return empty
        # A dense accumulator is linear; np.unique would sort every posting.
        sums = np.bincount(np.concatenate(idx_parts), weights=np.concatenate(w_parts), minlength=len(self._doc_len))
        slots = np.flatnonzero(sums != 0)  # on a bool array: 0.07 ms at 100k slots, 0.39 ms on the floats
        return slots, sums[slots] / ceiling

    def state(self) -> dict[str, Any]:
        """A msgpack-able snapshot of the index (stale postings purged).  Term
        frequencies are float32 (``terms_f32``): a previous turn's words count fractions."""
        for slot, text in list(self._stale.items()):
            self._purge(slot, text)
        self._stale.clear()
        terms = {}
        for term, posting in self._postings.items():
            slots, tfs = posting.readable()
            if len(slots):  # a term whose last holder went, not yet dropped (see _Posting.empty)
                terms[term] = [slots.astype(np.int32).tobytes(), tfs.astype(np.float32).tobytes()]
        return {"terms_f32": terms, "doc_len": self._doc_len.tobytes(), "n": self.n_docs,
                "previous_weight": self.previous_weight}

    def load_state(self, state: dict[str, Any]) -> bool:
        """Restore from :meth:`state` output without re-tokenising anything.  Returns
        False (and loads nothing) when the state was built with another
        ``previous_weight``: the caller re-adds its documents instead.  A state from
        before previous-turn fields (uint16 ``terms``) holds none, so any weight fits."""
        if "terms_f32" in state and state.get("previous_weight") != self.previous_weight:
            return False
        self._doc_len = np.frombuffer(state["doc_len"], np.float32).copy()
        self.n_docs = int(state["n"])
        self._total_len = float(self._doc_len.sum())
        terms, tf_type = (state["terms_f32"], np.float32) if "terms_f32" in state else (state["terms"], np.uint16)
        self._postings = {
            term: _Posting((np.frombuffer(s, np.int32).astype(np.int64), np.frombuffer(t, tf_type).astype(np.float32)))
            for term, (s, t) in terms.items()
        }
        return True


def _frequencies(tokenizer: Tokenizer, text: str, previous: str | None,
                 previous_weight: float) -> tuple[dict[str, float], int]:
    """(term -> frequency, document length) of a document: its own words count 1 each,
    the words of ``previous`` ``previous_weight`` each.  The previous turn lends words,
    not length: its length would bury a short answer's own words under a long
    question's.  An all-stopword text still counts as a (length 1) document."""
    terms = tokenizer.terms(text)
    tfs: dict[str, float] = dict(Counter(terms))
    for term in tokenizer.terms(previous) if previous and previous_weight else ():
        tfs[term] = tfs.get(term, 0.0) + previous_weight
    return tfs, max(len(terms), 1)


def index_state(docs: Iterable[tuple[int, str, str | None]], tokenizer: Tokenizer,
                previous_weight: float) -> dict[str, Any]:
    """The :meth:`LexicalIndex.state` of an index of ``docs`` ((slot, text, previous
    text), distinct slots), built in flat arrays: no posting objects and no entry
    dicts, which a background compaction's full rebuild made by the hundred thousand
    beside the engine's live objects (the heap they fragmented stayed resident).
    Loads into the index :meth:`LexicalIndex.add` would build (same postings, in
    the order of ``docs``; ``doc_len`` may be sized differently past the last slot)."""
    vocabulary: dict[str, int] = {}
    term_ids, slots, tfs = array("i"), array("i"), array("f")
    doc_slots, lengths = array("i"), array("f")
    for slot, text, previous in docs:
        counts, length = _frequencies(tokenizer, text, previous, previous_weight)
        for term, tf in counts.items():
            term_ids.append(vocabulary.setdefault(term, len(vocabulary)))
            slots.append(slot)
            tfs.append(tf)
        doc_slots.append(slot)
        lengths.append(length)
    doc_len = np.zeros(max(max(doc_slots, default=-1) + 1, 1024), np.float32)
    doc_len[np.frombuffer(doc_slots, np.int32)] = np.frombuffer(lengths, np.float32)
    return {"terms_f32": _postings_of(vocabulary, term_ids, slots, tfs), "doc_len": doc_len.tobytes(),
            "n": len(doc_slots), "previous_weight": previous_weight}


def _postings_of(vocabulary: dict[str, int], term_ids: array, slots: array, tfs: array) -> dict[str, list[bytes]]:
    """term -> [int32 slots, float32 frequencies] from parallel (term id, slot, tf) arrays,
    each posting in the arrays' order."""
    ids = np.frombuffer(term_ids, np.int32)
    order = np.argsort(ids, kind="stable")
    slot_bytes, tf_bytes = np.frombuffer(slots, np.int32)[order], np.frombuffer(tfs, np.float32)[order]
    ends = np.cumsum(np.bincount(ids, minlength=len(vocabulary)))
    starts = ends - np.bincount(ids, minlength=len(vocabulary))
    return {term: [slot_bytes[starts[i]:ends[i]].tobytes(), tf_bytes[starts[i]:ends[i]].tobytes()]
            for term, i in vocabulary.items()}


def _both(text: str, previous: str | None) -> str:
    """One text holding the words of both fields (what a purge must find)."""
    return f"{text}\n{previous}" if previous else text


def _take(mask: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``mask[slots]``, False for slots beyond the mask."""
    inside = slots < len(mask)
    out = np.zeros(len(slots), bool)
    out[inside] = mask[slots[inside]]
    return out
