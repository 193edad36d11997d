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
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from reachy_memory.config import Config
from reachy_memory.errors import TooLargeError, ValidationError
from reachy_memory.people.importer import (
    check_import_memory,
    check_import_person,
    check_merged_ids,
    check_note_names,
    check_supersession,
)
from reachy_memory.people.registry import Person

__all__ = ["ROWS_PER_REQUEST", "check_entries", "import_requests", "max_line_bytes", "person_entries",
           "read_jsonl", "strict_object"]

ROWS_PER_REQUEST = 64  # memories per import request at most (short turns)
# Text per import request: the daemon embeds a request's memories in one job on its embed
# thread, and searches wait behind it (600 notes of 1,500 characters: searches during the
# import waited 0.26 s at most with 2 notes a request, 1.5 s with 8; 17 s with 200 before).
CHARS_PER_REQUEST = 4000
LINE_SLACK = 1 << 20  # bytes of a line beyond its text and metadata (ids, times, names, subjects)
_MEMORY_FIELDS = frozenset({"id", "content", "type", "created_at", "expires_at", "metadata", "subjects", "owner",
                            "shared", "name", "aliases", "superseded_at", "superseded_by", "protected",
                            "covers_until"})  # Memory.to_dict
_PERSON_FIELDS = frozenset({"kind", "id", "name", "relation", "aliases", "owner", "external_id", "metadata",
                            "created_at", "updated_at", "merged_ids"})  # person_entries


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
    at); a UTF-8 BOM and ``\\r\\n`` are accepted.  The file is read a line at a time, each
    at most :func:`max_line_bytes` (memory stays bounded by the file's entries, not by
    one line of a gigabyte).  Raises ValidationError naming the file and line: not
    UTF-8, not JSON, a key given twice in one object, a field no export writes, not an
    exported entry, refused by import, or an id given twice with different fields
    (TooLargeError: a line over the limit); or naming the file, for supersession links
    that loop, a note name given to two memories, or a merged-away person id that is a
    person of the file or merged into two (``check_merged_ids``).  A memory about a
    person its owner may not see is the store's to judge (its link left out and
    reported at import: ``commit_import``).
    """
    memories: list[dict[str, Any]] = []
    people: list[dict[str, Any]] = []
    seen: dict[tuple[bool, str], tuple[int, dict[str, Any]]] = {}
    with open(path, "rb") as file:
        for n, line in enumerate(_lines(file, path.name, max_line_bytes(config)), 1):
            if line.strip():
                entry = _entry(f"{path.name} line {n}", line.removesuffix("\n").removesuffix("\r"), config)
                _once(seen, n, entry, path.name)
                (people if entry.get("kind") == "person" else memories).append(entry)
    check_supersession(path.name, memories)
    check_note_names(path.name, memories)
    check_merged_ids(path.name, people)
    return memories, people


def max_line_bytes(config: Config) -> int:
    """The longest line an exported entry can take: its text at ``memory.max_content_chars``
    of 12 bytes each (an astral character written as two ``\\u`` escapes), its metadata
    at 8 bytes a packed byte, and :data:`LINE_SLACK` for the other fields."""
    return 12 * config.memory.max_content_chars + 8 * config.memory.max_metadata_bytes + LINE_SLACK


def _lines(file: BinaryIO, name: str, limit: int) -> Iterator[str]:
    """The lines of ``file`` (split at ``\\n``, kept), decoded, a UTF-8 BOM dropped from the
    first.  Raises TooLargeError for a line over ``limit`` bytes (before reading the rest of
    it) and ValidationError for one that is not UTF-8, each naming ``name`` and the line."""
    for n, raw in enumerate(iter(lambda: file.readline(limit + 2), b""), 1):
        if len(raw.rstrip(b"\r\n")) > limit:
            raise TooLargeError(f"{name} line {n}: longer than {limit} bytes, more than an exported entry can be",
                                field="file", size=len(raw), limit=limit)
        try:
            yield raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError(f"{name} line {n}: not UTF-8 text (byte {exc.start})", field="file") from exc


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
    """One line's entry, checked as import will check it. Raises ValidationError
    starting with ``where``."""
    try:
        data = _DECODER.decode(line)
    except (ValueError, RecursionError) as exc:  # ValueError: a number of thousands of digits too
        raise ValidationError(f"{where}: not JSON ({str(exc)[:200]})", field="file") from exc
    if not isinstance(data, dict) or "id" not in data:
        raise ValidationError(f"{where}: not an exported memory or person", field="file")
    unknown = sorted(set(data) - (_PERSON_FIELDS if data.get("kind") == "person" else _MEMORY_FIELDS))
    if unknown:  # silently dropped, they would be lost; sent, they could overflow a request
        raise ValidationError(f"{where}: fields no export writes: {', '.join(map(repr, unknown[:5]))}",
                              field="file")
    if data.get("kind") == "person":
        check_import_person(where, data)
    else:
        check_import_memory(where, data, config)
    return data


def strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, unless a key is given twice (json.loads would keep the last silently,
    another reader the first). Raises ValueError naming the key."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        twice = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"the key {twice!r} is given twice in one object")
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=strict_object)


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
