"""The conversation app's own memory file (``memory.v1.json``), read for ``reachy-memory import``.

Pollen's Reachy Mini conversation app keeps up to 60 short facts about its user in
``$XDG_DATA_HOME/reachy_mini_conversation_app/memory.v1.json`` (or ``memory.v1.json`` in the
app's instance directory)::

    {"version": 1, "facts": [{"id": "m_1767000000000_ab12cd", "text": "Has a dog named Mochi",
                              "createdAt": 1767000000000}, ...]}

``createdAt`` is in milliseconds since the epoch; the app writes the newest fact first.
:func:`read_app_memory` turns each fact into an import entry of this store: a ``fact`` with
the app's id and its ``createdAt``, so importing the file again finds every id present and
adds nothing. Every fact is checked first, and a malformed file is one error naming the
fact at fault: nothing of it is imported.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reachy_memory.config import Config
from reachy_memory.engine.ingest import check_id
from reachy_memory.errors import TooLargeError, ValidationError
from reachy_memory.storage.export import check_entries, strict_object

FILENAME = "memory.v1.json"
SOURCE = "reachy_mini_conversation_app"  # metadata.source of an imported fact
MAX_FILE_BYTES = 4 << 20  # the app writes at most 60 facts of 280 characters


def is_app_memory(path: Path) -> bool:
    """Whether ``path`` is a file holding one JSON object with a ``facts`` list (the app's
    format), as opposed to an export (one JSON object a line). Never raises."""
    try:
        with path.open("rb") as file:
            head = file.read(MAX_FILE_BYTES + 1)
        if len(head) > MAX_FILE_BYTES:
            return False
        data = json.loads(head.decode("utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return path.name == FILENAME  # read_app_memory says what is wrong with it
    return isinstance(data, dict) and "facts" in data


def read_app_memory(path: Path, config: Config) -> list[dict[str, Any]]:
    """The facts of the app's memory file at ``path`` as import entries (oldest first), each
    checked as import will check it. Raises ValidationError (a malformed file or fact, named),
    TooLargeError (a file far larger than the app writes), OSError (unreadable)."""
    raw = path.read_bytes()
    if len(raw) > MAX_FILE_BYTES:
        raise TooLargeError(f"{path}: {len(raw)} bytes, more than a conversation-app memory file can be",
                            field="file", size=len(raw), limit=MAX_FILE_BYTES)
    try:
        data = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=strict_object)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValidationError(f"{path}: not JSON ({str(exc)[:200]})", field="file") from exc
    if not isinstance(data, dict) or not isinstance(data.get("facts"), list):
        raise ValidationError(f"{path}: not a conversation-app memory file (a JSON object with a 'facts' list)",
                              field="file")
    if data.get("version") != 1 or isinstance(data.get("version"), bool):
        raise ValidationError(f"{path}: memory file version {data.get('version')!r}; this import reads version 1",
                              field="file")
    entries, seen = [], set()
    for n, fact in enumerate(data["facts"], start=1):
        entry = _entry(f"{path}: fact {n}", fact)
        if entry["id"] in seen:
            raise ValidationError(f"{path}: fact {n}: id {entry['id']!r} appears twice", field="id")
        seen.add(entry["id"])
        entries.append(entry)
    entries.reverse()  # the app writes the newest first
    check_entries(entries, [], str(path), config)
    return entries


def _entry(where: str, fact: Any) -> dict[str, Any]:
    """One app fact as an import entry; ValidationError starting with ``where``."""
    if not isinstance(fact, dict):
        raise ValidationError(f"{where}: not an object with id, text and createdAt", field="facts")
    unknown = sorted(set(fact) - {"id", "text", "createdAt"})
    if unknown:  # a later format: refuse rather than drop what it holds
        raise ValidationError(f"{where}: fields this import does not know: {', '.join(map(repr, unknown[:5]))}",
                              field="facts")
    fact_id, text, created = fact.get("id"), fact.get("text"), fact.get("createdAt")
    if not isinstance(fact_id, str) or not fact_id.strip():
        raise ValidationError(f"{where}: id must be a non-empty string, got {fact_id!r}", field="id")
    try:  # as a new memory's id: a model must be able to copy it back (memory_forget)
        check_id(fact_id)
    except ValidationError as exc:
        raise ValidationError(f"{where}: {exc.message}", **exc.fields) from exc
    if not isinstance(text, str) or not text.strip():
        raise ValidationError(f"{where}: text must be a non-empty string, got {text!r}"[:300], field="text")
    if isinstance(created, bool) or not isinstance(created, int | float) or not math.isfinite(created) \
            or created <= 0:
        raise ValidationError(f"{where}: createdAt must be milliseconds since 1970, got {created!r}",
                              field="createdAt")
    try:
        when = datetime.fromtimestamp(created / 1000, UTC)
    except (OverflowError, OSError, ValueError) as exc:
        raise ValidationError(f"{where}: createdAt {created!r} is not a time", field="createdAt") from exc
    return {"id": fact_id, "content": " ".join(text.split()), "type": "fact", "created_at": when.isoformat(),
            "metadata": {"source": SOURCE}}


__all__ = ["FILENAME", "SOURCE", "is_app_memory", "read_app_memory"]
