"""The temporal-expression parser (reachy_memory.engine.temporal) and its ranking hook."""

from datetime import UTC, date, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reachy_memory import MemoryStore
from reachy_memory.engine.temporal import parse_window, query_window, window_bonus

PARIS = timezone(timedelta(hours=2))
# A fixed reference time: Wednesday 15 May 2024, 14:30 UTC.
NOW = datetime(2024, 5, 15, 14, 30, tzinfo=UTC)


def d(*args: int, tz: timezone = UTC) -> datetime:
    return datetime(*args, tzinfo=tz)


@pytest.mark.parametrize(("query", "start", "end"), [
    # today: the calendar day of now
    ("what did I eat today?", d(2024, 5, 15), d(2024, 5, 16)),
    # yesterday: the day before
    ("What did we talk about yesterday", d(2024, 5, 14), d(2024, 5, 15)),
    # last night counts as yesterday
    ("who called last night?", d(2024, 5, 14), d(2024, 5, 15)),
    # N days ago: exactly that day
    ("the film 3 days ago", d(2024, 5, 12), d(2024, 5, 13)),
    # spelled-out count
    ("the walk two days ago", d(2024, 5, 13), d(2024, 5, 14)),
    # weeks ago: half a week either side of the point named
    ("a week ago", d(2024, 5, 5), d(2024, 5, 12)),
    # last week: the previous Monday-to-Sunday week
    ("what happened last week", d(2024, 5, 6), d(2024, 5, 13)),
    # this week: the current week from Monday
    ("plans this week", d(2024, 5, 13), d(2024, 5, 20)),
    # last weekend: Saturday and Sunday of the previous week
    ("where did I go last weekend", d(2024, 5, 11), d(2024, 5, 13)),
    # last month: the previous calendar month
    ("last month's trip", d(2024, 4, 1), d(2024, 5, 1)),
    # last year crosses the year boundary
    ("the party last year", d(2023, 1, 1), d(2024, 1, 1)),
    # in <month> not yet reached this year: last year's
    ("When did Melanie go camping in June?", d(2023, 6, 1), d(2023, 7, 1)),
    # in <month> already begun: this year's
    ("what did I do in March", d(2024, 3, 1), d(2024, 4, 1)),
    # explicit year wins
    ("in December 2022", d(2022, 12, 1), d(2023, 1, 1)),
    # a weekday: the latest one strictly before today
    ("what did we cook on Monday", d(2024, 5, 13), d(2024, 5, 14)),
    # today's weekday means a week ago
    ("last Wednesday", d(2024, 5, 8), d(2024, 5, 9)),
    # recently: the last two weeks up to now
    ("what did Caroline paint recently", d(2024, 5, 1), NOW + timedelta(seconds=1)),
])
def test_expression_to_window(query: str, start: datetime, end: datetime) -> None:
    window = parse_window(query, NOW)
    assert window is not None
    assert (window.start, window.end) == (start.timestamp(), end.timestamp())


@pytest.mark.parametrize("query", [
    "When did Caroline go to the support group?",  # asks for a time, names none
    "What is my favourite colour?",  # no time at all
    "Maybe we can go to the mayor",  # "may" inside other words is no month
])
def test_no_window(query: str) -> None:
    assert parse_window(query, NOW) is None


def test_calendar_words_follow_the_zone_of_now() -> None:
    # 23:30 UTC on the 15th is already the 16th in Paris.
    late = datetime(2024, 5, 15, 23, 30, tzinfo=UTC)
    window = parse_window("yesterday", late.astimezone(PARIS))
    assert window is not None
    assert window.start == d(2024, 5, 15, tz=PARIS).timestamp()


def test_naive_now_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_window("yesterday", datetime(2024, 5, 15))


def test_bonus_only_inside_the_window() -> None:
    window = parse_window("yesterday", NOW)
    created = np.array([d(2024, 5, 14, 12).timestamp(), d(2024, 5, 13, 12).timestamp(), NOW.timestamp()])
    assert window_bonus(window, created, 0.05).tolist() == [0.05, 0.0, 0.0]
    assert query_window("no time here", NOW.timestamp(), UTC) is None


@pytest.mark.parametrize("now", [
    1e15,  # far beyond year 9999: fromtimestamp overflows
    -62135596800.0 + 3600,  # 0001-01-01: "last year" would be year 0
])
def test_out_of_calendar_now_gives_no_prior(now: float) -> None:
    assert query_window("what happened last year", now, UTC) is None


def test_in_window_memory_ranks_above_equal_out_of_window(store: MemoryStore) -> None:
    text = "We baked a lemon cake together in the kitchen."  # turns: events, never merged as restatements
    store.store_batch([
        {"content": text, "memory_type": "conversation", "id": "old", "created_at": d(2024, 4, 20, 18)},
        {"content": text, "memory_type": "conversation", "id": "fresh", "created_at": d(2024, 5, 14, 18)},
        {"content": text, "memory_type": "conversation", "id": "older", "created_at": d(2024, 3, 2, 18)},
    ])
    for query, expected in [("What did we bake yesterday?", "fresh"), ("What did we bake in April?", "old")]:
        hits = store.search(query, limit=3, min_score=0, now=NOW)
        assert hits[0].memory.id == expected
        assert hits[0].score > hits[1].score


def _first_second(day: date, tz: ZoneInfo) -> float:
    """The first whole second whose local date is ``day`` (bisection: no wall-time arithmetic)."""
    lo = int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()) - 2 * 86400
    hi = lo + 4 * 86400
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if datetime.fromtimestamp(mid, tz).date() < day else (lo, mid)
    return float(hi)


def _check_calendar_windows(now: float, tz: ZoneInfo) -> None:
    today = datetime.fromtimestamp(now, tz).date()
    monday = today - timedelta(days=today.weekday())
    first = today.replace(day=1)
    days = {"today": (today, today + timedelta(days=1)), "yesterday": (today - timedelta(days=1), today),
            "3 days ago": (today - timedelta(days=3), today - timedelta(days=2)),
            "last week": (monday - timedelta(days=7), monday),
            "last month": ((first - timedelta(days=1)).replace(day=1), first)}
    for query, (start, end) in days.items():
        window = query_window(query, now, tz)
        assert window is not None
        assert (window.start, window.end) == (_first_second(start, tz), _first_second(end, tz)), \
            (query, datetime.fromtimestamp(now, tz))


@pytest.mark.parametrize(("zone", "local"), [
    ("America/Havana", (2026, 11, 1, 0, 30)),  # 01:00 back to 00:00: midnight comes twice
    ("America/Santiago", (2026, 4, 4, 23, 30)),  # 00:00 back to 23:00
    ("America/Santiago", (2026, 9, 6, 1, 30)),  # 00:00 on to 01:00: no midnight
    ("Europe/Paris", (2026, 10, 25, 2, 30)),
    ("Australia/Lord_Howe", (2026, 4, 5, 1, 45)),  # half an hour back
])
@pytest.mark.parametrize("fold", [0, 1])
def test_calendar_days_begin_at_their_first_second_across_clock_changes(zone: str, local: tuple[int, ...],
                                                                        fold: int) -> None:
    # asked in the second of a repeated hour that holds midnight (fold 1), "today" began
    # at the second midnight and "yesterday" ended at the first: an hour in neither
    tz = ZoneInfo(zone)
    _check_calendar_windows(datetime(*local, tzinfo=tz, fold=fold).timestamp(), tz)


@settings(max_examples=300, deadline=None)
@given(zone=st.sampled_from(["Europe/Paris", "America/Santiago", "America/Havana", "Australia/Lord_Howe",
                             "Asia/Beirut", "Pacific/Apia", "UTC"]),
       now=st.integers(1_293_840_000, 1_830_297_600))  # 2011..2027
def test_calendar_windows_follow_the_zones_days(zone: str, now: int) -> None:
    _check_calendar_windows(float(now), ZoneInfo(zone))
