"""Named notes (a memory kept and found by its name or aliases) and conversation archives.

:class:`Notes` writes through the engine's funnel; the names index is the engine
state's (``state.names``, owned by the state).  The module functions are the name
rules the facts and the importer share: :func:`note_holder`, :func:`name_fields`,
:func:`free_label`, :func:`note_labels`.  Owns no state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reachy_memory.engine.ports import Component, Engine
from reachy_memory.engine.records import Record
from reachy_memory.engine.state import MemoryState
from reachy_memory.errors import NotFoundError, ValidationError
from reachy_memory.model import Memory, MemoryType
from reachy_memory.people.checks import MAX_ALIASES, flat, label_arg, text_arg

ARCHIVE_MARKER = 120  # characters of the summary kept in the window's marker


class Notes(Component):
    """The note and archive operations of :class:`~reachy_memory.engine.store.MemoryStore`.

    ``correct`` is the facts' correction (:meth:`.facts.Facts.correct`): a rewritten
    note supersedes its old version as a corrected fact does."""

    def __init__(self, engine: Engine, correct: Callable[[str, str], Memory]) -> None:
        super().__init__(engine)
        self._correct = correct

    def note(self, name: str) -> Memory | None:
        """The live note with this name or alias (case-insensitive), or None."""
        self._engine.require_open()
        with self._lock:
            memory_id = note_holder(self._state, text_arg(name, "name"))
            return self._state.records[memory_id].memory() if memory_id else None

    def rename_note(self, name: str, new_name: str) -> Memory:
        """Give a note a new name (its words become searchable). Raises NotFoundError, ValidationError."""
        with self._lock:
            rec = self._require_note(name)
            taken = note_holder(self._state, label_arg(new_name))
            if taken is not None and taken != rec.id:
                raise ValidationError(f"the note name {new_name!r} is already used by memory {taken}", field="name")
            self._engine.commit([["update", rec.id, {"name": label_arg(new_name)}]])
            return self._state.records[rec.id].memory()

    def alias_note(self, name: str, alias: str) -> Memory:
        """Add an alias (resolution only, not searchable). Raises NotFoundError, ValidationError
        (the alias is a name or alias of a memory, this one's included)."""
        with self._lock:
            rec = self._require_note(name)
            if len(rec.aliases) >= MAX_ALIASES:
                raise ValidationError(f"a note has at most {MAX_ALIASES} aliases", field="alias")
            self._engine.commit([["update", rec.id, {"aliases": [*rec.aliases, free_label(self._state, alias)]}]])
            return self._state.records[rec.id].memory()

    def rewrite_note(self, name: str, content: str) -> Memory:
        """New content for a note; the old version stays in its history."""
        with self._lock:
            rec = self._require_note(name)
            return self._correct(rec.id, content)

    def remove_note(self, name: str) -> bool:
        """Forget a note by name or alias, and every earlier version of it (what it
        superseded, down the chain: a removed note's old contents must not linger,
        hidden, in exports and ``include_superseded`` results); False if there is none."""
        self._engine.require_open()
        with self._lock:
            memory_id = note_holder(self._state, text_arg(name, "name"))
            if memory_id is None:
                return False
            self._engine.commit([["del", i] for i in [memory_id, *self._earlier_versions(memory_id)]])
            return True

    def _earlier_versions(self, memory_id: str) -> list[str]:
        """The ids of the memories ``memory_id`` superseded, directly or down their chains."""
        replaced_by: dict[str, list[str]] = {}
        for rec in self._state.records.values():
            if rec.superseded_by is not None:
                replaced_by.setdefault(rec.superseded_by, []).append(rec.id)
        found, todo = [], list(replaced_by.get(memory_id, ()))
        while todo:
            old = todo.pop()
            if old != memory_id and old not in found:
                found.append(old)
                todo.extend(replaced_by.get(old, ()))
        return found

    def _require_note(self, name: str) -> Record:
        self._engine.require_open()
        memory_id = note_holder(self._state, text_arg(name, "name"))
        if memory_id is None:
            raise NotFoundError(f"no note named {name!r}", memory_id=name)
        return self._state.records[memory_id]

    def archive_conversation(self, summary: str, until: Any = None, name: str | None = None,
                             owner: str | None = None) -> Memory:
        """Record a summary (written by the app's LLM) of the conversation up to ``until``
        (default now) as an archive: a fact that never expires, searched like facts.
        A compact marker is appended to the context window."""
        self._engine.require_open()
        covers = _epoch_or_now(until)
        prepared = self._engine.prepare([{"content": summary, "memory_type": MemoryType.FACT,
                                  "metadata": {"archive": True}}])
        with self._lock:
            op = prepared.ops[0]
            row = dict(op[1]) | {"covers_until": covers, "owner": owner} | name_fields(self._state, name, ())
            marker = f"[archived conversation: {flat(summary)[:ARCHIVE_MARKER]}]"
            self._engine.commit([["put", row, op[2]], ["win", "system", marker, time.time()]])
            return self._state.records[row["id"]].memory()


def note_holder(state: MemoryState, label: str) -> str | None:
    """The id of the live memory named or aliased ``label`` (case-insensitive), or None.
    An expired note the hourly sweep has not deleted yet holds nothing: readers never
    see it (``get``), so its name must not answer nor stay taken until the sweep."""
    memory_id = state.names.get(label.casefold())
    rec = state.records.get(memory_id) if memory_id else None
    return memory_id if rec is not None and not rec.expired(time.time()) else None


def name_fields(state: MemoryState, name: str | None, aliases: Sequence[str]) -> dict[str, Any]:
    """The record fields of a note name and its aliases (none without either). Raises
    ValidationError: aliases without a name or not a list, a label taken by a memory."""
    if name is None and not aliases:
        return {}
    if name is None:
        raise ValidationError("aliases need a note name", field="aliases")
    if not isinstance(aliases, list | tuple) or len(aliases) > MAX_ALIASES:  # a string: its letters
        raise ValidationError(f"aliases must be a list of at most {MAX_ALIASES} names", field="aliases")
    return {"name": free_label(state, name), "aliases": [free_label(state, a) for a in aliases]}


def free_label(state: MemoryState, label: str) -> str:
    """``label`` as a note name or alias is kept; ValidationError if a memory holds it."""
    kept = label_arg(label)
    taken = note_holder(state, kept)
    if taken is not None:
        raise ValidationError(f"the note name or alias {label!r} is already used by memory {taken}",
                              field="name")
    return kept


def note_labels(memory: Mapping[str, Any]) -> list[str]:
    """A memory's note name and aliases (the strings among them), as its record keeps them."""
    aliases = memory.get("aliases")
    labels = [memory.get("name"), *(aliases if isinstance(aliases, list | tuple) else ())]
    return [label for label in labels if isinstance(label, str) and label]


def _epoch_or_now(value: Any) -> float:
    if value is None:
        return time.time()
    from reachy_memory.model import check_time, to_epoch

    epoch = to_epoch(value)
    checked = check_time(epoch, "until")
    assert checked is not None
    return checked
