"""Where the household page's memory lives: a store in this process or the daemon.

:class:`WebBackend` is the small interface the page needs; :class:`StoreBackend`
serves it from a :class:`~reachy_memory.MemoryStore` opened here (``--data-dir``),
:class:`ClientBackend` from the running daemon through a
:class:`~reachy_memory.MemoryClient` (``--endpoint``, or the configured one).  Both
go through the library's public calls only (every change through the store's one
commit funnel) and run one call at a time: the page's server answers on several
threads, a client's socket and the store's engine state want one.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from reachy_memory.config import Config
from reachy_memory.model import Memory, SearchResult
from reachy_memory.people.registry import Person

__all__ = ["EXPORT_PAGE", "ClientBackend", "StoreBackend", "WebBackend", "open_backend"]

EXPORT_PAGE = 500  # memories read per call while listing or exporting
SEARCH_MIN_SCORE = 0.2  # the search box: looser than the tools' default (a person browses, no model reads it)
T = TypeVar("T")


class WebBackend(Protocol):
    """What the page reads and changes. Every method raises ReachyMemoryError subclasses."""

    def people(self) -> list[Person]:
        """Every person the robot knows (all owners')."""
        ...

    def person_redirects(self) -> dict[str, str]:
        """Person ids merged away -> the live id (for the export)."""
        ...

    def memories(self) -> Iterator[list[Memory]]:
        """Every live memory, a page at a time (id order)."""
        ...

    def search(self, query: str, limit: int) -> list[SearchResult]:
        """The best matches of ``query`` among every memory, superseded ones included."""
        ...

    def forget(self, memory_id: str) -> bool:
        """Delete one memory; False when there is none."""
        ...

    def about_person(self, reference: str) -> dict[str, Any]:
        """Everything kept about one person (``MemoryStore.about_person``)."""
        ...

    def forget_person(self, reference: str, dry_run: bool) -> dict[str, Any]:
        """Forget a person and what is kept about them (``MemoryStore.forget_person``): the counts."""
        ...

    def remembering(self) -> dict[str, Any]:
        """Whether remembering is paused, and until when (``MemoryStore.remembering``)."""
        ...

    def pause(self, minutes: float) -> dict[str, Any]:
        """Pause remembering for ``minutes``; the new status."""
        ...

    def resume(self) -> dict[str, Any]:
        """Remember again; the new status."""
        ...

    def close(self) -> None:
        """Release what the backend opened."""
        ...


class _Serialized:
    """The calls shared by both backends: the library's API (store or client) one call at a time."""

    def __init__(self, api: Any) -> None:
        self._api = api
        self._lock = threading.Lock()

    def _one(self, call: Callable[[], T]) -> T:
        with self._lock:
            return call()

    def people(self) -> list[Person]:
        return self._one(lambda: list(self._api.people()))

    def person_redirects(self) -> dict[str, str]:
        return self._one(lambda: dict(self._api.person_redirects()))

    def memories(self) -> Iterator[list[Memory]]:
        cursor: str | None = None
        while True:
            page, cursor = self._one(functools.partial(self._api.export_page, cursor, EXPORT_PAGE))
            yield list(page)
            if cursor is None:
                return

    def search(self, query: str, limit: int) -> list[SearchResult]:
        return self._one(lambda: list(self._api.search(query, limit=limit, min_score=SEARCH_MIN_SCORE,
                                                                include_superseded=True)))

    def forget(self, memory_id: str) -> bool:
        return self._one(lambda: bool(self._api.forget(memory_id)))

    def about_person(self, reference: str) -> dict[str, Any]:
        return self._one(lambda: self._api.about_person(reference))  # type: ignore[no-any-return]

    def forget_person(self, reference: str, dry_run: bool) -> dict[str, Any]:
        return self._one(lambda: self._api.forget_person(reference, dry_run=dry_run))  # type: ignore[no-any-return]

    def pause(self, minutes: float) -> dict[str, Any]:
        return self._one(lambda: self._api.pause_remembering(minutes))  # type: ignore[no-any-return]

    def resume(self) -> dict[str, Any]:
        return self._one(lambda: self._api.resume_remembering())  # type: ignore[no-any-return]


class StoreBackend(_Serialized):
    """The page on a :class:`~reachy_memory.MemoryStore` in this process (closed with the backend)."""

    def __init__(self, store: Any, *, own: bool = True) -> None:
        super().__init__(store)
        self._own = own

    def remembering(self) -> dict[str, Any]:
        return self._one(lambda: self._api.remembering())  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._own:
            self._one(self._api.close)


class ClientBackend(_Serialized):
    """The page on the running daemon, through a :class:`~reachy_memory.MemoryClient`."""

    def __init__(self, client: Any, *, own: bool = True) -> None:
        super().__init__(client)
        self._own = own

    def remembering(self) -> dict[str, Any]:
        status = self._one(lambda: self._api.health()).get("remembering")
        # a daemon from before pausing: always remembering
        return status if isinstance(status, dict) else {"paused": False, "until": None, "seconds_left": 0.0}

    def close(self) -> None:
        if self._own:
            self._one(self._api.close)


def open_backend(config: Config, *, in_process: bool, endpoint: str | None = None,
                 timeout: float = 10.0) -> WebBackend:
    """The backend ``reachy-memory web`` serves: the store of ``config.data_dir`` opened here
    (``in_process``; StoreLockedError while a daemon holds it), else a client of the daemon at
    ``endpoint`` (else the configured one), which must answer a ping now
    (DaemonUnavailableError / RequestTimeoutError otherwise)."""
    if in_process:
        from reachy_memory.engine.store import MemoryStore

        return StoreBackend(MemoryStore(config=config))
    from reachy_memory.client import MemoryClient

    client = MemoryClient(endpoint, config=config, timeout=timeout)
    try:
        client.ping(timeout=min(timeout, 5.0))
    except BaseException:
        client.close()
        raise
    return ClientBackend(client)


def now() -> float:
    """The wall clock (one place for tests to reason about)."""
    return time.time()
