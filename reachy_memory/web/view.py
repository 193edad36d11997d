"""What the household page shows, as JSON: built from the backend's people and memories.

Pure functions (no I/O): :func:`overview` is the page's one read (people with their
facts, other facts, recent conversations by day, the pause), :func:`memory_view` one
memory as the page lists it.  Times are shown in the store's configured zone
(``memory.timezone``).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta, tzinfo
from typing import Any

from reachy_memory.model import Memory, MemoryType, SearchResult
from reachy_memory.people.registry import Person

__all__ = ["DAYS_SHOWN", "FACTS_SHOWN", "TURNS_PER_DAY", "memory_view", "overview", "person_view", "search_view"]

DAYS_SHOWN = 14  # days of conversation the page lists (older turns: the search box finds them)
TURNS_PER_DAY = 200  # turns listed per day, the newest (the rest counted)
FACTS_SHOWN = 1000  # facts listed per person and among the others, the newest (the rest counted)
SPEAKER_KEYS = ("speaker", "person")  # metadata naming who said a turn (search.entity_fields' defaults)


def memory_view(m: Memory, tz: tzinfo, names: dict[str, str]) -> dict[str, Any]:
    """One memory as the page lists it: its text, kind, local day and time, who said it and
    whom it is about (display names; "someone" for a person no longer known)."""
    local = m.created_at.astimezone(tz)
    speaker = next((str(m.metadata[k]) for k in SPEAKER_KEYS if isinstance(m.metadata.get(k), str)), None)
    role = m.metadata.get("role")
    return {"id": m.id, "text": m.content, "type": m.memory_type.value, "when": m.created_at.isoformat(),
            "day": local.date().isoformat(), "time": local.strftime("%H:%M"),
            "role": role if isinstance(role, str) else None, "speaker": speaker,
            "about": [names.get(s, "someone") for s in m.subjects], "replaced": m.superseded_by is not None,
            "owner": m.owner, "shared": m.shared, "note": m.name}


def person_view(p: Person) -> dict[str, Any]:
    """A person as the page shows them: name (or "the user's wife"), relation, aliases."""
    return {"id": p.id, "name": p.display_name, "relation": p.relation, "aliases": list(p.aliases),
            "owner": p.owner}


def _newest(items: list[dict[str, Any]], limit: int) -> tuple[list[dict[str, Any]], int]:
    items.sort(key=lambda v: v["when"], reverse=True)
    return items[:limit], max(0, len(items) - limit)


def day_label(day: str, today: datetime) -> str:
    """"Today", "Yesterday", else the weekday and date ("Friday 27 November 2026")."""
    date = datetime.fromisoformat(day).date()
    if date == today.date():
        return "Today"
    if date == (today - timedelta(days=1)).date():
        return "Yesterday"
    return f"{date:%A} {date.day} {date:%B %Y}"


def overview(people: list[Person], pages: Iterable[list[Memory]], tz: tzinfo, now: float,
             remembering: dict[str, Any]) -> dict[str, Any]:
    """The page's whole view: ``people`` with the facts about each, the facts and context about
    nobody known, the conversations of the last :data:`DAYS_SHOWN` days by day (newest day
    first, each day's turns in the order said), counts, and the ``remembering`` status."""
    names = {p.id: p.display_name for p in people}
    today = datetime.fromtimestamp(now, tz)
    first_day = (today - timedelta(days=DAYS_SHOWN - 1)).date().isoformat()
    about: dict[str, list[dict[str, Any]]] = {p.id: [] for p in people}
    others: list[dict[str, Any]] = []
    days: dict[str, list[dict[str, Any]]] = {}
    counts = {"memories": 0, "facts": 0, "conversation": 0, "context": 0, "people": len(people)}
    for page in pages:
        for m in page:
            view = memory_view(m, tz, names)
            counts["memories"] += 1
            counts[m.memory_type.value if m.memory_type is not MemoryType.FACT else "facts"] += 1
            if m.memory_type is MemoryType.CONVERSATION:
                if view["day"] >= first_day:
                    days.setdefault(view["day"], []).append(view)
                continue
            known = [s for s in m.subjects if s in about]
            for s in known:
                about[s].append(view)
            if not known:
                others.append(view)
    persons = []
    for p in sorted(people, key=lambda p: (p.display_name.casefold(), p.id)):
        facts, more = _newest(about[p.id], FACTS_SHOWN)
        persons.append(person_view(p) | {"facts": facts, "more_facts": more})
    other_facts, more_others = _newest(others, FACTS_SHOWN)
    day_list = []
    for day in sorted(days, reverse=True):
        turns, more = _newest(days[day], TURNS_PER_DAY)
        day_list.append({"day": day, "label": day_label(day, today), "turns": turns[::-1], "more": more})
    return {"remembering": remembering, "people": persons, "facts": other_facts, "more_facts": more_others,
            "days": day_list, "counts": counts, "days_shown": DAYS_SHOWN}


def search_view(hits: list[SearchResult], tz: tzinfo, people: list[Person]) -> list[dict[str, Any]]:
    """Search hits as the page lists them (best first), with whom each is about."""
    names = {p.id: p.display_name for p in people}
    return [memory_view(h.memory, tz, names) | {"score": round(h.score, 3)} for h in hits]
