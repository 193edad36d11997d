"""The JSON Lines export: reading a file back for import, and sending it in pieces.

One line per exported person (``{"kind": "person", ...}``: :func:`person_entries`,
``Person.to_dict`` and the ids merged into the person, ``merged_ids``) or memory
(``Memory.to_dict``).  :func:`read_jsonl` checks every entry the way the
store's import will, before anything is sent, so a bad line anywhere is an error
naming the file and line and nothing is imported.  :func:`import_requests` cuts
the entries into requests bounded in rows and bytes: each is one short job for
the daemon (it embeds a request's memories at once) and within its message limit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ._people_ops import (
    check_import_memory,
    check_import_person,
    check_merged_ids,
    check_note_names,
    check_supersession,
)
from .config import Config
from .errors import ValidationError
from .people import Person

__all__ = ["ROWS_PER_REQUEST", "check_entries", "import_requests", "person_entries", "read_jsonl"]

ROWS_PER_REQUEST = 64  # memories per import request at most (short turns)
# Text per import request: the daemon embeds a request's memories in one job on its embed
# thread, and searches wait behind it (600 notes of 1,500 characters: searches during the
# import waited 0.26 s at most with 2 notes a request, 1.5 s with 8; 17 s with 200 before).
CHARS_PER_REQUEST = 4000


def person_entries(people: Iterable[Person], redirects: Mapping[str, str]) -> list[dict[str, Any]]:
    """Exported persons (both formats): ``Person.to_dict``, plus ``merged_ids`` (sorted) for
    a person others were merged into, from ``redirects`` (``person_redirects``: old id ->
    kept id), so that an import makes the old ids resolve to the person again."""
    merged: dict[str, list[str]] = {}
    for old, kept in sorted(redirects.items()):
        merged.setdefault(kept, []).append(old)
    return [p.to_dict() | ({"merged_ids": merged[p.id]} if p.id in merged else {}) for p in people]


def read_jsonl(path: Path, config: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(memories, people) of an exported file, each entry checked.

    Lines end at ``\\n`` only (a text may hold U+2028, which ``splitlines`` would cut
    at); a UTF-8 BOM and ``\\r\\n`` are accepted.  Raises ValidationError naming the
    file and line: not UTF-8, not JSON, not an exported entry, refused by import, or
    an id given twice with different fields; or naming the file, for supersession
    links that loop, a note name given to two memories, or a merged-away person id
    that is a person of the file or merged into two (``check_merged_ids``).
    """
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"{path}: not UTF-8 text (byte {exc.start})", field="file") from exc
    memories: list[dict[str, Any]] = []
    people: list[dict[str, Any]] = []
    seen: dict[tuple[bool, str], tuple[int, dict[str, Any]]] = {}
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            entry = _entry(f"{path.name} line {n}", line.removesuffix("\r"), config)
            _once(seen, n, entry, path.name)
            (people if entry.get("kind") == "person" else memories).append(entry)
    check_supersession(path.name, memories)
    check_note_names(path.name, memories)
    check_merged_ids(path.name, people)
    return memories, people


def check_entries(memories: list[dict[str, Any]], people: list[dict[str, Any]], source: str,
                  config: Config) -> None:
    """Check parsed entries (a markdown folder's) as import will, before any is sent;
    ValidationError naming ``source`` and the entry (a memory by its first words)."""
    for n, person in enumerate(people):
        check_import_person(f"{source}: person {person.get('name') or n!r}", person)
    for memory in memories:
        check_import_memory(f"{source}: memory {str(memory.get('content', ''))[:40]!r}", memory, config)
    check_supersession(source, memories)
    check_note_names(source, memories)
    check_merged_ids(source, people)


def _entry(where: str, line: str, config: Config) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:  # ValueError: a number of thousands of digits too
        raise ValidationError(f"{where}: not JSON ({str(exc)[:200]})", field="file") from exc
    if not isinstance(data, dict) or "id" not in data:
        raise ValidationError(f"{where}: not an exported memory or person", field="file")
    if data.get("kind") == "person":
        check_import_person(where, data)
    else:
        check_import_memory(where, data, config)
    return data


def _once(seen: dict[tuple[bool, str], tuple[int, dict[str, Any]]], n: int, entry: dict[str, Any],
          name: str) -> None:
    """Refuse an id given twice with different fields (one would silently win)."""
    key = (entry.get("kind") == "person", str(entry["id"]))
    before = seen.setdefault(key, (n, entry))
    if before[1] != entry:
        raise ValidationError(f"{name} line {n}: id {key[1]!r} is also on line {before[0]}, with other fields",
                              field="file")


def import_requests(memories: list[dict[str, Any]], people: list[dict[str, Any]], config: Config,
                    rows: int = ROWS_PER_REQUEST) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """(memories, people) per request: the persons first, then the memories oldest
    first (a conversation turn links to the turn before it as it is stored), each
    request at most ``rows`` memories (and ``memory.max_batch``), about
    :data:`CHARS_PER_REQUEST` characters of text to embed and half of
    ``server.max_message_bytes`` of JSON."""
    budget = config.server.max_message_bytes // 2
    for chunk in _pieces(people, budget, len(people) or 1, chars=None):
        yield [], chunk
    ordered = sorted(memories, key=lambda m: str(m.get("created_at", "")))
    limit = min(rows, config.memory.max_batch)
    yield from (([*chunk], []) for chunk in _pieces(ordered, budget, limit, chars=CHARS_PER_REQUEST))


def _pieces(entries: list[dict[str, Any]], budget: int, rows: int,
            chars: int | None) -> Iterator[list[dict[str, Any]]]:
    piece: list[dict[str, Any]] = []
    size = text = 0
    for entry in entries:
        cost, length = len(json.dumps(entry, ensure_ascii=False).encode()), len(str(entry.get("content", "")))
        if piece and (len(piece) >= rows or size + cost > budget or (chars and text + length > chars)):
            yield piece
            piece, size, text = [], 0, 0
        piece.append(entry)
        size, text = size + cost, text + length
    if piece:
        yield piece
