"""The data model: memory types, memories and search results.

Timestamps are timezone-aware UTC ``datetime`` objects.  Expiry follows the
spec: CONVERSATION lives ``conversation_ttl_days`` (30) days, FACT forever,
CONTEXT until the end of the local day it was created in, "local" being the
configured ``memory.timezone`` (an IANA name, or the system's zone).  A memory
is expired when ``now >= expires_at``.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from reachy_memory.errors import ConfigError, ValidationError

# Search defaults, stated once: the store, the protocol table, both clients, the CLI and the
# LLM tools take them from here (tests/test_operations.py checks they agree).
SEARCH_LIMIT = 5
SEARCH_MIN_SCORE = 0.3


class MemoryType(enum.Enum):
    """The three kinds of memory."""

    CONVERSATION = "conversation"  # dialogue; expires after memory.conversation_ttl_days (30 by default)
    FACT = "fact"  # preferences, people, learned things; never expires
    CONTEXT = "context"  # current task or topic; expires at the end of the day

    @classmethod
    def parse(cls, value: MemoryType | str) -> MemoryType:
        """Accept a member, its value or its name (any case); raise ValidationError."""
        if isinstance(value, MemoryType):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        allowed = ", ".join(m.value for m in cls)
        raise ValidationError(f"memory_type must be one of {allowed}; got {value!r}", field="memory_type")


@dataclass(frozen=True, slots=True)
class Memory:
    """One stored memory (immutable view).

    The people-aware fields (all optional): ``subjects`` are the ids of the
    persons it is about; ``owner`` the user it belongs to (None: unscoped) and
    ``shared`` a household fact every owner sees; ``name``/``aliases`` make it a
    named note; ``superseded_at``/``superseded_by`` say a newer memory replaced
    it (hidden from default retrieval, never deleted); ``protected`` means
    confirmed (never superseded automatically); ``covers_until`` marks an
    archive (a summary of the conversation up to that time).
    """

    id: str
    content: str
    memory_type: MemoryType
    created_at: datetime
    metadata: dict[str, Any] = field(default_factory=dict)
    expires_at: datetime | None = None
    subjects: tuple[str, ...] = ()
    owner: str | None = None
    shared: bool = False
    name: str | None = None
    aliases: tuple[str, ...] = ()
    superseded_at: datetime | None = None
    superseded_by: str | None = None
    protected: bool = False
    covers_until: datetime | None = None

    @property
    def is_archive(self) -> bool:
        """True for a conversation summary made by ``archive_conversation``."""
        return self.covers_until is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (ISO 8601 timestamps)."""
        return {
            "id": self.id,
            "content": self.content,
            "type": self.memory_type.value,
            "created_at": self.created_at.isoformat(),
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "metadata": dict(self.metadata),
            "subjects": list(self.subjects),
            "owner": self.owner,
            "shared": self.shared,
            "name": self.name,
            "aliases": list(self.aliases),
            "superseded_at": self.superseded_at.isoformat() if self.superseded_at else None,
            "superseded_by": self.superseded_by,
            "protected": self.protected,
            "covers_until": self.covers_until.isoformat() if self.covers_until else None,
        }


@dataclass(frozen=True, slots=True)
class SearchResult:
    """A search hit.

    ``score`` is in [0, 1], higher is more relevant: in hybrid mode the fused
    score (see ``store`` docs), in vector mode the cosine similarity clipped
    at 0, in lexical mode BM25 over the query's ceiling score.
    ``min_score`` in ``search`` is compared with this value.
    """

    memory: Memory
    score: float
    subject_names: tuple[str, ...] = ()  # display names of the memory's persons, at query time


def resolve_timezone(name: str) -> tzinfo:
    """The tzinfo for a config value: an IANA name, or "local" (:func:`system_zone`)."""
    if name == "local":
        return system_zone()
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigError(f"memory.timezone: unknown time zone {name!r}", key="memory.timezone") from exc


def system_zone() -> tzinfo:
    """The system's zone with its rules, daylight saving included, as the C library finds
    it: ``$TZ`` naming a zone or a zone file (an optional leading ``:``; empty: UTC), else
    ``/etc/localtime``.  A ``$TZ`` that is no zone file (a POSIX rule such as
    ``CET-1CEST,M3.5.0,M10.5.0/3``) or no readable ``/etc/localtime`` gives the offset in
    force now, fixed: without its rules a daemon started in winter would end every summer
    day at 01:00 (``datetime.now().astimezone()`` alone did that with every system zone)."""
    spec = os.environ.get("TZ")
    try:
        if spec is None:
            with open("/etc/localtime", "rb") as file:
                return ZoneInfo.from_file(file, key="localtime")
        spec = spec.removeprefix(":")
        if not spec:
            return UTC
        if os.path.isabs(spec):
            with open(spec, "rb") as file:
                return ZoneInfo.from_file(file, key=spec)
        return ZoneInfo(spec)
    except (OSError, ValueError, ZoneInfoNotFoundError):
        local = datetime.now().astimezone().tzinfo
        return local if local is not None else UTC


class Expiry:
    """Computes ``expires_at`` for each type from the configured TTLs."""

    def __init__(self, conversation_ttl_days: float, tz: tzinfo) -> None:
        self._conversation_ttl = conversation_ttl_days * 86400.0
        self._tz = tz

    def expires(self, memory_type: MemoryType, created: float) -> float | None:
        """Expiry as a UTC epoch, or None for never (FACT)."""
        if memory_type is MemoryType.FACT:
            return None
        if memory_type is MemoryType.CONVERSATION:
            return created + self._conversation_ttl
        local = datetime.fromtimestamp(created, self._tz)
        # The next day's midnight, by the zone's rules for that day (a DST change is honoured).
        midnight = datetime(local.year, local.month, local.day, tzinfo=self._tz) + timedelta(days=1)
        end = midnight.timestamp()
        # A clock set back over midnight (00:01 -> 23:01) shows it twice: the first may be past.
        return end if end > created else midnight.replace(fold=1).timestamp()


# The range of timestamps a memory may carry (created_at, expires_at): 2000-01-01 .. 2200-01-01 UTC.
# Outside it a value is a mistake (1e300, year 9999) that would make the memory unreadable.
MIN_TIME = 946_684_800.0
MAX_TIME = 7_258_118_400.0


def check_time(value: datetime | float | None, field: str) -> float | None:
    """``value`` as epoch seconds, or None; ValidationError naming ``field`` when it is
    not a finite time between 2000-01-01 and 2200-01-01 UTC."""
    try:
        epoch = to_epoch(value)
    except (OverflowError, OSError, ValueError) as exc:
        raise ValidationError(f"{field}: {value!r} is not a usable time", field=field) from exc
    except ValidationError as exc:
        raise ValidationError(f"{field}: expected a datetime or epoch seconds, got {value!r}", field=field) from exc
    if epoch is not None and not MIN_TIME <= epoch <= MAX_TIME:
        raise ValidationError(f"{field}: {value!r} is outside 2000-01-01..2200-01-01 UTC", field=field)
    return epoch


def check_unicode(text: str, field: str) -> str:
    """``text`` unless it holds a lone surrogate (no file, reply or tokenizer can take
    it: "\\ud800" from a broken JSON escape); ValidationError naming ``field`` then."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValidationError(f"{field} is not valid Unicode: a lone surrogate at character {exc.start}",
                                  field=field) from exc
    return text


def to_datetime(epoch: float) -> datetime:
    """UTC epoch seconds -> aware UTC datetime."""
    return datetime.fromtimestamp(epoch, UTC)


def to_epoch(value: datetime | float | None) -> float | None:
    """Aware datetime (naive is taken as UTC) or epoch -> epoch seconds."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationError(f"expected a datetime or epoch seconds, got {value!r}", field="now")
    return float(value)


def merged_metadata(metadata: Any, fields: dict[str, Any]) -> Any:
    """``metadata`` (a dict, or None) with keyword ``fields`` laid over it; anything else
    than a dict is passed on as it is, for the store's checks to refuse by name."""
    if not fields:
        return metadata
    if metadata is None:
        return fields
    return {**metadata, **fields} if isinstance(metadata, dict) else metadata
