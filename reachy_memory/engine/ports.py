"""The narrow interface the engine hands its components: :class:`Engine`.

The people components (:mod:`reachy_memory.people`) and anything else built on the
engine get an :class:`Engine`, never the :class:`~reachy_memory.engine.store.MemoryStore`:
the state to read (under ``lock`` when iterating), the one commit funnel to change it,
the embedder, the write preparation and the search pipeline.  The store builds the one
implementation (:class:`~reachy_memory.engine.core.Core`) and passes it in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import tzinfo
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from reachy_memory.config import Config
    from reachy_memory.engine.dedupe import Limits
    from reachy_memory.engine.records import Record
    from reachy_memory.engine.search import SearchQuery
    from reachy_memory.engine.state import MemoryState
    from reachy_memory.model import MemoryType, SearchResult
    from reachy_memory.people.registry import PersonRegistry


@dataclass
class Prepared:
    """A validated, embedded write, ready to be committed.

    ``texts`` are what was embedded for each op; the commit re-embeds an op whose
    previous-turn text changed between prepare (embed thread) and commit (engine thread).
    """

    ops: list[list[Any]]
    ids: list[str]
    texts: list[str | None]
    held: tuple[str, dict[str, Any], str | None] | None = None  # a turn said while paused: text, metadata, owner


class Engine(Protocol):
    """What a component may use of the engine (see the module doc).

    ``state`` is read by single lookups from any thread, by iteration only under
    ``lock``; it changes only through :meth:`commit`.
    """

    @property
    def state(self) -> MemoryState: ...

    @property
    def lock(self) -> threading.RLock: ...

    @property
    def config(self) -> Config: ...

    @property
    def tz(self) -> tzinfo:
        """``memory.timezone``: the user's day."""
        ...

    @property
    def embedder(self) -> Any:
        """The embedder in use, or None (lexical-only)."""
        ...

    def require_open(self) -> None:
        """Raise ClosedError once the store is closed."""
        ...

    def commit(self, ops: list[Any], *, durable: bool = False) -> None:
        """Journal ``ops`` (lists; persons' as dicts) as one frame, then apply them to
        ``state``: the one mutation funnel."""
        ...

    def one_frame(self) -> AbstractContextManager[None]:
        """Every commit inside is applied at once and journaled with the others as one
        frame at the end: all or nothing (see :meth:`.core.Core.one_frame`)."""
        ...

    def embed(self, texts: list[str]) -> np.ndarray | None:
        """(n, dim) vectors, or None when the model failed or there is none (logged)."""
        ...

    def embed_query(self, query: str) -> np.ndarray | None:
        """The query's vector, or None when no model is usable (thread-safe)."""
        ...

    def stored_text(self, rec: Record) -> str:
        """What is embedded for a stored memory (a turn with the turn it follows)."""
        ...

    def decayed(self, rec: Record, now: float) -> bool:
        """Whether ``rec`` has decayed below ``decay.threshold`` at ``now``."""
        ...

    def dedupe_limits(self) -> Limits:
        """What the restatement check (:mod:`.dedupe`) reads of the configuration."""
        ...

    def prepare(self, items: Iterable[Mapping[str, Any]], now: float | None = None, *,
                imported: bool = False) -> Prepared:
        """Validate and embed a write without changing anything (thread-safe)."""
        ...

    def check_retries_still_stored(self, prepared: Prepared) -> None:
        """Raise NotFoundError when a retry's memory was forgotten since prepare."""
        ...

    def check_search(self, query: Any, memory_type: Any = None, limit: Any = ..., min_score: Any = ...,
                     where: Any = None, *, mode: Any = None, now: Any = None, about: Any = None, owner: Any = None,
                     include_superseded: Any = False) -> SearchQuery:
        """A search's arguments checked once, before anything is embedded (any thread)."""
        ...

    def search_checked(self, query: SearchQuery, qvec: np.ndarray | None) -> list[SearchResult]:
        """Rank a checked search (``qvec``: its query's vector, or None)."""
        ...

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = ...,
               min_score: float = ..., where: dict[str, Any] | None = None, *, mode: str | None = None,
               now: Any = None, about: str | None = None, owner: str | None = None,
               include_superseded: bool = False) -> list[SearchResult]:
        """Check, embed and search (see :meth:`MemoryStore.search`)."""
        ...

    def window(self) -> list[dict[str, Any]]:
        """The context window's recent messages (role, content, timestamp), oldest first."""
        ...


class Component:
    """What every component of the store holds: the engine it was handed, and short names
    for the parts of it they all read (the state, its lock, its person registry).  It owns
    no state of its own; a component adds only what it owns (written in its docstring)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def _state(self) -> MemoryState:
        return self._engine.state

    @property
    def _lock(self) -> threading.RLock:
        return self._engine.lock

    @property
    def _people(self) -> PersonRegistry:
        return self._engine.state.people
