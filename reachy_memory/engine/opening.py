"""Opening a data directory into a :class:`~.core.Core`, and the model it embeds with.

:func:`open_core` reads the snapshot (or a previous generation, to recover), replays
the journal, picks the embedder (the configured model in the precision of the stored
vectors, or none: lexical-only), refuses vectors of another model, loads the graph
cache and queues the memories owed a vector.  :func:`adopt_embedder` starts using a
model fetched after the store opened.  Nothing here owns state: the Core it builds does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reachy_memory.config import Config
from reachy_memory.engine.core import Core
from reachy_memory.engine.records import first_dim, first_vkey
from reachy_memory.engine.state import MemoryState
from reachy_memory.errors import ModelError, ModelMismatchError, ReachyMemoryError
from reachy_memory.model import resolve_timezone
from reachy_memory.storage import files
from reachy_memory.storage.files import GRAPH_FILE, SNAPSHOT_FILE, read_snapshot
from reachy_memory.storage.generations import Storage

log = logging.getLogger(__name__)


class Embedder(Protocol):
    """What the store needs from an embedding model."""

    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """(n, dim) float32, L2-normalised."""
        ...


class _Default:
    def __repr__(self) -> str:
        return "<default embedder>"


DEFAULT_EMBEDDER: Any = _Default()


def embedder_key(embedder: Any) -> str:
    """A string naming the vector space of ``embedder`` (model, weights, precision)."""
    identity = getattr(embedder, "identity", None)
    if isinstance(identity, Mapping):
        return "{name}/{sha256:.12}/{precision}/{dim}".format(**identity)
    return f"{type(embedder).__name__}/{embedder.dim}"


def open_core(path: Path, config: Config, lock: threading.RLock, embedder: Any, reindex: bool,
              recover: bool = False) -> Core:
    """The engine of the data directory ``path`` (its lock held by the caller), replayed and
    with its model checked and adopted.  Raises ModelMismatchError (unless ``reindex``),
    CorruptionError and the storage errors."""
    tz = resolve_timezone(config.memory.timezone)  # temporal words in queries are read in this zone
    base = files.recovery_base(path) if recover else None
    snapshot = base.snapshot if base is not None else _read_snapshot(path)
    stored_key = snapshot.get("model") if snapshot and not reindex else None  # reindex: the configured model
    embedder, error = _resolve_embedder(path, config, embedder, stored_key)
    model_key = snapshot.get("model") if snapshot else (first_vkey(base.ops) if base else None)
    current_key = embedder_key(embedder) if embedder is not None else model_key
    dim = embedder.dim if embedder is not None else (
        (snapshot or {}).get("dim") or (first_dim(base.ops) if base else None) or 384)
    state = MemoryState(config, dim, current_key, model_key)
    storage = Storage(path, config, state, lock, snapshot)
    if snapshot is not None:
        state.load(snapshot)
    if base is not None:  # rebuild: the previous generation's ops, then the current journal
        storage.apply(base.ops)
        storage.rebuilt_from(base.generation, base.seq)
    storage.open(rebuilding=base is not None)
    # After the replay: a slot written while the cache loads is never kept, and the
    # journal's writes since the snapshot (nodes idle time may have cached) are not that.
    _load_graph(path, state, storage)
    core = Core(path, config, tz, state, storage, lock, embedder, error)
    try:
        _check_model(core, reindex)
    except BaseException:
        storage.journal.close()
        raise
    adopt_model(core)
    return core


def _resolve_embedder(path: Path, config: Config, embedder: Any, stored_key: str | None) -> tuple[Any, str | None]:
    """(the embedder to use or None, why there is none)."""
    if embedder is not DEFAULT_EMBEDDER:
        return embedder, None
    if not config.embedding.enabled:
        return None, None
    from reachy_memory.embedding.embedder import load_embedder  # late: the model is optional at import time

    try:
        return load_embedder(precision_of_store(config, stored_key), data_dir=path), None
    except ModelError as exc:
        log.warning("embedding model unavailable, search runs lexical-only: %s", exc)
        return None, str(exc)


def precision_of_store(config: Config, stored_key: str | None) -> Config:
    """The config to load the model with: a store whose vectors come from the same
    weights in the other precision keeps that precision (a store written before int8
    became the default opens instead of refusing), with a warning naming the fix."""
    parts = (stored_key or "").split("/")
    configured = config.embedding.precision
    if len(parts) == 4 and parts[2] in ("fp32", "int8") and parts[2] != configured:
        log.warning("this store's vectors are %s; using %s (run 'reachy-memory reindex' with "
                    "embedding.precision: %s to switch)", parts[2], parts[2], configured)
        return config.replace("embedding", precision=parts[2])
    return config


def _read_snapshot(path: Path) -> dict[str, Any] | None:
    snap = path / SNAPSHOT_FILE
    return read_snapshot(snap) if snap.exists() else None


def _check_model(core: Core, reindex: bool) -> None:
    """Refuse to mix vector spaces: stored vectors must come from the configured model."""
    if core.embedder is None or reindex:
        return
    other = core.state.foreign_vkey()
    if other is not None:
        key = core.state.current_key
        raise ModelMismatchError(
            f"this store's vectors were made by {other!r} but the configured model is {key!r}; "
            "run 'reachy-memory reindex' to re-embed, or configure the original model",
            stored=other, configured=key,
        )


def _load_graph(path: Path, state: MemoryState, storage: Storage) -> None:
    vectors = state.vectors
    if vectors.count <= vectors.exact_below // 2:
        return  # searched exactly at this size; vectors wait as pending
    vectors.load_graph(path / GRAPH_FILE, storage.graph_tag())


def adopt_embedder(core: Core, embedder: Any) -> bool:
    """See :meth:`MemoryStore.adopt_embedder`."""
    core.require_open()
    key = embedder_key(embedder)
    state = core.state
    with core.lock:
        if core.embedder is not None:
            return False
        if embedder.dim != state.vectors.dim or state.model_key not in (None, key) or any(
                r.vkey is not None for r in state.records.values()):
            core.embedder_error = (f"the model {key} is on disk, but this store holds vectors or declares "
                                   "another model: restart the daemon to use it")
            log.warning("%s", core.embedder_error)
            return False
        state.current_key = key  # first: a write prepared meanwhile gets no vector
        core.use_embedder(embedder)
        log.info("embedding model loaded: %s", key)
        try:
            adopt_model(core)
        except ReachyMemoryError as exc:  # the backfill is planned: only the model op waits for the next open
            log.warning("could not journal the model now in use (%s); the next open does", exc)
        return True


def adopt_model(core: Core) -> None:
    """Queue the memories without a vector from the model in use, then journal that
    model as the store's (planned first: a failed write leaves nothing unqueued)."""
    state = core.state
    key = state.current_key
    if core.embedder is None:
        return
    missing = core.backfill.plan(state.records.values(), key)
    if missing:
        log.warning("%d memories have no vector from %s: the daemon embeds them in idle time, oldest first "
                    "(MemoryStore.maintain(); 'reachy-memory reindex' does all at once)", missing, key)
    if key != state.model_key and state.foreign_vkey() is None:
        core.commit([["model", key]])
