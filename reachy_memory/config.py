"""Configuration: typed, validated, loaded from YAML.

The dataclasses below are the single source of the defaults;
``config/default.yaml`` spells the same values out for people (a test keeps
the two equal).  ``load_config(path)`` merges a YAML file over the defaults and
refuses unknown keys and wrong types with a :class:`ConfigError` that names the
dotted key.  A relative path in a file (``memory.path: memory``, the model and
key folders of :data:`PATH_KEYS`, an ``ipc://`` endpoint's socket) is read from
that file's folder, whatever the working directory; paths given as overrides
(``--data-dir``) stay relative to it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from reachy_memory.errors import ConfigError

ENV_CONFIG = "REACHY_MEMORY_CONFIG"
SUPPORTED_MODEL = "all-MiniLM-L6-v2"  # embedding.model: the one architecture the ONNX builder knows

# Documented ranges, checked at load: (lowest, highest) inclusive; None = unbounded.
# Why the bounds: a TTL beyond 100 years or a zero cleanup interval is a typo, and a
# TTL that pushes expiry past year 2300 would make every stored memory unreadable.
MAX_TTL_DAYS = 36_500
MAX_TTL_SECONDS = MAX_TTL_DAYS * 86_400.0  # the longest memory.conversation_ttl_days, in seconds
RANGES: dict[str, tuple[float | None, float | None]] = {
    "memory.context_window_size": (1, 1000),
    "memory.context_window_max_age_minutes": (0, 10_000_000),
    "memory.conversation_ttl_days": (1 / 24, MAX_TTL_DAYS),
    "memory.cleanup_interval": (1, 7 * 86_400),
    "memory.fsync_batch_window_ms": (0.1, 10_000),
    "memory.compact_journal_bytes": (1, 1 << 34),
    "memory.max_content_chars": (1, 1_000_000),
    "memory.max_metadata_bytes": (64, 1 << 20),
    "memory.max_metadata_keys": (1, 1024),
    "memory.max_batch": (1, 100_000),
    "embedding.threads": (1, 64),
    "embedding.max_seq_length": (8, 512),
    "embedding.lru_size": (0, 1_000_000),
    "search.vector_weight": (0.0, 1.0),
    "search.entity_boost": (0.0, 1.0),
    "search.bm25_b": (0.0, 1.0),
    "search.previous_turn_weight": (0.0, 1.0),
    "search.temporal_boost": (0.0, 1.0),
    "search.neighbour_boost": (0.0, 1.0),
    "search.feedback_weight": (0.0, 1.0),
    "search.diversity": (0.0, 1.0),
    "search.candidates": (1, 10_000),
    "search.hnsw_m": (2, 128),
    "search.hnsw_ef_construction": (8, 4096),
    "search.hnsw_ef_search": (8, 4096),
    "search.blas_threads": (1, 64),
    "server.max_message_bytes": (1024, 1 << 30),
    "server.max_reply_bytes": (64 * 1024, 1 << 30),
    "server.queue_size": (1, 1_000_000),
    "server.drain_seconds": (0.0, 3600.0),
    "server.graph_cache_quiet_seconds": (0.0, 86400.0),
    "server.heap_trim_seconds": (0.0, 3600.0),  # and 0 or >= MIN_HEAP_TRIM_SECONDS
    "decay.rate_per_day": (0.0, 10.0),
    "decay.threshold": (0.0, 1.0),
}


MIN_HEAP_TRIM_SECONDS = 0.1


@dataclass(frozen=True)
class MemoryConfig:
    """Where and how memories are kept."""

    path: str = "~/.reachy/memory"
    context_window_size: int = 5
    # The window is persisted (a daemon restart mid-conversation keeps it), but turns older
    # than this are not shown: after a night the robot starts a new conversation. 0: no limit.
    context_window_max_age_minutes: float = 240.0
    conversation_ttl_days: float = 30.0
    timezone: str = "local"  # IANA name, or "local" for the system's zone
    cleanup_interval: float = 3600.0
    fsync: Literal["always", "batch", "never"] = "always"
    fsync_batch_window_ms: float = 5.0
    compact_journal_bytes: int = 32 * 1024 * 1024
    max_content_chars: int = 16_000
    max_metadata_bytes: int = 8192
    max_metadata_keys: int = 64
    max_batch: int = 1000
    # A fact or context memory that restates one kept (same owner, type and persons; the same
    # words up to case, punctuation, fillers and word order) refreshes it instead of being
    # stored again (docs/USAGE.md, "Restated facts"); off: every write is kept.
    dedupe: bool = True


@dataclass(frozen=True)
class EmbeddingConfig:
    """Which sentence-embedding model to run and how."""

    enabled: bool = True
    model: str = "all-MiniLM-L6-v2"
    # int8 on one thread: about twice as fast per core as fp32 on two, same LoCoMo recall
    # (docs/MEASUREMENTS.md, "Embedder"), and it leaves a core to the control loop.
    precision: Literal["fp32", "int8"] = "int8"
    threads: int = 1  # onnxruntime intra-op threads
    max_seq_length: int = 256
    model_dir: str | None = None  # a local folder: model.onnx or model.safetensors + tokenizer.json
    download_dir: str | None = None  # default: $XDG_CACHE_HOME/reachy-memory
    cache_dir: str | None = None  # built ONNX graphs; default: $XDG_CACHE_HOME/reachy-memory/built
    allow_hub: bool = False  # try the Hugging Face Hub when huggingface_hub is installed
    lru_size: int = 512
    spin: bool = False  # let onnxruntime threads spin between calls (lower latency, busier CPU)
    neighbour_context: bool = True  # embed a conversation turn with the turn before it


@dataclass(frozen=True)
class SearchConfig:
    """Hybrid retrieval and hnswlib parameters (tuned with tools/eval_locomo.py)."""

    mode: Literal["hybrid", "vector", "lexical"] = "hybrid"
    vector_weight: float = 0.3
    entity_fields: list[str] = field(default_factory=lambda: ["speaker", "person"])
    # Added when the query names a memory's speaker/person; 0.06 by the cross rule
    # (issue 12: tuned on either dev conversation, it lifts the other; README).
    entity_boost: float = 0.06
    # issue 12 (retrieval): added to memories created inside the window a query's
    # time words name ("yesterday", "last week", "in May"); 0 turns it off.
    temporal_boost: float = 0.1
    # issue 12: a hit gains this times the score of the turn before or after it when
    # that turn is also among the best ``candidates``.  Off: it fails the cross rule
    # with int8 (tuned on one dev conversation it lowers the other; README).
    neighbour_boost: float = 0.0
    # issue 12: pseudo-relevance feedback for multi-hop questions.  The words of the
    # best 3 lexical hits the query lacks run as a second BM25 query; candidates
    # gain this times its relevance.  0 turns it off (see README for the cross rule).
    feedback_weight: float = 0.0
    # issue 12: result diversity for multi-hop questions.  The best max(2 x limit, 20)
    # hybrid hits are re-ordered by maximal marginal relevance: score minus this times
    # the cosine to the closest hit already taken (scores are unchanged).  0 turns it off.
    diversity: float = 0.0
    # BM25's length normalisation (0: none, 1: full).  Memories are single
    # utterances: a longer one is not less on-topic, it says more.  0.3 by the cross
    # rule (issue 12: tuned on either dev conversation it lifts the other; README).
    bm25_b: float = 0.3
    # A conversation turn's lexical document also holds the words of the turn it
    # follows (stored with it, :data:`~reachy_memory.engine.ingest.NEIGHBOUR_SECONDS` rule),
    # each counting this much of one of its own (BM25F field weight; 0: its own words
    # only).  An answer rarely repeats its question's words ("What did you paint?" /
    # "A sunrise").  Applied when a memory is indexed: new memories at once, the rest
    # when the store is next opened (turns stored before this setting existed have no
    # previous text).  0.5 by the cross rule (README).
    previous_turn_weight: float = 0.5
    candidates: int = 40  # per retriever, before fusion (LoCoMo recall is flat from 30 to 100)
    exact_threshold: int = 2048  # filtered candidate sets up to this size: exact numpy search
    # indexes up to this size: exact search.  With BLAS on one thread (blas_threads) the
    # graph wins from ~6k vectors: at 10k a search costs 0.6 ms against 1.4 (README).
    exact_below: int = 8192
    hnsw_m: int = 16
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 96
    blas_threads: int = 1  # numpy's BLAS/OpenMP pools (exact search); more only fight onnxruntime


@dataclass(frozen=True)
class ServerConfig:
    """The daemon's endpoint, limits and queues."""

    endpoint: str | None = None  # default: ipc socket in a private runtime directory
    max_message_bytes: int = 1024 * 1024
    max_reply_bytes: int = 1024 * 1024  # a bigger read result is answered too_large (ask for fewer)
    queue_size: int = 256
    curve_secret_key: str | None = None  # server's secret key file (zmq.auth), for non-loopback tcp
    curve_authorized_dir: str | None = None  # folder of allowed clients' public key files
    curve_server_public_key: str | None = None  # for clients: the server's public key file
    curve_client_secret_key: str | None = None  # for clients: their own secret key file
    drain_seconds: float = 10.0  # on SIGTERM, time allowed to finish in-flight requests
    # A vector graph that changed enough is saved to the graph cache (so a crash or a power
    # cut leaves little to rebuild) only after this long without a request: the save holds
    # the daemon for ~2.4 us a vector of that memory type (80 ms at 33k).
    graph_cache_quiet_seconds: float = 10.0
    watchdog: bool = True
    log_level: str = "INFO"
    heap_trim_seconds: float = 10.0  # at idle moments, at most this often: free C heap back to the system (0: never)


@dataclass(frozen=True)
class DecayConfig:
    """Opt-in confidence decay of facts (issue 10): ``confidence * exp(-rate * days since
    last access)``; a fact below ``threshold`` leaves default retrieval (kept, never
    deleted); retrieval refreshes it; confirmed facts never decay."""

    enabled: bool = False
    rate_per_day: float = 0.01  # 0.01: a fact unused for 160 days falls to 0.2
    threshold: float = 0.2


@dataclass(frozen=True)
class Config:
    """The whole configuration; every section has working defaults."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    decay: DecayConfig = field(default_factory=DecayConfig)

    @property
    def data_dir(self) -> Path:
        """The data directory with ``~`` and environment variables ("$HOME/robot") expanded."""
        return Path(os.path.expandvars(self.memory.path)).expanduser()

    def replace(self, section: str, **changes: Any) -> Config:
        """A copy with ``changes`` applied to ``section`` (validated)."""
        merged = {**to_dict(self), section: {**to_dict(self)[section], **changes}}
        return from_dict(merged)


def to_dict(config: Any) -> dict[str, Any]:
    """The configuration as plain nested dicts (the YAML shape)."""
    return dataclasses.asdict(config)


def from_dict(data: Any, cls: type = Config, prefix: str = "") -> Any:
    """Build ``cls`` from ``data``, refusing unknown keys and wrong types.

    Raises :class:`ConfigError` naming the dotted key at fault.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        name = prefix.rstrip(".") or "config"
        raise ConfigError(f"{name}: expected a mapping", key=name)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            name = f"{prefix}{key}"
            raise ConfigError(f"unknown configuration key {name!r}", key=name)
    values = {key: _check(value, hints[key], f"{prefix}{key}") for key, value in data.items()}
    result = cls(**values)
    if cls is Config:
        _check_ranges(result)
    return result


def _check_ranges(config: Config) -> None:
    """Refuse values outside :data:`RANGES`, an unknown time zone or log level (ConfigError naming the key)."""
    for key, (low, high) in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if (low is not None and value < low) or (high is not None and value > high):
            raise ConfigError(f"{key}: {value!r} is outside the allowed range {low}..{high}", key=key)
    from reachy_memory.model import resolve_timezone  # late: model imports errors only, but keep config light

    resolve_timezone(config.memory.timezone)  # ConfigError for an unknown zone
    if config.embedding.model != SUPPORTED_MODEL:
        raise ConfigError(f"embedding.model: {config.embedding.model!r} is not supported; the only model is "
                          f"{SUPPORTED_MODEL!r} (other weights of that architecture: set embedding.model_dir)",
                          key="embedding.model")
    if 0 < config.server.heap_trim_seconds < MIN_HEAP_TRIM_SECONDS:  # a trim per idle tick would cost a few % of a core
        raise ConfigError(f"server.heap_trim_seconds: {config.server.heap_trim_seconds!r} is below "
                          f"{MIN_HEAP_TRIM_SECONDS} s (0 turns trims off)", key="server.heap_trim_seconds")
    if not isinstance(logging.getLevelName(config.server.log_level.upper()), int):
        raise ConfigError(f"server.log_level: unknown level {config.server.log_level!r}", key="server.log_level")
    if not config.memory.path.strip():  # "" would make the working directory the store
        raise ConfigError("memory.path must name a directory (it is empty)", key="memory.path")


def _check(value: Any, hint: Any, key: str) -> Any:
    """Return ``value`` if it fits ``hint`` (ints widen to float), else raise."""
    if dataclasses.is_dataclass(hint):
        return from_dict(value, typing.cast(type, hint), key + ".")
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}", key=key)
        return [_check(v, typing.get_args(hint)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key}: must be one of {list(typing.get_args(hint))}, got {value!r}", key=key)
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(hint):
            return None
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check(value, inner[0], key)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint in (int, float) and (isinstance(value, bool) or not isinstance(value, hint)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}", key=key)
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}", key=key)
    if hint in (int, float) and value < 0:
        raise ConfigError(f"{key}: must not be negative, got {value!r}", key=key)
    if hint in (str, bool) and not isinstance(value, hint):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}", key=key)
    return value


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Config:
    """Load the configuration.

    ``path`` (or ``$REACHY_MEMORY_CONFIG`` when ``path`` is None) is a YAML file
    laid over the built-in defaults; with neither, the defaults are used.
    ``overrides`` are ``section={key: value}`` dicts applied last.
    Raises :class:`ConfigError` for unreadable files, bad YAML, unknown keys and
    wrong types.
    """
    path = path if path is not None else os.environ.get(ENV_CONFIG) or None
    data: dict[str, Any] = {}
    if path is not None:
        data = _anchor_paths(_read_yaml(Path(path)), Path(os.path.abspath(path)).parent)
    for section, changes in overrides.items():
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"{section}: expected a mapping", key=section)
        data[section].update(changes)
    return typing.cast(Config, from_dict(_spec_keys(data)))


# Keys naming files or folders: a relative one in a config file is read from the file's folder.
PATH_KEYS = {"memory": ("path",), "embedding": ("model_dir", "download_dir", "cache_dir"),
             "server": ("curve_secret_key", "curve_authorized_dir", "curve_server_public_key",
                        "curve_client_secret_key")}


def _anchor_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` with each relative path of :data:`PATH_KEYS` made absolute from ``folder``,
    the config file's: under systemd the working directory is ``/``, so ``path: memory``
    meant ``/memory`` to the daemon and ``./memory`` to the same user's CLI.  A value that
    starts with ``~`` or ``$`` is left for the later expansion; anything else is left for
    the type check (which names the key).  So is the socket of an ``ipc://`` endpoint
    (``ipc://run/memory.sock``: the daemon bound ``/run/memory.sock`` under systemd, the
    CLI connected to ``./run/memory.sock``); ``ipc://@name`` is an abstract socket."""
    out = dict(data)
    for section, keys in PATH_KEYS.items():
        values = out.get(section)
        if not isinstance(values, dict):
            continue
        out[section] = {k: (str(folder / v) if k in keys and _relative(v) else v) for k, v in values.items()}
    server = out.get("server")
    if isinstance(server, dict) and _relative_socket(server.get("endpoint")):
        out["server"] = {**server, "endpoint": IPC + str(folder / server["endpoint"][len(IPC):])}
    return out


IPC = "ipc://"


def _relative(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != "" and not value.startswith(("~", "$", "/"))


def _relative_socket(endpoint: Any) -> bool:
    """An ``ipc://`` endpoint with a relative socket path ('@': a Linux abstract name)."""
    return (isinstance(endpoint, str) and endpoint.startswith(IPC) and _relative(endpoint[len(IPC):])
            and not endpoint[len(IPC):].startswith("@"))


# Keys of the spec's own config/default.yaml that live elsewhere here: (section, key) -> (section, key).
SPEC_KEYS = {("memory", "embedding_model"): ("embedding", "model")}


def _spec_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the spec's key names moved to ours, so the spec's config file loads.
    Raises ConfigError when both names are given with different values."""
    for (section, key), (ours, our_key) in SPEC_KEYS.items():
        old = data.get(section)
        if not isinstance(old, dict) or key not in old:
            continue  # a section that is not a mapping is refused by from_dict
        value = old[key]
        data = {**data, section: {k: v for k, v in old.items() if k != key}}
        target = data.get(ours) or {}
        if not isinstance(target, dict):
            raise ConfigError(f"{ours}: expected a mapping", key=ours)
        if our_key in target and target[our_key] != value:
            raise ConfigError(f"{section}.{key} ({value!r}) and {ours}.{our_key} ({target[our_key]!r}) disagree; "
                              f"{section}.{key} is the spec's name for {ours}.{our_key}: keep one",
                              key=f"{section}.{key}")
        data[ours] = {**target, our_key: value}
    return data


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e2`` as the number YAML 1.2 says it is (PyYAML
    follows YAML 1.1, where a float needs a dot: ``1e2`` was the string '1e2')."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # a SafeLoader
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}", key="config") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})", key="config") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}", key="config") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping", key="config")
    return data
