"""Clients of the daemon: :class:`MemoryClient` (blocking) and
:class:`AsyncMemoryClient` (asyncio), both over a ZeroMQ DEALER socket.

Both expose the same API, defined once in :class:`_Api`: the spec's memory
operations (``store``, ``search``, ``forget``, ``cleanup_expired``, the context
window, ``set_context``/``get_context``, ``remember_fact``/``remember_conversation``)
plus ``get``, ``store_batch``, ``ping``, ``health``, ``stats``, ``backup``.

* Every call has a timeout (``timeout=`` per call, default from the client):
  seconds >= 0, ``inf`` for none (NaN, negative: ValidationError).  A timeout
  raises :class:`RequestTimeoutError` and the client stays usable: a late reply
  is never mistaken for another (the blocking client replaces its socket, the
  async one matches ids), and a request is only queued on a live connection, so
  one that timed out unsent never reaches a daemon started later.
* ``store`` sends a client-made memory id, so retrying it (``retries=``) after
  a timeout or a daemon restart cannot create a duplicate; ``record_turn`` is
  retried the same way when given an ``id``.
* Sockets use linger 0: a dead daemon never blocks the caller's exit.
* The daemon's errors come back as the same :class:`ReachyMemoryError` subclasses.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import zmq

if TYPE_CHECKING:  # imported when an AsyncMemoryClient is made: asyncio costs the daemon ~9 MB RSS
    import asyncio

from reachy_memory.config import Config, load_config
from reachy_memory.daemon import protocol as proto
from reachy_memory.daemon.endpoint import check_tcp_port, ipc_path, load_certificate, resolve_endpoint
from reachy_memory.daemon.operations import IDEMPOTENT, IDEMPOTENT_WITH_ID, carries_ids
from reachy_memory.engine.ingest import check_seconds
from reachy_memory.errors import (
    ClosedError,
    ConfigError,
    ProtocolError,
    ReachyMemoryError,
    RequestTimeoutError,
    TooLargeError,
    ValidationError,
)
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, Memory, MemoryType, SearchResult, merged_metadata

_IDEMPOTENT = IDEMPOTENT  # from the operations table
_IDEMPOTENT_WITH_ID = IDEMPOTENT_WITH_ID  # retried when the call carries its id
# What the converters raise for a result of the wrong shape (a buggy or foreign daemon).
_MALFORMED = (LookupError, TypeError, ValueError, AttributeError, ArithmeticError)
_POLL_SLICE = 0.1  # seconds: the longest single zmq poll of the blocking client


def _wire_type(memory_type: MemoryType | str) -> str:
    return MemoryType.parse(memory_type).value


def _with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for item in items:
        item = dict(item)
        if isinstance(item.get("memory_type"), MemoryType):
            item["memory_type"] = item["memory_type"].value
        item.setdefault("id", uuid.uuid4().hex)
        out.append(item)
    return out


def _memories(data: list[dict[str, Any]]) -> list[Memory]:
    return [proto.memory_from_wire(m) for m in data]  # type: ignore[misc]


class _Api:
    """The operations, written once; ``_call`` is sync or async in subclasses."""

    def _call(self, op: str, args: dict[str, Any], convert: Callable[[Any], Any] = lambda r: r,
              timeout: float | None = None) -> Any:
        raise NotImplementedError

    def ping(self, *, timeout: float | None = None) -> Any:
        """Round trip to the daemon; returns {"pong": True, "time": ...}."""
        return self._call("ping", {}, timeout=timeout)

    def health(self, *, timeout: float | None = None) -> Any:
        """Embedder state, counts, last cleanup, uptime."""
        return self._call("health", {}, timeout=timeout)

    def stats(self, *, timeout: float | None = None) -> Any:
        """Per-op counts and latency percentiles, store sizes."""
        return self._call("stats", {}, timeout=timeout)

    def store(self, content: str, memory_type: MemoryType | str = MemoryType.FACT,
              metadata: dict[str, Any] | None = None, *, id: str | None = None, owner: str | None = None,
              shared: bool = False, timeout: float | None = None) -> Any:
        """Store a memory; the id is made here so a retry cannot duplicate it.  ``owner``
        scopes it to a user of the robot (``shared``: every user sees it anyway); the
        daemon refuses a bad owner (ValidationError, nothing stored)."""
        args = {"content": content, "memory_type": _wire_type(memory_type), "metadata": metadata or {},
                "id": id or uuid.uuid4().hex}
        # only when given: an owner-less store is the request older daemons know
        args |= _given(owner=owner, shared=shared or None)
        return self._call("store", args, proto.memory_from_wire, timeout)

    def store_batch(self, items: list[dict[str, Any]], *, timeout: float | None = None) -> Any:
        """Store several memories atomically (items as for :meth:`store`: content,
        memory_type, metadata, id, created_at, owner, shared)."""
        return self._call("store_batch", {"items": _with_ids(items)}, _memories, timeout)

    def remember_fact(self, content: str, metadata: dict[str, Any] | None = None, *, id: str | None = None,
                      timeout: float | None = None, **fields: Any) -> Any:
        """Store a permanent FACT.  Metadata as a dict, or as spec 000's keywords
        (``remember_fact("...", category="user_profile")``), or both (keywords win);
        ``id`` and ``timeout`` are this call's own."""
        return self.store(content, MemoryType.FACT, merged_metadata(metadata, fields), id=id, timeout=timeout)

    def remember_conversation(self, content: str, metadata: dict[str, Any] | None = None, *,
                              id: str | None = None, timeout: float | None = None, **fields: Any) -> Any:
        """Store a CONVERSATION memory (expires after the configured TTL); metadata as
        for :meth:`remember_fact`."""
        return self.store(content, MemoryType.CONVERSATION, merged_metadata(metadata, fields), id=id,
                          timeout=timeout)

    def get(self, memory_id: str, *, timeout: float | None = None) -> Any:
        """The memory with that id, or None."""
        return self._call("get", {"id": memory_id}, proto.memory_from_wire, timeout)

    def search(self, query: str, memory_type: MemoryType | str | None = None, limit: int = SEARCH_LIMIT,
               min_score: float = SEARCH_MIN_SCORE, where: dict[str, Any] | None = None, *, mode: str | None = None,
               about: str | None = None, owner: str | None = None, include_superseded: bool = False,
               timeout: float | None = None) -> Any:
        """Hybrid search; returns a list of SearchResult (``about``: a person; ``owner``: a user)."""
        args = _given(query=query, limit=limit, min_score=min_score, where=where, mode=mode, about=about,
                      owner=owner, include_superseded=include_superseded or None)
        if memory_type is not None:
            args["memory_type"] = _wire_type(memory_type)
        return self._call("search", args, proto.results_from_wire, timeout)

    def forget(self, memory_id: str, *, timeout: float | None = None) -> Any:
        """Delete a memory; True if it existed."""
        return self._call("forget", {"id": memory_id}, lambda r: bool(r["deleted"]), timeout)

    def cleanup_expired(self, *, timeout: float | None = None) -> Any:
        """Delete expired memories now; returns the count."""
        return self._call("cleanup_expired", {}, lambda r: int(r["deleted"]), timeout)

    def apply_retention(self, *, dry_run: bool = False, max_deletions: int | None = None,
                        timeout: float | None = None) -> Any:
        """Give stored conversation turns the daemon's configured TTL, then delete what
        expired; returns the plan and counts (``MemoryStore.apply_retention``, which
        refuses with ValidationError when more than ``max_deletions`` turns would go)."""
        args = _given(dry_run=dry_run, max_deletions=max_deletions)
        return self._call("apply_retention", args, timeout=timeout)

    def dedupe(self, *, dry_run: bool = False, timeout: float | None = None) -> Any:
        """Merge the copies of fact and context memories the daemon's store holds, or with
        ``dry_run`` only report them; returns ``kept``, ``merged`` and the first 200
        ``merges`` (``MemoryStore.dedupe``)."""
        return self._call("dedupe", _given(dry_run=dry_run), timeout=timeout)

    def record_turn(self, role: str, content: str, metadata: dict[str, Any] | None = None, *,
                    owner: str | None = None, id: str | None = None, timeout: float | None = None) -> Any:
        """Append a turn to the window and keep it as a CONVERSATION memory (metadata
        ``role`` plus ``metadata``; ``owner``: the user whose turn it is) in one durable
        write; returns the Memory.  With ``id`` (client-chosen, e.g. ``uuid4().hex``) the
        call may be sent again (``retries=``, or the caller's own retry after a timeout or
        a daemon restart): the turn is kept once and the memory kept first is returned;
        without one it is sent once (the request daemons before the id know)."""
        args = _given(role=role, content=content, metadata=metadata, owner=owner, id=id)
        return self._call("record_turn", args, proto.memory_from_wire, timeout)

    def add_to_context_window(self, role: str, content: str, *, timeout: float | None = None) -> Any:
        """Append a turn to the daemon's context window."""
        return self._call("add_to_context_window", {"role": role, "content": content}, timeout=timeout)

    def get_context_window(self, *, timeout: float | None = None) -> Any:
        """Recent messages, oldest first."""
        return self._call("get_context_window", {}, timeout=timeout)

    def clear_context_window(self, *, timeout: float | None = None) -> Any:
        """Empty the context window."""
        return self._call("clear_context_window", {}, timeout=timeout)

    def set_context(self, key: str, value: str, *, timeout: float | None = None) -> Any:
        """Set named session context (expires at the end of the day)."""
        return self._call("set_context", {"key": key, "value": value}, proto.memory_from_wire, timeout)

    def get_context(self, key: str, *, timeout: float | None = None) -> Any:
        """The value of named context, or None."""
        return self._call("get_context", {"key": key}, timeout=timeout)

    def export_page(self, after: str | None = None, limit: int = 500, *, timeout: float | None = None) -> Any:
        """One page of memories in id order: (memories, next cursor or None)."""
        args = {"limit": limit} | ({"after": after} if after else {})
        return self._call("export", args, lambda r: (_memories(r["memories"]), r["next"]), timeout)

    def backup(self, path: str, *, force: bool = False, timeout: float | None = None) -> Any:
        """Ask the daemon for a consistent snapshot file at ``path`` (on the daemon's machine;
        a directory gets a timestamped file).  ValidationError for a target inside
        the data directory, a symlink, or an existing non-backup file (unless ``force``)."""
        return self._call("backup", {"path": path, "force": force}, timeout=timeout)

    def compact(self, *, timeout: float | None = None) -> Any:
        """Fold the journal into a snapshot now."""
        return self._call("compact", {}, timeout=timeout)

    def forgotten_in_backups(self, ids: list[str] | None = None, *, timeout: float | None = None) -> Any:
        """The backups the daemon wrote that still hold a forgotten memory (of ``ids``, or
        any), a forgotten person or an expired memory: [{"path", "made", "forgotten",
        "persons", "expired"}]."""
        return self._call("forgotten_in_backups", {} if ids is None else {"ids": list(ids)}, timeout=timeout)

    def purge_backups(self, paths: list[str] | None = None, *, timeout: float | None = None) -> Any:
        """Rewrite the backups the daemon wrote, and ``paths`` (absolute, on its machine),
        without what was forgotten or expired: [{"path", "removed", "persons", "bytes"}]."""
        return self._call("purge_backups", {} if paths is None else {"paths": list(paths)}, timeout=timeout)


    # -- people-aware memory -------------------------------------------------------------

    def remember(self, content: str | None = None, facts: list[dict[str, Any]] | None = None,
                 subjects: list[str] | None = None, expires_in_days: float | None = None, shared: bool = False,
                 owner: str | None = None, name: str | None = None, aliases: list[str] | None = None, *,
                 id: str | None = None, timeout: float | None = None) -> Any:
        """Store one fact or several, about people (resolved or created); returns [Memory].
        With ``id`` (client-chosen, with ``content``; with ``facts``: an ``id`` in each fact)
        a retry stores nothing twice and returns the memories kept first, and ``retries=``
        sends it again after a timeout; without, it is sent once (the request daemons before
        the id know: a daemon that does not know it refuses it, ValidationError naming "args"
        or "facts", nothing stored: see :func:`refuses_ids`).  A fact's persons are its
        owner's or the household's; without ``owner`` (unscoped, seen by every user) the
        household's only: another owner's person id is a ValidationError (``person_id``,
        ``owner``, ``other_owner``), nothing stored."""
        args = _given(content=content, facts=facts, subjects=subjects, expires_in_days=expires_in_days,
                      shared=shared, owner=owner, name=name, aliases=aliases, id=id)
        return self._call("remember", args, _memories, timeout)

    def recall(self, query: str, about: str | None = None, owner: str | None = None, limit: int = SEARCH_LIMIT,
               include_superseded: bool = False, *, timeout: float | None = None) -> Any:
        """Facts relevant to ``query``, optionally about a person; [SearchResult]."""
        args = _given(query=query, about=about, owner=owner, limit=limit, include_superseded=include_superseded)
        return self._call("recall", args, proto.results_from_wire, timeout)

    def history(self, memory_id: str, *, timeout: float | None = None) -> Any:
        """The supersession chain through a memory, oldest first."""
        return self._call("history", {"id": memory_id}, _memories, timeout)

    def correct(self, memory_id: str, new_content: str, *, timeout: float | None = None) -> Any:
        """Store the corrected fact, superseding the old one; returns the new Memory."""
        return self._call("correct", {"id": memory_id, "content": new_content}, proto.memory_from_wire, timeout)

    def confirm(self, memory_id: str, *, timeout: float | None = None) -> Any:
        """Mark a fact confirmed (never superseded automatically)."""
        return self._call("confirm", {"id": memory_id}, proto.memory_from_wire, timeout)

    def supersede(self, old_id: str, new_id: str, *, timeout: float | None = None) -> Any:
        """Mark ``old_id`` as replaced by ``new_id`` (both kept); returns the old Memory."""
        return self._call("supersede", {"old_id": old_id, "new_id": new_id}, proto.memory_from_wire, timeout)

    def add_person(self, name: str, relation: str | None = None, aliases: list[str] | None = None,
                   owner: str | None = None, external_id: str | None = None,
                   metadata: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Add a person; returns the Person."""
        args = _given(name=name, relation=relation, aliases=aliases, owner=owner, external_id=external_id,
                      metadata=metadata)
        return self._call("add_person", args, proto.person_from_wire, timeout)

    def find_person(self, reference: str, owner: str | None = None, *, timeout: float | None = None) -> Any:
        """The Person a reference means ("my wife", "Sarah"), or None."""
        return self._call("find_person", _given(reference=reference, owner=owner), proto.person_from_wire, timeout)

    def resolve_person(self, reference: str, owner: str | None = None, create: bool = True, *,
                       timeout: float | None = None) -> Any:
        """(Person or None, created): find, or create, the person a reference means."""
        args = _given(reference=reference, owner=owner, create=create)
        return self._call("resolve_person", args, lambda r: (proto.person_from_wire(r["person"]), r["created"]),
                          timeout)

    def person_by_external_id(self, external_id: str, *, timeout: float | None = None) -> Any:
        """The Person anchored to an outside identity (face, voice), or the one a person
        anchored to it was merged into, or None."""
        return self._call("person_by_external_id", {"external_id": external_id}, proto.person_from_wire, timeout)

    def people(self, owner: str | None = None, *, timeout: float | None = None) -> Any:
        """The persons an owner knows (everyone for None)."""
        return self._call("people", _given(owner=owner), lambda r: [proto.person_from_wire(p) for p in r], timeout)

    def person_redirects(self, *, timeout: float | None = None) -> Any:
        """Every person id merged away and the live person id it resolves to ({old: kept})."""
        return self._call("person_redirects", {}, timeout=timeout)

    def update_person(self, person_id: str, *, name: str | None = None, relation: str | None = None,
                      aliases: list[str] | None = None, external_id: str | None = None,
                      metadata: dict[str, Any] | None = None, owner: str | None = None,
                      household: bool = False, timeout: float | None = None) -> Any:
        """Change the given fields of a person (None leaves a field as it is, ``owner=None``
        too); returns the Person.  ``household=True`` makes the person the household's (no
        owner: every user sees them), e.g. the kept person before merging two users'
        persons; with ``owner`` too: a ValidationError (field "household"), nothing changed.
        A daemon older than ``household`` refuses it: a ValidationError naming it (field
        "args"), nothing changed.  A new ``owner`` that a memory about the person is not
        of: a ValidationError (``person_id``, ``owner``, ``memories``, ``other_owner``),
        nothing changed."""
        # household only when True: the request without it is the one older daemons know
        args = _given(id=person_id, name=name, relation=relation, aliases=aliases, external_id=external_id,
                      metadata=metadata, owner=owner, household=household or None)
        return self._call("update_person", args, proto.person_from_wire, timeout)

    def merge_people(self, keep: str, other: str, *, timeout: float | None = None) -> Any:
        """Merge ``other`` into ``keep``; returns the kept Person (a retry of a done merge: the same).
        Into another owner's person: a ValidationError naming both (``owner``, ``other_owner``)."""
        return self._call("merge_people", {"keep": keep, "other": other}, proto.person_from_wire, timeout)

    def delete_person(self, person_id: str, *, timeout: float | None = None) -> Any:
        """Forget a person (memories stay, unlinked); True if it existed. An id merged away
        is a ValidationError naming (``merged_into``) the person it was merged into."""
        return self._call("delete_person", {"id": person_id}, lambda r: bool(r["deleted"]), timeout)

    def note(self, name: str, *, timeout: float | None = None) -> Any:
        """The note with this name or alias, or None."""
        return self._call("note", {"name": name}, proto.memory_from_wire, timeout)

    def rename_note(self, name: str, new_name: str, *, timeout: float | None = None) -> Any:
        """Rename a note."""
        return self._call("rename_note", {"name": name, "new_name": new_name}, proto.memory_from_wire, timeout)

    def alias_note(self, name: str, alias: str, *, timeout: float | None = None) -> Any:
        """Add an alias to a note."""
        return self._call("alias_note", {"name": name, "alias": alias}, proto.memory_from_wire, timeout)

    def rewrite_note(self, name: str, content: str, *, timeout: float | None = None) -> Any:
        """New content for a note (the old version stays in its history)."""
        return self._call("rewrite_note", {"name": name, "content": content}, proto.memory_from_wire, timeout)

    def remove_note(self, name: str, *, timeout: float | None = None) -> Any:
        """Forget a note; True if there was one."""
        return self._call("remove_note", {"name": name}, lambda r: bool(r["deleted"]), timeout)

    def archive_conversation(self, summary: str, until: float | None = None, name: str | None = None,
                             owner: str | None = None, *, timeout: float | None = None) -> Any:
        """Record a conversation summary as an archive memory."""
        args = _given(summary=summary, until=until, name=name, owner=owner)
        return self._call("archive_conversation", args, proto.memory_from_wire, timeout)

    def context_for(self, message: str, owner: str | None = None, max_tokens: int = 800, max_memories: int = 10,
                    max_messages: int = 5, min_similarity: float = 0.3, *, timeout: float | None = None) -> Any:
        """Prompt-ready context for ``message`` in one round trip (a RetrievedContext)."""
        args = _given(message=message, owner=owner, max_tokens=max_tokens, max_memories=max_memories,
                      max_messages=max_messages, min_similarity=min_similarity)
        return self._call("context_for", args, proto.context_from_wire, timeout)


    def import_memories(self, memories: list[dict[str, Any]], people: list[dict[str, Any]] | None = None, *,
                        timeout: float | None = None) -> Any:
        """Recreate exported memories and persons (``Memory.to_dict`` / ``Person.to_dict``
        shapes; a person's ``merged_ids`` resolve to it again) with their ids and links;
        present ids are kept. Returns the counts.  A memory about a person its owner does not
        see (the stored person, kept as it is, else the import's) is imported without that
        link: ``links_left_out`` counts them, ``left_out_links`` lists ``{"memory_id",
        "person_id"}`` (a daemon older than that rule returns neither)."""
        return self._call("import", _given(memories=memories, people=people), timeout=timeout)

    # -- the household's controls (docs/HOUSEHOLD.md) --------------------------------------

    def forget_person(self, reference: str, dry_run: bool = False, *, timeout: float | None = None) -> Any:
        """Forget a person and what is kept about them (the person, their aliases, the
        memories about only them, their turns and window turns; their name removed from
        the memories that stay); returns the counts (``dry_run``: what would go, nothing
        changed). NotFoundError for a reference naming nobody."""
        return self._call("forget_person", _given(reference=reference, dry_run=dry_run or None), timeout=timeout)

    def about_person(self, reference: str, *, timeout: float | None = None) -> Any:
        """Everything kept about one person (``MemoryStore.about_person``); NotFoundError for nobody."""
        return self._call("about_person", {"reference": reference}, timeout=timeout)

    def pause_remembering(self, minutes: float, *, timeout: float | None = None) -> Any:
        """Stop writing memories for ``minutes`` (turns reach the window only, in memory);
        returns the status (``paused``, ``until``, ``seconds_left``, ``private_turns``)."""
        return self._call("pause_remembering", {"minutes": minutes}, timeout=timeout)

    def resume_remembering(self, *, timeout: float | None = None) -> Any:
        """Remember again; returns the status."""
        return self._call("resume_remembering", {}, timeout=timeout)


def _unsendable(exc: Exception) -> str:
    """What msgpack refused, in words a caller (or a model) can act on."""
    if isinstance(exc, OverflowError):
        return "an integer does not fit in 64 bits"
    if isinstance(exc, UnicodeEncodeError):
        return "a text is not valid Unicode (a lone surrogate)"
    return str(exc)


def refuses_ids(exc: ValidationError) -> bool:
    """Whether ``exc`` is a daemon's refusal of a client-made ``id`` it does not know yet (one
    from before ids on that op, not restarted since an upgrade): an unknown argument (field
    "args"), or ``remember``'s unknown fact key (field "facts"); it stored nothing. The caller
    may send the write once without its id (never again: then a retry could keep it twice)."""
    return exc.fields.get("field") in ("args", "facts") and "'id'" in exc.message


def _given(**args: Any) -> dict[str, Any]:
    """The arguments that were given (None means "not given" on the wire)."""
    return {k: v for k, v in args.items() if v is not None}


class _Base(_Api):
    _ctx: zmq.Context  # set by the subclass (blocking or asyncio), with its first socket
    _sock: zmq.Socket

    def __init__(self, endpoint: str | None, config: Config | None, timeout: float, retries: int) -> None:
        """ValidationError for a ``timeout`` that is not seconds >= 0 or ``retries`` that is
        not an int >= 0 (-1 made every call fail with AssertionError)."""
        check_seconds(timeout, "timeout")  # inf: no limit
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValidationError(f"retries must be an int >= 0, not {retries!r}", field="retries")
        self.config = config or load_config()
        self.endpoint = resolve_endpoint(endpoint, self.config)
        check_tcp_port(self.endpoint)
        self.timeout = timeout
        self.retries = retries
        self._closed = False

    def _no_reply(self, op: str, timeout: float, note: str = "") -> RequestTimeoutError:
        """The error for a call that got no reply in time, ``note`` added to its message;
        when the ipc socket is not there at all, it says so (one stat, after the
        deadline: the wait is not longer)."""
        path = ipc_path(self.endpoint)
        hint = ("; no socket there: is the daemon running? (`reachy-memory serve`; on the robot: "
                "sudo systemctl start reachy-memory)") if path is not None and not path.exists() else ""
        return RequestTimeoutError(f"no reply to {op!r} from {self.endpoint} within {timeout:.3g} s{hint}{note}",
                                   op=op, endpoint=self.endpoint)

    def _socket(self, ctx: zmq.Context) -> zmq.Socket:
        """A DEALER connected to the endpoint. ConfigError (the socket closed again) for an
        endpoint zmq refuses ("nonsense", "tcp://") or CURVE files that are not certificates."""
        sock = ctx.socket(zmq.DEALER)
        try:
            self._connect(sock)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _connect(self, sock: zmq.Socket) -> None:
        sock.linger = 0
        # Queue requests only on a live connection: without this a request made while no
        # daemon listens waits in the socket and reaches the next daemon that starts, long
        # after its caller got RequestTimeoutError (a store done that its caller was told
        # failed). The blocking client also replaces its socket; the async one cannot,
        # its other calls share it. Sends wait for a connection within the call's timeout.
        sock.immediate = 1
        server = self.config.server
        if server.curve_server_public_key and server.curve_client_secret_key:
            public, secret = load_certificate(server.curve_client_secret_key, "server.curve_client_secret_key")
            if secret is None:
                raise ConfigError(f"{server.curve_client_secret_key} holds no secret key",
                                  key="server.curve_client_secret_key")
            sock.curve_secretkey, sock.curve_publickey = secret, public
            sock.curve_serverkey, _ = load_certificate(server.curve_server_public_key, "server.curve_server_public_key")
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot connect to endpoint {self.endpoint!r}: {exc}", key="server.endpoint") from exc

    def _encode(self, op: str, args: dict[str, Any], timeout: float) -> tuple[str, bytes]:
        """A new request id and the request's frame. ClosedError after close(); ValidationError
        (field "args") for an argument msgpack cannot carry (a datetime, an int past 64 bits,
        a lone surrogate, a map that contains itself), TooLargeError (field "request") for a
        frame over ``server.max_message_bytes``: nothing is sent."""
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        check_seconds(timeout, "timeout")  # inf: no limit
        request_id = uuid.uuid4().hex
        try:
            frame = proto.request(request_id, op, args, timeout_ms=timeout * 1000)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValidationError(f"the arguments of {op!r} cannot be sent: {_unsendable(exc)}", field="args") from exc
        # Refused here, not sent: the daemon would refuse it unread (answering with the
        # id at its start), and past 16 x the daemon's limit it drops the frame and the
        # connection with no answer at all. A daemon with a smaller limit than this
        # config's still answers (see AsyncMemoryClient._unnamed_error for older ones).
        limit = self.config.server.max_message_bytes
        if len(frame) > limit:
            raise TooLargeError(f"{op!r} request of {len(frame)} bytes exceeds {limit}", field="request",
                                size=len(frame), limit=limit)
        return request_id, frame

    def _open(self, ctx: zmq.Context) -> zmq.Socket:
        """The first socket on ``ctx`` (the context terminated again if it cannot be made);
        from here on ``self._release()`` closes the client's sockets and ``ctx``, and runs by
        itself if the client is collected unclosed (not at interpreter exit: a daemon thread
        may still be in a call)."""
        self._sockets: list[zmq.Socket] = []
        try:
            sock = self._track(self._socket(ctx))
        except BaseException:
            ctx.term()
            raise
        self._release = weakref.finalize(self, _release, ctx, self._sockets)
        self._release.atexit = False
        return sock

    def _replace_socket(self) -> None:
        """Close the socket and connect a fresh one: what the old one had queued, and
        replies still to come to it, are dropped."""
        self._sock.close(linger=0)
        self._sock = self._track(self._socket(self._ctx))

    def _track(self, sock: zmq.Socket) -> zmq.Socket:
        """``sock``, kept for ``_release`` (closed ones are let go)."""
        self._sockets[:] = [s for s in self._sockets if not s.closed] + [sock]
        return sock

    def _attempts(self, op: str, args: dict[str, Any]) -> int:
        """1, plus ``retries`` for a call safe to send again (a read, a write with its id)."""
        safe = op in _IDEMPOTENT or (op in _IDEMPOTENT_WITH_ID and carries_ids(args))
        return 1 + (self.retries if safe else 0)

    @staticmethod
    def _result(op: str, reply: dict[str, Any], convert: Callable[[Any], Any]) -> Any:
        """The converted result of a reply; its error raised; ProtocolError for a
        result not of the op's shape (never the KeyError or TypeError of the converter)."""
        value = proto.raise_for(reply)
        try:
            return convert(value)
        except _MALFORMED as exc:
            raise ProtocolError(f"malformed result of {op!r}: {exc.__class__.__name__}: {exc}", op=op) from exc


def _release(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    """Close ``sockets``, then terminate ``ctx``: what close() does, and what runs when a
    client is collected unclosed. Left to pyzmq, a context collected in a reference cycle
    with its socket (an AsyncMemoryClient and its reader task are one) finds its list of
    sockets already cleared, and its term() waits for that socket forever."""
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


class MemoryClient(_Base):
    """Blocking client. Use as a context manager or call :meth:`close`.

    Threads may share one: their calls take turns on the socket (a call waits for
    another thread's within its own timeout, else RequestTimeoutError), and
    :meth:`close` from another thread makes a call in flight raise ClosedError.
    """

    def __init__(self, endpoint: str | None = None, *, config: Config | None = None, timeout: float = 5.0,
                 retries: int = 0) -> None:
        super().__init__(endpoint, config, timeout, retries)
        self._ctx = zmq.Context()
        self._sock = self._open(self._ctx)
        self._lock = threading.Lock()  # the socket, one call at a time: a zmq socket is not thread-safe

    def _call(self, op: str, args: dict[str, Any], convert: Callable[[Any], Any] = lambda r: r,
              timeout: float | None = None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        attempts = self._attempts(op, args)
        for attempt in range(attempts):
            try:
                return self._result(op, self._roundtrip(op, args, timeout), convert)
            except RequestTimeoutError:
                if attempt + 1 == attempts:
                    raise
        raise AssertionError("unreachable")

    def _roundtrip(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        request_id, frame = self._encode(op, args, timeout)
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout if timeout < threading.TIMEOUT_MAX else -1):
            raise RequestTimeoutError(f"no reply to {op!r} within {timeout:.3g} s: another thread's call "
                                      "held the client", op=op, endpoint=self.endpoint)
        try:
            if self._closed:  # by another thread while this one waited for the lock
                raise ClosedError("MemoryClient is closed")
            return self._exchange(op, request_id, frame, deadline, timeout)
        finally:
            self._lock.release()

    def _exchange(self, op: str, request_id: str, frame: bytes, deadline: float, timeout: float) -> dict[str, Any]:
        """Send ``frame`` and wait for its reply (the caller holds the lock)."""
        # A DEALER with no live pipe blocks a plain send forever: after a failed
        # handshake (a client without the daemon's CURVE keys) libzmq drops the pipe
        # and does not reconnect. Wait for room within the call's own deadline.
        if self._send(frame, deadline):
            while self._wait(zmq.POLLIN, deadline):
                reply = proto.decode(self._sock.recv())
                if reply.get("id") == request_id:
                    return reply
                if reply.get("id") is None and not reply.get("ok"):
                    proto.raise_for(reply)  # an error the daemon could not tie to a request
        self._replace_socket()
        raise self._no_reply(op, timeout)

    def _send(self, frame: bytes, deadline: float) -> bool:
        """Send ``frame`` without blocking; False if there is no room before ``deadline``.
        (Tried first, polled only when refused: a poll per call costs a system call.)
        POLLOUT is no promise: the daemon's connection can drop between the poll and the
        send (a restart, a kill), which refuses the send again (zmq.Again, which leaked
        to the caller); then it waits for the next connection, still within ``deadline``."""
        while True:
            try:
                self._sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                if not self._wait(zmq.POLLOUT, deadline):
                    return False

    def _wait(self, event: int, deadline: float) -> bool:
        """True once the socket is ready for ``event``, False if ``deadline`` (monotonic) passes
        first; ClosedError once :meth:`close` was called (on another thread). Polled in slices
        (zmq_poll takes an int of milliseconds, and close must not wait for a long timeout)."""
        while (left := deadline - time.monotonic()) > 0:
            if self._closed:
                raise ClosedError("MemoryClient closed during the call")
            if self._sock.poll(int(min(left, _POLL_SLICE) * 1000) + 1, event):
                return True
        return False


    def close(self) -> None:
        """Close the socket (linger 0); idempotent, from any thread: a call in flight on
        another thread raises ClosedError within ``_POLL_SLICE`` and close waits for that."""
        self._closed = True
        with self._lock:
            self._release()

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncMemoryClient(_Base):
    """asyncio client; concurrent calls are matched to replies by request id.

    Every method returns an awaitable, mirroring the spec's async MemoryManager.
    Use it on one event loop at a time; a later loop (another ``asyncio.run``, or
    ``run_until_complete`` on a new loop) may take it over once the earlier one is done.
    """

    def __init__(self, endpoint: str | None = None, *, config: Config | None = None, timeout: float = 5.0,
                 retries: int = 0) -> None:
        import zmq.asyncio  # here, not at module level: see the imports above

        super().__init__(endpoint, config, timeout, retries)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._open(self._ctx)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._unnamed: tuple[float, str] | None = None  # (when, what) of the last error reply without an id
        self._reader: asyncio.Task[None] | None = None

    def _call(self, op: str, args: dict[str, Any], convert: Callable[[Any], Any] = lambda r: r,
              timeout: float | None = None) -> Awaitable[Any]:
        return self._acall(op, args, convert, self.timeout if timeout is None else timeout)

    async def _acall(self, op: str, args: dict[str, Any], convert: Callable[[Any], Any], timeout: float) -> Any:
        attempts = self._attempts(op, args)
        for attempt in range(attempts):
            try:
                return self._result(op, await self._roundtrip(op, args, timeout), convert)
            except RequestTimeoutError:
                if attempt + 1 == attempts:
                    raise
        raise AssertionError("unreachable")

    async def _roundtrip(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        import asyncio

        request_id, frame = self._encode(op, args, timeout)
        loop = asyncio.get_running_loop()
        if self._reader is not None and not self._reader.done() and self._reader.get_loop() is not loop:
            self._new_loop()  # (asyncio.run cancels its tasks: a reader it ended leaves the socket usable)
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[request_id] = future
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        started = time.monotonic()
        try:
            # bounded for the same reason as the blocking client's send
            async with asyncio.timeout(timeout):
                await cast(Awaitable[Any], self._sock.send(frame))
                return await future
        except TimeoutError:
            raise self._no_reply(op, timeout, self._unnamed_since(started)) from None
        except (asyncio.CancelledError, zmq.ZMQError) as exc:
            # close() from another task cancels a send in progress (pyzmq); a cancellation
            # of this task itself is passed on as it is
            task = asyncio.current_task()
            if not self._closed or (task is not None and task.cancelling()):
                raise
            raise ClosedError(f"{type(self).__name__} closed during the call") from exc
        finally:
            self._pending.pop(request_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # set by close() while the send was in progress: seen, not "never retrieved"

    def _unnamed_error(self, reply: dict[str, Any]) -> None:
        """An error reply without a request id: from a daemon older than ``protocol.peek_id``
        (this one names the request it refuses unread), about a request it refused over its
        size limit. Which call's it is cannot be known (a request whose caller timed out may
        be answered late), so it goes to no call; calls timing out meanwhile say it may
        have been theirs."""
        try:
            proto.raise_for(reply)
        except ReachyMemoryError as exc:
            self._unnamed = (time.monotonic(), f"{type(exc).__name__}: {exc.message}")

    def _unnamed_since(self, started: float) -> str:
        """What a timeout of a call started at ``started`` adds about an id-less error
        that came meanwhile and was given to no call ("" when none did)."""
        if self._unnamed is None or self._unnamed[0] < started:
            return ""
        return (f"; meanwhile the daemon refused a request without naming it ({self._unnamed[1]}): it may have "
                "been this one")

    def _new_loop(self) -> None:
        """Called on another event loop than the live reader's: a fresh socket and reader.

        A loop closed without cancelling its tasks (``run_until_complete``, then ``close``)
        leaves the reader waiting in a recv on the socket, first in its queue, for good:
        it would take every reply and no call on a later loop could get one.
        """
        self._replace_socket()
        self._reader = None
        self._pending.clear()  # calls of the old loop: none can be resumed
        self._unnamed = None  # a new socket: no reply of the old one comes to it

    async def _read(self) -> None:
        while self._pending:
            try:
                reply = proto.decode(await cast(Awaitable[bytes], self._sock.recv()))
            except ProtocolError:
                continue
            request_id = reply.get("id")  # a list or map here must not end the reader (TypeError)
            if request_id is None and not reply.get("ok"):
                self._unnamed_error(reply)
                continue
            future = self._pending.get(request_id) if isinstance(request_id, str) else None
            if future is not None and not future.done():
                future.set_result(reply)

    async def close(self) -> None:
        """Close the socket (linger 0); idempotent. Calls in flight (in other tasks)
        raise ClosedError at once rather than waiting out their timeouts."""
        import asyncio

        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        for future in self._pending.values():
            if not future.done() and future.get_loop() is loop:
                future.set_exception(ClosedError(f"{type(self).__name__} closed during the call"))
        if self._reader is not None and self._reader.get_loop() is loop:
            self._reader.cancel()  # (one of a closed loop cannot be, and never runs again)
        self._release()

    async def __aenter__(self) -> AsyncMemoryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncMemoryClient", "MemoryClient", "SearchResult", "refuses_ids"]
