from datetime import UTC, datetime
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
