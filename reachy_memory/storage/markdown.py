"""Human-readable export and import as a folder of markdown files (spec 003).

Layout (``render``)::

    people/<name>.md    front matter (the person, and the ids merged into it) + "- fact" lines about them
    world.md            facts about nobody in particular, archives
    notes/<name>.md     one named note: front matter (name, aliases, rm) + its text as written
    daily/<date>.md     conversation turns and context of that day (UTC): "- HH:MM [type] text"

Every line written by ``render`` ends with an HTML comment, ``<!-- rm {...} -->``,
holding the memory's other fields as JSON (id, times, subjects, names,
supersession links), so ``parse(render(m, p))`` gives back exactly ``m`` and
``p`` (tested with hypothesis).  Superseded facts are shown struck through.
Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` only (never at U+2028, U+2029 or U+0085,
which the writer escapes besides); a note's body is kept byte for byte.

Files a person writes by hand need no comments: a person file's front matter
makes a person and its list items facts about them; world items are facts;
daily items ("- 14:05 user: text", "- [context] text" or "- text") are
conversation turns of that day; a note file is a named note.  A list item is a
line starting with ``- ``, ``* ``, ``+ `` or ``1. `` / ``1) `` (or the marker and a
tab) at the left margin; indented lines, other lines and fenced code blocks are
ignored.  Hand-written records get ids derived from where they are and what
they say (the file's path, the person, the item's text), so importing an
unchanged folder again adds nothing while an edited item imports as a new record.
Front matter text fields (id, name, relation, owner, external_id, aliases,
merged_ids) are taken as written (``name: yes`` is the name "yes", ``aliases:
Annie`` one alias).  Other front matter keys (an Obsidian vault's ``tags``,
``cssclasses``, ``created``...) are left out and reported (``parse``'s ``ignored``),
their values checked as ours are first; a note without a ``name`` (or without front
matter) is named by its file, as Obsidian names it; a daily or world file may start
with front matter, which is skipped the same way.  A person's ``merged_ids`` (written only when there are some)
are the person ids merged into it: an import makes them resolve to it again.
Files and folders whose names start with "." are skipped, as are files outside
``people/``, ``notes/``, ``daily/`` and ``world.md``.

Bad input (broken front matter or a YAML alias in a key left out, an impossible time, a wrong type, a file over
the size limit, non-UTF-8, a path leaving the folder, a symlink, a file that is
not a regular file) is a :class:`ValidationError` naming the file (and line),
raised before anything is imported; every record returned has been checked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import unicodedata
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from reachy_memory.engine.filters import validate_metadata
from reachy_memory.errors import ValidationError
from reachy_memory.model import MemoryType, check_time, check_unicode
from reachy_memory.people.importer import merged_ids_of
from reachy_memory.people.notes import note_labels
from reachy_memory.people.registry import check_metadata, person_from_op
from reachy_memory.storage.export import strict_object

MAX_FILES = 10_000
MAX_FILE_BYTES = 4 << 20
MAX_TOTAL_BYTES = 256 << 20
MAX_DEPTH = 32
_COMMENT_START = re.compile(r"\s*<!-- rm (?=\{)")
_COMMENT_END = re.compile(r"\}\s*-->\s*$")
_STAMP = re.compile(r"^\d{2}:\d{2} \[\w+\] ")  # what render puts before a daily line's text
_DAILY = re.compile(r"^(?:(\d{1,2}):(\d{2})\s+)?(?:\[(\w+)\]\s+)?(?:(user|assistant|system):\s+)?(.*)$",
                    re.IGNORECASE | re.DOTALL)
_DAY_FILE = re.compile(r"^daily/(\d{4}-\d{2}-\d{2})\.md$", re.IGNORECASE)
_LINE_END = re.compile(r"\r\n|\r|\n")
_RAW_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")
_ITEM = re.compile(r"^(?:[-*+]|\d{1,9}[.)])[ \t]+")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# Also "<": a text holding "<!-- rm {" must not look like the start of the comment.
_UNSAFE = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085", "<": "\\u003c"})
_PERSON_KEYS = ("id", "name", "relation", "aliases", "owner", "external_id", "metadata", "created_at", "updated_at")
_PERSON_FRONT = (*_PERSON_KEYS, "merged_ids")  # merged_ids: only when the person has some
_LIST_KEYS = frozenset({"aliases", "merged_ids"})  # lists of text, each item as written
_NOTE_KEYS = ("name", "aliases", "rm")
_TEXT_KEYS = frozenset({"id", "name", "relation", "owner", "external_id"})
_MEMORY_KEYS = frozenset({"id", "content", "type", "created_at", "expires_at", "metadata", "subjects", "owner",
                          "shared", "name", "aliases", "superseded_at", "superseded_by", "protected", "covers_until"})
_HAND_IDS = uuid.UUID("6f1c0a52-3d4e-4b7a-9c1e-2b8d5e7f9a10")  # the namespace of hand-written records' ids


class _Bad(Exception):
    """A fault in one file, at ``line`` (None: the file as a whole)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


# -- render ------------------------------------------------------------------------------------

def render(memories: list[dict[str, Any]], people: list[dict[str, Any]]) -> dict[str, str]:
    """The files (relative path -> text) of ``memories`` (``Memory.to_dict`` shapes)
    and ``people`` (``Person.to_dict`` shapes, with ``merged_ids`` when given:
    ``_export.person_entries``).  No line of a list file holds a line
    end of any kind (``\\n``, ``\\r``, U+2028, U+2029, U+0085) inside a record."""
    slugs = _slugs(people, lambda p: p.get("name") or p.get("relation") or "person")
    notes = _slugs([m for m in memories if m.get("name")], lambda m: m["name"])
    groups: dict[str, list[str]] = {f"people/{slugs[p['id']]}.md": [] for p in people}
    files: dict[str, str] = {}
    for memory in sorted(memories, key=lambda m: (m["created_at"], m["id"])):
        path = _home(memory, slugs, notes)
        if path.startswith("notes/"):
            files[path] = _note_file(memory)
        else:
            groups.setdefault(path, []).append(_line(memory, daily=path.startswith("daily/")))
    for person in people:
        path = f"people/{slugs[person['id']]}.md"
        files[path] = _front(_person_front(person)) + _body(groups.pop(path))
    for path, lines in groups.items():
        files[path] = f"# {path.removesuffix('.md')}\n\n" + _body(lines)
    return files


def _person_front(person: dict[str, Any]) -> dict[str, Any]:
    """A person file's front matter: every person field, then ``merged_ids`` if any."""
    merged = {"merged_ids": person["merged_ids"]} if person.get("merged_ids") else {}
    return {k: person.get(k) for k in _PERSON_KEYS} | merged


def _home(memory: dict[str, Any], slugs: dict[str, str], notes: dict[str, str]) -> str:
    """Which file a memory goes to (the first known subject's, for a fact)."""
    if memory.get("name"):
        return f"notes/{notes[memory['id']]}.md"
    if memory["type"] in ("conversation", "context"):
        return f"daily/{memory['created_at'][:10]}.md"
    subjects = [s for s in memory.get("subjects") or () if s in slugs]
    return f"people/{slugs[subjects[0]]}.md" if subjects else "world.md"


def _line(memory: dict[str, Any], *, daily: bool) -> str:
    """One list item: the visible text (whitespace of any kind folded to spaces) and the
    comment, whose JSON escapes every line end (json does ``\\n`` and ``\\r``; U+2028,
    U+2029 and U+0085 by ``_UNSAFE``, for editors that break lines there)."""
    content = memory["content"]
    meta = {k: v for k, v in memory.items() if k != "content" and v not in (None, [], {}, False)}
    text = " ".join(content.split())
    if text != content or "<!--" in content or "~~" in content:
        meta["content"] = content  # the visible text would not give it back exactly
    if memory.get("superseded_by"):
        text = f"~~{text}~~"
    if daily:
        text = f"{memory['created_at'][11:16]} [{memory['type']}] {text}"
    comment = json.dumps(meta, ensure_ascii=False, sort_keys=True).translate(_UNSAFE)
    return f"- {text}  <!-- rm {comment} -->"


def _note_file(memory: dict[str, Any]) -> str:
    meta = {k: v for k, v in memory.items() if k != "content" and v not in (None, [], {}, False)}
    return _front({"name": memory["name"], "aliases": memory.get("aliases") or [], "rm": meta}) + memory["content"]


class _Dumper(yaml.SafeDumper):
    """safe_dump, but a string holding anything unprintable (line ends of any kind, tabs,
    controls) is written double-quoted with escapes: PyYAML reads U+0085 / U+2028 in a
    plain or single-quoted scalar back as a line break, changing the text.  And never an
    anchor or alias (``&id001`` / ``*id001``): an object met twice (a note's ``aliases``
    list is also in its ``rm``) is written out again in full, as Obsidian and other YAML
    readers show and keep it (our own import refuses an alias in a key it leaves out)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=None if value.isprintable() else '"')


_Dumper.add_representer(str, _represent_str)


def _front(data: dict[str, Any]) -> str:
    return "---\n" + yaml.dump(data, Dumper=_Dumper, allow_unicode=True, sort_keys=False) + "---\n"


def _body(lines: list[str]) -> str:
    return "\n".join(lines) + ("\n" if lines else "")


def _slugs(items: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> dict[str, str]:
    """A safe file name per item (id -> name), unique even on case-insensitive file systems."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for item in sorted(items, key=lambda i: i["id"]):
        base = _slug(label(item))
        slug = next(c for c in (base, f"{base}-{item['id'][:8]}", f"{base}-{_slug(item['id'])}")
                    if c.casefold() not in taken)
        taken.add(slug.casefold())
        out[item["id"]] = slug
    return out


def _slug(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    slug = re.sub(r"[^\w-]+", "-", text).strip("-._")[:60]
    return slug or "unnamed"


# -- parse -------------------------------------------------------------------------------------

def parse(files: dict[str, str], now: str | None = None, ignored: dict[str, list[str]] | None = None,
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(memories, people) read back from ``files``, every record checked (types, times,
    memory types, metadata shape, person fields, ids unique).  Hand-written records
    get ids derived from their path and text (the same folder gives the same ids);
    ``now`` (ISO) is their time when they give none.  Hidden paths and files that are
    not part of the layout are skipped.  Front matter keys that are none of ours
    (Obsidian's ``tags``, ``cssclasses``, ``created``...) are checked as ours are, then
    left out; ``ignored``, when given, gets each such file's path -> those keys.

    Raises ValidationError naming the file (and line) at fault.
    """
    stamp = now or datetime.now(UTC).isoformat()
    memories: list[dict[str, Any]] = []
    people: list[dict[str, Any]] = []
    seen: dict[str, str] = {}  # "memory:<id>", "person:<id>", "name:<casefolded note name or alias>" -> path
    for path in sorted(files):
        _check_path(path)
        kind = _kind(path)
        if kind is None:
            continue
        try:
            with _at(None):
                got, person, unused = _parse_file(kind, path, files[path].removeprefix("\ufeff"), stamp)
                _unique(path, "memory", got, seen)
                _unique(path, "person", [person] if person else [], seen)
                _unique_names(path, got, seen)
        except _Bad as exc:
            where = path if exc.line is None else f"{path}:{exc.line}"
            raise ValidationError(f"{where}: {exc}", field="file") from exc
        memories += got
        people += [person] if person else []
        if unused and ignored is not None:
            ignored[path] = unused
    return memories, people


def _kind(path: str) -> str | None:
    """What a path holds: "person", "note", "daily", "world" or None (skipped)."""
    if _hidden(path) or not path.lower().endswith(".md"):
        return None
    top = path.split("/", 1)[0]
    if "/" in path and top in ("people", "notes", "daily"):
        return {"people": "person", "notes": "note", "daily": "daily"}[top]
    return "world" if path.lower() == "world.md" else None


def _hidden(path: str) -> bool:
    return any(part.startswith(".") for part in path.split("/"))


def _check_path(path: str) -> None:
    """Raises ValidationError for a path that is absolute, leaves the folder or is not Unicode."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path or not path.strip("/"):
        raise ValidationError(f"{path!r}: a path outside the export folder", field="file")
    try:
        check_unicode(path, "file")
    except ValidationError as exc:
        raise ValidationError(f"{path!r}: the file name is not valid Unicode", field="file") from exc


@contextmanager
def _at(line: int | None) -> Iterator[None]:
    """Faults raised inside (ValidationError, ValueError...) as a :class:`_Bad` at ``line``."""
    try:
        yield
    except _Bad as exc:
        exc.line = line if exc.line is None else exc.line
        raise
    except ValidationError as exc:
        raise _Bad(exc.message, line) from exc
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise _Bad(str(exc) or type(exc).__name__, line) from exc


def _unique(path: str, kind: str, records: list[dict[str, Any]], seen: dict[str, str]) -> None:
    """Raises _Bad when a record's id was already given (in this file or ``seen``'s)."""
    for record in records:
        key = f"{kind}:{record['id']}"
        if key in seen:
            raise _Bad(f"the {kind} id {record['id']} is given twice (also in {seen[key]})")
        seen[key] = path


def _unique_names(path: str, records: list[dict[str, Any]], seen: dict[str, str]) -> None:
    """Raises _Bad when a note's name or alias (case aside) is another file's too, naming
    that file: a vault's notes named by their files collide across folders (``a/Ideas.md``,
    ``b/ideas.md``), and the import's own check named only two memory ids."""
    for record in records:
        for label in note_labels(record):
            key = f"name:{label.casefold()}"
            if seen.setdefault(key, path) != path:
                raise _Bad(f"the note name or alias {label!r} is also {seen[key]}'s (a note without a name "
                           "in its front matter is named by its file: give one a name: of its own)")


def _parse_file(kind: str, path: str, text: str,
                stamp: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[str]]:
    """(memories, person or None, the front matter keys left out) of one file."""
    if kind == "person":
        person, body, first, unused = _person_file(path, text, stamp)
        return _lines(path, body, first, stamp, [person["id"]], None), person, unused
    if kind == "note":
        note, unused = _parse_note(path, text, stamp)
        return [note], None, unused
    day = _day(path) if kind == "daily" else None
    _, body, first, unused = _split_front(text, (), optional=True)  # an Obsidian daily note's properties
    return _lines(path, body, first, stamp, [], day), None, unused


def _day(path: str) -> str:
    """The date a daily file is named by. Raises _Bad for any other name."""
    found = _DAY_FILE.match(path)
    try:
        if found:
            return date.fromisoformat(found.group(1)).isoformat()
    except ValueError:
        pass
    raise _Bad("a daily file is named by an existing date: daily/YYYY-MM-DD.md")


def _hand_id(*parts: str) -> str:
    """The id of a hand-written record: the same parts (path, person, text), the same id."""
    return uuid.uuid5(_HAND_IDS, "\x1f".join(unicodedata.normalize("NFC", p) for p in parts)).hex
def _fold(text: str) -> str:
    return " ".join(text.split()).casefold()


def _person_file(path: str, text: str, stamp: str) -> tuple[dict[str, Any], str, int, list[str]]:
    """The person of a person file (checked), its body, the body's first line number and
    the front matter keys left out."""
    head, body, first, unused = _split_front(text, _PERSON_FRONT)
    name, relation = head.get("name"), head.get("relation")
    if not name and not relation:
        raise _Bad("the front matter needs a name or a relation")
    person = _person_front(head)
    person["id"] = person["id"] or _hand_id("person", path, _fold(name or ""), _fold(relation or ""))
    person["name"] = name or ""
    person["aliases"] = person["aliases"] or []
    person["metadata"] = {} if person["metadata"] is None else person["metadata"]
    person["created_at"] = _iso(person["created_at"] or stamp, "created_at")
    person["updated_at"] = _iso(person["updated_at"] or person["created_at"], "updated_at")
    return _checked_person(person), body, first, unused


def _checked_person(person: dict[str, Any]) -> dict[str, Any]:
    """``person`` unless a field is malformed (``people``'s own checks). Raises ValidationError."""
    if not isinstance(person["id"], str) or not 0 < len(person["id"]) <= 128:
        raise _Bad("id must be text of 1 to 128 characters")
    person["metadata"] = check_metadata(person["metadata"])
    person_from_op(person | {"op": "person_put", "created_at": _epoch(person["created_at"]),
                             "updated_at": _epoch(person["updated_at"])})
    merged_ids_of("front matter", person)
    return person


def _parse_note(path: str, text: str, stamp: str) -> tuple[dict[str, Any], list[str]]:
    """The named note of a note file, checked (its body as written when exported), and the
    front matter keys left out. Without front matter, or a name in it, the note is named
    by its file name (as Obsidian names a note), composed (NFC) as a name typed is."""
    head, body, _, unused = _split_front(text, _NOTE_KEYS, optional=True)
    name = head.get("name")
    if name is None:  # named by its file; NFC: a Mac writes file names decomposed ("Cafe\u0301")
        name = unicodedata.normalize("NFC", PurePosixPath(path).name[:-3])
    if not isinstance(name, str) or not name.strip():
        raise _Bad("a note's name must be text")
    meta = {} if head.get("rm") is None else head["rm"]
    if not isinstance(meta, dict):
        raise _Bad("rm must be a mapping (the fields the export wrote)")
    content = body if meta else body.strip()
    if not content.strip():
        raise _Bad("a note needs some text after its front matter")
    record = ({"type": "fact", "created_at": stamp, "metadata": {}, "subjects": []} | meta
              | {"content": content, "name": name, "aliases": head.get("aliases") or []})
    record.setdefault("id", _hand_id("note", path, name, content))
    return _checked_memory(record), unused


def _lines(path: str, text: str, first: int, stamp: str, subjects: list[str], day: str | None) -> list[dict[str, Any]]:
    """The memories of the list items of ``text`` (line ``first`` on), fenced blocks skipped."""
    out = []
    seen: dict[str, int] = {}
    fence: str | None = None
    for n, line in enumerate(_LINE_END.split(text), first):
        fence, inside = _fenced(line, fence)
        item = None if inside else _ITEM.match(line)
        if item:
            with _at(n):
                out.append(_entry(path, line[item.end():], day, stamp, subjects, seen))
    return out


def _fenced(line: str, fence: str | None) -> tuple[str | None, bool]:
    """(the open fence after ``line``, whether ``line`` is part of a fenced block)."""
    found = _FENCE.match(line)
    if fence is None:
        return (found.group(1), True) if found else (None, False)
    closes = (found is not None and found.group(1)[0] == fence[0] and len(found.group(1)) >= len(fence)
              and not line[found.end():].strip())
    return (None if closes else fence), True


def _entry(path: str, text: str, day: str | None, stamp: str, subjects: list[str],
           seen: dict[str, int]) -> dict[str, Any]:
    """The memory of one list item (its text after the marker), checked."""
    check_unicode(text, "the line")
    start, meta = _comment(text)
    visible = text[:start].strip()
    if meta:
        shown = _STAMP.sub("", visible) if day else visible
        record = ({"type": "fact", "created_at": stamp, "metadata": {}, "subjects": subjects} | meta
                  | {"content": meta.get("content", _unstrike(shown))})
    else:
        record = _hand_entry(visible, day, stamp, subjects)
    if "id" not in record:  # the n-th item of this text in this file (about this person)
        key = text.strip()
        seen[key] = seen.get(key, 0) + 1
        record["id"] = _hand_id("memory", path, *subjects, key, str(seen[key]))
    return _checked_memory(record)


def _comment(text: str) -> tuple[int, dict[str, Any]]:
    """(where the line's ``<!-- rm {...} -->`` comment starts, its object), or (the
    line's length, {}) without one.  The comment is the rightmost start whose rest
    parses: a text may hold "<!-- rm {" itself (older exports did not escape "<").
    Raises _Bad when the only candidate is not a JSON object."""
    end = _COMMENT_END.search(text)
    starts = [m for m in _COMMENT_START.finditer(text)] if end else []
    error: Exception | None = None
    for found in reversed(starts):
        try:
            meta = json.loads(text[found.end():end.start() + 1], object_pairs_hook=strict_object) if end else None
        except ValueError as exc:
            error = exc
            continue
        if isinstance(meta, dict):
            return found.start(), meta
    if error is not None:
        raise _Bad(f"the rm comment is not JSON ({str(error)[:200]})")
    return len(text), {}


def _hand_entry(visible: str, day: str | None, stamp: str, subjects: list[str]) -> dict[str, Any]:
    """A hand-written item: a fact, or in a daily file a turn ("HH:MM [type] role: text")."""
    if day is None:
        return {"type": "fact", "created_at": stamp, "metadata": {}, "subjects": subjects, "content": visible}
    found = _DAILY.match(visible)
    assert found is not None  # the pattern matches any text
    hour, minute, kind, role, content = found.groups()
    if int(hour or 0) > 23 or int(minute or 0) > 59:
        raise _Bad(f"{hour}:{minute} is not a time of day")
    return {"type": kind or "conversation", "created_at": f"{day}T{int(hour or 0):02d}:{int(minute or 0):02d}:00+00:00",
            "metadata": {"role": role.lower()} if role else {}, "subjects": subjects, "content": content.strip()}


def _checked_memory(m: dict[str, Any]) -> dict[str, Any]:
    """``m`` with its type and times normalized, unless a field is malformed. Raises _Bad."""
    unknown = sorted(set(m) - _MEMORY_KEYS, key=str)
    if unknown:
        raise _Bad(f"unknown fields {unknown}")
    if not isinstance(m.get("id"), str) or not 0 < len(m["id"]) <= 128:
        raise _Bad("id must be text of 1 to 128 characters")
    if not isinstance(m["content"], str) or not m["content"].strip():
        raise _Bad("an empty memory" if isinstance(m["content"], str) else "content must be text")
    check_unicode(m["content"], "content")
    m["type"] = MemoryType.parse(m["type"]).value
    for key in ("created_at", "expires_at", "superseded_at", "covers_until"):
        if key == "created_at" or m.get(key) is not None:
            m[key] = _iso(m.get(key), key)
    m["metadata"] = validate_metadata(m["metadata"], max_bytes=1 << 20, max_keys=1024)  # the store: its limits
    for key in ("subjects", "aliases"):
        if not isinstance(m.get(key, []), list) or not all(isinstance(v, str) and v for v in m.get(key, [])):
            raise _Bad(f"{key} must be a list of names")
    for key in ("owner", "name", "superseded_by"):
        if m.get(key) is not None and (not isinstance(m[key], str) or not m[key]):
            raise _Bad(f"{key} must be text")
    for key in ("shared", "protected"):
        if not isinstance(m.get(key, False), bool):
            raise _Bad(f"{key} must be true or false")
    return m


def _unstrike(text: str) -> str:
    text = text.strip()
    return text[2:-2] if text.startswith("~~") and text.endswith("~~") and len(text) > 4 else text


def _split_front(text: str, keys: tuple[str, ...], *,
                 optional: bool = False) -> tuple[dict[str, Any], str, int, list[str]]:
    """(front matter: its fields among ``keys``, body as written, the body's first line
    number, the other keys in file order). ``optional``: a text without front matter (not
    starting with a '---' line closed by another) is all body. Raises _Bad."""
    lines = _RAW_LINE.findall(text)
    if not lines or lines[0].rstrip(" \t\r\n") != "---":
        if optional:
            return {}, text, 1, []
        raise _Bad("expected front matter between '---' lines", 1)
    for i, line in enumerate(lines[1:], 1):
        if line.rstrip(" \t\r\n") == "---":
            head, unused = _front_matter("".join(lines[1:i]), keys)
            return head, "".join(lines[i + 1 :]), i + 2, unused
    if optional:
        return {}, text, 1, []
    raise _Bad("the front matter is not closed by a '---' line")


def _front_matter(text: str, keys: tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """(the fields of front matter (starting at line 2) among ``keys``, text fields as
    written; the other keys, in file order, their values checked then left out). Raises
    _Bad, also for a character YAML refuses (NUL, other controls), a key given twice, a key
    that is not text, and a left-out value with a YAML tag the safe loader refuses or a
    YAML alias (``*name``: the expansion of an alias bomb is never built)."""
    try:
        loader = _Loader(text)  # checks every character first
    except yaml.reader.ReaderError as exc:
        line = 2 + text.count("\n", 0, exc.position)
        raise _Bad(f"broken front matter (the character U+{exc.character:04X} is not allowed in YAML)", line) from exc
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            raise _Bad(f"broken front matter ({exc.problem or exc})", 2 + mark.line if mark else None) from exc
        except yaml.YAMLError as exc:
            raise _Bad(f"broken front matter ({exc})") from exc
        if node is None:
            return {}, []
        if not isinstance(node, yaml.MappingNode):
            raise _Bad("the front matter must be a mapping", 2)
        _no_key_twice(node)
        ours: list[tuple[yaml.Node, yaml.Node]] = []
        others: list[tuple[yaml.Node, yaml.Node]] = []
        for key, value in node.value:
            (ours if _known(key, keys) else others).append((key, value))
        for key, value in others:
            _check_ignored(loader, key, value)
        return dict(_front_field(loader, key, value) for key, value in ours), [str(k.value) for k, _ in others]
    finally:
        loader.dispose()


def _no_key_twice(node: yaml.MappingNode) -> None:
    """Raises _Bad (at the second) when a key of ``node`` is written twice: PyYAML would keep
    the last one silently (a merge key, ``<<``, may be overridden: that is its purpose)."""
    seen: set[str] = set()
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            if key.value in seen:
                raise _Bad(f"the key {key.value!r} is given twice", 2 + key.start_mark.line)
            seen.add(key.value)


class _Loader(yaml.SafeLoader):
    """SafeLoader refusing a mapping that gives a key twice (metadata, rm)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _no_key_twice(node)
        return super().construct_mapping(node, deep=deep)


def _known(key_node: yaml.Node, keys: tuple[str, ...]) -> bool:
    """Whether a front matter key is one of ``keys``. Raises _Bad for a key that is not
    text (a list or mapping as a key: no editor writes one)."""
    if not isinstance(key_node, yaml.ScalarNode):
        raise _Bad("a front matter key must be text, not a list or mapping", 2 + key_node.start_mark.line)
    return key_node.value in keys and key_node.tag != "tag:yaml.org,2002:merge"


def _check_ignored(loader: _Loader, key_node: yaml.Node, node: yaml.Node) -> None:
    """Check a value that is left out as a known one is read (the safe loader: YAML tags,
    depth), without YAML aliases (one node reached twice). Raises _Bad at its line."""
    line, seen, todo = 2 + key_node.start_mark.line, set(), [node]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            raise _Bad(f"{key_node.value}: YAML aliases (*name) are not read in front matter we do not use", line)
        seen.add(id(item))
        if isinstance(item, yaml.SequenceNode):
            todo += item.value
        elif isinstance(item, yaml.MappingNode):
            todo += [part for pair in item.value for part in pair]
    try:
        with _at(line):
            loader.construct_object(key_node, deep=True)
            loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise _Bad(f"{key_node.value}: {exc}", line) from exc


def _front_field(loader: _Loader, key_node: yaml.Node, node: yaml.Node) -> tuple[str, Any]:
    key, line = key_node.value, 2 + node.start_mark.line
    if key in _TEXT_KEYS:
        return key, _as_written(node, key, line)
    if key in _LIST_KEYS:
        items = node.value if isinstance(node, yaml.SequenceNode) else [node]
        what = "an alias" if key == "aliases" else "a merged id"
        return key, [a for a in (_as_written(item, what, line) for item in items) if a is not None]
    try:
        with _at(line):
            return key, loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise _Bad(f"{key}: {exc}", line) from exc


def _as_written(node: yaml.Node, key: str, line: int) -> str | None:
    """A scalar's text as written (``yes`` is "yes", ``17`` is "17"); None for an empty one."""
    if not isinstance(node, yaml.ScalarNode):
        raise _Bad(f"{key} must be text, not a list or mapping", line)
    return None if node.tag == "tag:yaml.org,2002:null" else str(node.value)


def _iso(value: Any, field: str) -> str:
    """``value`` (ISO text, a datetime or a date; UTC unless it says) as ISO text. Raises _Bad."""
    when = _as_datetime(value)
    if when is None:
        raise _Bad(f"{field} {value!r} is not a time")
    when = when if when.tzinfo else when.replace(tzinfo=UTC)
    try:
        check_time(when, field)
    except ValidationError as exc:
        raise _Bad(f"{field} {when.isoformat()} is outside 2000-01-01..2200-01-01 UTC") from exc
    return when.isoformat()


def _as_datetime(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day)
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


# -- folders -------------------------------------------------------------------------------------

def write_dir(files: dict[str, str], dest: str | Path, *, force: bool = False) -> Path:
    """Write ``files`` under ``dest`` atomically (a temporary folder renamed into place),
    each byte for byte (no newline translation).

    Raises ValidationError for a non-empty ``dest`` (unless ``force``: it is moved aside)
    or a path that leaves it or is hidden.
    """
    target = Path(dest)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ValidationError(f"{target} is not a folder", field="dest")
    if target.exists() and any(target.iterdir()):
        if not force:
            raise ValidationError(f"{target} is not empty (use --force to replace it)", field="dest")
        os.replace(target, target.with_name(f"{target.name}.before-export-{int(datetime.now(UTC).timestamp())}"))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for rel, text in files.items():
            _check_path(rel)
            if _hidden(rel):
                raise ValidationError(f"{rel}: a hidden file would not be imported", field="file")
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read_dir(src: str | Path) -> dict[str, str]:
    """The markdown files (``.md`` in any case) under ``src``: relative path -> text as
    written (line ends kept).  Hidden files and folders (a name starting with ".") are
    skipped.

    Raises ValidationError naming the file for a symlink (to a file or folder: not
    followed), a ``.md`` that is not a regular file (FIFO, device, socket: never opened
    for reading), a non-UTF-8 file or file name, or too many / too large files.
    """
    root = Path(src)
    if not root.is_dir() or root.is_symlink():
        raise ValidationError(f"{root} is not a folder", field="file")
    files: dict[str, str] = {}
    total = 0
    for rel, path in _walk(root, "", 0):
        data = _read(rel, path)
        total += len(data)
        if len(files) >= MAX_FILES or total > MAX_TOTAL_BYTES:
            raise ValidationError(f"{rel}: over the import limits ({MAX_FILES} files, {MAX_FILE_BYTES} bytes "
                                  f"each, {MAX_TOTAL_BYTES} in all)", field="file")
        try:
            files[rel] = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError(f"{rel}: not UTF-8 text ({exc.reason} at byte {exc.start})", field="file") from exc
    return files


def _walk(folder: Path, rel: str, depth: int) -> Iterator[tuple[str, Path]]:
    """(relative path, path) of each markdown file under ``folder``, in name order,
    hidden names skipped. Raises ValidationError for symlinks and bad names."""
    if depth > MAX_DEPTH:
        raise ValidationError(f"{rel}: folders nested deeper than {MAX_DEPTH}", field="file")
    try:
        with os.scandir(folder) as found:
            entries = sorted(found, key=lambda e: e.name)
    except OSError as exc:
        raise ValidationError(f"{rel or '.'}: the folder cannot be read ({exc.strerror})", field="file") from exc
    for entry in entries:
        if entry.name.startswith("."):
            continue
        name = f"{rel}{entry.name}"
        _check_path(name)
        is_md = entry.name.lower().endswith(".md")
        if entry.is_symlink():
            if is_md or entry.is_dir():
                raise ValidationError(f"{name}: symlinks are not followed", field="file")
        elif entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path), f"{name}/", depth + 1)
        elif is_md:
            yield name, Path(entry.path)


def _read(rel: str, path: Path) -> bytes:
    """The bytes of a regular file, opened without following a symlink or blocking on a
    FIFO. Raises ValidationError naming ``rel``."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ValidationError(f"{rel}: cannot be read ({exc.strerror})", field="file") from exc
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise ValidationError(f"{rel}: not a regular file (a FIFO, device or socket is not read)", field="file")
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValidationError(f"{rel}: over the import limits ({MAX_FILES} files, {MAX_FILE_BYTES} bytes "
                              f"each, {MAX_TOTAL_BYTES} in all)", field="file")
    return data
