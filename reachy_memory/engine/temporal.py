"""Temporal expressions in a query -> a date window (pure functions, no state).

A small rule-based parser: no dependency (dateparser-style libraries cost
~100 ms+ to import and guess far more than we need).  Every rule is relative to
the search's reference time ``now`` (a time-zone-aware datetime) and yields a
half-open window ``[start, end)`` in epoch seconds, or None when the query
names no time.  "When did ..." asks for a time rather than naming one, so it
yields no window.  Windows are used as a small additive prior in ranking
(``search.temporal_boost``), never as a filter: a wrong guess costs little.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo

import numpy as np

MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_UNIT_DAYS = {"day": 1, "week": 7, "month": 30, "year": 365}
_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
            "seven": 7, "eight": 8, "nine": 9, "ten": 10, "a couple of": 2, "a few": 3}
_N = r"(\d{1,3}|a couple of|a few|an|a|one|two|three|four|five|six|seven|eight|nine|ten)"
_AGO = re.compile(_N + r"\s+(day|week|month|year)s?\s+ago\b")
_LAST = re.compile(r"\b(last|past|previous|this)\s+(night|week|weekend|month|year)\b")
_IN_MONTH = re.compile(r"\b(?:in|during|since|of)\s+(" + "|".join(MONTHS) + r")(?:\s+(\d{4}))?\b")
_ON_DAY = re.compile(r"\b(?:on|last)\s+(" + "|".join(WEEKDAYS) + r")\b")
_RECENT = re.compile(r"\b(recently|lately|these days|nowadays)\b")


@dataclass(frozen=True)
class TimeWindow:
    """Half-open ``[start, end)`` in epoch seconds."""

    start: float
    end: float

    def contains(self, created: np.ndarray) -> np.ndarray:
        """Boolean mask of the epoch times inside the window."""
        return (created >= self.start) & (created < self.end)


def parse_window(query: str, now: datetime) -> TimeWindow | None:
    """The window the query's first temporal expression names, or None.

    ``now`` must be time-zone aware (calendar words follow its zone).
    Raises ValueError for a naive ``now``.
    """
    if now.tzinfo is None:
        raise ValueError("now must be time-zone aware")
    text = query.lower()
    for rule in (_rule_day_words, _rule_ago, _rule_last, _rule_month, _rule_weekday, _rule_recent):
        found = rule(text, now)
        if found is not None:
            return TimeWindow(found[0].timestamp(), found[1].timestamp())
    return None


def _midnight(at: datetime) -> datetime:
    # fold 0: the first midnight of a day that has two (a zone that sets its clock back
    # from 01:00 to 00:00), whatever occurrence of the repeated hour ``at`` is in
    return at.replace(hour=0, minute=0, second=0, microsecond=0, fold=0)


def _day(at: datetime) -> tuple[datetime, datetime]:
    start = _midnight(at)
    return start, start + timedelta(days=1)


def _rule_day_words(text: str, now: datetime) -> tuple[datetime, datetime] | None:
    if re.search(r"\b(today|this morning|this afternoon|this evening|tonight)\b", text):
        return _day(now)
    if re.search(r"\b(yesterday|last night)\b", text):
        return _day(now - timedelta(days=1))
    return None


def _rule_ago(text: str, now: datetime) -> tuple[datetime, datetime] | None:
    m = _AGO.search(text)
    if m is None:
        return None
    count = int(m.group(1)) if m.group(1).isdigit() else _NUMBERS[m.group(1)]
    days = _UNIT_DAYS[m.group(2)]
    if days == 1:
        return _day(now - timedelta(days=count))
    # "2 weeks ago" is vague: half a unit either side of the point it names.
    centre = _midnight(now) - timedelta(days=count * days)
    return centre - timedelta(days=days // 2), centre + timedelta(days=days - days // 2)


def _rule_last(text: str, now: datetime) -> tuple[datetime, datetime] | None:
    m = _LAST.search(text)
    if m is None:
        return None
    which, unit = m.groups()
    if unit == "night":
        return _day(now - timedelta(days=1)) if which != "this" else _day(now)
    if unit in ("week", "weekend"):
        return _week(now, which, weekend=unit == "weekend")
    if unit == "month":
        return _month(now, which)
    year = now.year - (which != "this")
    start = _midnight(now).replace(year=year, month=1, day=1)
    return start, start.replace(year=year + 1)


def _week(now: datetime, which: str, *, weekend: bool) -> tuple[datetime, datetime]:
    monday = _midnight(now) - timedelta(days=now.weekday())
    if which != "this":
        monday -= timedelta(days=7)
    if weekend:
        return monday + timedelta(days=5), monday + timedelta(days=7)
    return monday, monday + timedelta(days=7)


def _month(now: datetime, which: str) -> tuple[datetime, datetime]:
    first = _midnight(now).replace(day=1)
    if which == "this":
        return first, _next_month(first)
    previous = (first - timedelta(days=1)).replace(day=1)
    return previous, first


def _next_month(first: datetime) -> datetime:
    return (first + timedelta(days=32)).replace(day=1)


def _rule_month(text: str, now: datetime) -> tuple[datetime, datetime] | None:
    m = _IN_MONTH.search(text)
    if m is None:
        return None
    month = MONTHS.index(m.group(1)) + 1
    # Without a year: the latest such month that has begun by ``now``.
    year = int(m.group(2)) if m.group(2) else now.year - (month > now.month)
    if not 1900 <= year <= 2200:
        return None
    first = _midnight(now).replace(year=year, month=month, day=1)
    return first, _next_month(first)


def _rule_weekday(text: str, now: datetime) -> tuple[datetime, datetime] | None:
    m = _ON_DAY.search(text)
    if m is None:
        return None
    # The most recent such day strictly before today.
    back = (now.weekday() - WEEKDAYS.index(m.group(1))) % 7 or 7
    return _day(now - timedelta(days=back))


def _rule_recent(text: str, now: datetime) -> tuple[datetime, datetime] | None:
    if _RECENT.search(text) is None:
        return None
    return _midnight(now) - timedelta(days=14), now + timedelta(seconds=1)


def window_bonus(window: TimeWindow | None, created: np.ndarray, boost: float) -> np.ndarray:
    """``boost`` for each epoch time in ``created`` inside the window, else 0."""
    if window is None or not boost:
        return np.zeros(len(created))
    return np.where(window.contains(created), boost, 0.0)


def query_window(query: str, now: float, tz: tzinfo) -> TimeWindow | None:
    """The search hook: the window the query's time words name, or None.

    ``now`` is epoch seconds; calendar words are read in ``tz`` (memory.timezone).
    A ``now`` outside the calendar (year 1 or beyond 9999) gives no window rather
    than an error: the prior is optional, the search must still answer.
    """
    try:
        return parse_window(query, datetime.fromtimestamp(now, tz))
    except (ValueError, OverflowError, OSError):
        return None
