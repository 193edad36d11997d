"""Human-readable export and import as a folder of markdown files (spec 003).

Layout (``render``)::

    people/<name>.md    front matter (the person) + "- fact" lines about them
    world.md            facts about nobody in particular, archives
    notes/<name>.md     one named note: front matter (name, aliases) + its text
    daily/<date>.md     conversation turns and context of that day (UTC): "- HH:MM [type] text"

Every line written by ``render`` ends with an HTML comment, ``<!-- rm {...} -->``,
holding the memory's other fields as JSON (id, times, subjects, names,
supersession links), so ``parse(render(m, p))`` gives back exactly ``m`` and
``p`` (tested with hypothesis).  Superseded facts are shown struck through.
Files a person writes by hand need no comments: a person file's front matter
makes a person and its "- ..." lines facts about them; world lines are facts;
daily lines ("- 14:05 user: text" or "- text") are conversation turns of that
day; a note file is a named note.  Those get new ids.

Bad input (broken front matter, a file over the size limit, non-UTF-8, a
path leaving the folder, a symlink) is a :class:`ValidationError` naming the
file and line, raised before anything is imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import unicodedata
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from .errors import ValidationError

MAX_FILES = 10_000
MAX_FILE_BYTES = 4 << 20
MAX_TOTAL_BYTES = 256 << 20
_COMMENT = re.compile(r"\s*<!-- rm (\{.*\}) -->\s*$")
_STAMP = re.compile(r"^\d{2}:\d{2} \[\w+\] ")  # what render puts before a daily line's text
_DAILY = re.compile(r"^(?:(\d{1,2}):(\d{2})\s+)?(?:\[(\w+)\]\s+)?(?:(\w[\w -]{0,30}):\s+)?(.*)$")
_PERSON_KEYS = ("id", "name", "relation", "aliases", "owner", "external_id", "metadata", "created_at", "updated_at")

NewId = Callable[[], str]


# -- render ------------------------------------------------------------------------------------

def render(memories: list[dict[str, Any]], people: list[dict[str, Any]]) -> dict[str, str]:
    """The files (relative path -> text) of ``memories`` (``Memory.to_dict`` shapes)
    and ``people`` (``Person.to_dict`` shapes)."""
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
        files[path] = _front({k: person.get(k) for k in _PERSON_KEYS}) + _body(groups.pop(path))
    for path, lines in groups.items():
        files[path] = f"# {path.removesuffix('.md')}\n\n" + _body(lines)
    return files


def _home(memory: dict[str, Any], slugs: dict[str, str], notes: dict[str, str]) -> str:
    """Which file a memory goes to (the first known subject's, for a fact)."""
    if memory.get("name"):
        return f"notes/{notes[memory['id']]}.md"
    if memory["type"] in ("conversation", "context"):
        return f"daily/{memory['created_at'][:10]}.md"
    subjects = [s for s in memory.get("subjects") or () if s in slugs]
    return f"people/{slugs[subjects[0]]}.md" if subjects else "world.md"


def _line(memory: dict[str, Any], *, daily: bool) -> str:
    content = memory["content"]
    meta = {k: v for k, v in memory.items() if k != "content" and v not in (None, [], {}, False)}
    text = " ".join(content.split())
    if text != content or "<!--" in content or "~~" in content:
        meta["content"] = content  # the visible text would not give it back exactly
    if memory.get("superseded_by"):
        text = f"~~{text}~~"
    if daily:
        text = f"{memory['created_at'][11:16]} [{memory['type']}] {text}"
    return f"- {text}  <!-- rm {json.dumps(meta, ensure_ascii=False, sort_keys=True)} -->"


def _note_file(memory: dict[str, Any]) -> str:
    meta = {k: v for k, v in memory.items() if k != "content" and v not in (None, [], {}, False)}
    return _front({"name": memory["name"], "aliases": memory.get("aliases") or [], "rm": meta}) + memory["content"]


def _front(data: dict[str, Any]) -> str:
    return "---\n" + yaml.safe_dump(data, allow_unicode=True, sort_keys=False) + "---\n"


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

def parse(files: dict[str, str], new_id: NewId = lambda: uuid.uuid4().hex,
          now: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(memories, people) read back from ``files``; hand-written entries get new ids.

    Raises ValidationError naming the file (and line) at fault.
    """
    stamp = now or datetime.now(UTC).isoformat()
    memories: list[dict[str, Any]] = []
    people: list[dict[str, Any]] = []
    for path in sorted(files):
        _check_path(path)
        text = files[path]
        if path.startswith("people/"):
            person, lines = _person_file(path, text, new_id, stamp)
            people.append(person)
            memories += _lines(path, lines, new_id, stamp, subjects=[person["id"]])
        elif path.startswith("notes/"):
            memories.append(_parse_note(path, text, new_id, stamp))
        elif path.startswith("daily/") or path == "world.md":
            memories += _lines(path, text.splitlines(), new_id, stamp, subjects=[])
    return memories, people


def _check_path(path: str) -> None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or any(p.startswith(".") for p in pure.parts):
        raise ValidationError(f"{path}: a path outside the export folder", field="file")


def _person_file(path: str, text: str, new_id: NewId, stamp: str) -> tuple[dict[str, Any], list[str]]:
    head, body = _split_front(path, text)
    if not head.get("name") and not head.get("relation"):
        raise ValidationError(f"{path}: the front matter needs a name or a relation", field="file")
    person = {k: head.get(k) for k in _PERSON_KEYS}
    person["id"] = person["id"] or new_id()
    person["name"] = person["name"] or ""
    person["aliases"] = list(person["aliases"] or [])
    person["metadata"] = dict(person["metadata"] or {})
    person["created_at"] = _iso(path, person["created_at"] or stamp)
    person["updated_at"] = _iso(path, person["updated_at"] or person["created_at"])
    return person, body.splitlines()


def _parse_note(path: str, text: str, new_id: NewId, stamp: str) -> dict[str, Any]:
    head, body = _split_front(path, text)
    meta: dict[str, Any] = head["rm"] if isinstance(head.get("rm"), dict) else {}
    if not isinstance(head.get("name"), str) or not head["name"].strip():
        raise ValidationError(f"{path}: a note needs a name in its front matter", field="file")
    memory = _memory(meta, body if meta else body.strip(), new_id, stamp, "fact", [])
    return memory | {"name": head["name"], "aliases": list(head.get("aliases") or [])}


def _lines(path: str, lines: Iterable[str], new_id: NewId, stamp: str, subjects: list[str]) -> list[dict[str, Any]]:
    out = []
    day = path[6:16] if path.startswith("daily/") else None
    for n, line in enumerate(lines, 1):
        if not line.startswith("- "):
            continue
        try:
            out.append(_entry(line[2:], day, new_id, stamp, subjects))
        except (ValueError, json.JSONDecodeError) as exc:
            raise ValidationError(f"{path}:{n}: {exc}", field="file") from exc
    return out


def _entry(text: str, day: str | None, new_id: NewId, stamp: str, subjects: list[str]) -> dict[str, Any]:
    found = _COMMENT.search(text)
    meta = json.loads(found.group(1)) if found else {}
    if not isinstance(meta, dict):
        raise ValueError("the rm comment must hold a JSON object")
    visible = text[: found.start()] if found else text
    if meta:
        shown = _STAMP.sub("", visible.strip()) if day else visible
        return _memory(meta, meta.get("content", _unstrike(shown)), new_id, stamp, "fact", subjects)
    if day is None:
        return _memory({}, visible.strip(), new_id, stamp, "fact", subjects)
    hour, minute, kind, role, content = _DAILY.match(visible.strip()).groups()  # type: ignore[union-attr]
    when = f"{day}T{int(hour or 0):02d}:{int(minute or 0):02d}:00+00:00"
    metadata = {"role": role} if role else {}
    return _memory({"created_at": when, "metadata": metadata}, content.strip(), new_id, stamp,
                   kind or "conversation", subjects)


def _memory(meta: dict[str, Any], content: str, new_id: NewId, stamp: str, kind: str,
            subjects: list[str]) -> dict[str, Any]:
    if not content:
        raise ValueError("an empty memory")
    base = {"id": new_id(), "type": kind, "created_at": stamp, "metadata": {}, "subjects": subjects}
    return base | {k: v for k, v in meta.items() if k != "content"} | {"content": content}


def _unstrike(text: str) -> str:
    text = text.strip()
    return text[2:-2] if text.startswith("~~") and text.endswith("~~") and len(text) > 4 else text


def _split_front(path: str, text: str) -> tuple[dict[str, Any], str]:
    if not text.startswith("---\n"):
        raise ValidationError(f"{path}:1: expected front matter between '---' lines", field="file")
    end = text.find("\n---\n", 3)
    if end == -1:
        raise ValidationError(f"{path}: the front matter is not closed by a '---' line", field="file")
    try:
        head = yaml.safe_load(text[4:end]) or {}
    except yaml.YAMLError as exc:
        raise ValidationError(f"{path}: broken front matter ({exc})", field="file") from exc
    if not isinstance(head, dict):
        raise ValidationError(f"{path}: the front matter must be a mapping", field="file")
    return head, text[end + 5 :]


def _iso(path: str, value: Any) -> str:
    when = value if isinstance(value, datetime) else None
    if when is None:
        try:
            when = datetime.fromisoformat(str(value))
        except ValueError as exc:
            raise ValidationError(f"{path}: {value!r} is not a time", field="file") from exc
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).isoformat()


# -- folders -------------------------------------------------------------------------------------

def write_dir(files: dict[str, str], dest: str | Path, *, force: bool = False) -> Path:
    """Write ``files`` under ``dest`` atomically (a temporary folder renamed into place).

    Raises ValidationError for a non-empty ``dest`` (unless ``force``: it is moved aside).
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
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as out:
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
    """The markdown files under ``src`` (relative path -> text), within the limits.

    Raises ValidationError for a symlink, a non-UTF-8 file, or too many / too large files.
    """
    root = Path(src)
    if not root.is_dir() or root.is_symlink():
        raise ValidationError(f"{root} is not a folder", field="file")
    files: dict[str, str] = {}
    total = 0
    for path in sorted(root.rglob("*.md")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink() or any(p.is_symlink() for p in path.relative_to(root).parents if str(p) != "."):
            raise ValidationError(f"{rel}: symlinks are not followed", field="file")
        size = path.stat().st_size
        total += size
        if size > MAX_FILE_BYTES or total > MAX_TOTAL_BYTES or len(files) >= MAX_FILES:
            raise ValidationError(f"{rel}: over the import limits ({MAX_FILES} files, {MAX_FILE_BYTES} bytes "
                                  f"each, {MAX_TOTAL_BYTES} in all)", field="file")
        try:
            files[rel] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError(f"{rel}: not UTF-8 text ({exc.reason} at byte {exc.start})", field="file") from exc
    return files
