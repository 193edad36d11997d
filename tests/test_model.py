import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from datetime import time as dt_time
from zoneinfo import ZoneInfo

import pytest

from reachy_memory import ConfigError, MemoryType, ValidationError
from reachy_memory.model import Expiry, resolve_timezone


def ts(*args: int, tz: object = UTC) -> float:
    return datetime(*args, tzinfo=tz).timestamp()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("memory_type", "created", "expected"),
    [
        (MemoryType.FACT, ts(2026, 1, 1), None),  # facts never expire
        (MemoryType.CONVERSATION, ts(2026, 1, 1), ts(2026, 1, 31)),  # 30 days later
        # Paris is UTC+1 in January: local midnight is 23:00 UTC
        (MemoryType.CONTEXT, ts(2026, 1, 1, 10), ts(2026, 1, 1, 23)),
        # 23:30 UTC is already the next day in Paris: expires at the end of that day
        (MemoryType.CONTEXT, ts(2026, 1, 1, 23, 30), ts(2026, 1, 2, 23)),
        # DST starts 2026-03-29 in Paris: midnight after is 22:00 UTC (UTC+2)
        (MemoryType.CONTEXT, ts(2026, 3, 29, 12), ts(2026, 3, 29, 22)),
    ],
)
def test_expiry(memory_type: MemoryType, created: float, expected: float | None) -> None:
    assert Expiry(30, ZoneInfo("Europe/Paris")).expires(memory_type, created) == expected


@pytest.mark.parametrize("value", ["fact", "FACT", "Fact", MemoryType.FACT])
def test_memory_type_parse(value: object) -> None:
    assert MemoryType.parse(value) is MemoryType.FACT  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["facts", "", 3, None])
def test_memory_type_parse_refuses(value: object) -> None:
    with pytest.raises(ValidationError):
        MemoryType.parse(value)  # type: ignore[arg-type]


def test_unknown_timezone_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        resolve_timezone("Mars/Olympus")


@pytest.fixture
def paris_system_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's own zone (``TZ``, as the C library reads it) set to Europe/Paris."""
    monkeypatch.setenv("TZ", "Europe/Paris")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("day", [(2026, 1, 10), (2026, 3, 29), (2026, 7, 10), (2026, 10, 25), (2026, 12, 31)])
@pytest.mark.usefixtures("paris_system_zone")
def test_local_zone_keeps_its_daylight_saving_rules(day: tuple[int, int, int]) -> None:
    # "local" (the default memory.timezone) was the fixed offset of the day the store was
    # opened: a daemon started in winter ended every summer context at 01:00 and read
    # "today" from 01:00 to 01:00 (one started in summer: 23:00) until its restart
    paris = ZoneInfo("Europe/Paris")
    expiry = Expiry(30, resolve_timezone("local"))
    for hour, minute in ((0, 0), (12, 0), (23, 59)):
        created = datetime(*day, hour, minute, tzinfo=paris)
        ends = datetime.fromtimestamp(expiry.expires(MemoryType.CONTEXT, created.timestamp()) or 0, paris)
        assert (ends.date() - created.date()).days == 1 and ends.time() == dt_time(0), (created, ends)


def test_local_zone_follows_tz_as_the_c_library_does(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        for spec, offset in ((":Asia/Tokyo", 9), ("", 0), ("Not/AZone", 0), ("XYZ-3", 3)):
            monkeypatch.setenv("TZ", spec)
            time.tzset()
            zone = resolve_timezone("local")
            assert datetime(2026, 7, 1, tzinfo=zone).utcoffset() == timedelta(hours=offset), spec
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize(("zone", "local", "ends"), [
    # St. John's set its clock back from 00:01 to 23:01 until 2011: midnight came twice, and a
    # context set after the step (23:30, second pass) ended at the first one, before it was set
    ("America/St_Johns", (2010, 11, 6, 23, 30), (2010, 11, 7, 0, 0)),
    # Havana sets it back from 01:00 to 00:00: a context of the day before ends at the first midnight
    ("America/Havana", (2026, 10, 31, 23, 30), (2026, 11, 1, 0, 0)),
])
@pytest.mark.parametrize("fold", [0, 1])
def test_context_ends_at_the_first_midnight_after_it(zone: str, local: tuple[int, ...], ends: tuple[int, ...],
                                                     fold: int) -> None:
    tz = ZoneInfo(zone)
    created = datetime(*local, tzinfo=tz, fold=fold).timestamp()
    expires = Expiry(30, tz).expires(MemoryType.CONTEXT, created)
    assert expires is not None and created < expires <= created + 86400
    end = datetime.fromtimestamp(expires, tz)
    assert end.replace(tzinfo=None, fold=0) == datetime(*ends)
    assert datetime.fromtimestamp(expires - 1, tz).date() < end.date()
