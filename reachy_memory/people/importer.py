"""Import (the round trip of export) and the checks every import path shares.

:class:`Importer` recreates exported persons and memories with their ids, times,
subjects, names and supersession links, through the engine's funnel; it is split in
a thread-safe half (:meth:`Importer.prepare_import`: checked and embedded, on the
daemon's embed thread) and the engine thread's :meth:`Importer.commit_import`.
The module functions (``check_*``, :func:`merged_ids_of`) are the checks the JSONL,
markdown and backup readers of :mod:`reachy_memory.storage` run before anything is
written.  Owns no state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reachy_memory.config import Config
from reachy_memory.engine import ingest
from reachy_memory.engine.ports import Component
from reachy_memory.errors import ValidationError
from reachy_memory.model import MemoryType, check_unicode
from reachy_memory.people.checks import MAX_ALIASES, MAX_NAME_CHARS, unique
from reachy_memory.people.facts import supersession_loop
from reachy_memory.people.notes import note_holder, note_labels
from reachy_memory.people.registry import (
    check_metadata,
    may_be_about,
    person_from_op,
    read_person_id,
)

_IMPORT_OPTIONAL = {"expires_at": "expires", "superseded_at": "superseded_at", "covers_until": "covers_until"}


@dataclass(frozen=True)
class ImportPlan:
    """A checked, embedded import waiting for the engine (see :meth:`Importer.prepare_import`)."""

    person_ops: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    ops: dict[str, list[Any]]  # by memory id: the prepared put
    merged: dict[str, str]  # merged-away person id -> the imported person it was merged into


class Importer(Component):
    """The import operations of :class:`~reachy_memory.engine.store.MemoryStore`."""

    def import_memories(self, memories: Sequence[Mapping[str, Any]], people: Sequence[Mapping[str, Any]] = (),
                        batch: int = 200) -> dict[str, int]:
        """Recreate exported persons and memories with their ids, times, subjects, names and
        supersession links (ids already present are kept as they are), and the person ids
        merged away (a person's ``merged_ids``: each resolves to that person again, see
        :meth:`_redirect_ops`).  Everything is checked before anything is written.  A
        memory about a person its owner may not see (``people.may_be_about``) is imported
        without that link, reported (:meth:`commit_import`).
        Returns the counts imported and the links left out (summed over the batches).
        Raises ValidationError naming the entry at fault, or for ``batch`` not a positive int."""
        memories, people = _entries(memories, "memories"), _entries(people, "people")  # an iterator: read once
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValidationError(f"batch must be a positive number of memories, not {batch!r}", field="batch")
        person_ops = [_person_op(f"person {n}", p) for n, p in enumerate(people)]  # all checked before any write
        merged = check_merged_ids("import", people)
        rows = self._import_rows(memories)
        done: dict[str, Any] = {"people": 0, "memories": 0, "links_left_out": 0, "left_out_links": []}
        for start in range(0, max(len(rows), 1), batch):
            first = not start
            got = self.commit_import(self._prepare_rows(rows[start:start + batch], person_ops if first else [],
                                                        merged if first else {}))
            done = {k: done[k] + got[k] for k in done}  # counts added, left-out links in order
        return done

    def prepare_import(self, memories: Sequence[Mapping[str, Any]],
                       people: Sequence[Mapping[str, Any]] = ()) -> ImportPlan:
        """The checked, embedded half of an import (thread-safe: the daemon runs it on its
        embed thread, so an import does not hold the engine while it embeds).  Memories
        already present are left out.  Raises ValidationError naming the entry at fault
        (as :meth:`import_memories` does)."""
        self._engine.require_open()
        memories, people = _entries(memories, "memories"), _entries(people, "people")
        person_ops = [_person_op(f"person {n}", p) for n, p in enumerate(people)]
        return self._prepare_rows(self._import_rows(memories), person_ops, check_merged_ids("import", people))

    def _import_rows(self, memories: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Every memory checked (their supersession links too) as record fields, oldest
        first: a conversation turn links to the turn before it as it is stored."""
        check_supersession("import", memories)
        check_note_names("import", memories)
        rows = [check_import_memory(f"memory {n}", m, self._engine.config) for n, m in enumerate(memories)]
        self._check_names_free(rows)
        self._check_no_loop_with_stored(rows)
        return sorted(rows, key=lambda r: r["created"])

    def _check_no_loop_with_stored(self, rows: list[dict[str, Any]]) -> None:
        """Raise ValidationError if the ``superseded_by`` links of rows not stored yet close a
        loop through stored memories (a stored A left pointing at a forgotten B, and the
        import's B superseded by A: both hidden, and the store's export then refused by
        import).  Each link is followed once (``check_supersession``, with the store)."""
        after = {r["id"]: r.get("superseded_by") for r in rows if r["id"] not in self._state.records}

        def link(node: str) -> str | None:  # the import's link, else the stored memory's
            stored = self._state.records.get(node)
            return after.get(node, stored.superseded_by if stored is not None else None)

        loop = supersession_loop(after, link)
        if loop:
            raise ValidationError(f"import: superseded_by links loop through stored memories ({' -> '.join(loop)})"
                                  ": every memory in it would be superseded by another of them", field="superseded_by")

    def _check_names_free(self, rows: list[dict[str, Any]]) -> None:
        """Raise ValidationError if a row not stored yet names its note by a name or alias
        a stored memory holds: two notes of one name, ``note()`` answering whichever the
        names index saw last (not the same after a reload)."""
        for row in rows:
            if row["id"] in self._state.records:
                continue  # kept as it is
            for label in note_labels(row):
                taken = note_holder(self._state, label)
                if taken is not None and taken != row["id"]:
                    raise ValidationError(f"import: memory {row['id']}: the note name or alias {label!r} is "
                                          f"already used by memory {taken}", field="name")

    def _seen_subjects(self, row: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """(the subjects an imported ``row`` is stored with, the person ids left out): its
        ids as they are now (``_current_ids``) but a person its owner may not see
        (``people.may_be_about``; the person as stored: :meth:`commit_import` calls it
        after writing the import's persons).  Ids the store does not know stay."""
        kept: list[str] = []
        left_out: list[str] = []
        for person_id in self._current_ids(row.get("subjects", [])):
            person = self._people.get(person_id)
            seen = person is None or may_be_about(person, row.get("owner"))
            (kept if seen else left_out).append(person_id)
        return kept, left_out

    def _check_anchors(self, person_ops: list[dict[str, Any]]) -> None:
        """Raise ValidationError if a person not stored yet would take an external id a
        stored person, or an earlier one of ``person_ops``, holds: two persons for one face,
        and every later update of one of them refused (``external_id`` must be unique)."""
        seen: dict[str, str] = {}
        for op in person_ops:
            external = op.get("external_id")
            if external is None or self._people.get(op["id"]) is not None:
                continue  # a stored person is kept as it is
            holder = self._people.find_by_external_id(external)
            holder_id = holder.id if holder is not None else seen.setdefault(external, op["id"])
            if holder_id != op["id"]:
                raise ValidationError(f"import: person {op['id']}: external_id {external!r} already belongs to "
                                      f"{holder_id}", field="external_id")

    def _prepare_rows(self, rows: list[dict[str, Any]], person_ops: list[dict[str, Any]],
                      merged: dict[str, str]) -> ImportPlan:
        """Embed the checked ``rows`` not stored yet (those present are kept as they are)."""
        self._check_anchors(person_ops)
        self._redirect_ops(merged, [op for op in person_ops if self._people.get(op["id"]) is None])  # refused early
        rows = [r for r in rows if r["id"] not in self._state.records]
        items = [{"content": r["content"], "memory_type": r["type"], "metadata": r.get("metadata"), "id": r["id"],
                  "created_at": r["created"], "owner": r.get("owner"), "shared": r.get("shared", False)}
                 for r in rows]  # owned: a turn borrows the previous turn's words by its owner (_ingest.lends_to)
        ops = self._engine.prepare(items, imported=True).ops if items else []
        return ImportPlan(person_ops, rows, {op[1]["id"]: op for op in ops}, merged)

    def _redirect_ops(self, merged: Mapping[str, str], fresh: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The ``person_merge`` ops (``other`` absent: a redirect only) making each merged-away
        id of an import (``merged``: old id -> the imported person it was merged into)
        resolve to that person as stored: one of ``fresh`` (the import's new persons,
        journaled just before) or the stored person it is now.  An id already redirected
        here is kept as it is.  Raises ValidationError: an id that is a live person's
        (stored or imported), or a person neither the import nor the store knows."""
        new = {op["id"] for op in fresh}
        ops = []
        for old, target in merged.items():
            if old in new or self._people.is_live(old):
                raise ValidationError(f"import: person id {old} is merged into {target} in the import, but it is a "
                                      "live person here: import into a store without it", field="merged_ids")
            if self._people.get(old) is not None:
                continue  # redirected already: kept as it is
            known = self._people.get(target)
            keep = target if target in new else known.id if known is not None else None
            if keep is None:
                raise ValidationError(f"import: person id {old} is merged into {target}, a person neither the import "
                                      "nor the store knows", field="merged_ids")
            ops.append({"op": "person_merge", "keep": keep, "other": old, "at": time.time()})
        return ops

    def commit_import(self, prepared: ImportPlan) -> dict[str, Any]:
        """Write a :meth:`prepare_import`: its new persons, then its memories not stored
        since, in one frame each.  A memory about a person its owner may not see
        (``people.may_be_about``: a file written before that rule held, or edited) is
        imported without that link, about the other persons it names or nobody: decided
        here, with the persons as stored (kept as they are, owner included; an owner may
        have changed since ``prepare_import``).  Returns ``{"people", "memories"}`` (the
        counts imported), ``"links_left_out"`` (how many links) and ``"left_out_links"``
        (``[{"memory_id", "person_id"}]``, in import order).  A memory already present is
        kept as it is: an import done twice leaves nothing out the second time."""
        self._engine.require_open()
        with self._lock:
            self._check_names_free(prepared.rows)  # again: a note may have been named since prepare_import
            self._check_no_loop_with_stored(prepared.rows)  # and a memory superseded or forgotten
            self._check_anchors(prepared.person_ops)  # and a face anchored
            fresh_people = [op for op in prepared.person_ops if self._people.get(op["id"]) is None]
            redirects = self._redirect_ops(prepared.merged, fresh_people)  # again: a person may have come since
            if fresh_people or redirects:
                self._engine.commit([*fresh_people, *redirects])  # one frame: a redirect never without its person
            ops, left_out = [], []
            for row in prepared.rows:
                op = prepared.ops.get(row["id"])
                if op is None or row["id"] in self._state.records:
                    continue
                fields = {k: v for k, v in row.items() if k not in ("content", "type", "metadata", "created")}
                fields["subjects"], unseen = self._seen_subjects(row)  # the persons as stored now
                left_out += [{"memory_id": row["id"], "person_id": p} for p in unseen]
                ops.append(["put", dict(op[1]) | fields, op[2]])
            hidden = {row["id"] for row in prepared.rows if row.get("superseded_at") is not None}
            for op in ops:  # a turn imported superseded lends no text to the one after it
                if op[1].get("follows") in hidden:
                    op[1]["previous_text"] = None
            if ops:
                self._engine.commit(ops)
            return {"people": len(fresh_people), "memories": len(ops), "links_left_out": len(left_out),
                    "left_out_links": left_out}

    def _current_ids(self, person_ids: Iterable[str]) -> list[str]:
        """Person ids as they are now: one merged into another since is the kept one's (as
        ``merge_people`` relinks the stored memories); ids the store does not know stay."""
        return unique(p.id if (p := self._people.get(i)) is not None else i for i in person_ids)


def _entries(given: Any, field: str) -> list[Any]:
    """``given`` (a list, tuple or other iterable of entries) as a list, read once: an
    iterator checked first and imported after would import nothing.  Raises
    ValidationError naming ``field`` for None, a mapping, text or a non-iterable."""
    if isinstance(given, Mapping | str | bytes) or not isinstance(given, Iterable):
        raise ValidationError(f"{field} must be a list of exported entries, not {type(given).__name__}", field=field)
    return list(given)


def check_supersession(source: str, memories: Sequence[Any]) -> None:
    """Refuse ``superseded_by`` links that loop (a memory superseded by itself, or A by
    B and B by A): each memory of the loop would point past the other, and those
    marked superseded would all be hidden with no current one to show.
    ValidationError naming ``source`` and the loop.  Links to memories outside
    ``memories`` are not followed (they may be stored already)."""
    after: dict[str, str] = {m["id"]: m["superseded_by"] for m in memories
             if isinstance(m, Mapping) and isinstance(m.get("id"), str) and isinstance(m.get("superseded_by"), str)}
    loop = supersession_loop(after, after.get)
    if loop:
        raise ValidationError(f"{source}: superseded_by links loop ({' -> '.join(loop)}): every memory in it "
                              "would be superseded by another of them", field="superseded_by")


def check_note_names(source: str, memories: Sequence[Any]) -> None:
    """Refuse a note name or alias (case aside) given to two memories of ``memories``:
    ValidationError naming ``source``, the label and both ids.  Names stored already
    are the store's to check (``import_memories``)."""
    holders: dict[str, str] = {}
    for m in memories:
        if not isinstance(m, Mapping) or not isinstance(m.get("id"), str):
            continue  # refused by check_import_memory
        for label in note_labels(m):
            holder = holders.setdefault(label.casefold(), m["id"])
            if holder != m["id"]:
                raise ValidationError(f"{source}: the note name or alias {label!r} is given to memories {holder} "
                                      f"and {m['id']}", field="name")


def check_import_memory(where: str, memory: Any, config: Config) -> dict[str, Any]:
    """One exported memory as the record fields import writes, checked as a store would
    (text, type, metadata, times, links); ValidationError starting with ``where`` otherwise."""
    try:
        row = _import_row(where, memory)
        ingest.validate_item({"content": row["content"], "memory_type": row["type"],
                              "metadata": row.get("metadata"), "id": row["id"]}, config, imported=True)
    except ValidationError as exc:
        if exc.message.startswith(f"{where}:"):
            raise
        raise type(exc)(f"{where}: {exc.message}", **exc.fields) from exc
    return row


def check_import_person(where: str, person: Any) -> None:
    """Raise ValidationError (starting with ``where``) if import would refuse this person
    (its ``merged_ids`` included)."""
    _person_op(where, person)


def check_merged_ids(source: str, people: Sequence[Any]) -> dict[str, str]:
    """The person ids merged away that exported ``people`` carry (each person's
    ``merged_ids``; none in exports written before them), each mapped to the person it
    was merged into.  Raises ValidationError naming ``source``: malformed ``merged_ids``
    (:func:`merged_ids_of`), an id that is also a person of ``people``, or an id merged
    into two persons.  Whether an id is a live person in the store is the store's
    to check (``import_memories``)."""
    persons = [p for p in people if isinstance(p, Mapping)]  # others: refused by check_import_person
    ids = {p.get("id") for p in persons}
    merged: dict[str, str] = {}
    for p in persons:
        for old in merged_ids_of(f"{source}: person {p.get('id')}", p):
            if old in ids:
                raise ValidationError(f"{source}: person id {old} is a person of the import and merged into "
                                      f"{p['id']}", field="merged_ids")
            if merged.setdefault(old, p["id"]) != p["id"]:
                raise ValidationError(f"{source}: person id {old} is merged into both {merged[old]} and {p['id']}",
                                      field="merged_ids")
    return merged


def merged_ids_of(where: str, p: Mapping[str, Any]) -> list[str]:
    """A person's ``merged_ids``: ids as a person's are (no whitespace around them), not
    its own.  Missing or None: none.  Raises ValidationError starting with ``where``."""
    value = p.get("merged_ids")
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValidationError(f"{where}: merged_ids must be a list of person ids", field="merged_ids")
    for old in value:
        check_unicode(ingest.check_label(old, "merged_ids", f"{where}: "), "merged_ids")
        if old != old.strip() or old == p.get("id"):
            raise ValidationError(f"{where}: merged_ids holds {old!r}: not another person's id", field="merged_ids")
        _exact_person_id(where, old, "merged_ids")  # a control character: no operation could name it
    return list(value)


def _import_row(where: str, m: Any) -> dict[str, Any]:
    """One exported memory (``Memory.to_dict`` or its wire form) as record fields, checked."""
    if not isinstance(m, Mapping) or not isinstance(m.get("id"), str) or not isinstance(m.get("content"), str):
        raise ValidationError(f"{where}: needs an id and content", field="memories")
    row: dict[str, Any] = {"id": m["id"], "content": m["content"],
                           "type": MemoryType.parse(m.get("type", "fact")).value,
                           "metadata": m.get("metadata") or {},
                           "created": _when(where, m.get("created_at"), "created_at")}
    for key, field in _IMPORT_OPTIONAL.items():
        if m.get(key) is not None:
            row[field] = _when(where, m[key], key)
    check_unicode(row["id"], "id")  # here, not at the journal write (after earlier requests were stored)
    for key in ("owner", "name", "superseded_by"):
        if m.get(key) is not None:
            row[key] = check_unicode(ingest.check_label(m[key], key, f"{where}: "), key)
    for key, limit in (("subjects", 64), ("aliases", MAX_ALIASES)):
        values = m.get(key) or []
        if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values) or len(values) > limit:
            raise ValidationError(f"{where}: {key} must be a list of at most {limit} strings", field=key)
        row[key] = list(values)
    _check_import_labels(where, row)
    for key in ("shared", "protected"):
        if not isinstance(m.get(key, False), bool):
            raise ValidationError(f"{where}: {key} must be true or false", field=key)
        row[key] = bool(m.get(key, False))
    return row


def _check_import_labels(where: str, row: Mapping[str, Any]) -> None:
    """Refuse labels no store operation writes: a note name or alias with whitespace around
    it (``remember`` strips them) or over :data:`MAX_NAME_CHARS`, aliases without a note
    name, a subject that is not a person id as ``people.read_person_id`` reads one (no
    whitespace around, no control character, at most 200 characters).  ValidationError
    starting with ``where`` and naming the field."""
    if row.get("aliases") and row.get("name") is None:
        raise ValidationError(f"{where}: aliases need a note name", field="aliases")
    for key, label in [("name", row.get("name")), *(("aliases", a) for a in row.get("aliases", ()))]:
        if label is not None and (not label.strip() or label != label.strip() or len(label) > MAX_NAME_CHARS):
            raise ValidationError(f"{where}: {key} {label[:40]!r} is not a note name (1 to {MAX_NAME_CHARS} "
                                  "characters, no whitespace around it)", field=key)
        check_unicode(label or "", key)
    for subject in row.get("subjects", ()):
        _exact_person_id(where, subject, "subjects")


def _exact_person_id(where: str, value: str, field: str) -> None:
    """Refuse a person id that ``people.read_person_id`` would not read back as itself (no
    operation could name it). ValidationError starting with ``where``, naming ``field``."""
    try:
        ok = read_person_id(value, field) == value
    except ValidationError as exc:
        raise ValidationError(f"{where}: {exc.message}", field=field) from exc
    if not ok:
        raise ValidationError(f"{where}: {field} {value[:40]!r}: a person id must not start or end with "
                              "whitespace", field=field)


def _when(where: str, value: Any, field: str) -> float:
    from datetime import datetime

    from reachy_memory.model import check_time

    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as exc:
            raise ValidationError(f"{where}: {field} {value!r} is not a time", field=field) from exc
    epoch = check_time(value, field)
    if epoch is None:
        raise ValidationError(f"{where}: {field} is missing", field=field)
    return epoch


def _person_op(where: str, p: Any) -> dict[str, Any]:
    """The ``person_put`` op recreating an exported person (checked; its metadata as a
    caller's: ``people.check_metadata``)."""
    if not isinstance(p, Mapping):
        raise ValidationError(f"{where}: not a map", field="people")
    for key in ("name", "relation"):  # person_from_op would store None or 5 as the text 'None' / '5'
        if p.get(key) is not None and not isinstance(p[key], str):
            raise ValidationError(f"{where}: {key} must be a string", field="people")
    if not (p.get("name") or p.get("relation")):
        raise ValidationError(f"{where}: a person needs a name or a relation", field="people")
    if isinstance(p.get("id"), str):  # one no operation could name (read_person_id) is refused
        _exact_person_id(where, p["id"], "id")
    merged_ids_of(where, p)
    op = {"op": "person_put", **{k: p.get(k) for k in ("id", "name", "relation", "aliases", "owner",
                                                      "external_id", "metadata")}}
    op["name"] = op["name"] or ""  # a relation only ("my wife"): no name, as the registry keeps it
    op["created_at"] = _when(where, p.get("created_at"), "created_at")
    op["updated_at"] = _when(where, p.get("updated_at") or p.get("created_at"), "updated_at")
    try:
        op["metadata"] = check_metadata(op["metadata"])
        return person_from_op(op).to_op()
    except ValidationError as exc:
        raise ValidationError(f"{where}: {exc.message}", field="people") from exc
