"""Ingest: validating what callers send, and the previous-turn rule.

Pure functions over the configuration and the records already stored; they
never change the state (the store commits what they return).  Everything here
raises :class:`ValidationError` / :class:`TooLargeError` before anything is
written.

The previous-turn rule: a conversation turn is embedded together with the turn
stored just before it (when that turn is at most :data:`NEIGHBOUR_SECONDS`
older), because a reply ("yes, on Tuesdays") means little without what it
answers.  The store resolves "the turn before" on the engine thread at commit.
A turn borrows those words only when everyone who can find it can also find the
turn before (:func:`lends_to`): Bob's turn must not be findable by Alice's private
words.  It still ``follows`` that turn (the dialogue's order, for the neighbour
prior, which only ever joins hits the searcher may see).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from reachy_memory.config import Config
from reachy_memory.engine.filters import validate_metadata
from reachy_memory.engine.records import Record
from reachy_memory.errors import TooLargeError, ValidationError
from reachy_memory.model import Expiry, MemoryType, check_time, check_unicode

NEIGHBOUR_SECONDS = 600.0  # a previous turn older than this is not context any more
# Of the previous turn's text, what a turn keeps for its lexical document: a bound on the
# copy (one more string per turn), longer than almost any utterance.
PREVIOUS_CHARS = 1000
ITEM_KEYS = frozenset({"content", "memory_type", "metadata", "id", "created_at", "owner", "shared"})
MODES = ("hybrid", "vector", "lexical")
MAX_NAME_CHARS = 200  # an owner, a note name, an id a memory's fields take
MAX_ID_CHARS = 128  # a memory's own id (a uuid4 hex is 32)
_ID_QUOTES = frozenset("\"'`")


class Item(NamedTuple):
    """One checked item of a store."""

    content: str
    type: str
    metadata: dict[str, Any]
    id: str | None
    created_at: float | None
    owner: str | None = None  # a user of the robot; None: unscoped
    shared: bool = False  # a household memory every user sees


def as_list(items: Iterable[Any], limit: int) -> list[Any]:
    """``items`` as a non-empty list of at most ``limit`` entries."""
    if isinstance(items, str | bytes | Mapping):
        raise ValidationError("items must be a list of dicts", field="items")
    items = list(items)
    if not items:
        raise ValidationError("items must not be empty", field="items")
    if len(items) > limit:
        raise TooLargeError(f"{len(items)} items in one batch; the limit is {limit}",
                            field="items", size=len(items), limit=limit)
    return items


def validate_item(item: Any, config: Config, *, imported: bool = False) -> Item:
    """One item of a batch store, checked.  ``id`` (optional) must be a client id
    (:func:`check_id`); ``imported``: an exported memory's id, taken as any earlier version
    wrote it (1 to 128 characters).  ``owner`` (optional) must be a valid owner
    (:func:`check_owner`), ``shared`` a bool; shared without an owner is kept as given,
    as ``remember`` does (an unscoped memory is seen by every user anyway).
    Raises ValidationError / TooLargeError."""
    if not isinstance(item, Mapping):
        raise ValidationError("each item must be a dict with content, memory_type, metadata", field="items")
    unknown = set(item) - ITEM_KEYS
    if unknown:
        raise ValidationError(f"unknown item keys: {sorted(unknown, key=str)}", field="items")
    content = validate_text(item.get("content"), "content", config)
    mtype = MemoryType.parse(item.get("memory_type", MemoryType.FACT))
    mem = config.memory
    metadata = validate_metadata(item.get("metadata"), max_bytes=mem.max_metadata_bytes,
                                 max_keys=mem.max_metadata_keys)
    memory_id = item.get("id")
    if memory_id is not None:
        memory_id = _check_imported_id(memory_id) if imported else check_id(memory_id)
    owner, shared = item.get("owner"), item.get("shared", False)
    if owner is not None:
        owner = check_owner(owner)
    if not isinstance(shared, bool):
        raise ValidationError("shared must be true or false", field="shared")
    return Item(content, mtype.value, metadata, memory_id, check_time(item.get("created_at"), "created_at"),
                owner, shared)


def check_id(value: Any, field: str = "id") -> str:
    """``value`` if it is a memory id a client may choose for a new write: a string of 1 to
    :data:`MAX_ID_CHARS` printable characters, none of them whitespace or a quote (``"``, ``'``,
    a backquote).  Raises ValidationError naming ``field``.

    Why the characters: an id is handed back to language models and people, who copy it
    (the tools strip the whitespace and quotes models wrap copies in, so an id holding
    them could never be forgotten through a tool); a control character, a lone surrogate
    or an invisible one (U+200B) would make an id nobody can type or read back."""
    _check_imported_id(value, field)
    bad = next((c for c in value if not c.isprintable() or c.isspace() or c in _ID_QUOTES), None)
    if bad is not None:
        raise ValidationError(f"{field} {value[:40]!r} holds {bad!r}: an id is printable characters without "
                              "whitespace or quotes (e.g. a uuid4 hex)", field=field)
    return value


def _check_imported_id(value: Any, field: str = "id") -> str:
    """An exported memory's id: 1 to :data:`MAX_ID_CHARS` characters, as every earlier version
    took it (an export must import again; :func:`check_id`'s characters came later)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise ValidationError(f"{field} must be a non-empty string of at most {MAX_ID_CHARS} characters",
                              field=field)
    return value


def check_label(value: Any, field: str, where: str = "") -> str:
    """``value`` if it is a string of 1 to :data:`MAX_NAME_CHARS` characters: an owner (a user of
    the robot), a note name or an id as a memory's fields take them. Raises ValidationError
    naming ``field`` (its message starts with ``where``)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise ValidationError(f"{where}{field} must be a string of 1 to {MAX_NAME_CHARS} characters", field=field)
    return value


def check_owner(owner: Any) -> str:
    """``owner`` if it is a valid owner (what an import accepts for a memory's ``owner``), and
    valid Unicode (a lone surrogate would be accepted by a search, then refused by every
    write). Raises ValidationError."""
    return check_unicode(check_label(owner, "owner"), "owner")


def validate_text(text: Any, field: str, config: Config) -> str:
    """A non-blank string within ``memory.max_content_chars``."""
    if not isinstance(text, str):
        raise ValidationError(f"{field} must be a string, got {type(text).__name__}", field=field)
    if not text.strip():
        raise ValidationError(f"{field} must not be empty or whitespace only", field=field)
    limit = config.memory.max_content_chars
    if len(text) > limit:
        raise TooLargeError(f"{field} is {len(text)} characters; the limit is {limit}",
                            field=field, size=len(text), limit=limit)
    return check_unicode(text, field)


def check_duplicate(existing: Record | None, memory_id: str, content: str, mtype: str,
                    owner: str | None = None, shared: bool = False) -> bool:
    """True when ``memory_id`` already holds this memory (an idempotent retry).

    Raises ValidationError when the id holds a different memory: other content, type,
    owner or sharing (a retry must not move a memory into another user's scope).
    """
    if existing is None:
        return False
    if (existing.content, existing.type, existing.owner, existing.shared) != (content, mtype, owner, shared):
        raise ValidationError(f"id {memory_id!r} is already used by another memory", field="id")
    return True


def new_records(items: list[Item], now: float, expiry: Expiry,
                stored: Mapping[str, Record]) -> tuple[list[Record], list[str]]:
    """Records for validated items (``created_at`` defaults to ``now``), leaving out
    retries of memories already ``stored``; returns (records, the id of every item).
    An id given twice in the batch is one memory when both items agree, else a
    ValidationError (the second item was dropped without a word, its write "acknowledged")."""
    recs: dict[str, Record] = {}
    ids: list[str] = []
    for item in items:
        memory_id = item.id or uuid.uuid4().hex
        ids.append(memory_id)
        fields = (memory_id, item.content, item.type, item.owner, item.shared)
        if check_duplicate(stored.get(memory_id), *fields) or check_duplicate(recs.get(memory_id), *fields):
            continue
        created = now if item.created_at is None else item.created_at
        expires = expiry.expires(MemoryType(item.type), created)
        recs[memory_id] = Record(memory_id, item.content, item.type, created, expires, item.metadata,
                                 owner=item.owner, shared=item.shared)
    return list(recs.values()), ids


def embedding_texts(recs: list[Record], previous: Record | None, config: Config) -> list[str]:
    """Each new record's text to embed (``previous``: the last turn stored before them)."""
    return [context_text(rec, before, config) for rec, before in zip(recs, turns_before(recs, previous), strict=True)]


def turns_before(recs: list[Record], previous: Record | None) -> list[Record | None]:
    """For each new record, the conversation turn it follows by the previous-turn rule
    (None for other types and after a pause of over :data:`NEIGHBOUR_SECONDS`)."""
    out: list[Record | None] = []
    for rec in recs:
        turn = rec.type == MemoryType.CONVERSATION.value
        out.append(previous if turn and previous is not None and _close(previous, rec) else None)
        if turn and (previous is None or rec.created >= previous.created):
            previous = rec
    return out


def linked(recs: list[Record], previous: Record | None) -> list[Record]:
    """``recs`` with ``follows`` set to the id of the turn each follows and
    ``previous_text`` to its first :data:`PREVIOUS_CHARS` characters (or both None;
    a superseded turn lends no text: its words are hidden; nor one that :func:`lends_to`
    refuses)."""
    return [rec.replace(follows=before.id,
                        previous_text=clipped(before.content) if lends_to(before, rec) else None)
            if before is not None else rec.replace(follows=None, previous_text=None)
            for rec, before in zip(recs, turns_before(recs, previous), strict=True)]


def clipped(text: str) -> str:
    """``text`` cut to :data:`PREVIOUS_CHARS` characters, at a space when it has one
    (a word cut in two would be indexed as another word)."""
    if len(text) <= PREVIOUS_CHARS:
        return text
    cut = text[:PREVIOUS_CHARS]
    head, space, _ = cut.rpartition(" ")
    return head if space else cut


def context_text(rec: Record, previous: Record | None, config: Config) -> str:
    """What is embedded for ``rec``: a conversation turn carries the turn before it
    (when :func:`lends_to` allows)."""
    if (config.embedding.neighbour_context and rec.type == MemoryType.CONVERSATION.value
            and previous is not None and _close(previous, rec) and lends_to(previous, rec)):
        return f"{previous.content}\n{rec.content}"
    return rec.content


def lends_to(before: Record, rec: Record) -> bool:
    """Whether ``rec`` may be indexed with the words of ``before``, the turn it follows:
    ``before`` is not superseded, and everyone who can find ``rec`` can find ``before``."""
    return not before.hidden and _visible_with(before, rec)


def _visible_with(before: Record, rec: Record) -> bool:
    """Everyone who sees ``rec`` sees ``before``: ``before`` is unscoped or shared, or
    both are the same user's and ``rec`` is not shared (a shared or unscoped turn is
    seen by every user, so it borrows only from turns every user sees)."""
    if before.owner is None or before.shared:
        return True
    return rec.owner == before.owner and not rec.shared


def _close(previous: Record, rec: Record) -> bool:
    """``rec`` came at most :data:`NEIGHBOUR_SECONDS` after ``previous`` (never before it)."""
    return 0 <= rec.created - previous.created <= NEIGHBOUR_SECONDS


def check_search(query: Any, limit: Any, min_score: Any, mode: str | None, config: Config) -> str:
    """Validate search arguments; returns the mode to use."""
    validate_text(query, "query", config)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise ValidationError(f"limit must be an integer from 1 to 1000, got {limit!r}", field="limit")
    if isinstance(min_score, bool) or not isinstance(min_score, int | float) or not math.isfinite(min_score):
        raise ValidationError(f"min_score must be a number, got {min_score!r}", field="min_score")
    mode = mode or config.search.mode
    if mode not in MODES:
        raise ValidationError(f"mode must be hybrid, vector or lexical, got {mode!r}", field="mode")
    return mode


def check_seconds(value: Any, field: str, *, finite: bool = False) -> float:
    """``value`` as a float number of seconds >= 0 (``inf``, no limit, unless ``finite``);
    raises ValidationError naming ``field`` otherwise (NaN, negative, bool, not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 \
            or (finite and not math.isfinite(value)):
        raise ValidationError(f"{field} must be a number of seconds >= 0, not {value!r}", field=field)
    return float(value)


def check_str(value: Any, field: str) -> None:
    """Raise ValidationError unless ``value`` is a string."""
    if not isinstance(value, str):
        raise ValidationError(f"{field} must be a string, got {type(value).__name__}", field=field)
