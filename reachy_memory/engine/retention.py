"""Expiry, retention and clock repairs: functions over a :class:`~.core.Core`.

They own no state: each decides under the store lock and writes one frame through
the Core's funnel (the replay then does exactly the same).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from reachy_memory._threads import gc_paused
from reachy_memory.engine.core import Core
from reachy_memory.engine.state import redate_args
from reachy_memory.errors import ValidationError
from reachy_memory.model import MemoryType, to_epoch


def cleanup_expired(core: Core, now: Any = None) -> int:
    """See :meth:`MemoryStore.cleanup_expired`."""
    core.require_open()
    at = epoch(now)
    with core.lock, gc_paused():  # 66k records freed: no full collection midway
        due = core.state.count_expired(at)
        if due:  # one small op, whatever the count: the replay deletes the same set
            core.commit([["expire", at]])
    return due


def apply_retention(core: Core, *, dry_run: bool = False, max_deletions: int | None = None,
                    now: Any = None) -> dict[str, Any]:
    """Give the conversation turns stored and alive at ``now`` the configured
    lifetime (``memory.conversation_ttl_days`` from their creation, as new turns
    get), and delete what is expired at ``now``.  A memory's expiry is otherwise
    fixed when it is written, so a changed TTL reaches stored turns only through
    this explicit call; a turn already expired stays gone, even with a longer TTL.

    Returns the configured days and the plan (``turns`` alive; how many expire
    ``earlier`` or ``later`` than before; ``expire_now``: expired with the new
    lifetime), ``applied``, and ``deleted`` (every expired memory swept).
    ``dry_run`` counts only.  A ``now`` before the clock counts as the clock (a turn
    expired in between must not come back).  Raises ValidationError, changing nothing, when the
    new lifetime would delete more than ``max_deletions`` turns (the consent of
    ``reachy-memory retention --apply`` without ``--yes``).

    One frame (sweep, ``ttl`` op, sweep), synced whatever ``memory.fsync`` says.
    The op sets expiries in place; a snapshot or backup being written meanwhile
    holds the ones of its frozen moment (``MemoryState.retime``).  A replay gives
    the same expiries whatever config the store is reopened with.
    """
    core.require_open()
    at = max(epoch(now), time.time())  # a past ``now`` must not revive a turn expired since
    ttl = core.config.memory.conversation_ttl_days * 86400.0
    state = core.state
    with core.lock, gc_paused():
        plan = state.retime_plan(ttl, at)
        if not dry_run and max_deletions is not None and plan["expire_now"] > max_deletions:
            raise ValidationError(f"the configured TTL would delete {plan['expire_now']} stored conversation "
                                  f"turns now, over the {max_deletions} allowed", field="max_deletions")
        applied = not dry_run and bool(plan["earlier"] or plan["later"])
        before = len(state.records)
        if applied:
            sweep = ["expire", at]  # before the ttl op too: a longer TTL must not revive an expired turn
            core.commit([sweep, ["ttl", MemoryType.CONVERSATION.value, ttl], sweep], durable=True)
        elif not dry_run and state.count_expired(at):
            core.commit([["expire", at]])
        deleted = before - len(state.records)
    return {"conversation_days": ttl / 86400.0, **plan, "applied": applied, "deleted": deleted}


def latest_time(core: Core) -> float:
    """See :meth:`MemoryStore.latest_time`."""
    core.require_open()
    with core.lock:
        created = (rec.created for rec in core.state.records.values())
        return max(itertools.chain(created, (turn[2] for turn in core.state.window_view)), default=0.0)


def redate(core: Core, since: float, until: float, delta: float) -> int:
    """Move every memory created in ``[since, until)`` (epoch seconds) by ``delta``
    seconds, its expiry with it, and every window turn of that period: the memories
    written while the wall clock was wrong by ``-delta`` (the daemon calls it when NTP's
    first sync steps a stale clock).  One ``redate`` op, synced whatever
    ``memory.fsync`` says; a replay gives the same times, whatever the clock or config.
    Returns how many memories moved.  Raises ValidationError, writing nothing, for
    values that are not finite, ``since > until``, or times moved out of 1970..2200."""
    core.require_open()
    op = ["redate", *redate_args([since, until, delta])]
    with core.lock:
        moving, turns = core.state.dated_in(since, until)
        if moving or turns:
            core.commit([op], durable=True)
    return moving


def epoch(now: Any) -> float:
    """``now`` (datetime, epoch or None for the current time) as epoch seconds."""
    at = to_epoch(now) if now is not None else None
    return time.time() if at is None else at
