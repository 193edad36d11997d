"""The one table of the daemon's operations.

Every operation the daemon answers is one :class:`Op` row here.  A row says
everything the daemon and the clients need to know about the op besides its
code: its name, the thread it runs on (``lane``), its arguments (names, types,
required or default), whether it is a read, whether its reply is capped,
whether the clients retry it, what it returns and a one-line doc.  From the
table come:

* the daemon's argument checks (:func:`check_args`, on the I/O thread, before
  any queue: an unknown, missing or mistyped argument is ``bad_request`` with
  the field named) and its one dispatch path (``daemon/server.py`` routes a
  request to the queue of its row's lane; ``daemon/lanes.py`` runs the row's
  handler from ``daemon/handlers.py``, answers a read at once and a write once
  durable, refuses a capped reply over ``server.max_reply_bytes``);
* the clients' retries (:data:`IDEMPOTENT`, :data:`IDEMPOTENT_WITH_ID`);
* the protocol reference, ``docs/PROTOCOL.md`` (:func:`protocol_doc`;
  regenerate with ``python -m reachy_memory.daemon.operations > docs/PROTOCOL.md``);
* the drift test (``tests/test_operations.py``): every row has a server
  handler and a client method, every client method and server handler has a
  row, and the reference on disk is the generated one.

Adding an operation ``frob``:

1. one row in ``_ROWS`` below: a write is ``_op("frob", "engine", [_req("id", STR)], "memory",
   "What it does.")`` (add ``retry="yes"``, or ``"with_id"``, when sending it again
   cannot repeat it); a read, which changes nothing, is ``_read(...)`` (add
   ``capped=True`` when its reply can outgrow its request);
2. one handler function in ``daemon/handlers.py``, decorated ``@handles("frob")``:
   ``def frob(d, job): return proto.memory_to_wire(d.store.frob(job.args["id"]))``
   (``job.args`` are checked against the row, defaults filled in; an ``embed`` op
   also names the function that embeds, ``@handles("frob", prepare=...)``, whose
   value the handler finds in ``job.prepared``);
3. the store method it calls (the engine), and one method on ``client._Api`` (both
   clients get it); then regenerate the reference.

No other list of ops exists to update: the daemon routes, checks, runs and caps
from the row, and a missing handler or a handler without a row fails at import.

Lanes (the thread an op runs on): ``inline`` ops are answered on the I/O thread
from lock-free views (they never wait behind a search or a compaction);
``embed`` ops embed on the embedding thread, then run on the engine thread;
``engine`` ops run on the engine thread in arrival order; ``background`` ops (a
backup, merging copies) run on a thread of their own, one at a time, taking the store
lock only briefly (a dedupe: a step of its comparisons or a frame of its merges at a
time, through the commit funnel): the engine goes on meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from reachy_memory.errors import ValidationError
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE

__all__ = ["IDEMPOTENT", "IDEMPOTENT_WITH_ID", "LANES", "OPERATIONS", "Arg", "Op", "carries_ids", "check_args",
           "protocol_doc"]

_MISSING: Any = object()

# Accepted wire types (after msgpack decoding).  bool is never an int here.
STR, INT, NUM, BOOL, LIST, DICT = "str", "int", "number", "bool", "list", "map"
_CHECKS = {
    STR: lambda v: isinstance(v, str),
    INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
    NUM: lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
    BOOL: lambda v: isinstance(v, bool),
    LIST: lambda v: isinstance(v, list),
    DICT: lambda v: isinstance(v, dict),
}


@dataclass(frozen=True)
class Arg:
    """One argument: ``kind`` is a wire type; ``default`` _MISSING means optional and
    left out when absent (None is then allowed too); ``required`` has no default."""

    name: str
    kind: str
    required: bool = False
    default: Any = _MISSING
    doc: str = ""

    def describe(self) -> str:
        if self.required:
            return f"{self.name}: {self.kind}"
        if self.default is _MISSING:
            return f"{self.name}?: {self.kind}"
        return f"{self.name}: {self.kind} = {_show(self.default)}"


LANES = ("inline", "embed", "engine", "background")
RETRIES = ("yes", "with_id", "no")


@dataclass(frozen=True)
class Op:
    """One operation of the protocol: what it is called and takes, and how the daemon runs it.

    ``lane``: the thread it runs on (module doc).  ``read``: it changes nothing, so
    its reply goes at once (a write's reply waits until what the journal holds is
    durable, even when it wrote nothing itself: a retried store finds its memory
    written but maybe not synced).  ``capped``: a read whose result can outgrow its
    request is refused ``too_large`` over ``server.max_reply_bytes`` (a write's reply
    echoes what it stored, bounded by the request limit, and is never refused after
    the write was made durable).  ``retry``: "yes", the clients send it again after
    a timeout (every read; a write whose ids the client chose); "with_id", only when
    the call carries its ids (:func:`carries_ids`); "no".
    """

    name: str
    lane: str
    args: tuple[Arg, ...]
    result: str
    doc: str
    read: bool = False
    capped: bool = False
    retry: str = "no"
    client: str = ""  # the client method, when its name differs from the op's

    def __post_init__(self) -> None:
        if self.lane not in LANES or self.retry not in RETRIES:
            raise ValueError(f"{self.name}: lane {self.lane!r} or retry {self.retry!r} unknown")
        if (self.lane == "inline" or self.capped) and not self.read:
            raise ValueError(f"{self.name}: only a read may be inline or capped")
        if self.read and self.retry != "yes":
            raise ValueError(f"{self.name}: a read is always safe to retry")
        if self.retry == "with_id" and "id" not in {a.name for a in self.args}:
            raise ValueError(f"{self.name}: retried with its id, but it takes none")

    @property
    def idempotent(self) -> bool:
        """Safe to send again after a timeout: reads, and writes whose ids the client chose."""
        return self.retry == "yes"

    @property
    def client_method(self) -> str:
        return self.client or self.name


def _op(name: str, lane: str, args: list[Arg], result: str, doc: str, *, read: bool = False, capped: bool = False,
        retry: str | None = None, client: str = "") -> Op:
    """A row; ``retry`` defaults to "yes" for a read, "no" for a write."""
    return Op(name, lane, tuple(args), result, doc, read, capped, retry or ("yes" if read else "no"), client)


def _read(name: str, lane: str, args: list[Arg], result: str, doc: str, *, capped: bool = False,
          client: str = "") -> Op:
    return _op(name, lane, args, result, doc, read=True, capped=capped, client=client)


def _req(name: str, kind: str, doc: str = "") -> Arg:
    return Arg(name, kind, required=True, doc=doc)


def _opt(name: str, kind: str, default: Any = _MISSING, doc: str = "") -> Arg:
    return Arg(name, kind, default=default, doc=doc)


_MEMORY_TYPE = _opt("memory_type", STR, doc="conversation | fact | context")
_OWNER = _opt("owner", STR, doc="a user of the robot; None: unscoped")

_ROWS = [
    # -- service --------------------------------------------------------------------------
    _read("ping", "inline", [], '{"pong": true, "time": float}', "Round trip; answered on the I/O thread."),
    _read("health", "inline", [], "{status, embedder, memories, last_cleanup, uptime_s, remembering, ...}",
        "Whether the daemon and its model are usable (status ok | degraded | read_only); remembering: the pause "
        "({paused, until, seconds_left, private_turns})."),
    _read("stats", "inline", [], "{ops: {op: {count, errors, p50_ms, p99_ms, stages_p50_ms}}, store: {...}, uptime_s, "
        "queues: {embed, engine, sync, background}, replies_dropped, heap_trims: {recent, p50_ms, max_ms}}",
        "Per-operation counts and latencies (p50 per stage: wait, embed, engine, sync: a write's fsync), store "
        "sizes (store.memories and by_type: what readers see; expired_unswept: expired, hidden, deleted by the "
        "next sweep), the conversation TTL (store.conversation_ttl_days) and the pause (store.remembering), "
        "queue depths, replies dropped, the last heap trims (ms; null before the first)."),
    # -- memories -------------------------------------------------------------------------
    _op("store", "embed", [_req("content", STR), _opt("memory_type", STR, "fact"), _opt("metadata", DICT),
                           _opt("id", STR, doc="client-chosen: a retry never duplicates"), _OWNER,
                           _opt("shared", BOOL, False, doc="every user sees it")],
        "memory", "Store one memory (durable when answered).", retry="yes"),
    _op("store_batch", "embed", [_req("items", LIST,
                                      "[{content, memory_type, metadata, id?, created_at?, owner?, shared?}]")],
        "[memory]", "Store several memories in one durable write: all or none.", retry="yes"),
    _op("remember_fact", "embed", [_req("content", STR), _opt("metadata", DICT), _opt("id", STR)],
        "memory", "Store a permanent FACT.", retry="yes"),
    _op("remember_conversation", "embed", [_req("content", STR), _opt("metadata", DICT), _opt("id", STR)],
        "memory", "Store a CONVERSATION turn (expires after the configured TTL).", retry="yes"),
    _read("get", "inline", [_req("id", STR)], "memory | null", "The live memory with that id."),
    _read("search", "embed", [_req("query", STR), _MEMORY_TYPE, _opt("limit", INT, SEARCH_LIMIT),
                            _opt("min_score", NUM, SEARCH_MIN_SCORE),
                            _opt("where", DICT, doc="Chroma-style filter"),
                            _opt("mode", STR, doc="hybrid|vector|lexical"),
                            _opt("about", STR, doc="a person: 'my wife', 'Sarah'"), _OWNER,
                            _opt("include_superseded", BOOL, False)],
        '[{"memory": memory, "score": float, "subject_names"?: [str]}]', "Find memories by meaning and words.",
          capped=True),
    _op("forget", "engine", [_req("id", STR)], '{"deleted": bool, "backups": [str]}',
        "Delete a memory; its text leaves every file of the data directory within seconds. "
        "`backups`: the backups made before that still hold it (see purge_backups)."),
    _op("cleanup_expired", "engine", [_opt("now", NUM, doc="epoch; never in the future")], '{"deleted": int}',
        "Delete expired memories now."),
    _op("apply_retention", "engine", [_opt("dry_run", BOOL, False),
                                      _opt("max_deletions", INT, doc="refuse if more turns would go now"),
                                      _opt("now", NUM, doc="epoch; never in the future")],
        '{"conversation_days": float, "turns": int, "earlier": int, "later": int, "expire_now": int, '
        '"applied": bool, "deleted": int}',
        "Give stored conversation turns the configured TTL, then delete what expired (dry_run: count only)."),
    _op("dedupe", "background", [_opt("dry_run", BOOL, False)],
        '{"dry_run": bool, "kept": int, "merged": int, "merges": [{"kept", "content", "type", "owner", '
        '"copies_count", "copies": [{"id", "content", "reason"}]}]}',
        "Merge the copies of fact and context memories a store holds (each set keeps its oldest memory, "
        "refreshed); dry_run: report only. The first 200 merges and 20 copies of each listed (texts cut at "
        "200 characters), all counted."),
    _read("export", "engine", [_opt("after", STR), _opt("limit", INT, 500)],
        '{"memories": [memory], "next": str | null}', "One page of memories in id order.", client="export_page",
          capped=True),
    # -- context window and named context --------------------------------------------------------
    _op("add_to_context_window", "engine", [_req("role", STR), _req("content", STR)], "null",
        "Append a turn to the context window."),
    _op("record_turn", "embed", [_req("role", STR), _req("content", STR), _opt("metadata", DICT), _OWNER,
                                 _opt("id", STR, doc="client-chosen: a retry never appends the turn twice")],
        "memory", "Append a turn to the context window and keep it as a CONVERSATION memory: one durable write.",
        retry="with_id"),
    _read("get_context_window", "inline", [], '[{"role", "content", "timestamp"}]', "Recent turns, oldest first."),
    _op("clear_context_window", "engine", [], "null", "Empty the context window."),
    _op("set_context", "embed", [_req("key", STR), _req("value", STR)], "memory",
        "Set named session context (a CONTEXT memory, until the end of the day)."),
    _read("get_context", "inline", [_req("key", STR)], "str | null", "The value of named context."),
    # -- maintenance -----------------------------------------------------------------------------
    _op("backup", "background", [_req("path", STR), _opt("force", BOOL, False)], '{"path", "bytes", "memories"}',
        "A consistent snapshot file on the daemon's machine (a directory gets a timestamped file)."),
    _op("compact", "engine", [], "null", "Fold the journal into a snapshot now."),
    _read("forgotten_in_backups", "engine", [_opt("ids", LIST, doc="memory ids; default: any forgotten")],
          '[{"path", "made", "forgotten": int, "persons": int, "expired": bool}]',
          "The backups this daemon wrote that still hold a forgotten memory or person, or an expired memory."),
    _op("purge_backups", "background", [_opt("paths", LIST, doc="absolute backup files or directories")],
        '[{"path", "removed": int, "persons": int, "bytes": int}]',
        "Rewrite the backups this daemon wrote (and `paths`) without what was forgotten or expired."),
    # -- people-aware memory (issue 10) ----------------------------------------------------------
    _op("remember", "engine", [_opt("content", STR), _opt("facts", LIST, doc="[{content, subjects?, name?, id?, ...}]"),
                               _opt("subjects", LIST, doc="references: 'my wife', 'Sarah', person ids"),
                               _opt("expires_in_days", NUM), _opt("shared", BOOL, False), _OWNER,
                               _opt("name", STR, doc="a unique note name"), _opt("aliases", LIST),
                               _opt("id", STR, doc="client-chosen, with content (with facts: each fact's id): "
                                                   "a retry never stores a fact twice")],
        "[memory]", "Store facts about people; persons are resolved or created; conflicting older facts superseded. "
        "A fact's persons are its owner's or the household's (unscoped: the household's only); another owner's "
        "person id is bad_request (person_id, owner, other_owner), nothing stored.", retry="with_id"),
    _read("recall", "engine", [_req("query", STR), _opt("about", STR), _OWNER, _opt("limit", INT, SEARCH_LIMIT),
                             _opt("include_superseded", BOOL, False)],
        '[{"memory": memory, "score": float, "subject_names"?: [str]}]', "Facts relevant to a query.", capped=True),
    _read("history", "engine", [_req("id", STR)], "[memory]", "The supersession chain through a memory, oldest first.",
          capped=True),
    _op("correct", "engine", [_req("id", STR), _req("content", STR)], "memory",
        "Store the corrected fact and supersede the old one (kept in history)."),
    _op("confirm", "engine", [_req("id", STR)], "memory", "Mark a fact confirmed: never superseded automatically."),
    _op("supersede", "engine", [_req("old_id", STR), _req("new_id", STR)], "memory",
        "Mark a memory as replaced by another (both kept)."),
    _op("add_person", "engine", [_req("name", STR), _opt("relation", STR), _opt("aliases", LIST), _OWNER,
                                 _opt("external_id", STR, doc="face or voice identity"), _opt("metadata", DICT)],
        "person", "Add a person."),
    _read("find_person", "engine", [_req("reference", STR), _OWNER], "person | null",
        "The person a reference means ('my wife', 'Sarah')."),
    _op("resolve_person", "engine", [_req("reference", STR), _OWNER, _opt("create", BOOL, True)],
        '{"person": person | null, "created": bool}', "Find, or create, the person a reference means."),
    _read("person_by_external_id", "engine", [_req("external_id", STR)], "person | null",
        "The person anchored to an outside identity (or the one a person anchored to it was merged into)."),
    _read("people", "engine", [_OWNER], "[person]", "The persons an owner knows (everyone for none).", capped=True),
    _read("person_redirects", "engine", [], "{old_id: kept_id}",
        "Every person id merged away and the live person id it resolves to (what an export carries)."),
    _op("update_person", "engine", [_req("id", STR), _opt("name", STR), _opt("relation", STR), _opt("aliases", LIST),
                                    _opt("external_id", STR), _opt("metadata", DICT), _OWNER,
                                    _opt("household", BOOL, False,
                                         doc="true: make the person the household's (no owner); not with owner")],
        "person", "Change the given fields of a person (an absent or null field stays as it is: `household: true` "
        "makes the person the household's; with `owner` too: bad_request, field household); a new owner is "
        "bad_request (person_id, owner, memories, other_owner) unless every memory about the person is that "
        "owner's. A daemon before `household` refuses it as an unknown argument (field args)."),
    _op("merge_people", "engine", [_req("keep", STR), _req("other", STR)], "person",
        "Merge two persons: aliases united, memories re-linked (a retry of a done merge changes nothing); "
        "into another owner's person is bad_request naming both owners (keep a household person instead)."),
    _op("delete_person", "engine", [_req("id", STR)], '{"deleted": bool}',
        "Forget a person (memories stay, unlinked); an id merged away is bad_request naming the live person."),
    _read("note", "engine", [_req("name", STR)], "memory | null", "The note with this name or alias."),
    _op("rename_note", "engine", [_req("name", STR), _req("new_name", STR)], "memory", "Rename a note."),
    _op("alias_note", "engine", [_req("name", STR), _req("alias", STR)], "memory", "Add an alias to a note."),
    _op("rewrite_note", "engine", [_req("name", STR), _req("content", STR)], "memory",
        "New content for a note (the old version stays in its history)."),
    _op("remove_note", "engine", [_req("name", STR)], '{"deleted": bool}',
        "Forget a note by name or alias, with its earlier versions."),
    _op("archive_conversation", "engine", [_req("summary", STR), _opt("until", NUM), _opt("name", STR), _OWNER],
        "memory", "Record a conversation summary as an archive (never expires); marks the window."),
    _op("import", "embed", [_req("memories", LIST, "exported memories (all fields)"),
                             _opt("people", LIST, doc="exported persons (with their merged_ids)")],
        '{"people": int, "memories": int, "links_left_out": int, "left_out_links": [{"memory_id", "person_id"}]}',
        "Recreate exported persons and memories (present ids kept); a memory about a person its owner does not "
        "see is imported without that link, each link left out listed.",
        client="import_memories", retry="yes"),
    _read("context_for", "engine", [_req("message", STR), _OWNER, _opt("max_tokens", INT, 800),
                                  _opt("max_memories", INT, 10), _opt("max_messages", INT, 5),
                                  _opt("min_similarity", NUM, 0.3)],
        "{window, messages, memories, people, text, tokens, dropped_lines}",
        "Everything a prompt needs about a message, with prompt-ready text within a token budget.", capped=True),
    # -- the household's controls (docs/HOUSEHOLD.md) ------------------------------------------
    _op("forget_person", "engine", [_req("reference", STR, "a name, an alias, 'my wife' or a person id"),
                                    _opt("dry_run", BOOL, False, doc="say what would go, change nothing")],
        '{"person": {id, name}, "aliases", "memories_deleted", "turns_deleted", "unlinked", "mentions_rewritten", '
        '"followers_rewritten", "window_turns_dropped", "window_turns_rewritten", "names_removed", "names_kept", '
        '"dry_run"}',
        "Forget a person and what is kept about them in one synced frame: the person, the memories about only "
        "them, their turns and window turns deleted; their name removed from the memories that stay; the counts. "
        "Nobody is not_found. Not retried: a retry of a done forget finds nobody."),
    _read("about_person", "engine", [_req("reference", STR, "a name, an alias, 'my wife' or a person id")],
        "{person, memories, turns, shared, mentions, window, names, names_kept}",
        "Everything kept about one person (every owner's memories; memory maps as exported). Nobody is not_found.",
          capped=True),
    _op("pause_remembering", "engine", [_req("minutes", NUM, "above 0, at most a week (10080)")],
        '{"paused": bool, "until": float | null, "seconds_left": float, "private_turns": int}',
        "Stop remembering for a while (replacing a pause in force): no memory or person is written "
        "(bad_request, type RememberingPausedError, paused_until), turns reach the context window only, in the "
        "daemon's memory; ends by itself, or at a restart. Retried: a repeat only restarts the same pause.",
        retry="yes"),
    _op("resume_remembering", "engine", [], '{"paused": false, "until": null, "seconds_left": 0.0, '
        '"private_turns": int}', "Remember again (the turns held meanwhile stay in the window, in memory only).",
        retry="yes"),
]
OPERATIONS: dict[str, Op] = {op.name: op for op in _ROWS}
# Retried by the clients after a timeout: the reads, and the writes whose ids the client made
# (store/store_batch/remember_* carry them, so a retry cannot duplicate; import keeps ids already present),
# and pause/resume_remembering (sent twice, they leave what once would).
IDEMPOTENT = frozenset(op.name for op in _ROWS if op.retry == "yes")
# Retried only when the call carries a client-chosen id (:func:`carries_ids`): without one, a retry
# after a lost reply would keep the write twice.
IDEMPOTENT_WITH_ID = frozenset(op.name for op in _ROWS if op.retry == "with_id")


def carries_ids(args: dict[str, Any]) -> bool:
    """Whether a call of an op of :data:`IDEMPOTENT_WITH_ID` names what it writes: its ``id``,
    or (``remember``) an ``id`` in each of its facts."""
    if args.get("id") is not None:
        return True
    facts = args.get("facts")
    return isinstance(facts, list) and bool(facts) and all(isinstance(f, dict) and f.get("id") is not None
                                                          for f in facts)


def check_args(op: Op, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` checked against ``op``'s row, defaults filled in.

    Raises ValidationError naming the field: an unknown argument (field
    "args"), a missing required one, or a value of the wrong type.
    """
    known = {a.name for a in op.args}
    unknown = [k for k in args if k not in known]
    if unknown:
        raise ValidationError(f"{op.name}: unknown arguments {sorted(map(str, unknown))}", field="args")
    out: dict[str, Any] = {}
    for arg in op.args:
        value = args.get(arg.name, _MISSING)
        if value is _MISSING or (value is None and not arg.required):
            if arg.required:
                raise ValidationError(f"{op.name}: missing argument {arg.name!r}", field=arg.name)
            if arg.default is not _MISSING:
                out[arg.name] = arg.default
            continue
        if not _CHECKS[arg.kind](value):
            raise ValidationError(f"{op.name}: {arg.name} must be a {arg.kind}, got {type(value).__name__}",
                                  field=arg.name)
        out[arg.name] = value
    return out


def protocol_doc() -> str:
    """The protocol reference (``docs/PROTOCOL.md``), generated from the table."""
    lines = ["# reachy-memory protocol: operations", "",
             "Generated from `reachy_memory/daemon/operations.py` by",
             "`python -m reachy_memory.daemon.operations > docs/PROTOCOL.md`; the framing, errors and the memory map",
             "are described in `reachy_memory/daemon/protocol.py`. `name?` is optional, `name = value` has a "
             "default.", "",
             "Lane, the thread an op runs on: inline (I/O thread, never waits), embed (embedding thread, then "
             "engine),",
             "engine (engine thread, in order), background (a thread of its own, one at a time; the engine goes on "
             "meanwhile).",
             "Kind: a read changes nothing and is answered at once; a write is answered once it is durable; a "
             "capped read",
             "is refused `too_large` when its reply would pass `server.max_reply_bytes` (ask for fewer results).",
             "Retried: the clients send it again after a timeout (reads, and writes with client-made ids).", "",
             "`where` filters mean what they mean in ChromaDB 1.5.9 (`$eq $ne $gt $gte $lt $lte $in $nin $and "
             "$or`, nested;", "`$ne` and `$nin` also match memories that lack the key): 300 generated filters "
             "recorded from ChromaDB", "are replayed by `tests/test_filters_chroma.py` "
             "(`tools/record_chroma_filters.py` records them).", "",
             "| op | lane | kind | retried | args | result | what it does |", "|---|---|---|---|---|---|---|"]
    for op in _ROWS:
        args = ", ".join(a.describe() for a in op.args) or "—"
        kind = "capped read" if op.capped else "read" if op.read else "write"
        retried = {"yes": "yes", "with_id": "with `id`", "no": "no"}[op.retry]
        cells = [f"`{op.name}`", op.lane, kind, retried, args, f"`{op.result}`", op.doc]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


if __name__ == "__main__":
    print(protocol_doc(), end="")
