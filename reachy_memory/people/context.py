"""One-call prompt context: :class:`Context` (``context_for``).

Owns the token counter of the model in use (the embedder's own tokenizer, or an
estimate in lexical-only mode), made again when the engine's embedder changes (a
model adopted after the store opened).  Reads everything else through the engine:
three searches with one query vector, the context window and the known persons.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from reachy_memory.engine import dedupe, ingest
from reachy_memory.engine.context_text import (
    ContextItem,
    CountTokens,
    RetrievedContext,
    Turn,
    approximate_tokens,
    build_context,
    check_limits,
    token_counter,
    tokenizer_path,
)
from reachy_memory.engine.ports import Engine
from reachy_memory.errors import ReachyMemoryError
from reachy_memory.model import MemoryType, SearchResult
from reachy_memory.people.persons import Persons

log = logging.getLogger(__name__)


class Context:
    """``context_for`` of :class:`~reachy_memory.engine.store.MemoryStore` (see the module doc)."""

    def __init__(self, engine: Engine, persons: Persons) -> None:
        self._engine = engine
        self._persons = persons
        self._counter: tuple[Any, CountTokens] | None = None  # (the embedder it counts for, the counter)

    def context_for(self, message: str, owner: str | None = None, max_tokens: int = 800, max_memories: int = 10,
                    max_messages: int = 5, min_similarity: float = 0.3) -> RetrievedContext:
        """Everything a prompt needs about ``message``: the window, relevant past messages
        (above ``min_similarity``), relevant memories, known people, and ``.text`` with
        source and subject attribution, cut to ``max_tokens`` (the embedder's tokens)."""
        engine = self._engine
        engine.require_open()
        ingest.validate_text(message, "message", engine.config)
        check_limits(max_tokens, max_memories, max_messages, min_similarity)  # all checked before the embedding
        facts_query = engine.check_search(message, MemoryType.FACT, min(max(max_memories, 1), 1000), 0.0,
                                          mode="hybrid", owner=owner)  # one check and one embedding, three searches
        qvec = engine.embed_query(message)
        facts = engine.search_checked(facts_query, qvec)
        context = engine.search_checked(replace(facts_query, memory_type=MemoryType.CONTEXT.value), qvec)
        turns = replace(facts_query, memory_type=MemoryType.CONVERSATION.value,
                        limit=min(max(max_messages * 2, 1), 1000))
        past = engine.search_checked(turns, qvec)
        window = [Turn(t["role"], t["content"]) for t in engine.window()]
        found = dedupe.unique_hits(facts + context) if engine.config.memory.dedupe else facts + context
        return build_context(window=window, messages=[_item(h) for h in past],
                             memories=[_item(h) for h in found], people=self._persons.people(owner),
                             count_tokens=self.token_counter(), max_tokens=max_tokens, max_memories=max_memories,
                             max_messages=max_messages, min_similarity=min_similarity,
                             tz=engine.tz)  # dated as the user's day, not UTC's

    def token_counter(self) -> CountTokens:
        """The embedder's own tokenizer, or an estimate in lexical-only mode."""
        embedder = self._engine.embedder
        if self._counter is None or self._counter[0] is not embedder:
            count: CountTokens = approximate_tokens
            if embedder is not None:
                try:
                    count = token_counter(tokenizer_path(self._engine.config))
                except ReachyMemoryError as exc:
                    log.warning("counting prompt tokens approximately: %s", exc)
            self._counter = (embedder, count)
        return self._counter[1]


def _item(hit: SearchResult) -> ContextItem:
    m = hit.memory
    kind = "archive" if m.is_archive else m.memory_type.value
    role = m.metadata.get("role") if isinstance(m.metadata.get("role"), str) else None
    return ContextItem(m.content, kind, m.created_at, hit.score, hit.subject_names, m.id, role)
