"""``verify`` on a live data directory (docs/FORMAT.md, "Backups and restore"): while the
daemon writes and compacts, every check reads one generation (it checks again when a
compaction replaced files under it) and never calls a healthy store damaged (it said
"snapshot is missing or was replaced", exit 5, in 9 of 47 runs during compactions)."""

from __future__ import annotations

import threading
import time

import pytest

from reachy_memory import Config, MemoryStore
from reachy_memory.storage import backup as bk

pytestmark = pytest.mark.timeout(120)


def test_verify_in_a_loop_during_compactions_never_calls_the_store_damaged(config: Config) -> None:
    stop, done = threading.Event(), []
    with MemoryStore(config=config.replace("memory", fsync="never"), embedder=None) as store:

        def churn() -> None:
            n = 0
            while not stop.is_set():
                store.remember_fact(f"fact number {n}")
                if n % 3 == 0:
                    store.compact()
                    done.append(n)
                n += 1

        writer = threading.Thread(target=churn, daemon=True)
        writer.start()
        reports, deadline = [], time.monotonic() + 6.0
        try:
            while time.monotonic() < deadline and len(reports) < 150:
                reports.append(bk.verify(config.data_dir))
                time.sleep(0.005)  # the writer's turn
        finally:
            stop.set()
            writer.join(timeout=30)
    assert len(done) > 10 and len(reports) >= 10  # compactions did happen while verify ran
    bad = [r.problems for r in reports if not r.ok]
    assert not bad, f"{len(bad)} of {len(reports)} checks called a healthy store damaged: {bad[:3]}"
    odd = [r.to_dict() for r in reports if not any("running daemon" in n or "is live" in n for n in r.notes)]
    assert not odd, odd[:2]  # it says the store is live
