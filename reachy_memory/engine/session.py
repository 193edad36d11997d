"""The conversation's session: the context window and named context (:class:`Session`).

Owns no state: the window and the CONTEXT memories are the Core's state, written
through its funnel.  ``prepare_*`` run on any thread (the daemon's embed thread),
``commit_*`` on the engine thread.
"""

from __future__ import annotations

import time
from typing import Any

from reachy_memory.engine import ingest
from reachy_memory.engine.core import Core
from reachy_memory.engine.ports import Prepared
from reachy_memory.engine.retention import epoch
from reachy_memory.errors import ValidationError
from reachy_memory.model import Memory, MemoryType, merged_metadata


class Session:
    """Window turns, recorded turns and named context (see :class:`MemoryStore`'s methods)."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def add_to_context_window(self, role: str, content: str) -> None:
        """Append a turn to the persisted window (the last N turns, 2N messages)."""
        self._core.require_open()
        self._core.commit([_window_op(_role(role), ingest.validate_text(content, "content", self._core.config))])

    def prepare_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                     owner: str | None = None, id: str | None = None) -> Prepared:
        """The validated, embedded write of ``record_turn`` (thread-safe): a conversation turn,
        appended to the window and kept as a CONVERSATION memory (metadata ``role`` plus
        ``metadata``; ``owner``: the user whose turn it is), see :meth:`commit_turn`."""
        self._core.require_open()
        _role(role)  # before the embedding
        return self._core.prepare([{"content": content, "memory_type": MemoryType.CONVERSATION,
                                    "metadata": merged_metadata(metadata, {"role": role}), "owner": owner,
                                    "id": id}])

    def commit_turn(self, role: str, prepared: Prepared) -> Memory:
        """Commit a :meth:`prepare_turn` write and its window turn in one frame; a retry of
        a turn already kept (its id's memory: found by prepare, or committed since by the
        same request sent twice) commits nothing and returns that memory."""
        role = _role(role)
        with self._core.lock:
            kept = self._core.state.records.get(prepared.ids[0])
            if kept is not None and kept.metadata.get("role") != role:
                raise ValidationError(f"id {prepared.ids[0]!r} is already used by another memory", field="id")
            also = [_window_op(role, prepared.ops[0][1]["content"])] if kept is None and prepared.ops else []
            [memory] = self._core.commit_prepared(prepared, also=also)
            return memory

    def clear_context_window(self) -> None:
        """Empty the window (a new session)."""
        self._core.require_open()
        self._core.commit([["winclr"]])

    def prepare_context(self, key: str, value: str) -> Prepared:
        """The validated, embedded write of ``set_context`` (thread-safe)."""
        self._core.require_open()
        if not isinstance(key, str) or not 0 < len(key) <= 256:
            raise ValidationError("context key must be a non-empty string of at most 256 characters", field="key")
        return self._core.prepare([{"content": value, "memory_type": MemoryType.CONTEXT,
                                    "metadata": {"context_key": key}}])

    def commit_context(self, key: str, prepared: Prepared) -> Memory:
        """Commit a :meth:`prepare_context` write, dropping the key's earlier values."""
        core = self._core
        core.require_open()
        with core.lock:
            old = [["del", r.id] for r in core.state.context_records(key)]
            core.commit(old + prepared.ops)
            return core.state.records[prepared.ids[0]].memory()

    def get_context(self, key: str, *, now: Any = None) -> str | None:
        """The live value of named context ``key``, or None."""
        self._core.require_open()
        ingest.check_str(key, "key")
        at = epoch(now)
        live = [r for r in self._core.state.context_view.get(key, ()) if not r.expired(at)]  # no lock: the view
        return max(live, key=lambda r: r.created).content if live else None


def _role(role: Any) -> str:
    """A window turn's role, checked; ValidationError otherwise."""
    if not isinstance(role, str) or not 0 < len(role.strip()) <= 64:
        raise ValidationError("role must be a non-empty string of at most 64 characters", field="role")
    return role


def _window_op(role: str, content: str) -> list[Any]:
    """The journal op appending ``role: content`` to the window, now."""
    return ["win", role, content, time.time()]
