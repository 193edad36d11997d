"""Spec 000's ``MemoryManager``, as its code calls it: a drop-in for an agent loop.

The same constructor (``persist_path``, ``context_window_size``), the same async
data methods (``store``, ``search``, ``forget``, ``cleanup_expired``,
``remember_fact`` / ``remember_conversation`` with ``**metadata``,
``set_context``, ``get_context``) and the same *sync* context-window methods
(``add_to_context_window``, ``get_context_window``, ``clear_context_window``),
over an in-process :class:`~reachy_memory.MemoryStore` that owns the data
directory (a daemon serving the same directory refuses to start beside it, and
the reverse).  Everything else of the store (people, ``recall``, ``context_for``,
backups) is at :attr:`MemoryManager.memory_store`.

Differences from the spec's sketch, all on purpose: the window is persisted (a
restart mid-conversation keeps it; turns older than
``memory.context_window_max_age_minutes`` are not shown), ``set_context``
replaces the key's earlier value, and times are timezone-aware UTC.

Threads: the async methods run the store's calls on the default executor (the
store is thread-safe); the window methods run on the caller's thread (a journal
append for ``add_to_context_window``; reads take no lock).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reachy_memory.config import Config, load_config
from reachy_memory.engine.store import DEFAULT_EMBEDDER, MemoryStore
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, Memory, MemoryType, SearchResult, merged_metadata


async def _off_loop(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` on the default executor.  asyncio is imported here, not at the
    top: importing reachy_memory must not load it (~9 MB the daemon never uses)."""
    import asyncio

    return await asyncio.to_thread(call, *args)


class MemoryManager:
    """Spec 000's memory API over an in-process store.  Use as a (async) context
    manager or call :meth:`close`.  Raises what :class:`MemoryStore` raises
    (``StoreLockedError`` when another process holds the directory, ``ValidationError``
    for bad input)."""

    def __init__(self, persist_path: str | Path | None = None, context_window_size: int | None = None, *,
                 config: Config | None = None, embedder: Any = DEFAULT_EMBEDDER) -> None:
        """``persist_path`` and ``context_window_size`` default to the configuration's
        (``memory.path``, ``~/.reachy/memory``, and ``memory.context_window_size``, 5: the
        spec's defaults); ``config`` defaults to :func:`load_config`'s."""
        cfg = config or load_config()
        changes = {k: v for k, v in (("path", None if persist_path is None else str(persist_path)),
                                     ("context_window_size", context_window_size)) if v is not None}
        self.memory_store = MemoryStore(config=cfg.replace("memory", **changes) if changes else cfg,
                                        embedder=embedder)

    # -- core operations (async, as the spec's) ------------------------------------------------

    async def store(self, content: str, memory_type: MemoryType | str = MemoryType.FACT,
                    metadata: dict[str, Any] | None = None) -> Memory:
        """Store a memory; its expiry follows its type."""
        return await _off_loop(self.memory_store.store, content, memory_type, metadata)

    async def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
                     min_score: float = SEARCH_MIN_SCORE) -> list[SearchResult]:
        """Memories by meaning and by words, best first (scores in [0, 1])."""
        return await _off_loop(self.memory_store.search, query, memory_type, limit, min_score)

    async def forget(self, memory_id: str) -> bool:
        """Delete a memory; False when there was none with that id."""
        return await _off_loop(self.memory_store.forget, memory_id)

    async def cleanup_expired(self) -> int:
        """Delete the expired memories; how many went."""
        return await _off_loop(self.memory_store.cleanup_expired)

    # -- context window (sync, as the spec's) --------------------------------------------------

    def add_to_context_window(self, role: str, content: str) -> None:
        """Add a turn (the last ``context_window_size`` turns are kept)."""
        self.memory_store.add_to_context_window(role, content)

    def get_context_window(self) -> list[dict[str, Any]]:
        """Recent turns for the prompt, oldest first: role, content, timestamp."""
        return self.memory_store.get_context_window()

    def clear_context_window(self) -> None:
        """Empty the window (a new session)."""
        self.memory_store.clear_context_window()

    # -- convenience (async) -------------------------------------------------------------------

    async def remember_fact(self, content: str, metadata: dict[str, Any] | None = None, **fields: Any) -> Memory:
        """Store a permanent fact; metadata as the spec's keywords, a dict, or both."""
        return await self.store(content, MemoryType.FACT, merged_metadata(metadata, fields))

    async def remember_conversation(self, content: str, metadata: dict[str, Any] | None = None,
                                    **fields: Any) -> Memory:
        """Store a conversation memory (kept ``memory.conversation_ttl_days``); metadata as
        for :meth:`remember_fact`."""
        return await self.store(content, MemoryType.CONVERSATION, merged_metadata(metadata, fields))

    async def set_context(self, key: str, value: str) -> Memory:
        """Set named session context (expires at the end of the day)."""
        return await _off_loop(self.memory_store.set_context, key, value)

    async def get_context(self, key: str) -> str | None:
        """The live value of a context key, or None."""
        return await _off_loop(self.memory_store.get_context, key)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the store (compacts, releases the directory); idempotent."""
        self.memory_store.close()

    def __enter__(self) -> MemoryManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> MemoryManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await _off_loop(self.close)


__all__ = ["MemoryManager"]
