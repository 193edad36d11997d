"""``stats``/``len`` count what a reader sees: ``MemoryState.expired_counts`` caches its
answer by a write version and the time span until the next expiry. Attacked here with
random writes, deletions, retimes, redates, sweeps, compactions, reopenings and a clock
going forwards and back: its answer must always be a fresh count's."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reachy_memory import MemoryStore
from reachy_memory.config import Config
from reachy_memory.model import MemoryType

HOUR = 3600.0
T0 = time.time()
_TYPES = [t.value for t in MemoryType]

_op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(_TYPES), st.floats(-72, 0)),  # created hours ago
    st.tuples(st.just("forget"), st.integers(0, 40), st.just(0.0)),
    st.tuples(st.just("sweep"), st.just(""), st.floats(-72, 72)),  # cleanup_expired at T0 + hours
    st.tuples(st.just("retime"), st.just(""), st.just(0.0)),  # apply_retention with another TTL
    st.tuples(st.just("redate"), st.just(""), st.floats(-48, 48)),
    st.tuples(st.just("compact"), st.just(""), st.just(0.0)),
    st.tuples(st.just("reopen"), st.just(""), st.just(0.0)),
    st.tuples(st.just("count"), st.just(""), st.floats(-96, 96)),  # the clock anywhere, back or forth
)


def _fresh(store: MemoryStore, at: float) -> dict[str, int]:
    """The expired, unswept memories at ``at`` by type, counted record by record."""
    counted = Counter(r.type for r in store._state.records.values() if r.expires is not None and r.expires <= at)
    return {t: counted.get(t, 0) for t in _TYPES}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, max_size=40))
def test_expired_counts_match_a_fresh_count_whatever_happens(tmp_path_factory: pytest.TempPathFactory,
                                                            ops: list[tuple[str, str, float]]) -> None:
    path = tmp_path_factory.mktemp("data")
    config = Config().replace("memory", path=str(path), conversation_ttl_days=1.0)
    store = MemoryStore(config=config, embedder=None)
    ids: list[str] = []
    try:
        for n, (op, kind, hours) in enumerate(ops):
            at = T0 + hours * HOUR
            if op == "store":
                ids.append(store.store_batch([{"content": f"memory {n}", "memory_type": kind,
                                               "created_at": at}])[0].id)
            elif op == "forget" and ids:
                store.forget(ids[int(kind) % len(ids)])
            elif op == "sweep":
                store.cleanup_expired(at)
            elif op == "retime":
                config = config.replace("memory", conversation_ttl_days=2.0 if config.memory.conversation_ttl_days
                                        == 1.0 else 1.0)
                store.close()
                store = MemoryStore(config=config, embedder=None)
                assert store._state.expired_counts(at) == _fresh(store, at)  # cached before the retime
                store.apply_retention(now=T0)
            elif op == "redate":
                store.redate(T0 - 100 * HOUR, T0 + HOUR, hours * HOUR)
            elif op == "compact":
                store.compact()
            elif op == "reopen":
                store.close()
                store = MemoryStore(config=config, embedder=None)
            assert store._state.expired_counts(at) == _fresh(store, at), (n, op)
            for later in (T0, T0 + 6 * HOUR, T0 + 30 * HOUR, T0 + 60 * HOUR):  # within the span cached, and past it
                assert store._state.expired_counts(later) == _fresh(store, later), (n, op, later)
    finally:
        store.close()


def test_len_and_stats_leave_out_what_expired_since_the_last_answer(tmp_path: Path) -> None:
    """The cached answer holds until the next expiry: a memory expiring after it was given
    must leave the counts then, with no write in between."""
    with MemoryStore(config=Config().replace("memory", path=str(tmp_path)), embedder=None) as store:
        store.store_batch([{"content": "soon gone", "memory_type": "conversation",
                            "created_at": time.time() - 30 * 86_400 + 0.5}])
        store.store("kept", "fact")
        assert len(store) == 2 and store.stats()["expired_unswept"] == 0
        time.sleep(0.6)
        assert len(store) == 1 and store.stats()["expired_unswept"] == 1
        assert store.stats()["by_type"]["conversation"] == 0


def test_a_retention_moving_expiries_earlier_is_seen_by_the_cached_counts(tmp_path: Path) -> None:
    """apply_retention changes expiries in place: counts cached before it (until the next
    expiry under the old TTL) must not stand after it."""
    config = Config().replace("memory", path=str(tmp_path), conversation_ttl_days=2.0)
    with MemoryStore(config=config, embedder=None) as store:
        store.store_batch([{"content": "said 20 hours ago", "memory_type": "conversation",
                            "created_at": T0 - 20 * HOUR}])
    with MemoryStore(config=config.replace("memory", conversation_ttl_days=1.0), embedder=None) as store:
        assert store._state.expired_counts(T0)["conversation"] == 0  # cached until T0 + 28 h
        store.apply_retention(now=T0)  # now it expires at T0 + 4 h
        assert store._state.expired_counts(T0 + 6 * HOUR)["conversation"] == 1
