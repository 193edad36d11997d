"""The LLM tools of the spec ("MCP Tools (3 tools)"), defined once.

:data:`TOOLS` is the single table: each :class:`ToolDef` has the spec's name, a
description a language model can act on, its parameters (as JSON Schema and as
Python annotations), an argument check and the call that runs it on a
:class:`Backend`.  The MCP server (:mod:`reachy_memory.mcp_server`) and the
conversation-app tools (:mod:`.conversation`) are both generated from it, so a
new operation (``remember``/``recall``) is added here once.

Backends:

* :class:`DaemonBackend` talks to ``reachy-memory serve`` through
  :class:`~reachy_memory.AsyncMemoryClient`; when no daemon answers it raises
  :class:`~reachy_memory.DaemonUnavailableError` whose message says how to start one.
  Its writes (``store_memory``, ``remember``) are safe to send again: each memory a
  call writes gets an id made for that call, and a write failing "not now" (no daemon
  listening, no reply, busy: a restart) is sent again with the same ids for up to
  ``retry_for`` seconds (the client's timeout by default) after its first failure; the
  daemon keeps it once however often it arrives. So the model is told "kept" (with the
  ids) or "not stored"; only when an attempt got no reply and the daemon stays away, or
  the daemon kept it before its disk failed (an fsync error), is it told the memory may
  have been kept (a ``remember`` is one journal frame: a full disk stores none of it). A write whose client
  was closed (ClosedError) is not sent again. A daemon from before the ids (it refuses
  them) gets the write once without.
* :class:`LocalBackend` opens a :class:`~reachy_memory.MemoryStore` in this
  process (a desktop without the daemon); the store is used only by one worker
  thread, its owner.

The current user (``owner``): a backend may be bound to the user who is speaking,
which the application knows (face or voice recognition), never the language model
(no tool has an ``owner`` parameter: a model could name another user). Bound,
``search_memories`` and ``recall`` see that user's memories plus shared and
unscoped ones; ``remember`` and ``store_memory`` of a fact store facts owned by the
user (``shared=true``: a household fact every user sees); ``forget_memory`` refuses
a memory another user owns and has not shared (``success: false``, the reply for an
unknown id, so another user's ids are not confirmed); persons named in
``subjects``/``about`` are resolved among the user's and the household's, and a
result's ``about`` names only those; a bound ``remember`` takes no note name (note
names are one namespace for the store: "already used by memory <id>" would confirm
another user's note); ``store_memory`` of a ``conversation`` or ``context`` memory
stores it owned by the user too (the backend's ``store`` passes the owner: another
user's ``search_memories`` does not find it).
Unbound (``owner=None``, the default) a backend behaves as before: it sees every
user's memories.  ``backend.owner = "bob"`` switches the user for the calls that
start afterwards (each call reads it once when it starts; set it on the thread
running the calls, between turns); ``backend.for_owner("bob")`` is a view on the
same connection or store bound to another user, for callers on one loop that
serve different users at once.

Errors are :class:`~reachy_memory.ReachyMemoryError` subclasses carrying the
daemon's (or store's) message; callers turn them into their tool-error form.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self, TypeGuard, cast

from reachy_memory.client import AsyncMemoryClient, MemoryClient, refuses_ids
from reachy_memory.config import RANGES, Config, MemoryConfig
from reachy_memory.daemon.endpoint import ipc_listener_gone, resolve_endpoint
from reachy_memory.daemon.protocol import retryable
from reachy_memory.engine.ingest import check_owner, check_seconds
from reachy_memory.engine.mentions import norm
from reachy_memory.errors import (
    DaemonUnavailableError,
    ReachyMemoryError,
    ReadOnlyError,
    RequestTimeoutError,
    ValidationError,
)
from reachy_memory.model import SEARCH_LIMIT, Memory, MemoryType, SearchResult
from reachy_memory.people.registry import names_someone

MEMORY_TYPES: tuple[str, ...] = tuple(m.value for m in MemoryType)
MAX_LIMIT = 50
MAX_ERROR_CHARS = 1000  # an error text a tool hands a model (it may echo a huge bad value)
MAX_CONTENT_CHARS = 600  # of one memory in a search or recall result (a voice model reads it)
MAX_RESULT_CHARS = 6000  # of a search or recall result's JSON: the best hits that fit
START_HINT = ("start it with `reachy-memory serve` (on the robot: `sudo systemctl start reachy-memory`), "
              "or run `reachy-memory mcp --data-dir DIR` to open a store in this process instead")

DEFAULT_CONVERSATION_DAYS = MemoryConfig.conversation_ttl_days  # what TOOLS say: the default config's
# A write sent again while the daemon restarts: the pauses between attempts (doubling, capped; a
# model waits on the call, so shorter than the bridge's) and the shortest timeout of a late attempt.
_FIRST_PAUSE, _LONGEST_PAUSE, _SHORTEST_ATTEMPT = 0.05, 0.5, 0.5
_MAYBE_KEPT = "the memory may have been kept: search for it before storing it again"


def retention_text(days: float) -> str:
    """How long a conversation memory is kept, as a model reads it: ``"30 days"``, ``"1 day"``,
    ``"1.5 days"``, ``"12 hours"`` (under a day: hours; one decimal at most)."""
    amount, unit = (round(days * 24, 1), "hour") if days < 1 else (round(days, 1), "day")
    return f"{amount:g} {unit}{'' if amount == 1 else 's'}"


def type_guide(conversation_days: float) -> str:
    """The memory types and how long each is kept, conversation turns for ``conversation_days``."""
    return ('"fact": lasting knowledge (preferences, names, relationships, birthdays, things learned about '
            f'people or the home), kept forever; "conversation": things that were said, kept '
            f'{retention_text(conversation_days)}; "context": the current task, topic or situation, kept until '
            'the end of today.')


TYPE_GUIDE = type_guide(DEFAULT_CONVERSATION_DAYS)


class Backend(Protocol):
    """Where the tools' memory lives (the daemon, or a store in this process).

    Binding a user takes more: ``owner`` and ``for_owner`` (see :class:`DaemonBackend`);
    a backend without them serves only unbound callers."""

    async def search(self, query: str, memory_type: str | None, limit: int) -> list[SearchResult]: ...

    async def store(self, content: str, memory_type: str, metadata: dict[str, Any] | None) -> Memory: ...

    async def forget(self, memory_id: str) -> bool: ...

    async def remember(self, args: dict[str, Any]) -> list[Memory]: ...

    async def recall(self, query: str, about: str | None, limit: int) -> list[SearchResult]: ...

    async def knows(self, reference: str) -> bool: ...

    async def context(self, message: str, max_tokens: int, max_memories: int) -> Any: ...

    async def aclose(self) -> None: ...


# -- parameters and their check ----------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One tool parameter: JSON Schema for LLM clients, an annotation for typed servers."""

    name: str
    schema: dict[str, Any]
    annotation: Any
    description: str
    required: bool = False
    default: Any = None
    nullable: bool = False

    def check(self, tool: str, value: Any) -> Any:
        """The value, or ValidationError naming the tool and parameter."""
        if value is None and self.nullable:
            return None
        if "enum" in self.schema and isinstance(value, str):
            value = value.strip().lower()  # "Fact" from a model means "fact"
        problem = _problem(self.schema, value)
        if problem:
            raise ValidationError(f"{tool}: {self.name} {problem}", field=self.name)
        return value


def _problem(schema: dict[str, Any], value: Any) -> str | None:
    kind = schema["type"]
    if kind == "string":
        if not isinstance(value, str):
            return f"must be a string, got {value!r}"
        if "enum" in schema and value not in schema["enum"]:
            return f"must be one of {', '.join(schema['enum'])}; got {value!r}"
        if not value.strip() and schema.get("minLength", 0) > 0:
            return "must not be empty"
    elif kind == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {value!r}"
        if not schema["minimum"] <= value <= schema["maximum"]:
            return f"must be between {schema['minimum']} and {schema['maximum']}, got {value}"
    elif kind == "object" and not isinstance(value, dict):
        return f"must be an object of key/value pairs, got {value!r}"
    elif kind == "boolean" and not isinstance(value, bool):
        return f"must be true or false, got {value!r}"
    elif kind == "array":
        return _array_problem(schema, value)
    return None


def _array_problem(schema: dict[str, Any], value: Any) -> str | None:
    if not isinstance(value, list) or len(value) > schema.get("maxItems", 100):
        return f"must be a list of at most {schema.get('maxItems', 100)} items, got {value!r}"
    for item in value:
        problem = _problem(schema["items"], item)
        if problem:
            return f"item {problem}"
        if isinstance(item, dict) and not isinstance(item.get("content"), str):
            return "items must each have a content string"
    return None


# -- the tools ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolDef:
    """One tool: what an LLM sees (name, description, schema), what it runs, and the text a
    model reads of its result (:attr:`text`: MCP sends it beside the structured content)."""

    name: str
    description: str
    params: tuple[Param, ...]
    call: Callable[[Backend, dict[str, Any]], Awaitable[Any]]
    read_only: bool = False
    destructive: bool = False
    returns: Any = field(default=dict[str, Any])
    text: Callable[[dict[str, Any], Any], str] = field(default=lambda args, result: _json_text(result))

    def parameters_schema(self) -> dict[str, Any]:
        """The parameters as one JSON Schema object (OpenAI / conversation-app style). An optional
        parameter is typed nullable (``null`` means "omitted": :meth:`check` fills its default);
        no other key is taken (``additionalProperties: false``, and :meth:`check` refuses one)."""
        props = {p.name: {**p.schema, "description": p.description} for p in self.params}
        for p in self.params:
            if not p.required:
                props[p.name].update(_nullable(p.schema))
                if p.default is not None:
                    props[p.name]["default"] = p.default
        return {"type": "object", "properties": props, "required": [p.name for p in self.params if p.required],
                "additionalProperties": False}

    def check(self, args: Mapping[str, Any], ignored: frozenset[str] = frozenset()) -> dict[str, Any]:
        """Checked arguments with defaults filled in (``null`` for an optional one counts as
        omitted). A key the tool does not take is refused, naming the ones it takes, unless it
        is in ``ignored`` (a dispatcher's own, e.g. the conversation app's ``tool_manager``).
        Raises ValidationError."""
        unknown = sorted(str(k) for k in args if k not in self._names and k not in ignored)
        if unknown:
            shown = ", ".join(repr(k[:40]) for k in unknown[:5]) + (f" and {len(unknown) - 5} more"
                                                                   if len(unknown) > 5 else "")
            raise ValidationError(f"{self.name}: unknown argument{'s' if len(unknown) > 1 else ''} {shown}; "
                                  f"it takes {', '.join(p.name for p in self.params)}", field=unknown[0][:40])
        out: dict[str, Any] = {}
        for p in self.params:
            if p.name not in args or args[p.name] is None:
                if p.required:
                    raise ValidationError(f"{self.name}: {p.name} is required", field=p.name)
                out[p.name] = p.default
                continue
            out[p.name] = p.check(self.name, args[p.name])
        return out

    @functools.cached_property
    def _names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.params)

    async def run(self, backend: Backend, args: Mapping[str, Any], ignored: frozenset[str] = frozenset()) -> Any:
        """Check ``args`` (``ignored``: as :meth:`check`) and run the tool on ``backend`` as bound
        when the call starts (a tool making two calls, ``recall``'s ``knows`` then ``recall``,
        must not serve another user's second half after ``backend.owner`` changes in between);
        raises ReachyMemoryError subclasses."""
        return await self.call(_pinned(backend), self.check(args, ignored))


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """The keys that make ``schema`` accept ``null`` too: its type as ``[type, "null"]`` and, for
    an enum, ``null`` among the values (JSON Schema checks both)."""
    made: dict[str, Any] = {"type": [schema["type"], "null"]}
    if "enum" in schema:
        made["enum"] = [*schema["enum"], None]
    return made


def _json_text(result: Any) -> str:
    """A result as compact JSON text (a tool without a text of its own)."""
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"))


def _pinned(backend: Backend) -> Backend:
    """``backend`` bound, for a whole call, to the user it has now (a view: ``owner`` read once);
    an unbound backend as it is (a call starting unbound already sees every user's memories)."""
    owner, for_owner = getattr(backend, "owner", None), getattr(backend, "for_owner", None)
    return backend if owner is None or for_owner is None else for_owner(owner)  # type: ignore[no-any-return]


def _no_note_names(backend: Backend, a: dict[str, Any]) -> None:
    """Refuse a note name (``name``/``aliases`` in a fact) from a bound user's ``remember``:
    note names are one namespace for the whole store, so the store's "already used by
    memory <id>" would confirm another user's note and hand out its id. Unbound, as before."""
    if getattr(backend, "owner", None) is None or not isinstance(a.get("facts"), list):
        return
    if any(isinstance(f, dict) and ("name" in f or "aliases" in f) for f in a["facts"]):
        raise ValidationError("remember: note names (name, aliases) are not available to a user-bound tool: "
                              "they are shared by every user of the robot", field="facts")


def _hit(h: SearchResult) -> dict[str, Any]:
    m = h.memory
    return {"id": m.id, "content": capped(m.content), "type": m.memory_type.value,
            "score": round(finite_score(float(h.score)), 4),
            "created_at": m.created_at.isoformat(), "metadata": dict(m.metadata)}


def capped(text: str, limit: int = MAX_CONTENT_CHARS) -> str:
    """``text``, or its first characters and how long it was when longer than ``limit``: a
    long note read out whole would fill a voice model's context (``get`` has all of it)."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text)} characters in all)"
    return text[:limit - len(tail)] + tail


def _within_budget(hits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best hits whose JSON fits :data:`MAX_RESULT_CHARS` (always the first): a result a
    model reads is bounded whatever the limit asked and however long each memory is."""
    kept: list[dict[str, Any]] = []
    used = 0
    for hit in hits:
        used += len(_json_text(hit)) + 1
        if kept and used > MAX_RESULT_CHARS:
            break
        kept.append(hit)
    return kept


async def _search(backend: Backend, a: dict[str, Any]) -> list[dict[str, Any]]:
    return _within_budget([_hit(h) for h in await backend.search(a["query"], a["memory_type"], int(a["limit"]))])


def hits_text(args: dict[str, Any], hits: list[dict[str, Any]]) -> str:
    """Search or recall results as a model reads them aloud: one line a memory (its type, the
    persons it is about, its id), or that nothing relevant is remembered."""
    if not hits:
        about = args.get("about")
        return f"Nothing relevant is remembered{f' about {about}' if about else ''}: say so instead of guessing."
    lines = [f"{len(hits)} memor{'y' if len(hits) == 1 else 'ies'} found, most relevant first:"]
    for h in hits:
        about = f", about {', '.join(h['about'])}" if h.get("about") else ""
        lines.append(f"- [{h['type']}{about}] {h['content']} (id {h['id']})")
    return "\n".join(lines)


def _stored_text(args: dict[str, Any], m: dict[str, Any]) -> str:
    return f"Stored as a {m['type']} (id {m['id']}): {capped(m['content'])}"


def _forget_text(args: dict[str, Any], r: dict[str, Any]) -> str:
    if r["success"]:
        return f"Forgot memory {r['id']}."
    return (f"No memory has the id {r['id']} (already forgotten, expired, or not an id from a result): "
            "nothing was deleted.")


def _remembered_text(args: dict[str, Any], r: dict[str, Any]) -> str:
    if not r["stored"]:
        return "Nothing was stored."
    lines = [f"Remembered {r['count']} fact{'s' if r['count'] != 1 else ''}:"]
    lines += [f"- {capped(m['content'])} (id {m['id']})" for m in r["stored"]]
    return "\n".join(lines)


async def _store(backend: Backend, a: dict[str, Any]) -> dict[str, Any]:
    """Spec 000's store; a fact goes the way of ``remember`` (its metadata kept), so it is
    linked to the person ``metadata.person`` names and a newer fact supersedes the one it
    contradicts: an LLM using this tool must not leave "likes tea" beside
    "likes coffee"."""
    if a["memory_type"] == "fact":
        # Only metadata.person names who it is about: reading persons from the sentence would
        # make "Trash day is Monday" a fact about a person named Trash.
        person = (a["metadata"] or {}).get("person")
        subjects = [person] if names_someone(person) else []  # else about nobody, its metadata kept
        [m] = await backend.remember({"facts": [{"content": a["content"], "metadata": a["metadata"],
                                                 "subjects": subjects}]})
    else:
        m = await backend.store(a["content"], a["memory_type"], a["metadata"])
    return {"id": m.id, "content": m.content, "type": m.memory_type.value, "created_at": m.created_at.isoformat()}


def _unwrapped(value: str) -> str:
    """An id (or a reference to a person) a model copied, without the quotes and
    whitespace models wrap copies in (no stored memory or person id starts or ends with
    those); ``value`` itself when nothing else is left."""
    return value.strip().strip("\"'`").strip() or value


async def _forget(backend: Backend, a: dict[str, Any]) -> dict[str, Any]:
    memory_id = _unwrapped(a["memory_id"])
    return {"success": bool(await backend.forget(memory_id)), "id": memory_id}


def _no_empty_subjects(a: dict[str, Any]) -> dict[str, Any]:
    """``a`` with ``subjects: []`` dropped, at the top and in each fact: models often send
    an empty array for an optional one, and to ``remember`` ``[]`` means "about nobody"
    (no persons read from the sentence, no "she" resolved).  Each subject is
    :func:`_unwrapped`: a person id copied from a result in quotes is that person, not a
    new one named after the id."""
    def subjects(value: Any) -> Any:
        return [_unwrapped(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    def clean(item: Any) -> Any:
        if not isinstance(item, dict):
            return item
        return {k: subjects(v) if k == "subjects" else v for k, v in item.items()
                if not (k == "subjects" and v == [])}

    out: dict[str, Any] = clean(a)
    if isinstance(out.get("facts"), list):
        out["facts"] = [clean(f) for f in out["facts"]]
    return out


def _no_fact_ids(a: dict[str, Any]) -> None:
    """Refuse an ``id`` in a fact from a model (as the store refused it before facts took ids):
    the ids are the backend's to make (one per fact per call), never a model's to choose."""
    if isinstance(a.get("facts"), list) and any(isinstance(f, dict) and "id" in f for f in a["facts"]):
        raise ValidationError("remember: a fact takes no id (each stored fact gets its own)", field="facts")


async def _remember(backend: Backend, a: dict[str, Any]) -> dict[str, Any]:
    _no_note_names(backend, a)
    _no_fact_ids(a)
    stored = await backend.remember(_no_empty_subjects(a))
    return {"stored": [{"id": m.id, "content": m.content, "subjects": list(m.subjects)} for m in stored],
            "count": len(stored)}


async def _recall(backend: Backend, a: dict[str, Any]) -> list[dict[str, Any]]:
    limit, about = int(a["limit"]), _unwrapped(a["about"]) if a["about"] else a["about"]
    knows = getattr(backend, "knows", None)  # a custom backend may predate it: unfiltered, as before
    if about and knows is not None and not await knows(about):
        # The store answers an unknown person unfiltered (spec 004); a model would read every
        # hit as about them. Keep only what metadata.person says is theirs, from the widest
        # page (an empty list: "nothing remembered about Bob").
        hits = await backend.recall(a["query"], about, MAX_LIMIT)
        hits = [h for h in hits if norm(str(h.memory.metadata.get("person", ""))) == norm(about)][:limit]
    else:
        hits = await backend.recall(a["query"], about, limit)
    return _within_budget([_hit(h) | ({"about": list(h.subject_names)} if h.subject_names else {}) for h in hits])


_TypeName = Literal["conversation", "fact", "context"]
_TYPE_SCHEMA = {"type": "string", "enum": list(MEMORY_TYPES)}


def _search_memories(conversation_days: float) -> ToolDef:
    """``search_memories``, its description saying conversation memories are kept ``conversation_days``."""
    return ToolDef(
        name="search_memories",
        description=(
            "Search the robot's long-term memory by meaning and by words. Use it before answering anything about "
            "the user, people the robot knows, past conversations or what is going on today (for example \"what "
            "food does Sarah like?\"). Returns the best matches, most relevant first, each with id, content, type, "
            "score (0 to 1, higher is more relevant), created_at and metadata. An empty list means nothing relevant "
            "is remembered: say so instead of guessing. Memory types: " + type_guide(conversation_days)),
        params=(
            Param("query", {"type": "string", "minLength": 1}, str,
                  "What to look for, as a question or keywords (e.g. \"Sarah's favourite food\").", required=True),
            Param("memory_type", _TYPE_SCHEMA, _TypeName | None,
                  "Only search this type: \"fact\", \"conversation\" or \"context\". Omit to search all.",
                  nullable=True),
            Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}, int,
                  f"Maximum number of results (1 to {MAX_LIMIT}).", default=SEARCH_LIMIT),
        ),
        call=_search, read_only=True, returns=list[dict[str, Any]], text=hits_text,
    )


def _store_memory(conversation_days: float) -> ToolDef:
    """``store_memory``, its description saying conversation memories are kept ``conversation_days``."""
    kept = retention_text(conversation_days)
    return ToolDef(
        name="store_memory",
        description=(
            "Save something to remember later. Store one self-contained statement per call, written so it makes "
            "sense on its own (\"Sarah is allergic to peanuts\", not \"she is allergic\"). Choose memory_type: "
            "\"fact\" (default) for lasting knowledge such as preferences, names, relationships and birthdays, kept "
            "forever; \"context\" for the current task, topic or situation, forgotten at the end of today; "
            f"\"conversation\" for notable things that were said, kept {kept}. Put who it is about in metadata "
            "(e.g. {\"person\": \"Sarah\"}) so later searches naming them rank it first. A new fact that "
            "contradicts an older one about the same people replaces it (the old one is kept in history). Returns "
            "the stored memory with its id."),
        params=(
            Param("content", {"type": "string", "minLength": 1}, str, "The statement to remember.", required=True),
            Param("memory_type", _TYPE_SCHEMA, _TypeName,
                  f"\"fact\" (forever), \"conversation\" ({kept}) or \"context\" (until the end of today).",
                  default="fact"),
            Param("metadata", {"type": "object"}, dict[str, Any] | None,
                  "Optional flat key/value pairs (strings, numbers, booleans), e.g. {\"person\": \"Sarah\"}.",
                  nullable=True),
        ),
        call=_store, text=_stored_text,
    )


SEARCH_MEMORIES = _search_memories(DEFAULT_CONVERSATION_DAYS)
STORE_MEMORY = _store_memory(DEFAULT_CONVERSATION_DAYS)

FORGET_MEMORY = ToolDef(
    name="forget_memory",
    description=(
        "Delete one memory for good, by its id (the id field of a search_memories or store_memory result). "
        "Use it when the user asks the robot to forget something, or to remove a wrong memory before storing "
        "the corrected one. Returns success false if no memory has that id (already forgotten, expired, or "
        "not an id from a result: copy it exactly)."),
    params=(Param("memory_id", {"type": "string", "minLength": 1}, str, "The id of the memory to delete.",
                  required=True),),
    call=_forget, destructive=True, text=_forget_text,
)

_FACT_ITEM = {"type": "object", "properties": {"content": {"type": "string"},
                                              "subjects": {"type": "array", "items": {"type": "string"}},
                                              "expires_in_days": {"type": "integer"}, "shared": {"type": "boolean"}},
              "required": ["content"]}

REMEMBER = ToolDef(
    name="remember",
    description=(
        "Store a fact or preference in long-term memory, with who it is about. Give subjects as the user "
        "said them (['my wife'], ['Sarah', 'John']): known people are found, new ones are created and linked, "
        "so a later 'my wife' or 'Sarah' finds the fact. Batch several facts with facts=[...] (preferred). A "
        "new fact that contradicts an older one about the same people replaces it (the old one is kept in "
        "history). Returns the stored facts with their ids and subject person ids."),
    params=(
        Param("content", {"type": "string", "minLength": 1}, str | None, "A single fact to remember.",
              nullable=True),
        Param("facts", {"type": "array", "items": _FACT_ITEM, "maxItems": 100}, list[dict[str, Any]] | None,
              "Batch multiple facts in one call (preferred): [{content, subjects?, expires_in_days?, shared?}].",
              nullable=True),
        Param("subjects", {"type": "array", "items": {"type": "string"}, "maxItems": 16}, list[str] | None,
              "Who this fact is about, one person per entry, by name or by what they are to the user (e.g. "
              "['Sarah'], ['my wife', 'John']; not 'her brother'); omit it for a fact about the user, or to have "
              "the people the sentence names found.", nullable=True),
        Param("expires_in_days", {"type": "integer", "minimum": 1, "maximum": 36500}, int | None,
              "Days until the fact expires (omit: kept forever).", nullable=True),
        Param("shared", {"type": "boolean"}, bool, "True for household facts every user sees.", default=False),
    ),
    call=_remember, text=_remembered_text,
)

RECALL = ToolDef(
    name="recall",
    description=(
        "Search long-term memory for facts relevant to a question, optionally only about one person "
        "(about='my wife', 'Sarah'). Results carry who they are about. An empty list means nothing relevant is "
        "remembered: say so instead of guessing."),
    params=(
        Param("query", {"type": "string", "minLength": 1}, str, "What to search for.", required=True),
        Param("about", {"type": "string", "minLength": 1}, str | None,
              "Filter to a person (e.g. 'my wife', 'Sarah'); for a person the robot does not know, only "
              "memories whose metadata names them (often none).", nullable=True),
        Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}, int,
              f"Maximum number of results (1 to {MAX_LIMIT}).", default=SEARCH_LIMIT),
    ),
    call=_recall, read_only=True, returns=list[dict[str, Any]], text=hits_text,
)

# -- the household's tools: forgetting a person, pausing (docs/HOUSEHOLD.md) ---------------------


def _household_wide(backend: Backend, tool: str) -> None:
    """Refuse ``tool`` on a backend bound to one user: it reaches every user's memories."""
    if getattr(backend, "owner", None) is not None:
        raise ValidationError(f"{tool}: not available to a user-bound tool, as it reaches every user's memories; "
                              "the household does it on its page (reachy-memory web) or with reachy-memory "
                              "forget-person", field="person")


def _backend_call(backend: Backend, name: str, tool: str) -> Callable[..., Awaitable[Any]]:
    call = getattr(backend, name, None)
    if call is None:
        raise ValidationError(f"{tool}: this backend cannot do it", field=name)
    return call  # type: ignore[no-any-return]


async def _forget_person(backend: Backend, a: dict[str, Any]) -> dict[str, Any]:
    _household_wide(backend, "forget_person")
    return await _backend_call(backend, "forget_person", "forget_person")(_unwrapped(a["person"]), a["dry_run"])


async def _pause_remembering(backend: Backend, a: dict[str, Any]) -> dict[str, Any]:
    return await _backend_call(backend, "pause_remembering", "pause_remembering")(int(a["minutes"]))


async def _resume_remembering(backend: Backend, a: dict[str, Any]) -> dict[str, Any]:
    return await _backend_call(backend, "resume_remembering", "resume_remembering")()


FORGET_PERSON = ToolDef(
    name="forget_person",
    description=(
        "Forget a person for good, when the user clearly asks the robot to forget everything about someone: "
        "the person and their other names, every memory about only them, their conversation turns, and their "
        "name in the memories about others (removed; those memories stay). Call it first with dry_run true and "
        "tell the user what would be forgotten, then again with dry_run false once they confirm. Returns the "
        "counts (memories_deleted, turns_deleted, mentions_rewritten...)."),
    params=(
        Param("person", {"type": "string", "minLength": 1}, str,
              "Who: a name ('Dave'), what they are to the user ('my wife') or a person id.", required=True),
        Param("dry_run", {"type": "boolean"}, bool, "True: only say what would be forgotten.", default=False),
    ),
    call=_forget_person, destructive=True,
)

PAUSE_REMEMBERING = ToolDef(
    name="pause_remembering",
    description=(
        "Stop remembering for a while when the user asks (\"don't remember this\", a guest is visiting, a private "
        "moment): until then the conversation is followed but nothing is written down, and no memory can be "
        "stored. It ends by itself. Returns the status (paused, until as epoch seconds)."),
    params=(Param("minutes", {"type": "integer", "minimum": 1, "maximum": 10080}, int,
                  "How long, in minutes (1 to 10080, a week).", default=60),),
    call=_pause_remembering,
)

RESUME_REMEMBERING = ToolDef(
    name="resume_remembering",
    description="Remember again before a pause ends, when the user asks. Returns the status.",
    params=(), call=_resume_remembering,
)

HOUSEHOLD_TOOLS: tuple[ToolDef, ...] = (FORGET_PERSON, PAUSE_REMEMBERING, RESUME_REMEMBERING)

DEFAULT_CONTEXT_MESSAGE = "the user, the people the robot knows, and what matters to them today"
CONTEXT_MEMORIES = 20  # facts and context memories a memory_context block may hold


async def _context(backend: Backend, a: dict[str, Any]) -> dict[str, Any]:
    """``context_for`` as a tool: the prompt-ready block (people, the facts that matter, recent
    context) for ``message``, within ``max_tokens`` of the embedder's tokens."""
    context = getattr(backend, "context", None)
    if context is None:  # a custom backend from before the tool
        raise ValidationError(f"memory_context: the backend {type(backend).__name__} has no context", field="message")
    got = await context(a["message"] or DEFAULT_CONTEXT_MESSAGE, int(a["max_tokens"]), CONTEXT_MEMORIES)
    return {"text": got.text, "tokens": int(got.tokens), "people": [p.name for p in got.people],
            "memories": len(got.memories), "left_out": int(got.dropped_lines)}


def _context_text(args: dict[str, Any], r: dict[str, Any]) -> str:
    return r["text"] or "Nothing is remembered yet: the robot knows no one and no facts."


MEMORY_CONTEXT = ToolDef(
    name="memory_context",
    description=(
        "What the robot remembers that matters now, as one short block to read before answering: the people it "
        "knows and the most relevant facts and plans, each with who it is about. Call it once at the start of a "
        "conversation (with the user's first words, if any), and again when the talk turns to a person or a "
        "plan it may know about. Use what it says naturally; do not recite it."),
    params=(
        Param("message", {"type": "string", "minLength": 1}, str | None,
              "The user's words or the topic to gather memories for (omit at the start of a conversation).",
              nullable=True),
        Param("max_tokens", {"type": "integer", "minimum": 100, "maximum": 2000}, int,
              "Longest block to return, in tokens (100 to 2000).", default=600),
    ),
    call=_context, read_only=True, text=_context_text,
)

#: The tool table: the spec's three tools (000), then spec 004's people-aware pair, then
#: the one-call context block; its descriptions say the default retention (:func:`tools_for`
#: says another).
TOOLS: tuple[ToolDef, ...] = (SEARCH_MEMORIES, STORE_MEMORY, FORGET_MEMORY, REMEMBER, RECALL, MEMORY_CONTEXT,
                               *HOUSEHOLD_TOOLS)
TOOLS_BY_NAME: dict[str, ToolDef] = {t.name: t for t in TOOLS}


def tools_for(conversation_days: float) -> tuple[ToolDef, ...]:
    """The tool table with descriptions saying conversation memories are kept
    ``conversation_days`` (``search_memories`` and ``store_memory`` say it; the rest are
    :data:`TOOLS`'s); the same objects for the same days (``7`` and ``7.0`` alike).
    Raises ValidationError for days outside ``memory.conversation_ttl_days``'s range
    (NaN too: "nan days" to a model, and a new table cached for each NaN)."""
    if not _is_conversation_ttl(conversation_days):
        raise ValidationError(f"conversation_days must be a conversation TTL in days "
                              f"({_TTL_RANGE[0]:.4g} to {_TTL_RANGE[1]:g}), not {conversation_days!r}",
                              field="conversation_days")
    return _tools_for(float(conversation_days))


def _is_conversation_ttl(days: Any) -> TypeGuard[float]:
    """Whether ``days`` is a number the configuration takes as ``memory.conversation_ttl_days``."""
    return isinstance(days, int | float) and not isinstance(days, bool) and _TTL_RANGE[0] <= days <= _TTL_RANGE[1]


_TTL_RANGE = cast(tuple[float, float], RANGES["memory.conversation_ttl_days"])


@functools.cache
def _tools_for(conversation_days: float) -> tuple[ToolDef, ...]:
    if conversation_days == DEFAULT_CONVERSATION_DAYS:
        return TOOLS
    return (_search_memories(conversation_days), _store_memory(conversation_days), FORGET_MEMORY, REMEMBER, RECALL,
            MEMORY_CONTEXT, *HOUSEHOLD_TOOLS)


def local_retention(store: Any) -> float:
    """The conversation TTL, in days, of an in-process :class:`~reachy_memory.MemoryStore`."""
    return float(store.config.memory.conversation_ttl_days)


_ASKED: dict[tuple[str, float], tuple[float, bool]] = {}  # daemon_retention's answers, by (endpoint, fallback)
_ASKING = threading.Lock()


def daemon_retention(config: Config, endpoint: str | None = None, timeout: float = 1.0) -> tuple[float, bool]:
    """``(days, asked)``: the conversation TTL of the daemon at ``endpoint`` (default: the
    configured one), from its ``stats`` reply (``asked`` True); when none answers within
    ``timeout`` (or an older one does not say), ``config``'s ``memory.conversation_ttl_days``
    (``asked`` False): the daemon normally reads the same configuration file.

    Asked once per process for each endpoint and fallback: the first answer stands, so the
    tool descriptions a process hands out do not change under a cached tool list. Never
    raises (an endpoint or CURVE keys the client cannot use give the fallback too)."""
    fallback = (float(config.memory.conversation_ttl_days), False)
    try:
        key = (resolve_endpoint(endpoint, config), fallback[0])
    except ReachyMemoryError:
        return fallback
    with _ASKING:
        if key not in _ASKED:
            _ASKED[key] = _ask_retention(config, key[0], timeout) or fallback
        return _ASKED[key]


def _ask_retention(config: Config, endpoint: str, timeout: float) -> tuple[float, bool] | None:
    """The daemon's conversation TTL in days, with True; None if it does not answer (or say)."""
    if ipc_listener_gone(endpoint) is not None:
        return None  # nobody listens (no socket, or a killed daemon's): do not wait for the timeout
    try:
        with MemoryClient(endpoint, config=config, timeout=timeout) as client:
            reply = client.stats()
    except ReachyMemoryError:
        return None
    store = reply.get("store") if isinstance(reply, dict) else None  # a foreign daemon's may be anything
    days = store.get("conversation_ttl_days") if isinstance(store, dict) else None
    return (float(days), True) if _is_conversation_ttl(days) else None  # NaN, 0, -5, 1e300: not a TTL it runs with


# -- backends ----------------------------------------------------------------------------------


def may_forget(memory: Memory | None, owner: str) -> bool:
    """Whether the user ``owner`` may forget ``memory``: one they can see (theirs, a shared
    one or an unscoped one); not None (no live memory has that id)."""
    return memory is not None and (memory.owner is None or memory.owner == owner or memory.shared)


class _OwnerBound:
    """The current user a backend's calls are scoped to (see the module docstring)."""

    _owner: str | None = None
    _own: bool = True

    @property
    def owner(self) -> str | None:
        """The user the next calls are scoped to; None: unscoped (every user's memories)."""
        return self._owner

    @owner.setter
    def owner(self, owner: str | None) -> None:
        """Bind the next calls to ``owner`` (None unbinds). Raises ValidationError for an
        owner the store would not take (not a string of 1 to 200 characters)."""
        self._owner = None if owner is None else check_owner(owner)

    def for_owner(self, owner: str | None) -> Self:
        """A view of this backend (the same client or store, not closed by its ``aclose``)
        bound to ``owner``. Raises ValidationError as the ``owner`` setter does."""
        view = copy.copy(self)
        view.owner = owner
        view._own = False
        return view


class DaemonBackend(_OwnerBound):
    """The tools on the daemon, through an :class:`AsyncMemoryClient` (one event loop)."""

    def __init__(self, client: AsyncMemoryClient, *, own: bool = True, owner: str | None = None,
                 retry_for: float | None = None) -> None:
        """``own``: close the client in :meth:`aclose`; ``owner``: the current user (see the
        module docstring); ``retry_for``: how long a write (``store``, ``remember``) is sent
        again after its first "not now" failure (seconds; default: the client's timeout; 0:
        not sent again; ``inf``: until the daemon is back). Raises ValidationError for a bad
        owner or ``retry_for``."""
        self.client = client
        self._own = own
        self.owner = owner
        self.retry_for = check_seconds(client.timeout if retry_for is None else retry_for, "retry_for")

    @classmethod
    def from_config(cls, config: Config, timeout: float = 10.0, *, owner: str | None = None,
                    endpoint: str | None = None, retry_for: float | None = None) -> DaemonBackend:
        """A backend with its own client on ``endpoint`` (default: the configured one),
        bound to ``owner``. Raises ValidationError for a bad owner or ``retry_for``."""
        owner = None if owner is None else check_owner(owner)  # before a client (a socket) exists
        if retry_for is not None:
            check_seconds(retry_for, "retry_for")
        return cls(AsyncMemoryClient(endpoint, config=config, timeout=timeout), owner=owner, retry_for=retry_for)

    def _unavailable(self, why: str, kept: str = "") -> DaemonUnavailableError:
        return DaemonUnavailableError(f"no reachy-memory daemon {why} at {self.client.endpoint}{kept}: {START_HINT}",
                                      endpoint=self.client.endpoint)

    async def _guard(self, call: Awaitable[Any], *, write: bool = False) -> Any:
        """``call``'s result; DaemonUnavailableError at once when no daemon listens on the ipc
        socket (none there, or one a killed daemon left: a crashed daemon's restart made every
        tool call wait out the client's timeout and a ping); after a timeout, DaemonUnavailableError
        or RequestTimeoutError (busy), saying that a ``write`` (one sent without ids) may have been kept."""
        if ipc_listener_gone(self.client.endpoint) is not None:
            if asyncio.iscoroutine(call):
                call.close()  # never awaited: do not leave a warning behind
            raise self._unavailable("is listening")
        try:
            return await call
        except RequestTimeoutError as exc:
            raise await self._no_reply(exc, write) from exc

    async def _no_reply(self, exc: RequestTimeoutError, write: bool) -> ReachyMemoryError:
        """What a call that got no reply (``exc``) tells the caller: DaemonUnavailableError,
        or RequestTimeoutError while the daemon answers a ping (busy); for a ``write``, that
        the memory may have been kept (a daemon that stopped, a restart, after the request
        reached it may have journaled it; a busy one may still)."""
        if not await self._answers():
            kept = f"; if it stopped during this call, {_MAYBE_KEPT}" if write else ""
            return self._unavailable(f"answered within {self.client.timeout:g} s", kept)
        return RequestTimeoutError(
            f"the reachy-memory daemon is running but did not finish this call within {self.client.timeout:g} s "
            "(busy, or a large request); a store may still complete: search for it before storing it again",
            **exc.fields)

    async def _write(self, send: Callable[[bool, float | None], Awaitable[Any]]) -> Any:
        """``send(True, timeout)``: a write carrying its client-made ids, sent again after each
        "not now" failure (:func:`~reachy_memory.daemon.protocol.retryable`, or no daemon listening)
        until :attr:`retry_for` seconds after the first, then answered definitely: the
        daemon keeps it once however often it arrived, so a result is the memory kept.  A daemon
        from before the ids (it refuses them, storing nothing) gets ``send(False, None)``, once,
        as :meth:`_guard` sends any call.  The daemon writes each call as one journal frame (a
        ``remember`` of several facts too): a full disk refusing it stores nothing.

        Raises the write's own error at once (nothing was stored), and ClosedError at once once
        this backend's client is closed (:meth:`aclose`, from another task: an attempt in flight
        then may have been kept; sending again could only fail again), else when the time is up:
        the last "not now" error saying the memory was not stored when no attempt can have been
        kept (each was refused, or never sent: no daemon listened), else (an attempt got no
        reply, or the daemon kept part or all of it before its disk failed) saying it may have been."""
        deadline: float | None = None
        pause, unsure = _FIRST_PAUSE, ""
        while True:
            try:
                return await self._attempt(send, None if deadline is None else deadline - time.monotonic())
            except ValidationError as exc:
                if not refuses_ids(exc):
                    raise
                return await self._guard(send(False, None), write=True)  # sent once: a retry could keep it twice
            except ReachyMemoryError as exc:
                if not retryable(exc):  # its own error, or this backend's client closed: not sent again
                    raise
                unsure = unsure or _may_have_kept(exc)
                deadline = time.monotonic() + self.retry_for if deadline is None else deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    raise await self._not_written(exc, unsure) from exc
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, _LONGEST_PAUSE)

    async def _attempt(self, send: Callable[[bool, float | None], Awaitable[Any]], left: float | None) -> Any:
        """One attempt of :meth:`_write` (``left``: seconds until its deadline, None for the
        first): DaemonUnavailableError at once, the write unsent, while no daemon listens on
        the ipc socket; a late attempt waits at most until the deadline (or a short minimum)."""
        if ipc_listener_gone(self.client.endpoint) is not None:
            raise self._unavailable("is listening")
        timeout = None if left is None else min(self.client.timeout, max(left, _SHORTEST_ATTEMPT))
        return await send(True, timeout)

    async def _not_written(self, last: ReachyMemoryError, unsure: str) -> ReachyMemoryError:
        """The answer to a write given up after ``last``: that it may have been kept when
        ``unsure`` (why: :func:`_may_have_kept` of an attempt), else that it was not stored."""
        if isinstance(last, RequestTimeoutError):
            return await self._no_reply(last, write=True)
        if unsure:
            return type(last)(f"{last.message}; {unsure}: {_MAYBE_KEPT}", **last.fields)
        if isinstance(last, DaemonUnavailableError):  # no daemon listened: none had the write
            return self._unavailable(f"listened for {self.retry_for:g} s", "; the memory was not stored")
        return type(last)(f"{last.message}; sent again for {self.retry_for:g} s: the memory was not stored",
                          **last.fields)

    async def _answers(self) -> bool:
        """Whether the daemon answers a ping (its I/O thread answers one at once, even
        while a long call holds the engine): tells "busy" from "not running"."""
        try:
            await self.client.ping(timeout=1.0)
        except ReachyMemoryError:
            return False
        return True

    async def search(self, query: str, memory_type: str | None, limit: int) -> list[SearchResult]:
        return await self._guard(  # type: ignore[no-any-return]
            self.client.search(query, memory_type, limit, owner=self._owner))

    async def store(self, content: str, memory_type: str, metadata: dict[str, Any] | None) -> Memory:
        """Store as given, owned by the bound user (unscoped when unbound), under an id made
        here: sent again while the daemon restarts (:meth:`_write`), it is kept once."""
        owner, memory_id = self._owner, uuid.uuid4().hex
        return await self._write(lambda ids, timeout: self.client.store(  # type: ignore[no-any-return]
            content, memory_type, metadata, owner=owner, id=memory_id if ids else None, timeout=timeout))

    async def forget(self, memory_id: str) -> bool:
        """Delete the memory; False if there is none, or (bound) it is another user's own.
        Bound, it reads the memory first (two round trips): another user could at most
        change that memory's owner in between, which no tool does."""
        owner = self._owner
        if owner is not None and not may_forget(await self._guard(self.client.get(memory_id)), owner):
            return False
        return bool(await self._guard(self.client.forget(memory_id)))  # a repeated forget is harmless

    async def remember(self, args: dict[str, Any]) -> list[Memory]:
        """``remember`` owned by the bound user, each fact under an id made here (one the caller
        put in a fact is kept): sent again while the daemon restarts (:meth:`_write`), each
        fact is kept once."""
        owned = _owned(args, self._owner)
        ided = _with_ids(owned)
        return await self._write(lambda ids, timeout: self.client.remember(  # type: ignore[no-any-return]
            **(ided if ids else _without_ids(owned)), timeout=timeout))  # one journal frame, however many facts

    async def recall(self, query: str, about: str | None, limit: int) -> list[SearchResult]:
        return await self._guard(  # type: ignore[no-any-return]
            self.client.recall(query, about, owner=self._owner, limit=limit))

    async def knows(self, reference: str) -> bool:
        return await self._guard(self.client.find_person(reference, owner=self._owner)) is not None

    # the household's calls (docs/HOUSEHOLD.md)
    async def forget_person(self, reference: str, dry_run: bool) -> dict[str, Any]:
        return await self._guard(self.client.forget_person(reference, dry_run=dry_run))  # type: ignore[no-any-return]

    async def pause_remembering(self, minutes: float) -> dict[str, Any]:
        return await self._guard(self.client.pause_remembering(minutes))  # type: ignore[no-any-return]

    async def resume_remembering(self) -> dict[str, Any]:
        return await self._guard(self.client.resume_remembering())  # type: ignore[no-any-return]
    async def context(self, message: str, max_tokens: int, max_memories: int) -> Any:
        """``context_for`` on the daemon, for the bound user (a RetrievedContext)."""
        return await self._guard(self.client.context_for(message, owner=self._owner, max_tokens=max_tokens,
                                                         max_memories=max_memories))

    async def aclose(self) -> None:
        if self._own:
            await self.client.close()


class LocalBackend(_OwnerBound):
    """The tools on a :class:`MemoryStore` in this process; one worker thread owns the store."""

    def __init__(self, store: Any, *, owner: str | None = None) -> None:
        """``owner``: the current user (see the module docstring). Raises ValidationError for a bad owner."""
        self.owner = owner
        self.memory_store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reachy-memory-store")

    @classmethod
    def open(cls, config: Config, *, owner: str | None = None) -> LocalBackend:
        """Open the configured data directory, bound to ``owner``. Raises ValidationError for a
        bad owner, StoreLockedError if a daemon holds the directory."""
        from reachy_memory.engine.store import MemoryStore

        owner = None if owner is None else check_owner(owner)  # before the store is opened
        return cls(MemoryStore(config=config), owner=owner)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def search(self, query: str, memory_type: str | None, limit: int) -> list[SearchResult]:
        owner = self._owner
        return await self._run(  # type: ignore[no-any-return]
            lambda: self.memory_store.search(query, memory_type, limit, owner=owner))

    async def store(self, content: str, memory_type: str, metadata: dict[str, Any] | None) -> Memory:
        """Store as given, owned by the bound user (unscoped when unbound)."""
        owner = self._owner  # read once, when the call starts
        return await self._run(  # type: ignore[no-any-return]
            lambda: self.memory_store.store(content, memory_type, metadata, owner=owner))

    async def forget(self, memory_id: str) -> bool:
        """Delete the memory; False if there is none, or (bound) it is another user's own.
        The check and the delete are one job on the store's thread."""
        owner = self._owner
        if owner is None:
            return bool(await self._run(self.memory_store.forget, memory_id))

        def forget_visible() -> bool:
            return may_forget(self.memory_store.get(memory_id), owner) and bool(self.memory_store.forget(memory_id))

        return bool(await self._run(forget_visible))

    async def remember(self, args: dict[str, Any]) -> list[Memory]:
        owned = _owned(args, self._owner)
        return await self._run(lambda: self.memory_store.remember(**owned))  # type: ignore[no-any-return]

    async def recall(self, query: str, about: str | None, limit: int) -> list[SearchResult]:
        owner = self._owner
        return await self._run(  # type: ignore[no-any-return]
            lambda: self.memory_store.recall(query, about, owner=owner, limit=limit))

    async def knows(self, reference: str) -> bool:
        owner = self._owner
        return await self._run(lambda: self.memory_store.find_person(reference, owner)) is not None

    # the household's calls (docs/HOUSEHOLD.md)
    async def forget_person(self, reference: str, dry_run: bool) -> dict[str, Any]:
        return await self._run(  # type: ignore[no-any-return]
            lambda: self.memory_store.forget_person(reference, dry_run=dry_run))

    async def pause_remembering(self, minutes: float) -> dict[str, Any]:
        return await self._run(self.memory_store.pause_remembering, minutes)  # type: ignore[no-any-return]

    async def resume_remembering(self) -> dict[str, Any]:
        return await self._run(self.memory_store.resume_remembering)  # type: ignore[no-any-return]
    async def context(self, message: str, max_tokens: int, max_memories: int) -> Any:
        """``context_for`` on the store, for the bound user (a RetrievedContext)."""
        owner = self._owner
        return await self._run(lambda: self.memory_store.context_for(message, owner=owner, max_tokens=max_tokens,
                                                                     max_memories=max_memories))

    async def aclose(self) -> None:
        """Close the store on its own thread, then stop the thread; idempotent; a view
        (:meth:`for_owner`) leaves both to the backend it came from."""
        if self._own and not self._pool._shutdown:  # type: ignore[attr-defined]
            await self._run(self.memory_store.close)
            self._pool.shutdown(wait=True)


def _may_have_kept(failure: ReachyMemoryError) -> str:
    """Why an attempt of a write (one journal frame) that failed with ``failure``
    ("not now") may have been kept, or "" when it cannot have been: no reply (it may have
    reached a daemon); an fsync failing after the daemon applied it (ReadOnlyError: readers
    see it; it may even be on disk)."""
    if isinstance(failure, RequestTimeoutError):
        return "an earlier attempt got no reply"
    if isinstance(failure, ReadOnlyError):
        return "the daemon may have kept an attempt before its disk failed"
    return ""


def _with_ids(args: dict[str, Any]) -> dict[str, Any]:
    """``remember``'s arguments with an id for each fact: ``id`` with ``content``, else one in
    each fact of ``facts`` (a fact's own kept)."""
    facts = args.get("facts")
    if not isinstance(facts, list):
        return {**args, "id": args.get("id") or uuid.uuid4().hex}
    return {**args, "facts": [{**f, "id": f.get("id") or uuid.uuid4().hex} if isinstance(f, dict) else f
                              for f in facts]}


def _without_ids(args: dict[str, Any]) -> dict[str, Any]:
    """``remember``'s arguments as a daemon from before ids takes them: no id anywhere."""
    out = {k: v for k, v in args.items() if k != "id"}
    if isinstance(out.get("facts"), list):
        out["facts"] = [{k: v for k, v in f.items() if k != "id"} if isinstance(f, dict) else f
                        for f in out["facts"]]
    return out


def _owned(args: dict[str, Any], owner: str | None) -> dict[str, Any]:
    """``remember``'s arguments with the bound owner laid over them (none given by the caller
    counts: the owner is the application's to choose); as given when unbound."""
    return args if owner is None else {**args, "owner": owner}


def error_text(exc: ReachyMemoryError) -> str:
    """``"ErrorClass: message"``, cut to :data:`MAX_ERROR_CHARS` characters (then ending with how
    long it was): a message echoes the bad value, which a model can make as long as it likes."""
    text = f"{type(exc).__name__}: {exc.message}"
    if len(text) <= MAX_ERROR_CHARS:
        return text
    tail = f"... ({len(text)} characters in all)"
    return text[:MAX_ERROR_CHARS - len(tail)] + tail


def finite_score(score: float) -> float:
    """A JSON-safe score (NaN/inf never reach a client)."""
    return score if math.isfinite(score) else 0.0


__all__ = ["DEFAULT_CONVERSATION_DAYS", "FORGET_PERSON", "HOUSEHOLD_TOOLS", "MAX_CONTENT_CHARS", "MAX_ERROR_CHARS",
           "MAX_LIMIT", "MAX_RESULT_CHARS", "MEMORY_CONTEXT", "MEMORY_TYPES", "PAUSE_REMEMBERING", "RECALL", "REMEMBER",
           "RESUME_REMEMBERING", "TOOLS", "TOOLS_BY_NAME", "Backend", "DaemonBackend", "LocalBackend", "Param",
           "ToolDef", "capped", "daemon_retention", "error_text", "hits_text", "local_retention", "may_forget",
           "retention_text", "tools_for"]
