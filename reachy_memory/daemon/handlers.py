"""The daemon's op handlers: one function per row of the op table (``operations.py``).

A handler takes the daemon ``d`` (its ``store``, ``config``, ``upkeep`` and what
``health`` and ``stats`` read) and the request ``job`` (``job.args`` checked
against the row, defaults filled in) and returns the op's result in its wire
form, what ``protocol.ok`` encodes.  It runs on its row's lane: the I/O thread
(inline), the engine thread (engine and embed) or the background thread.  An
embed op also has a ``prepare`` function, run on the embedding thread first
(its argument checks, then the embedding, changing nothing): the handler finds
its value in ``job.prepared``.  A ReachyMemoryError raised becomes the error
reply; anything else an ``internal`` one (logged).

Register a handler with ``@handles("op")`` (``@handles("op", prepare=fn)`` for an
embed op; several ops may share a function).  :data:`HANDLERS` maps every op
name to its :class:`Handler`; this module refuses to import when a row has no
handler, a handler no row, or an embed op no ``prepare`` (or another op one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reachy_memory.daemon import protocol as proto
from reachy_memory.daemon.jobs import Job
from reachy_memory.daemon.operations import OPERATIONS
from reachy_memory.errors import ValidationError
from reachy_memory.model import to_epoch

if TYPE_CHECKING:
    from reachy_memory.daemon.server import Daemon

__all__ = ["HANDLERS", "BackupProgress", "Handler", "handles"]

Run = Callable[["Daemon", Job], Any]


@dataclass(frozen=True)
class Handler:
    """What runs an op: ``run`` on its lane's thread; for an embed op, ``prepare`` first
    on the embedding thread (its value is ``job.prepared``)."""

    run: Run
    prepare: Run | None = None


HANDLERS: dict[str, Handler] = {}


def handles(*ops: str, prepare: Run | None = None) -> Callable[[Run], Run]:
    """Register the decorated function as the handler of ``ops`` (rows of the op table)."""
    def register(run: Run) -> Run:
        for name in ops:
            if name not in OPERATIONS or name in HANDLERS:
                raise RuntimeError(f"handler for {name!r}: no such row in the op table, or a second handler")
            HANDLERS[name] = Handler(run, prepare)
        return run
    return register


def _memory(m: Any) -> dict[str, Any] | None:
    return proto.memory_to_wire(m) if m is not None else None


def _memories(ms: list[Any]) -> list[dict[str, Any]]:
    return [proto.memory_to_wire(m) for m in ms]


def _person(p: Any) -> dict[str, Any] | None:
    return proto.person_to_wire(p) if p is not None else None


# -- service (inline) -------------------------------------------------------------------


@handles("ping")
def ping(d: Daemon, job: Job) -> dict[str, Any]:
    return {"pong": True, "time": time.time()}


@handles("health")
def health(d: Daemon, job: Job) -> dict[str, Any]:
    return d.health()


@handles("stats")
def stats(d: Daemon, job: Job) -> dict[str, Any]:
    return d.stats()


@handles("get")
def get(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.get(job.args["id"]))


@handles("get_context")
def get_context(d: Daemon, job: Job) -> str | None:
    return d.store.get_context(job.args["key"])


@handles("get_context_window")
def get_context_window(d: Daemon, job: Job) -> list[dict[str, Any]]:
    return d.store.get_context_window()


# -- memories -----------------------------------------------------------------------------
# A store-like op's checked arguments are the item the store takes (its keys are item keys):
# passed on as they are, not copied into another dict.


def _embed_query(d: Daemon, job: Job) -> tuple[Any, Any]:
    """Embedding thread: every argument of the search checked, once, before the embedding
    and the engine queue; then its query embedded (a lexical search embeds nothing).
    Returns (the checked query, its vector or None)."""
    a = job.args
    query = d.store.check_search(a["query"], a.get("memory_type"), a["limit"], a["min_score"], a.get("where"),
                                 mode=a.get("mode"), about=a.get("about"), owner=a.get("owner"),
                                 include_superseded=a["include_superseded"])
    return query, (d.store.embed_query(query.text) if query.mode != "lexical" else None)


@handles("search", prepare=_embed_query)
def search(d: Daemon, job: Job) -> list[dict[str, Any]]:
    return proto.results_to_wire(d.store.search_checked(*job.prepared))


def _prepare_store(d: Daemon, job: Job) -> Any:
    return d.store.prepare([job.args])


def _prepare_fact(d: Daemon, job: Job) -> Any:
    return d.store.prepare([job.args | {"memory_type": "fact"}])


def _prepare_conversation(d: Daemon, job: Job) -> Any:
    return d.store.prepare([job.args | {"memory_type": "conversation"}])


@handles("store", prepare=_prepare_store)
@handles("remember_fact", prepare=_prepare_fact)
@handles("remember_conversation", prepare=_prepare_conversation)
def commit_one(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.commit(job.prepared)[0])


def _prepare_batch(d: Daemon, job: Job) -> Any:
    return d.store.prepare(job.args["items"])


@handles("store_batch", prepare=_prepare_batch)
def store_batch(d: Daemon, job: Job) -> list[dict[str, Any]]:
    return _memories(d.store.commit(job.prepared))


def _prepare_import(d: Daemon, job: Job) -> Any:
    return d.store.prepare_import(job.args["memories"], job.args.get("people") or ())


@handles("import", prepare=_prepare_import)
def import_(d: Daemon, job: Job) -> dict[str, Any]:
    return d.store.commit_import(job.prepared)


@handles("forget")
def forget(d: Daemon, job: Job) -> dict[str, Any]:
    """Forget one memory; the backups made before that still hold it are named."""
    memory_id = job.args["id"]
    deleted = d.store.forget(memory_id)
    return {"deleted": deleted, "backups": [b["path"] for b in d.store.forgotten_in_backups([memory_id])]}


def _past(now: Any) -> Any:
    """A client's ``now``, unless in the future: a client may replay an old "now"
    (tests, imports), never expire the future early.  Raises ValidationError."""
    if now is not None and to_epoch(now) > time.time() + 1.0:  # type: ignore[operator]
        raise ValidationError("now must not be in the future", field="now")
    return now


@handles("cleanup_expired")
def cleanup_expired(d: Daemon, job: Job) -> dict[str, int]:
    deleted = d.store.cleanup_expired(_past(job.args.get("now")))
    d.upkeep.swept(deleted)
    return {"deleted": deleted}


@handles("apply_retention")
def apply_retention(d: Daemon, job: Job) -> dict[str, Any]:
    a = job.args
    result = d.store.apply_retention(dry_run=a["dry_run"], max_deletions=a.get("max_deletions"),
                                     now=_past(a.get("now")))
    if not a["dry_run"]:  # it swept: health shows it as a cleanup
        d.upkeep.swept(result["deleted"])
    return result


@handles("dedupe")
def dedupe(d: Daemon, job: Job) -> dict[str, Any]:
    return d.store.dedupe(dry_run=job.args["dry_run"])


@handles("export")
def export(d: Daemon, job: Job) -> dict[str, Any]:
    limit = job.args["limit"]
    if not 1 <= limit <= 5000:
        raise ValidationError("limit must be an integer from 1 to 5000", field="limit")
    page, cursor = d.store.export_page(job.args.get("after"), limit)
    kept: list[Any] = []
    size = 0
    for memory in page:  # long memories: a shorter page, so the reply stays under the reply limit
        size += len(memory.content) * 4 + 512
        if kept and size > d.config.server.max_reply_bytes // 2:
            cursor = kept[-1].id
            break
        kept.append(memory)
    return {"memories": _memories(kept), "next": cursor}


# -- context window and named context -------------------------------------------------------


@handles("add_to_context_window")
def add_to_context_window(d: Daemon, job: Job) -> None:
    d.store.add_to_context_window(job.args["role"], job.args["content"])


def _prepare_turn(d: Daemon, job: Job) -> Any:
    a = job.args
    return d.store.prepare_turn(a["role"], a["content"], a.get("metadata"), owner=a.get("owner"), id=a.get("id"))


@handles("record_turn", prepare=_prepare_turn)
def record_turn(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.commit_turn(job.args["role"], job.prepared))


@handles("clear_context_window")
def clear_context_window(d: Daemon, job: Job) -> None:
    d.store.clear_context_window()


def _prepare_context(d: Daemon, job: Job) -> Any:
    return d.store.prepare_context(job.args["key"], job.args["value"])


@handles("set_context", prepare=_prepare_context)
def set_context(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.commit_context(job.args["key"], job.prepared))


# -- maintenance ------------------------------------------------------------------------------


class BackupProgress:
    """The backup being written, as ``health`` shows it: the background thread writes
    ``written``, the I/O thread reads it (one int, replaced whole)."""

    def __init__(self, path: str) -> None:
        self.path, self.since, self.written = path, time.monotonic(), 0

    def wrote(self, total: int) -> None:
        self.written = total

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "seconds": round(time.monotonic() - self.since, 3), "bytes": self.written}


@handles("backup")
def backup(d: Daemon, job: Job) -> dict[str, Any]:
    path = job.args["path"]
    if not path:
        raise ValidationError("path must be a non-empty string", field="path")
    if not os.path.isabs(os.path.expanduser(path)):  # else it lands in the daemon's working directory
        raise ValidationError(f"backup path {path[:200]!r} must be absolute", field="path")
    d.backup_running = running = BackupProgress(path)
    try:
        return d.store.backup(path, force=job.args["force"], progress=running.wrote)
    finally:
        d.backup_running = None


@handles("compact")
def compact(d: Daemon, job: Job) -> None:
    d.store.compact()


@handles("forgotten_in_backups")
def forgotten_in_backups(d: Daemon, job: Job) -> list[dict[str, Any]]:
    return d.store.forgotten_in_backups(job.args.get("ids"))


@handles("purge_backups")
def purge_backups(d: Daemon, job: Job) -> list[dict[str, Any]]:
    paths = job.args.get("paths") or []
    for path in paths:  # the daemon's working directory is not the caller's
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValidationError(f"backup path {str(path)[:200]!r} must be absolute", field="paths")
    return d.store.purge_backups(paths)


# -- people-aware memory ------------------------------------------------------------------------


@handles("remember")
def remember(d: Daemon, job: Job) -> list[dict[str, Any]]:
    return _memories(d.store.remember(**job.args))


@handles("recall")
def recall(d: Daemon, job: Job) -> list[dict[str, Any]]:
    return proto.results_to_wire(d.store.recall(**job.args))


@handles("history")
def history(d: Daemon, job: Job) -> list[dict[str, Any]]:
    return _memories(d.store.history(job.args["id"]))


@handles("correct")
def correct(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.correct(job.args["id"], job.args["content"]))


@handles("confirm")
def confirm(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.confirm(job.args["id"]))


@handles("supersede")
def supersede(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.supersede(**job.args))


@handles("add_person")
def add_person(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _person(d.store.add_person(**job.args))


@handles("find_person")
def find_person(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _person(d.store.find_person(**job.args))


@handles("resolve_person")
def resolve_person(d: Daemon, job: Job) -> dict[str, Any]:
    person, created = d.store.resolve_person(**job.args)
    return {"person": _person(person), "created": created}


@handles("person_by_external_id")
def person_by_external_id(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _person(d.store.person_by_external_id(job.args["external_id"]))


@handles("people")
def people(d: Daemon, job: Job) -> list[dict[str, Any] | None]:
    return [_person(p) for p in d.store.people(job.args.get("owner"))]


@handles("person_redirects")
def person_redirects(d: Daemon, job: Job) -> dict[str, str]:
    return d.store.person_redirects()


@handles("update_person")
def update_person(d: Daemon, job: Job) -> dict[str, Any] | None:
    fields = dict(job.args)
    return _person(d.store.update_person(fields.pop("id"), **fields))


@handles("merge_people")
def merge_people(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _person(d.store.merge_people(**job.args))


@handles("delete_person")
def delete_person(d: Daemon, job: Job) -> dict[str, bool]:
    return {"deleted": d.store.delete_person(job.args["id"])}


@handles("note")
def note(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.note(job.args["name"]))


@handles("rename_note")
def rename_note(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.rename_note(**job.args))


@handles("alias_note")
def alias_note(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.alias_note(**job.args))


@handles("rewrite_note")
def rewrite_note(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.rewrite_note(**job.args))


@handles("remove_note")
def remove_note(d: Daemon, job: Job) -> dict[str, bool]:
    return {"deleted": d.store.remove_note(job.args["name"])}


@handles("archive_conversation")
def archive_conversation(d: Daemon, job: Job) -> dict[str, Any] | None:
    return _memory(d.store.archive_conversation(**job.args))


@handles("context_for")
def context_for(d: Daemon, job: Job) -> dict[str, Any]:
    return proto.context_to_wire(d.store.context_for(**job.args))


# -- the household's controls ---------------------------------------------------------------------


@handles("forget_person")
def forget_person(d: Daemon, job: Job) -> dict[str, Any]:
    return d.store.forget_person(job.args["reference"], dry_run=job.args["dry_run"])


@handles("about_person")
def about_person(d: Daemon, job: Job) -> dict[str, Any]:
    return d.store.about_person(job.args["reference"])


@handles("pause_remembering")
def pause_remembering(d: Daemon, job: Job) -> dict[str, Any]:
    return d.store.pause_remembering(job.args["minutes"])


@handles("resume_remembering")
def resume_remembering(d: Daemon, job: Job) -> dict[str, Any]:
    return d.store.resume_remembering()


def _check_complete() -> None:
    """Every row has a handler; an embed op, and only one, has a ``prepare``."""
    missing = sorted(set(OPERATIONS) - set(HANDLERS))
    if missing:
        raise RuntimeError(f"ops of the table without a handler: {missing}")
    for name, handler in HANDLERS.items():
        if (OPERATIONS[name].lane == "embed") != (handler.prepare is not None):
            raise RuntimeError(f"{name}: an embed op needs a prepare, and only an embed op has one")


_check_complete()
