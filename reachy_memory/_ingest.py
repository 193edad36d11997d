"""Ingest: validating what callers send, and the previous-turn rule.

Pure functions over the configuration and the records already stored; they
never change the state (the store commits what they return).  Everything here
raises :class:`ValidationError` / :class:`TooLargeError` before anything is
written.

The previous-turn rule: a conversation turn is embedded together with the turn
stored just before it (when that turn is at most :data:`NEIGHBOUR_SECONDS`
older), because a reply ("yes, on Tuesdays") means little without what it
answers.  The store resolves "the turn before" on the engine thread at commit.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from ._filters import validate_metadata
from ._records import Record
from .config import Config
from .errors import TooLargeError, ValidationError
from .model import Expiry, MemoryType, check_time, check_unicode

NEIGHBOUR_SECONDS = 600.0  # a previous turn older than this is not context any more
# Of the previous turn's text, what a turn keeps for its lexical document: a bound on the
# copy (one more string per turn), longer than almost any utterance.
PREVIOUS_CHARS = 1000
ITEM_KEYS = frozenset({"content", "memory_type", "metadata", "id", "created_at"})
MODES = ("hybrid", "vector", "lexical")

Item = tuple[str, str, dict[str, Any], str | None, float | None]  # content, type, metadata, id, created_at


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


def validate_item(item: Any, config: Config) -> Item:
    """One item of a batch store, checked: (content, type, metadata, id, created_at)."""
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
    if memory_id is not None and (not isinstance(memory_id, str) or not 0 < len(memory_id) <= 128):
        raise ValidationError("id must be a non-empty string of at most 128 characters", field="id")
    return content, mtype.value, metadata, memory_id, check_time(item.get("created_at"), "created_at")


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


def check_duplicate(existing: Record | None, memory_id: str, content: str, mtype: str) -> bool:
    """True when ``memory_id`` already holds this memory (an idempotent retry).

    Raises ValidationError when the id holds a different memory.
    """
    if existing is None:
        return False
    if existing.content != content or existing.type != mtype:
        raise ValidationError(f"id {memory_id!r} is already used by another memory", field="id")
    return True


def new_records(items: list[Item], now: float, expiry: Expiry,
                stored: Mapping[str, Record]) -> tuple[list[Record], list[str]]:
    """Records for validated items (``created_at`` defaults to ``now``), leaving out
    retries of memories already ``stored``; returns (records, the id of every item)."""
    recs: dict[str, Record] = {}
    ids: list[str] = []
    for content, mtype, metadata, memory_id, created_at in items:
        memory_id = memory_id or uuid.uuid4().hex
        ids.append(memory_id)
        if check_duplicate(stored.get(memory_id), memory_id, content, mtype) or memory_id in recs:
            continue
        created = now if created_at is None else created_at
        expires = expiry.expires(MemoryType(mtype), created)
        recs[memory_id] = Record(memory_id, content, mtype, created, expires, metadata)
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
    a superseded turn lends no text: its words are hidden)."""
    return [rec.replace(follows=before.id, previous_text=None if before.hidden else clipped(before.content))
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
    """What is embedded for ``rec``: a conversation turn carries the turn before it."""
    if (config.embedding.neighbour_context and rec.type == MemoryType.CONVERSATION.value
            and previous is not None and _close(previous, rec)):
        return f"{previous.content}\n{rec.content}"
    return rec.content


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


def check_str(value: Any, field: str) -> None:
    """Raise ValidationError unless ``value`` is a string."""
    if not isinstance(value, str):
        raise ValidationError(f"{field} must be a string, got {type(value).__name__}", field=field)
