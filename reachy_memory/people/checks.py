"""Argument checks and small helpers the people components share (no state)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from reachy_memory.engine import ingest
from reachy_memory.errors import ValidationError
from reachy_memory.model import check_unicode

MAX_NAME_CHARS = ingest.MAX_NAME_CHARS
MAX_ALIASES = 32


def text_arg(value: Any, field: str) -> str:
    """``value`` if it is a non-empty string of at most 4000 characters; ValidationError naming ``field``."""
    if not isinstance(value, str) or not value.strip() or len(value) > 4000:
        raise ValidationError(f"{field} must be a non-empty string of at most 4000 characters", field=field)
    return value


def label_arg(value: Any) -> str:
    """A note name or alias, stripped; ValidationError (field "name") otherwise."""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_CHARS:
        raise ValidationError(f"a note name or alias must be a non-empty string of at most {MAX_NAME_CHARS} "
                              "characters", field="name")
    return check_unicode(value.strip(), "name")


def unique(values: Iterable[Any]) -> list[Any]:
    """``values`` without repeats, in first-seen order."""
    return list(dict.fromkeys(values))


def flat(text: str) -> str:
    """``text`` with every run of whitespace one space."""
    return " ".join(text.split())
