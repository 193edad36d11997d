"""A request on its way through the daemon (:class:`Job`), and what the daemon counts of
finished ones (:class:`Stats`, the ``ops`` part of the ``stats`` op)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reachy_memory.daemon.operations import Op

__all__ = ["Job", "OpStats", "Recent", "Stats"]


@dataclass
class Job:
    """One request, from the I/O thread that parsed it to the thread that answers it.

    ``op`` is its row of the op table (lane, read, capped: how it is run); ``args``
    were checked against the row (defaults filled in).  ``prepared`` is what the
    embedding thread made for an embed op (its row's ``prepare``); ``stages`` the
    seconds spent per stage (see :class:`Stats`); ``done`` that it succeeded (its
    reply is an ok one).
    """

    envelope: list[bytes]
    request_id: Any
    op: Op
    args: dict[str, Any]
    deadline: float | None
    received: float
    prepared: Any = None
    stages: dict[str, float] = field(default_factory=dict)
    done: bool = False


class Recent:
    """The latest ``size`` durations (seconds) in a float32 ring: a deque of Python
    floats cost ~32 bytes a sample (2 MB over a daemon's ops) and kept every sample
    alive for 2,048 requests among the long-lived objects, fragmenting the heap.
    Two threads appending at once may overwrite one sample (stats only)."""

    def __init__(self, size: int = 2048) -> None:
        self._values = np.zeros(size, np.float32)
        self._count = 0

    def append(self, seconds: float) -> None:
        self._values[self._count % len(self._values)] = seconds
        self._count += 1

    def values(self) -> np.ndarray:
        """The samples held (at most ``size``, in no particular order)."""
        return self._values[: len(self)]

    def __len__(self) -> int:
        return min(self._count, len(self._values))


@dataclass
class OpStats:
    count: int = 0
    errors: int = 0
    latencies: Recent = field(default_factory=Recent)
    # Where a request's time went: "wait" (in queues and handoffs), "embed", "engine", "sync".
    stages: dict[str, Recent] = field(default_factory=dict)


class Stats:
    """Counts and latencies per op.  :meth:`record` runs on the I/O thread (inline ops,
    refusals), the embedding thread (its failures), the engine, sync and background
    threads (what they answer)."""

    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {}  # op name -> its stats; threads add ops by setdefault

    def record(self, op: str, seconds: float, *, failed: bool, stages: dict[str, float] | None = None) -> None:
        """Count one answered request of ``op`` that took ``seconds`` since it was read."""
        # one atomic setdefault: two threads meeting a new op must not both make one
        stats = self.ops.get(op) or self.ops.setdefault(op, OpStats())
        stats.count += 1
        stats.errors += failed
        stats.latencies.append(seconds)
        if stages:  # what the stages do not account for waited in queues and handoffs
            for name, spent in (stages | {"wait": seconds - sum(stages.values())}).items():
                stats.stages.setdefault(name, Recent()).append(spent)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per op: count, errors, p50/p99 latency (ms), and the p50 of each stage when known."""
        ops: dict[str, dict[str, Any]] = {}
        for op, s in sorted(self.ops.items()):
            lat = s.latencies.values() * 1000 if len(s.latencies) else np.zeros(1)
            ops[op] = {"count": s.count, "errors": s.errors, "p50_ms": round(float(np.percentile(lat, 50)), 3),
                       "p99_ms": round(float(np.percentile(lat, 99)), 3)}
            if s.stages:
                ops[op]["stages_p50_ms"] = {name: round(1000 * float(np.percentile(v.values(), 50)), 3)
                                            for name, v in sorted(s.stages.items())}
        return ops
