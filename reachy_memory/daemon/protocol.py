"""The wire protocol between the daemon and its clients (version 1).

Transport: ZeroMQ.  The daemon binds a ROUTER socket; clients connect a DEALER
(or REQ) socket.  Every message is ONE frame holding one msgpack map (a REQ
socket's empty delimiter frame is accepted and echoed).  Strings are UTF-8
(msgpack str), binary is msgpack bin, timestamps are float seconds since the
Unix epoch (UTC).

Request::

    {"v": 1, "id": <str|int, echoed>, "op": <str>, "args": {...},
     "timeout_ms": <number, optional: the daemon drops work not started in time>}

Reply::

    {"v": 1, "id": <same>, "ok": true,  "result": <op-specific>}
    {"v": 1, "id": <same>, "ok": false, "error": {"code": <str>, "message": <str>, "fields": {...},
                                                  "type": <error class name, e.g. "StorageFullError">}}

Clients re-raise the class named by ``type`` (with its fields) and fall back
to the class of ``code`` for a name they do not know (:func:`error_to_wire` and
:func:`error_from_wire`, also the Reachy Mini bridge's helper pipe; an error that
passed through a client already may carry its ``remote_code``).

Error codes: ``bad_request`` (malformed message, unknown op, bad arguments),
``too_large`` (message or value over a limit), ``not_found``, ``busy`` (queues
full: retry later), ``unavailable`` (no model, stopping), ``timeout`` (the
deadline passed before the work started), ``internal``.

A message larger than ``server.max_message_bytes`` (default 1 MiB) is answered
``too_large`` without being decoded.  Replies may arrive out of order: match
them by ``id``.  A request refused before it could be read whole (over the size
limit, undecodable) is answered with the id found in its first
:data:`PEEK_BYTES` bytes (a request map's ``id`` among its entries there: put
``v`` and ``id`` first), else with ``id`` null.

A memory on the wire::

    {"id": str, "content": str, "type": "conversation"|"fact"|"context",
     "created_at": float, "expires_at": float|null, "metadata": {str: scalar|[scalar]}}

A person on the wire::

    {"id": str, "name": str, "relation": str|null, "aliases": [str], "owner": str|null,
     "external_id": str|null, "metadata": {...}, "created_at": float, "updated_at": float}

A memory may also carry (only when set) ``subjects`` (person ids), ``owner``,
``shared``, ``name``, ``aliases``, ``superseded_at``, ``superseded_by``,
``protected``, ``covers_until``.

The operations, their arguments and results are one table,
``reachy_memory/daemon/operations.py``; ``docs/PROTOCOL.md`` is generated from it.
"""

from __future__ import annotations

from typing import Any

import msgpack

from reachy_memory.engine.context_text import ContextItem, RetrievedContext, Turn
from reachy_memory.errors import (
    ERROR_BY_CODE,
    ClosedError,
    ProtocolError,
    ReachyMemoryError,
    RemoteError,
    TooLargeError,
    error_class,
)
from reachy_memory.model import Memory, MemoryType, SearchResult, to_datetime, to_epoch
from reachy_memory.people.registry import Person

VERSION = 1
CODES = frozenset({"bad_request", "too_large", "not_found", "busy", "unavailable", "timeout", "internal"})
#: The codes that mean "not now" (the daemon restarting, stopping, slow or full): a write
#: carrying its client-made id may be sent again after one (the bridge's turns, the LLM tools).
RETRY_CODES = frozenset({"unavailable", "timeout", "busy"})


def retryable(exc: BaseException) -> bool:
    """Whether ``exc`` means "not now" (its code is one of :data:`RETRY_CODES`): a write
    carrying its client-made id may be sent again after it.

    A :class:`~reachy_memory.ClosedError` raised in this process is not, though its code is
    "unavailable": the caller's own client (or store) is closed, and each attempt would fail
    again at once until a retry loop's bound (the bridge: 60 s). One the daemon sent (its
    store closing while it stops: a restart; :func:`raise_for` marks a daemon's error with
    ``remote_code``) is.
    """
    if isinstance(exc, ClosedError) and not hasattr(exc, "remote_code"):
        return False
    return getattr(exc, "code", None) in RETRY_CODES


def encode(message: dict[str, Any]) -> bytes:
    """msgpack-encode a message."""
    return msgpack.packb(message, use_bin_type=True)


MAX_CONTAINER = 10_000  # entries of any one list or map in a request (decoding stops at once past it)


def decode(frame: bytes, *, untrusted: bool = False) -> dict[str, Any]:
    """Decode one frame into a message map; ProtocolError if it is not one.

    ``untrusted`` (the daemon reading a request): a list or map of more than
    :data:`MAX_CONTAINER` entries is refused as TooLargeError before it is built,
    so a 125,000-way filter costs the I/O thread microseconds, not a decode.
    """
    limits = {"max_array_len": MAX_CONTAINER, "max_map_len": MAX_CONTAINER} if untrusted else {}
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False, **limits)
    except ValueError as exc:
        if "exceeds max_" in str(exc):
            raise TooLargeError(f"a list or map in the request has more than {MAX_CONTAINER} entries",
                                field="args", size=len(frame), limit=MAX_CONTAINER) from exc
        raise ProtocolError(f"undecodable message: {exc.__class__.__name__}") from exc
    except Exception as exc:  # msgpack raises many types for bad input
        raise ProtocolError(f"undecodable message: {exc.__class__.__name__}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a msgpack map")
    return message


PEEK_BYTES = 4096  # how much of a frame the daemon reads for the id of a request it cannot decode


def peek_id(frame: bytes) -> str | int | None:
    """The request id of a frame not decoded whole (over the size limit, or undecodable):
    the value of the ``id`` key of the msgpack map it starts with, found among the
    entries held in its first :data:`PEEK_BYTES` bytes (bounded work whatever the
    frame).  None when there is none there, or it is not a string or an integer.
    Never raises."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=PEEK_BYTES,
                                max_array_len=MAX_CONTAINER, max_map_len=MAX_CONTAINER)
    try:
        unpacker.feed(frame[:PEEK_BYTES])
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                value = unpacker.unpack()
                return value if is_request_id(value) else None
            unpacker.skip()
    except Exception:  # msgpack raises many types for a cut or bad frame: no id then
        return None
    return None


def is_request_id(value: Any) -> bool:
    """Whether ``value`` can be a request id (a string or an integer, not a bool)."""
    return isinstance(value, str | int) and not isinstance(value, bool)


def request(request_id: str, op: str, args: dict[str, Any], timeout_ms: float | None = None) -> bytes:
    """Encode a request."""
    message: dict[str, Any] = {"v": VERSION, "id": request_id, "op": op, "args": args}
    if timeout_ms is not None:
        message["timeout_ms"] = timeout_ms
    return encode(message)


def ok(request_id: Any, result: Any) -> bytes:
    """Encode a success reply."""
    return encode({"v": VERSION, "id": request_id, "ok": True, "result": result})


def error(request_id: Any, code: str, message: str, fields: dict[str, Any] | None = None,
          type_name: str | None = None) -> bytes:
    """Encode an error reply."""
    body = {"code": code if code in CODES else "internal", "message": message, "fields": _plain(fields or {})}
    if type_name:
        body["type"] = type_name
    return encode({"v": VERSION, "id": request_id, "ok": False, "error": body})


def error_from(request_id: Any, exc: ReachyMemoryError) -> bytes:
    """Encode our exception as an error reply."""
    return encode({"v": VERSION, "id": request_id, "ok": False, "error": error_to_wire(exc)})


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, str | int | float | bool | type(None)) else str(v) for k, v in fields.items()}


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """The error map of ``exc`` (a reply's ``error``; also what the Reachy Mini bridge's
    helper process sends for a failed call): one of ours by class name (``type``), ``code``,
    message and fields (a field that is not a scalar as its text); any other exception as
    ``internal`` with "TypeName: message". A daemon's error re-raised by a client (its
    ``remote_code``, :func:`raise_for`) keeps it as ``remote_code``. Never raises."""
    if isinstance(exc, ReachyMemoryError):
        body: dict[str, Any] = {"code": exc.code if exc.code in CODES else "internal", "message": str(exc.message),
                                "fields": _plain(exc.fields), "type": type(exc).__name__}
    else:
        body = {"code": "internal", "message": f"{type(exc).__name__}: {exc}", "fields": {}}
    remote = getattr(exc, "remote_code", None)
    if isinstance(remote, str):
        body["remote_code"] = remote
    return body


def error_from_wire(body: Any, *, remote: bool = False) -> ReachyMemoryError:
    """The exception of an error map (:func:`error_to_wire`): the class named by ``type``
    (any depth of the tree), else the class of ``code``, with the message and fields.
    ``remote`` (a daemon's reply): its ``remote_code`` is the map's code; otherwise it has
    one only when the map carries ``remote_code``.

    A malformed map (not a map, a code that is not a string, a field named like an
    attribute of the exception, such as ``message`` or ``args``) still gives a
    ReachyMemoryError: the odd parts are left out, never a TypeError.
    """
    err: dict[Any, Any] = body if isinstance(body, dict) else {}
    raw_code = err.get("code", "internal")
    code = raw_code if isinstance(raw_code, str) else "internal"
    cls = error_class(err.get("type")) or ERROR_BY_CODE.get(code, RemoteError)
    raw = err.get("fields")
    fields: dict[Any, Any] = raw if isinstance(raw, dict) else {}
    kept = {k: v for k, v in fields.items() if isinstance(k, str) and k != "message" and not hasattr(cls, k)}
    exc = cls(str(err.get("message", "unknown error")), **kept)
    mark = code if remote else err.get("remote_code")
    if isinstance(mark, str):
        exc.remote_code = mark  # type: ignore[attr-defined]
    return exc


def raise_for(reply: dict[str, Any]) -> Any:
    """The result of a reply, or the matching ReachyMemoryError raised
    (:func:`error_from_wire`, marked with the daemon's ``remote_code``)."""
    if reply.get("ok"):
        return reply.get("result")
    raise error_from_wire(reply.get("error"), remote=True)


_PEOPLE_FIELDS = {"subjects": (), "owner": None, "shared": False, "name": None, "aliases": (),
                  "superseded_by": None, "protected": False}  # wire keys left out while at these defaults
_PEOPLE_TIMES = ("superseded_at", "covers_until")  # epochs on the wire


def memory_to_wire(memory: Memory) -> dict[str, Any]:
    """A Memory as its wire map (people-aware fields only when set)."""
    out: dict[str, Any] = {"id": memory.id, "content": memory.content, "type": memory.memory_type.value,
           "created_at": memory.created_at.timestamp(),
           "expires_at": memory.expires_at.timestamp() if memory.expires_at else None,
           "metadata": memory.metadata}
    for key, default in _PEOPLE_FIELDS.items():
        value = getattr(memory, key)
        if value != default:
            out[key] = list(value) if isinstance(value, tuple) else value
    for key in _PEOPLE_TIMES:
        when = getattr(memory, key)
        if when is not None:
            out[key] = when.timestamp()
    return out


def memory_from_wire(data: dict[str, Any] | None) -> Memory | None:
    """The Memory of a wire map (None stays None)."""
    if data is None:
        return None
    expires = data.get("expires_at")
    extra: dict[str, Any] = {k: (tuple(data[k]) if isinstance(d, tuple) else data[k])
                             for k, d in _PEOPLE_FIELDS.items() if k in data}
    extra |= {k: to_datetime(data[k]) for k in _PEOPLE_TIMES if data.get(k) is not None}
    return Memory(data["id"], data["content"], MemoryType(data["type"]), to_datetime(data["created_at"]),
                  dict(data.get("metadata") or {}), to_datetime(expires) if expires is not None else None, **extra)


def results_to_wire(hits: list[SearchResult]) -> list[dict[str, Any]]:
    """Search results in their wire form (``subject_names`` only when there are some)."""
    return [{"memory": memory_to_wire(h.memory), "score": h.score}
            | ({"subject_names": list(h.subject_names)} if h.subject_names else {}) for h in hits]


def results_from_wire(data: list[dict[str, Any]]) -> list[SearchResult]:
    """Search results from their wire form."""
    return [SearchResult(memory_from_wire(r["memory"]), float(r["score"]),  # type: ignore[arg-type]
                         tuple(r.get("subject_names") or ())) for r in data]


def person_to_wire(person: Person) -> dict[str, Any]:
    """A Person as its wire map (epoch timestamps)."""
    return {"id": person.id, "name": person.name, "relation": person.relation, "aliases": list(person.aliases),
            "owner": person.owner, "external_id": person.external_id, "metadata": dict(person.metadata),
            "created_at": to_epoch(person.created_at), "updated_at": to_epoch(person.updated_at)}


def person_from_wire(data: dict[str, Any] | None) -> Person | None:
    """The Person of a wire map (None stays None)."""
    if data is None:
        return None
    return Person(data["id"], data["name"], data.get("relation"), tuple(data.get("aliases") or ()),
                  data.get("owner"), data.get("external_id"), dict(data.get("metadata") or {}),
                  to_datetime(data["created_at"]), to_datetime(data["updated_at"]))


def _item_to_wire(item: ContextItem) -> dict[str, Any]:
    return {"content": item.content, "kind": item.kind, "created_at": to_epoch(item.created_at),
            "score": item.score, "subjects": list(item.subjects), "id": item.id, "role": item.role}


def _item_from_wire(data: dict[str, Any]) -> ContextItem:
    return ContextItem(data["content"], data["kind"], to_datetime(data["created_at"]), float(data["score"]),
                       tuple(data.get("subjects") or ()), data.get("id"), data.get("role"))


def context_to_wire(ctx: RetrievedContext) -> dict[str, Any]:
    """A RetrievedContext (``context_for``) as its wire map."""
    return {"window": [{"role": t.role, "content": t.content} for t in ctx.window],
            "messages": [_item_to_wire(i) for i in ctx.messages], "memories": [_item_to_wire(i) for i in ctx.memories],
            "people": [person_to_wire(p) for p in ctx.people], "text": ctx.text, "tokens": ctx.tokens,
            "dropped_lines": ctx.dropped_lines, "max_tokens": ctx.max_tokens}


def context_from_wire(data: dict[str, Any]) -> RetrievedContext:
    """The RetrievedContext of a wire map."""
    people = [person_from_wire(p) for p in data.get("people") or ()]
    return RetrievedContext(tuple(Turn(t["role"], t["content"]) for t in data.get("window") or ()),
                            tuple(_item_from_wire(i) for i in data.get("messages") or ()),
                            tuple(_item_from_wire(i) for i in data.get("memories") or ()),
                            tuple(p for p in people if p is not None), data.get("text", ""),
                            int(data.get("tokens", 0)), int(data.get("dropped_lines", 0)),
                            int(data.get("max_tokens", 0)))
