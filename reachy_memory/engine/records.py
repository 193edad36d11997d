"""The record and operation schema: what a memory is on disk and in RAM.

A :class:`Record` is one stored memory with named fields.  It is encoded as a
msgpack map (record format v2) that leaves out every optional field still at
its default, so old readers' sizes are kept and new fields cost nothing until
used.  Record format v1 (before named fields) was a positional list of 8
values; :func:`decode` reads both, so a v1 snapshot or journal migrates on the
next compaction without a conversion step (tested with a v1 fixture).

Journal operations (``docs/FORMAT.md``, "Operations")::

    ["put", record, vector | None]   store or replace a memory
    ["del", id]                      delete a memory
    ["expire", time]                 delete every memory expired at ``time`` (a sweep)
    ["ttl", type, seconds]           every stored memory of ``type`` (conversation) expires
                                     ``seconds`` after its creation (a retention change)
    ["redate", since, until, delta]  every memory and window turn dated in ``[since, until)``
                                     moves by ``delta`` (a clock set right by NTP's first sync)
    ["win", role, content, time]     append a turn to the context window
    ["winclr"]                       clear the context window
    ["model", key]                   the vector space of the stored vectors
    ["update", id, {field: value}]   change fields of a memory that leave its text and
                                     vector alone (see :data:`MUTABLE_FIELDS`)
    {"op": "person_put" | "person_merge" | "person_delete", ...}   persons (``people.py``)

A record is **immutable once the state has placed it**: a change is a new
record put in its place.  Background compaction relies on this (it writes
records from a shallow copy of the record table while the engine goes on).
The one exception is ``expires``, set in place by a ``ttl`` op for every turn
at once (``MemoryState.retime`` says why that is safe).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from reachy_memory.errors import ValidationError
from reachy_memory.model import Memory, MemoryType, to_datetime

__all__ = ["MUTABLE_FIELDS", "OP_KINDS", "RECORD_FIELDS", "RECORD_VERSION", "Record", "decode", "encode", "first_dim",
           "first_vkey", "is_put", "record_id"]

RECORD_VERSION = 2
OP_KINDS = frozenset({"put", "del", "expire", "ttl", "redate", "win", "winclr", "model", "update"})

_V1_FIELDS = ("id", "content", "type", "created", "expires", "metadata", "slot", "vkey")
# Optional fields and their defaults: left out of the encoded map when at the default.
_OPTIONAL: dict[str, Any] = {
    "subjects": (),  # ids of the persons the memory is about
    "owner": None,  # the user of the robot it belongs to; None: unscoped
    "shared": False,  # a household fact every owner sees
    "name": None,  # a unique note name (its words are searchable)
    "aliases": (),  # other names of the note (resolution only)
    "superseded_at": None,  # epoch when a newer memory replaced it (hidden from default retrieval)
    "superseded_by": None,  # id of that newer memory
    "protected": False,  # confirmed: never superseded automatically
    "covers_until": None,  # an archive: the conversation it summarises ends here (epoch)
    "confidence": 1.0,  # decay (opt-in): the confidence at ``last_access``
    "last_access": None,  # decay clock: when retrieval last returned it (None: created)
    "follows": None,  # a conversation turn: id of the turn it answers (the previous-turn rule)
    "previous_text": None,  # and that turn's text when stored: a second field of its lexical document
}
# What an "update" op may change: everything but the text, type, times and vector.
MUTABLE_FIELDS = frozenset({"subjects", "owner", "shared", "name", "aliases", "superseded_at", "superseded_by",
                            "protected", "metadata", "confidence", "last_access"})
RECORD_FIELDS = (*_V1_FIELDS, *_OPTIONAL)


class Record:
    """A stored memory, in the compact form kept in RAM and on disk.

    ``slot`` is the row of the memory in the vector and lexical indexes
    (assigned by the state when placed); ``vkey`` names the vector space of
    its vector, None when it has none.
    """

    __slots__ = RECORD_FIELDS

    id: str
    content: str
    type: str
    created: float
    expires: float | None
    metadata: dict[str, Any]
    slot: int
    vkey: str | None
    subjects: tuple[str, ...]
    owner: str | None
    shared: bool
    name: str | None
    aliases: tuple[str, ...]
    superseded_at: float | None
    superseded_by: str | None
    protected: bool
    covers_until: float | None
    confidence: float
    last_access: float | None
    follows: str | None
    previous_text: str | None

    def __init__(self, id: str, content: str, type: str, created: float, expires: float | None,
                 metadata: dict[str, Any], slot: int = -1, vkey: str | None = None, **optional: Any) -> None:
        self.id, self.content, self.type = id, content, type
        self.created, self.expires, self.metadata = created, expires, metadata
        self.slot, self.vkey = slot, vkey
        for name, default in _OPTIONAL.items():
            value = optional.pop(name, default)
            object.__setattr__(self, name, tuple(value) if isinstance(default, tuple) else value)
        if optional:
            raise ValidationError(f"unknown record fields {sorted(optional)}", field="record")

    def replace(self, **changes: Any) -> Record:
        """A copy with ``changes`` applied (placed records change only this way, but for a
        ``ttl`` op's expiries: ``MemoryState.retime``)."""
        fields = {name: getattr(self, name) for name in RECORD_FIELDS}
        return Record(**{**fields, **changes})

    @property
    def lexical_text(self) -> str:
        """What the lexical index holds for this memory: its text, and its note name."""
        return f"{self.content}\n{self.name}" if self.name else self.content

    @property
    def words(self) -> tuple[str, str | None]:
        """The two fields of its lexical document: its text, and the previous turn's."""
        return self.lexical_text, self.previous_text

    @property
    def hidden(self) -> bool:
        """Left out of default retrieval (superseded), never deleted."""
        return self.superseded_at is not None

    def decayed(self, now: float, rate_per_day: float, threshold: float) -> bool:
        """True when a fact's decayed confidence is below ``threshold`` (opt-in decay;
        confirmed facts and other types never decay)."""
        if self.protected or self.type != MemoryType.FACT.value:
            return False
        days = max(now - (self.last_access or self.created), 0.0) / 86400.0
        return self.confidence * math.exp(-rate_per_day * days) < threshold

    def expired(self, now: float) -> bool:
        """True when the memory's lifetime ended at or before ``now``."""
        return self.expires is not None and self.expires <= now

    def memory(self) -> Memory:
        """The public, immutable view of this record."""
        return Memory(self.id, self.content, MemoryType(self.type), to_datetime(self.created),
                      dict(self.metadata), to_datetime(self.expires) if self.expires is not None else None,
                      subjects=self.subjects, owner=self.owner, shared=self.shared, name=self.name,
                      aliases=self.aliases,
                      superseded_at=to_datetime(self.superseded_at) if self.superseded_at is not None else None,
                      superseded_by=self.superseded_by, protected=self.protected,
                      covers_until=to_datetime(self.covers_until) if self.covers_until is not None else None)

    def __repr__(self) -> str:
        return f"Record({self.id!r}, {self.type}, slot={self.slot})"


def encode(rec: Record) -> dict[str, Any]:
    """The record as a v2 map (optional fields at their default left out)."""
    out = {name: getattr(rec, name) for name in _V1_FIELDS}
    for name, default in _OPTIONAL.items():
        value = getattr(rec, name)
        if value != default:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def decode(obj: Any) -> Record:
    """A record from its v2 map or its v1 positional list.

    Raises ValidationError for anything else (the caller turns it into a
    CorruptionError naming the file and offset).
    """
    if isinstance(obj, dict):
        missing = [name for name in _V1_FIELDS[:6] if name not in obj]
        if missing:
            raise ValidationError(f"record lacks {missing}", field="record")
        fields = dict(obj)
        for name, default in _OPTIONAL.items():
            if isinstance(default, tuple) and name in fields:
                if not isinstance(fields[name], list | tuple):  # a string was taken letter by letter
                    raise ValidationError(f"record field {name} must be a list", field="record")
                fields[name] = tuple(fields[name])
        if not isinstance(fields["content"], str) or not isinstance(fields.get("previous_text"), str | None):
            raise ValidationError("record texts must be strings", field="record")  # the indexes tokenise them
        # Optional fields given (open decodes 100k: a count, not a key set; a map may leave out slot and vkey)
        if len(fields) > len(_V1_FIELDS) or "slot" not in fields or "vkey" not in fields:
            _check_optional(fields)
        return _checked_required(_checked_times(_shared_strings(Record(**fields))))
    if isinstance(obj, list | tuple) and len(obj) == len(_V1_FIELDS):
        return _checked_required(_checked_times(_shared_strings(Record(*obj))))
    raise ValidationError(f"not a record: {type(obj).__name__}", field="record")


_TYPES = frozenset(t.value for t in MemoryType)


def _checked_required(rec: Record) -> Record:
    """``rec``, its fixed fields' types checked: a record of a file that did not come from
    this store (a backup edited by hand, or crafted) with an id that is not text, an unknown
    type, metadata that is not a map or a slot that is not a whole number opened, and then
    failed in a listing or a search (a foreign exception), or at the first write.
    Raises ValidationError."""
    if not (type(rec.id) is str and rec.id and type(rec.slot) is int and type(rec.metadata) is dict
            and type(rec.type) is str and rec.type in _TYPES and (rec.vkey is None or type(rec.vkey) is str)):
        raise ValidationError(f"record {str(rec.id)[:64]!r}: a field of the wrong type (id and type are text, "
                              "metadata a map, slot a whole number, vkey text or nil)", field="record")
    return rec


def _text(value: Any) -> bool:
    return value is None or type(value) is str


def _time(value: Any) -> bool:
    return value is None or (_number(value) and _EARLIEST <= value <= _LATEST)


# What each optional field may hold (absent: the default); last_access is checked with the times.
_OPTIONAL_OK: dict[str, Any] = {
    **dict.fromkeys(("owner", "name", "superseded_by", "follows", "previous_text"), _text),
    **dict.fromkeys(("subjects", "aliases"), lambda value: all(type(v) is str for v in value)),
    **dict.fromkeys(("shared", "protected"), lambda value: type(value) is bool),
    **dict.fromkeys(("superseded_at", "covers_until"), _time),
    "confidence": lambda value: _number(value),
    "last_access": lambda value: True,
}


def _check_optional(fields: dict[str, Any]) -> None:
    """Check the optional fields of a record's map (see :func:`_checked_required`).
    Raises ValidationError naming the field."""
    for name, value in fields.items():
        check = _OPTIONAL_OK.get(name)
        if check is not None and not check(value):
            raise ValidationError(f"record {str(fields['id'])[:64]!r}: field {name} holds {str(value)[:64]!r}",
                                  field="record")


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


# Epoch seconds a datetime can show (years 1..9999, with a day's margin for time zones).
_EARLIEST, _LATEST = -62_135_510_400.0, 253_402_214_400.0


def _checked_times(rec: Record) -> Record:
    """``rec``, its times checked: a stored time a datetime cannot show (2^40 s is in
    the year 36812) would make every listing of the memory fail, long after open."""
    for value in (rec.created, rec.expires, rec.last_access):  # no getattr or isinstance: open decodes 100k
        # a non-number fails the comparison with TypeError, which the callers report as damage too
        if value is not None and not _EARLIEST <= value <= _LATEST:
            raise ValidationError(f"record time {value!r} is not a usable time", field="record")
    return rec


def _shared_strings(rec: Record) -> Record:
    """``rec`` with its type and vector key interned (one object each for every record):
    every decoded record had its own copies (~140 bytes a record, 14 MB at 100k)."""
    if isinstance(rec.type, str):
        rec.type = sys.intern(rec.type)
    if isinstance(rec.vkey, str):
        rec.vkey = sys.intern(rec.vkey)
    return rec


def record_id(obj: Any) -> str | None:
    """The id of an encoded record (either version) without decoding the rest."""
    if isinstance(obj, dict):
        value = obj.get("id")
    elif isinstance(obj, list | tuple) and obj:
        value = obj[0]
    else:
        return None
    return value if isinstance(value, str) else None


def first_vkey(ops: list[list[Any]]) -> str | None:
    """The vector space named by the first stored memory in ``ops`` (a rebuild with no snapshot)."""
    return next((decode(op[1]).vkey for op in ops if is_put(op) and decode(op[1]).vkey is not None), None)


def first_dim(ops: list[list[Any]]) -> int | None:
    """The dimension of the first stored vector in ``ops`` (a rebuild with no snapshot)."""
    return next((len(op[2]) // 4 for op in ops if is_put(op) and op[2]), None)


def is_put(op: Any) -> bool:
    """A memory put (person ops are maps, the others lists)."""
    return isinstance(op, list) and bool(op) and op[0] == "put"
