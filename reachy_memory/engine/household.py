"""What the household controls: forgetting a person, seeing what is kept about one,
and pausing remembering (guests, private moments).

The store's methods (``forget_person``, ``about_person``, ``pause_remembering``,
``resume_remembering``, ``remembering``) are thin: the decisions are here.

**What is about a person** (:func:`sort_records`), for a live person P (their id,
and the ids merged into them):

* a memory *about only P*: its subjects are P (no one else), or it has no other
  subject and its metadata's speaker (``search.entity_fields``: ``speaker``,
  ``person``) names P;
* *P's conversation turns*: a CONVERSATION memory said by P (its speaker names P),
  or about only P;
* a memory *about P and others*: P among its subjects, or said by P (not a turn),
  beside other persons;
* a *mention*: any other memory whose text, previous-turn text or a metadata string
  names P by name or alias (whole words, any case), or by the first word of P's
  name; a name that another known person also has is not read as P (it stays:
  ``names_kept``).

**Forgetting a person** (:func:`plan_forget`) in one journal frame: memories about only
P and P's turns are deleted; memories about P and others lose P from their subjects and
every mention is *rewritten with P's names removed* ("someone" in their place; the
first letter of a text kept upper case), in text, previous-turn text and metadata
strings, and embedded anew (their vector held the name too); a turn following a deleted
turn loses its copy of that text and is embedded anew; P (with their aliases, external
id and the redirects of ids merged into them) is deleted; the context window loses P's
turns (same role and text as a deleted turn, or a role naming P) and the others are
rewritten as above.  Memories are kept otherwise (a memory about Sarah stays about
Sarah).  Superseded and expired-but-not-swept memories count: they are still kept.

**Pausing** (:class:`Remembering`): while paused, no memory and no person is written
(:class:`~reachy_memory.errors.RememberingPausedError`, nothing stored), and a turn
(``record_turn``, ``add_to_context_window``) reaches the context window only, held in
this process's memory, never journaled, snapshotted or backed up; those private turns
stay in the window until newer turns push them out, the window is cleared or the
store closes.  A pause ends by itself at its deadline; a restart ends it too (it is
held in memory only).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reachy_memory.engine import ingest
from reachy_memory.engine.records import Record, encode
from reachy_memory.errors import NotFoundError, RememberingPausedError, ValidationError
from reachy_memory.model import MemoryType, to_datetime
from reachy_memory.people.registry import Person

__all__ = ["MAX_PAUSE_MINUTES", "REDACTED", "ForgetPlan", "Household", "Remembering", "Sorted", "name_pattern",
           "plan_forget", "redact", "sort_records"]

MAX_PAUSE_MINUTES = 7 * 24 * 60  # a pause of at most a week (a guest staying over)
REDACTED = "someone"  # what a forgotten person's name becomes in the memories that stay
_TURN = MemoryType.CONVERSATION.value
Turn = tuple[str, str, float]  # a context window turn: role, text, time


# -- whom a memory is about ------------------------------------------------------------------


def person_names(person: Person) -> list[str]:
    """The words that name ``person``: their name, aliases and the first word of a name of
    several (case kept; empty ones left out)."""
    names = [person.name, *person.aliases]
    first = person.name.split()[0] if len(person.name.split()) > 1 else ""
    return [n.strip() for n in [*names, first] if n and n.strip() and len(n.strip()) > 1]


def name_pattern(names: Iterable[str]) -> re.Pattern[str] | None:
    """A case-insensitive pattern of ``names`` as whole words (longest first), or None."""
    unique = sorted({n.casefold(): n for n in names}.values(), key=len, reverse=True)
    if not unique:
        return None
    return re.compile(r"(?<!\w)(?:" + "|".join(re.escape(n) for n in unique) + r")(?!\w)", re.IGNORECASE)


def redact(text: str, pattern: re.Pattern[str] | None) -> str:
    """``text`` with every match of ``pattern`` replaced by :data:`REDACTED` (upper case
    first where the name opened the text or a sentence)."""
    if pattern is None:
        return text

    def one(match: re.Match[str]) -> str:
        before = text[: match.start()].rstrip()
        opens = not before or before[-1] in ".!?\n:"
        return REDACTED.capitalize() if opens else REDACTED

    return pattern.sub(one, text)


@dataclass
class Sorted:
    """The memories about one person, by how they are about them (see the module doc)."""

    person: Person
    ids: frozenset[str]  # the person's id and the ids merged into them
    names: list[str]  # names read as theirs
    names_kept: list[str]  # names another known person has too: not read as theirs
    only: list[Record] = field(default_factory=list)
    turns: list[Record] = field(default_factory=list)
    shared: list[Record] = field(default_factory=list)
    mentions: list[Record] = field(default_factory=list)
    pattern: re.Pattern[str] | None = None


def sort_records(person: Person, ids: Iterable[str], records: Iterable[Record], everyone: Sequence[Person],
                 speaker_keys: Sequence[str]) -> Sorted:
    """Sort ``records`` by how they are about ``person`` (live id plus merged ``ids``);
    ``everyone``: every live person (for names two persons share)."""
    own = person_names(person)
    taken = {n.casefold() for p in everyone if p.id != person.id for n in person_names(p)}
    names = [n for n in own if n.casefold() not in taken]
    kept = sorted({n for n in own if n.casefold() in taken})
    out = Sorted(person, frozenset(ids) | {person.id}, names, kept, pattern=name_pattern(names))
    said = {n.casefold() for n in [*own, person.id]}
    for rec in records:
        linked = any(s in out.ids for s in rec.subjects)
        others = [s for s in rec.subjects if s not in out.ids]
        by = _said_by(rec, said, speaker_keys)
        if rec.type == _TURN and (by or (linked and not others)):
            out.turns.append(rec)
        elif (linked or by) and not others:
            out.only.append(rec)
        elif linked or by:
            out.shared.append(rec)
        elif _mentions(rec, out.pattern):
            out.mentions.append(rec)
    return out


def _said_by(rec: Record, said: set[str], keys: Sequence[str]) -> bool:
    return any(isinstance(rec.metadata.get(k), str) and rec.metadata[k].strip().casefold() in said for k in keys)


def _mentions(rec: Record, pattern: re.Pattern[str] | None) -> bool:
    if pattern is None:
        return False
    texts = [rec.content, rec.previous_text or "", *(v for v in rec.metadata.values() if isinstance(v, str))]
    return any(pattern.search(t) for t in texts)


# -- forgetting a person ---------------------------------------------------------------------


@dataclass
class ForgetPlan:
    """What forgetting one person does: the records deleted and rewritten, the new window."""

    found: Sorted
    deleted: list[Record]
    rewritten: list[Record]  # new records in the place of the old (same id, slot to be given)
    window: list[Turn] | None  # the context window after (None: unchanged)
    window_dropped: int
    window_rewritten: int
    private_window: list[Turn]  # the in-memory (paused) turns after

    def counts(self, dry_run: bool) -> dict[str, Any]:
        """What ``forget_person`` answers: who, and how many of each."""
        f = self.found
        return {"person": {"id": f.person.id, "name": f.person.display_name}, "aliases": list(f.person.aliases),
                "memories_deleted": len(f.only), "turns_deleted": len(f.turns),
                "unlinked": len(f.shared), "mentions_rewritten": len(f.shared) + len(f.mentions),
                "followers_rewritten": len(self.rewritten) - len(f.shared) - len(f.mentions),
                "window_turns_dropped": self.window_dropped, "window_turns_rewritten": self.window_rewritten,
                "names_removed": list(f.names), "names_kept": list(f.names_kept), "dry_run": dry_run}


def plan_forget(found: Sorted, records: dict[str, Record], window: Sequence[Turn],
                private: Sequence[Turn]) -> ForgetPlan:
    """The plan of forgetting ``found.person`` (see the module doc); changes nothing."""
    deleted = [*found.only, *found.turns]
    gone = {r.id for r in deleted}
    changed: dict[str, Record] = {}
    for rec in [*found.shared, *found.mentions]:
        subjects = tuple(s for s in rec.subjects if s not in found.ids)
        changed[rec.id] = _redacted(rec, found.pattern).replace(subjects=subjects)
    # a turn following a deleted or rewritten turn holds a copy of its text: rewritten too
    for rec in records.values():
        if rec.follows is None or rec.id in gone or rec.previous_text is None:
            continue
        if rec.follows in gone:
            changed[rec.id] = changed.get(rec.id, rec).replace(previous_text=None)
        elif rec.follows in changed:
            base = changed.get(rec.id, rec)
            changed[rec.id] = base.replace(previous_text=ingest.clipped(changed[rec.follows].content))
    said = {(r.metadata.get("role"), r.content) for r in found.turns}
    names = {n.casefold() for n in found.names} | {found.person.id}
    new_window, dropped, rewritten = _window_after(window, said, names, found.pattern)
    new_private, p_dropped, p_rewritten = _window_after(private, said, names, found.pattern)
    return ForgetPlan(found, deleted, list(changed.values()), new_window if dropped or rewritten else None,
                      dropped + p_dropped, rewritten + p_rewritten, new_private)


def _redacted(rec: Record, pattern: re.Pattern[str] | None) -> Record:
    metadata = {k: redact(v, pattern) if isinstance(v, str) else v for k, v in rec.metadata.items()}
    previous = redact(rec.previous_text, pattern) if rec.previous_text is not None else None
    return rec.replace(content=redact(rec.content, pattern), previous_text=previous, metadata=metadata)


def _window_after(turns: Sequence[Turn], said: set[tuple[Any, str]], names: set[str],
                  pattern: re.Pattern[str] | None) -> tuple[list[Turn], int, int]:
    kept: list[Turn] = []
    dropped = rewritten = 0
    for role, text, at in turns:
        if (role, text) in said or role.strip().casefold() in names:
            dropped += 1
            continue
        new = redact(text, pattern)
        rewritten += new != text
        kept.append((role, new, at))
    return kept, dropped, rewritten


def about(found: Sorted, window: Sequence[Turn]) -> dict[str, Any]:
    """Everything kept about ``found.person``, as ``about_person`` answers it (JSON-friendly):
    the person, the memories about only them, their turns, the memories about them and
    others, the mentions, and the context window's turns that are theirs or name them."""
    said = {(r.metadata.get("role"), r.content) for r in found.turns}
    names = {n.casefold() for n in found.names} | {found.person.id}

    def theirs(turn: Turn) -> bool:
        role, text, _ = turn
        return (role, text) in said or role.strip().casefold() in names or bool(
            found.pattern is not None and found.pattern.search(text))

    def rows(recs: list[Record]) -> list[dict[str, Any]]:
        return [r.memory().to_dict() for r in sorted(recs, key=lambda r: (r.created, r.id))]

    return {"person": found.person.to_dict(), "memories": rows(found.only), "turns": rows(found.turns),
            "shared": rows(found.shared), "mentions": rows(found.mentions),
            "window": [{"role": r, "content": c, "timestamp": to_datetime(t).isoformat()}
                       for r, c, t in window if theirs((r, c, t))],
            "names": list(found.names), "names_kept": list(found.names_kept)}


# -- pausing -----------------------------------------------------------------------------------


class Remembering:
    """Whether the store remembers, and the turns it holds in memory only while it does not.

    ``paused`` ends by itself at the deadline (read from the monotonic clock: a wall-clock
    step neither lengthens nor ends it). Thread-safe; readers (``status``) take no lock
    beyond a brief one."""

    def __init__(self, window_size: int, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._monotonic = clock, monotonic
        self._lock = threading.Lock()
        self._deadline: float | None = None  # monotonic
        self._until: float | None = None  # wall clock, for people to read
        self._private: list[Turn] = []
        self._window_size = max(1, window_size)  # turns the window holds (2N messages)

    @property
    def paused(self) -> bool:
        with self._lock:
            return self._paused_now()

    def _paused_now(self) -> bool:
        if self._deadline is not None and self._monotonic() >= self._deadline:
            self._deadline = self._until = None
        return self._deadline is not None

    def pause(self, minutes: Any) -> dict[str, Any]:
        """Pause for ``minutes`` (a number, 0 < minutes <= a week) from now, replacing a pause
        in force. Raises ValidationError."""
        if isinstance(minutes, bool) or not isinstance(minutes, int | float) or not (
                0 < minutes <= MAX_PAUSE_MINUTES):
            raise ValidationError(f"minutes must be a number above 0 and at most {MAX_PAUSE_MINUTES} (a week), "
                                  f"got {minutes!r}", field="minutes")
        with self._lock:
            self._deadline = self._monotonic() + minutes * 60.0
            self._until = self._clock() + minutes * 60.0
        return self.status()

    def resume(self) -> dict[str, Any]:
        """Remember again (nothing to do when not paused)."""
        with self._lock:
            self._deadline = self._until = None
        return self.status()

    def status(self) -> dict[str, Any]:
        """``{"paused": bool, "until": epoch seconds or None, "seconds_left": float}``."""
        with self._lock:
            paused = self._paused_now()
            left = max(0.0, self._deadline - self._monotonic()) if self._deadline is not None else 0.0
            return {"paused": paused, "until": self._until if paused else None, "seconds_left": round(left, 3),
                    "private_turns": len(self._private)}

    def refuse(self, what: str) -> None:
        """Raise RememberingPausedError (``what`` was not stored) while paused."""
        status = self.status()
        if status["paused"]:
            until = to_datetime(status["until"]).isoformat(timespec="seconds")
            raise RememberingPausedError(f"remembering is paused until {until} UTC: {what} was not stored "
                                         "(resume_remembering, or `reachy-memory resume`, to store it)",
                                         paused_until=status["until"])

    def check(self, ops: Iterable[Any], records: Any) -> None:
        """The funnel's check: while paused, a frame that would write a new memory (a ``put``
        of an id ``records`` does not hold) or a person (``person_put``) raises
        RememberingPausedError, nothing written; deleting, unlinking, rewriting a memory in
        its place (a vector added, a name removed) and the window's own ops pass."""
        if not self.paused:
            return
        for op in ops:
            if isinstance(op, dict) and op.get("op") == "person_put":
                self.refuse("the person")
            if isinstance(op, list) and op and op[0] == "put" and op[1].get("id") not in records:
                self.refuse("the memory")

    def add_turn(self, role: str, content: str) -> None:
        """Keep a turn said while paused, in memory only (the newest ``window_size``)."""
        with self._lock:
            self._private = [*self._private, (role, content, self._clock())][-self._window_size:]

    def private_turns(self) -> list[Turn]:
        with self._lock:
            return list(self._private)

    def set_private(self, turns: list[Turn]) -> None:
        with self._lock:
            self._private = list(turns)

    def clear(self) -> None:
        """Drop the private turns (the window was cleared, or the store closes)."""
        self.set_private([])

    def window(self, journaled: Sequence[Turn]) -> list[Turn]:
        """The window as shown: the journaled turns and the private ones, by time, the newest
        ``window_size``."""
        private = self.private_turns()
        if not private:
            return list(journaled)
        return sorted([*journaled, *private], key=lambda t: t[2])[-self._window_size:]


# -- the store's component -----------------------------------------------------------------------


class Household:
    """``forget_person`` and ``about_person`` of :class:`~reachy_memory.engine.store.MemoryStore`
    on the engine (its state, lock and one commit funnel); the pause is ``remembering``."""

    def __init__(self, engine: Any, remembering: Remembering) -> None:
        self._engine = engine
        self.remembering = remembering

    def pause_remembering(self, minutes: float) -> dict[str, Any]:
        """Stop remembering for ``minutes`` (above 0, at most a week; a pause in force is
        replaced): until then no memory or person is written (RememberingPausedError) and
        turns reach the context window only, held in this process's memory, never on disk.
        Ends by itself; a restart ends it too. Returns :meth:`remembering`. Raises ValidationError."""
        self._engine.require_open()
        return self.remembering.pause(minutes)

    def resume_remembering(self) -> dict[str, Any]:
        """Remember again (the turns held meanwhile stay in the window, in memory only);
        returns :meth:`remembering`."""
        self._engine.require_open()
        return self.remembering.resume()

    def remembering_status(self) -> dict[str, Any]:
        """The pause: ``paused``, ``until`` (epoch seconds or None), ``seconds_left``,
        ``private_turns`` (turns held in memory only). Takes no store lock."""
        return self.remembering.status()

    def _sorted(self, reference: Any) -> Sorted:
        """The records about the person ``reference`` names (under the lock). Raises
        ValidationError for a reference that is no text, NotFoundError for nobody."""
        if not isinstance(reference, str) or not reference.strip():
            raise ValidationError("a person (a name, an alias, 'my wife' or a person id) is needed", field="reference")
        state = self._engine.state
        person = state.people.find_person(reference.strip(), None)
        if person is None:
            raise NotFoundError(f"no person the robot knows is {reference.strip()[:100]!r}", reference=reference)
        merged = [old for old, kept in state.people.redirects().items() if kept == person.id]
        return sort_records(person, merged, list(state.records.values()), state.people.people(None),
                            self._engine.config.search.entity_fields)

    def about_person(self, reference: str) -> dict[str, Any]:
        """Everything kept about one person (every owner's memories): the person, the memories
        about only them, their conversation turns, the memories about them and others, the
        memories that name them, and the context window's turns that are theirs or name them
        (see the module doc). Raises ValidationError, NotFoundError."""
        self._engine.require_open()
        with self._engine.lock:
            found = self._sorted(reference)
            return about(found, self.remembering.window(self._engine.state.window_view))

    def forget_person(self, reference: str, dry_run: bool = False) -> dict[str, Any]:
        """Forget a person and what is kept about them, in one journal frame synced whatever
        ``memory.fsync`` says (see the module doc): the counts of what went (``dry_run``: of
        what would go, nothing changed). Raises ValidationError, NotFoundError."""
        self._engine.require_open()
        if not isinstance(dry_run, bool):
            raise ValidationError("dry_run must be true or false", field="dry_run")
        with self._engine.lock:
            found = self._sorted(reference)
            state = self._engine.state
            plan = plan_forget(found, state.records, state.window_view, self.remembering.private_turns())
            if dry_run:
                return plan.counts(True)
            ops: list[Any] = [["del", rec.id] for rec in plan.deleted]
            ops += self._rewrite_ops(plan)
            ops.append(state.people.delete_person(found.person.id))
            if plan.window is not None:
                ops += [["winclr"], *(["win", role, text, at] for role, text, at in plan.window)]
            self._engine.commit(ops, durable=True)
            self.remembering.set_private(plan.private_window)
            return plan.counts(False)

    def _rewrite_ops(self, plan: ForgetPlan) -> list[list[Any]]:
        """``put`` ops of the rewritten records, each embedded anew (its text as stored: a
        turn with the turn it follows, as rewritten); without a model (or when it fails) with
        no vector, which the idle-time backfill gives it."""
        engine, state = self._engine, self._engine.state
        if not plan.rewritten:
            return []
        gone = {rec.id for rec in plan.deleted}
        new = {rec.id: rec for rec in plan.rewritten}

        def before(rec: Record) -> Record | None:
            if rec.follows is None or rec.follows in gone:
                return None
            return new.get(rec.follows) or state.records.get(rec.follows)

        texts = [ingest.context_text(rec, before(rec), engine.config) for rec in plan.rewritten]
        vectors = engine.embed(texts) if engine.embedder is not None else None
        key = state.current_key
        ops = []
        for i, rec in enumerate(plan.rewritten):
            vector = vectors[i].astype("float32").tobytes() if vectors is not None else None
            ops.append(["put", encode(rec.replace(vkey=key if vector is not None else None)), vector])
        return ops
