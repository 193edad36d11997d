"""The conversation's session: the context window and named context (:class:`Session`).

Owns no state: the window and the CONTEXT memories are the Core's state, written
through its funnel.  ``prepare_*`` run on any thread (the daemon's embed thread),
``commit_*`` on the engine thread.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from reachy_memory.engine import ingest
from reachy_memory.engine.core import Core
from reachy_memory.engine.ports import Prepared
from reachy_memory.engine.retention import epoch
from reachy_memory.errors import ValidationError
from reachy_memory.model import Memory, MemoryType, merged_metadata, to_datetime


class Session:
    """Window turns, recorded turns and named context (see :class:`MemoryStore`'s methods)."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def add_to_context_window(self, role: str, content: str) -> None:
        """Append a turn to the persisted window (the last N turns, 2N messages); while
        remembering is paused, to the window held in memory only."""
        self._core.require_open()
        op = _window_op(_role(role), ingest.validate_text(content, "content", self._core.config))
        with self._core.lock:
            if self._core.remembering.paused:
                self._core.remembering.add_turn(op[1], op[2])
                return
            self._core.commit([op])

    def prepare_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                     owner: str | None = None, id: str | None = None) -> Prepared:
        """The validated, embedded write of ``record_turn`` (thread-safe): a conversation turn,
        appended to the window and kept as a CONVERSATION memory (metadata ``role`` plus
        ``metadata``; ``owner``: the user whose turn it is), see :meth:`commit_turn`."""
        self._core.require_open()
        _role(role)  # before the embedding
        if self._core.remembering.paused:  # held in memory only: checked, never embedded
            return _held(content, metadata, owner, id, self._core)
        return self._core.prepare([{"content": content, "memory_type": MemoryType.CONVERSATION,
                                    "metadata": merged_metadata(metadata, {"role": role}), "owner": owner,
                                    "id": id}])

    def commit_turn(self, role: str, prepared: Prepared) -> Memory:
        """Commit a :meth:`prepare_turn` write and its window turn in one frame; a retry of
        a turn already kept (its id's memory: found by prepare, or committed since by the
        same request sent twice) commits nothing and returns that memory."""
        role = _role(role)
        with self._core.lock:
            if self._core.remembering.paused:
                return self._hold(role, prepared)
            if prepared.held is not None:  # the pause ended meanwhile: kept, as any turn
                content, metadata, owner = prepared.held
                prepared = self.prepare_turn(role, content, metadata or None, owner=owner, id=prepared.ids[0])
            kept = self._core.state.records.get(prepared.ids[0])
            if kept is not None and kept.metadata.get("role") != role:
                raise ValidationError(f"id {prepared.ids[0]!r} is already used by another memory", field="id")
            also = [_window_op(role, prepared.ops[0][1]["content"])] if kept is None and prepared.ops else []
            [memory] = self._core.commit_prepared(prepared, also=also)
            return memory

    def _hold(self, role: str, prepared: Prepared) -> Memory:
        """A turn said while paused: into the window held in memory only, never journaled;
        returns the turn as it would have been kept (``get`` finds nothing under its id)."""
        if prepared.held is not None:
            content, metadata, _ = prepared.held
        else:  # prepared before the pause began: its text and metadata from the write
            row = prepared.ops[0][1]
            content, metadata = row["content"], dict(row.get("metadata") or {})
        self._core.remembering.add_turn(role, content)
        return Memory(prepared.ids[0], content, MemoryType.CONVERSATION, to_datetime(time.time()),
                      merged_metadata(metadata, {"role": role}))

    def clear_context_window(self) -> None:
        """Empty the window (a new session), the turns held while paused too."""
        self._core.require_open()
        with self._core.lock:
            self._core.remembering.clear()
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


def _held(content: str, metadata: dict[str, Any] | None, owner: str | None, memory_id: str | None,
          core: Core) -> Prepared:
    """The write of a turn said while paused: checked as any turn, never embedded."""
    text = ingest.validate_text(content, "content", core.config)
    if metadata is not None and not isinstance(metadata, dict):
        raise ValidationError("metadata must be a dict", field="metadata")
    if memory_id is not None:
        ingest.check_str(memory_id, "id")
    return Prepared([], [memory_id or uuid.uuid4().hex], [None], held=(text, dict(metadata or {}), owner))


def _role(role: Any) -> str:
    """A window turn's role, checked; ValidationError otherwise."""
    if not isinstance(role, str) or not 0 < len(role.strip()) <= 64:
        raise ValidationError("role must be a non-empty string of at most 64 characters", field="role")
    return role


def _window_op(role: str, content: str) -> list[Any]:
    """The journal op appending ``role: content`` to the window, now."""
    return ["win", role, content, time.time()]
