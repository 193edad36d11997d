"""Metadata validation and Chroma-style ``where`` filters over an inverted index.

Supported: ``{"key": value}`` (equality), ``{"key": {"$eq"|"$ne"|"$gt"|"$gte"|
"$lt"|"$lte"|"$in"|"$nin": ...}}``, and ``{"$and": [...]}`` / ``{"$or": [...]}``;
several keys in one dict are joined by AND.  A list-valued metadata field
matches ``$eq``/``$in`` when any element matches.  ``$ne`` and ``$nin`` match
every memory that does not have the value, **including memories that lack the
key** (ChromaDB's and MongoDB's semantics).  Range operators take numbers and
never match a memory that lacks the key.

Limits, checked before any work: at most ``MAX_FILTER_NODES`` operators, keys
and list items in one filter, nested at most ``MAX_FILTER_DEPTH`` deep; keys
are strings.  Anything else is a ValidationError (``too_large`` for size).

Filters are evaluated on the index, never by scanning memories, and produce a
boolean mask over slots.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from reachy_memory.errors import TooLargeError, ValidationError

Scalar = str | int | float | bool | None
_RANGE: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le,
}
_OPS = {"$eq", "$ne", "$in", "$nin", *_RANGE}
MAX_FILTER_NODES = 1024
MAX_FILTER_DEPTH = 16


_KIND = {str: "s", int: "n", float: "n", bool: "b", type(None): "z"}


def _key(value: Scalar) -> tuple[str, Scalar]:
    """Index key: keeps True apart from 1 while 1 and 1.0 stay equal."""
    return (_KIND.get(type(value), "s"), value)


_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what msgpack can store


def _is_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return _INT_RANGE[0] <= value <= _INT_RANGE[1]
    return value is None or isinstance(value, str | bool)


def validate_metadata(metadata: Any, *, max_bytes: int, max_keys: int) -> dict[str, Any]:
    """Return a clean copy of ``metadata`` or raise ValidationError/TooLargeError.

    Values must be str, int, float (finite), bool, None or lists of those.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ValidationError(f"metadata must be a dict, got {type(metadata).__name__}", field="metadata")
    if len(metadata) > max_keys:
        raise TooLargeError(f"metadata has {len(metadata)} keys; the limit is {max_keys}",
                            field="metadata", size=len(metadata), limit=max_keys)
    clean: dict[str, Any] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not key or key.startswith("$"):
            raise ValidationError(f"metadata keys must be non-empty strings not starting with '$': {key!r}",
                                  field="metadata")
        clean[key] = _clean_value(key, value)
    try:
        size = len(msgpack.packb(clean, use_bin_type=True))
    except UnicodeEncodeError as exc:  # a lone surrogate in a key or a value
        raise ValidationError("metadata holds text that is not valid Unicode (a lone surrogate)",
                              field="metadata") from exc
    if size > max_bytes:
        raise TooLargeError(f"metadata is {size} bytes packed; the limit is {max_bytes}",
                            field="metadata", size=size, limit=max_bytes)
    return clean


def _clean_value(key: str, value: Any) -> Any:
    if _is_scalar(value):
        return value
    if isinstance(value, list | tuple) and all(_is_scalar(v) for v in value):
        return list(value)
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValidationError(f"metadata[{key!r}]: integers must fit in 64 bits, got {str(value)[:40]}",
                              field=f"metadata.{key}")
    raise ValidationError(
        f"metadata[{key!r}]: values must be str, int, float, bool, None or a list of those; "
        f"got {type(value).__name__}", field=f"metadata.{key}",
    )


class FieldIndex:
    """Inverted index: metadata key -> value -> slots, plus memory type -> slots."""

    def __init__(self) -> None:
        self._fields: dict[str, dict[tuple[str, Scalar], set[int]]] = {}
        self._types: dict[str, set[int]] = {}
        self._capacity = 0
        self._cache: dict[tuple[str | None, bytes], np.ndarray] = {}
        # Slots of a mass removal (:meth:`hide`) whose metadata entries are still
        # indexed until :meth:`bury`; left out of every answer meanwhile.
        self._ghosts: set[int] = set()
        self._ghost_mask = np.zeros(0, bool)

    def add(self, slot: int, memory_type: str, metadata: dict[str, Any]) -> None:
        """Index ``slot``'s type and metadata."""
        self._capacity = max(self._capacity, slot + 1)
        self._cache.clear()
        self._types.setdefault(memory_type, set()).add(slot)
        for key, value in metadata.items():
            values = self._fields.setdefault(key, {})
            for item in value if isinstance(value, list) else (value,):
                values.setdefault(_key(item), set()).add(slot)

    def remove(self, slot: int, memory_type: str, metadata: dict[str, Any]) -> None:
        """Forget ``slot``'s entries (the inverse of :meth:`add`)."""
        self._cache.clear()
        self._types.get(memory_type, set()).discard(slot)
        self._forget(slot, metadata)

    def hide(self, slots: np.ndarray, types: dict[str, np.ndarray]) -> None:
        """The first half of :meth:`remove` for many slots at once (a mass expiry):
        ``types`` maps each memory type to its slots among them.  The metadata
        entries stay, hidden, until :meth:`bury` removes them (the slots must not be
        reused before)."""
        self._cache.clear()
        for memory_type, gone in types.items():
            self._types.get(memory_type, set()).difference_update(gone.tolist())
        if len(self._ghost_mask) < self._capacity:
            self._ghost_mask = np.concatenate([self._ghost_mask,
                                               np.zeros(self._capacity - len(self._ghost_mask), bool)])
        self._ghost_mask[slots] = True
        self._ghosts.update(slots.tolist())

    def bury(self, slot: int, metadata: dict[str, Any]) -> None:
        """The second half of :meth:`remove` for a slot of :meth:`hide`."""
        self._cache.clear()
        self._forget(slot, metadata)
        self._ghosts.discard(slot)
        self._ghost_mask[slot] = False

    def _forget(self, slot: int, metadata: dict[str, Any]) -> None:
        for key, value in metadata.items():
            values = self._fields.get(key, {})
            for item in value if isinstance(value, list) else (value,):
                slots = values.get(_key(item))
                if slots is not None:
                    slots.discard(slot)
                    if not slots:
                        del values[_key(item)]

    def type_counts(self) -> dict[str, int]:
        """How many slots each memory type holds."""
        return {memory_type: len(slots) for memory_type, slots in self._types.items()}

    def string_values(self, key: str) -> dict[str, set[int]]:
        """The string values of metadata ``key`` and the slots holding each, hidden
        slots (:meth:`hide`) included: for scoring slots already known to be live."""
        values = self._fields.get(key, {})
        return {v: slots for (kind, v), slots in values.items() if kind == "s" and isinstance(v, str)}

    def slots_with(self, key: str, value: Scalar) -> set[int]:
        """Slots whose metadata ``key`` equals (or contains) ``value``."""
        return self._visible(self._fields.get(key, {}).get(_key(value), set()))

    def _visible(self, slots: set[int]) -> set[int]:
        """``slots`` without hidden ones (a copy only while some are hidden)."""
        return slots - self._ghosts if self._ghosts and not slots.isdisjoint(self._ghosts) else slots

    def mask(self, memory_type: str | None, where: dict[str, Any] | None) -> np.ndarray | None:
        """Boolean mask over slots, or None when nothing restricts the search.

        ``where`` must have passed :func:`check_where` (the search pipeline checks it
        before the query is embedded); this only evaluates it.
        """
        if memory_type is None and not where:
            return None
        key = (memory_type, msgpack.packb(where, use_bin_type=True) if where else b"")
        mask = self._cache.get(key)
        if mask is None:
            if len(self._cache) >= 64:
                self._cache.clear()
            mask = self._cache[key] = self._compute(memory_type, where)
        return mask

    def _compute(self, memory_type: str | None, where: dict[str, Any] | None) -> np.ndarray:
        mask = np.ones(self._capacity, bool)
        if memory_type is not None:
            mask = self._to_mask(self._types.get(memory_type, set()))
        if where:
            mask &= self._eval(where)
        if self._ghosts:
            n = min(len(mask), len(self._ghost_mask))
            mask[:n] &= ~self._ghost_mask[:n]
        return mask

    def _to_mask(self, slots: set[int]) -> np.ndarray:
        mask = np.zeros(self._capacity, bool)
        if slots:
            mask[np.fromiter(slots, np.int64, len(slots))] = True
        return mask

    def _eval(self, where: dict[str, Any]) -> np.ndarray:
        mask = np.ones(self._capacity, bool)
        for key, cond in where.items():
            mask &= self._eval_item(key, cond)
        return mask

    def _eval_item(self, key: str, cond: Any) -> np.ndarray:
        if key in ("$and", "$or"):
            parts = [self._eval(c) for c in cond]
            return np.logical_and.reduce(parts) if key == "$and" else np.logical_or.reduce(parts)
        if isinstance(cond, dict):
            ((op, arg),) = cond.items()
            return self._eval_op(key, op, arg)
        return self._eval_op(key, "$eq", cond)

    def _eval_op(self, key: str, op: str, arg: Any) -> np.ndarray:
        values = self._fields.get(key, {})
        if op in ("$eq", "$ne"):
            hit = self._to_mask(values.get(_key(arg), set()))
            return hit if op == "$eq" else self._live() & ~hit
        if op in ("$in", "$nin"):
            hit = self._to_mask(set().union(*(values.get(_key(a), set()) for a in arg)))
            return hit if op == "$in" else self._live() & ~hit
        compare = _RANGE[op]
        return self._to_mask(set().union(*(
            slots for (kind, value), slots in values.items() if kind == "n" and compare(value, arg)
        )))

    def _live(self) -> np.ndarray:
        """Every slot that holds a memory."""
        return self._to_mask(set().union(*self._types.values()))


def check_where(where: Any) -> dict[str, Any] | None:
    """``where`` if :meth:`FieldIndex.mask` can evaluate it (None or ``{}``: no filter);
    else ValidationError, or TooLargeError over the size limits, naming field "where".
    No index is needed: a search checks its filter before its query is embedded."""
    if where is None:
        return None
    if not isinstance(where, dict):
        raise ValidationError(f"where must be a dict, got {type(where).__name__}", field="where")
    if where:
        check_filter_shape(where)
        _check_filter(where)
        try:
            msgpack.packb(where, use_bin_type=True)  # the mask cache's key
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"where holds a value that is not a scalar or list: {exc}", field="where") from exc
    return where


def _check_filter(where: Any) -> None:
    if not isinstance(where, dict) or not where:
        raise ValidationError(f"a where filter must be a non-empty dict, got {where!r}", field="where")
    for key, cond in where.items():
        if key in ("$and", "$or"):
            if not isinstance(cond, list) or not cond:
                raise ValidationError(f"{key} takes a non-empty list of filters", field="where")
            for part in cond:
                _check_filter(part)
        elif key.startswith("$"):
            raise ValidationError(f"unknown filter operator {key!r}", field="where")
        elif isinstance(cond, dict):
            if len(cond) != 1:
                raise ValidationError(f"filter on {key!r} takes exactly one operator", field="where")
            ((op, arg),) = cond.items()
            _check_op(key, op, arg)
        else:
            _check_op(key, "$eq", cond)


def _check_op(key: str, op: str, arg: Any) -> None:
    if op not in _OPS:
        raise ValidationError(f"unknown filter operator {op!r} on {key!r}", field="where")
    if op in ("$eq", "$ne"):
        if not _is_scalar(arg):
            raise ValidationError(f"{op} on {key!r} takes a scalar, got {arg!r}", field="where")
    elif op in ("$in", "$nin"):
        if not isinstance(arg, list) or not all(_is_scalar(a) for a in arg):
            raise ValidationError(f"{op} on {key!r} takes a list of scalars", field="where")
    elif isinstance(arg, bool) or not isinstance(arg, int | float):
        raise ValidationError(f"{op} on {key!r} takes a number, got {arg!r}", field="where")


def check_filter_shape(where: Any) -> None:
    """Refuse a filter over the size or depth limits, or with non-string keys,
    before any work (TooLargeError / ValidationError)."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(where, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_FILTER_NODES:
            raise TooLargeError(f"a where filter may hold at most {MAX_FILTER_NODES} keys, operators and values",
                                field="where", size=nodes, limit=MAX_FILTER_NODES)
        if depth > MAX_FILTER_DEPTH:
            raise ValidationError(f"a where filter may nest at most {MAX_FILTER_DEPTH} levels", field="where")
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise ValidationError("where keys must be strings", field="where")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
