"""reachy-memory: the long-term memory of the Reachy Mini robot.

In-process engine (``MemoryStore``), daemon (``reachy-memory serve``) and its
clients (``MemoryClient``, ``AsyncMemoryClient``)::

    from reachy_memory import MemoryStore, MemoryType, load_config
    with MemoryStore("~/.reachy/memory") as store:
        store.remember_fact("User prefers to be called Alex")
        hits = store.search("what is the user's name?")

    with MemoryClient() as client:  # talks to the running daemon
        client.remember_fact("Sarah likes Italian food")
"""

from .client import AsyncMemoryClient, MemoryClient
from .config import Config, load_config
from .embedding import OnnxEmbedder, load_embedder
from .errors import (
    AlreadyRunningError,
    BusyError,
    ClosedError,
    ConfigError,
    CorruptionError,
    DaemonUnavailableError,
    FormatVersionError,
    ModelError,
    ModelMismatchError,
    ModelUnavailableError,
    NotFoundError,
    ProtocolError,
    ReachyMemoryError,
    ReadOnlyError,
    RemoteError,
    RequestTimeoutError,
    ServiceError,
    StorageError,
    StorageFullError,
    StoreLockedError,
    TooLargeError,
    ValidationError,
)
from .manager import MemoryManager
from .model import Memory, MemoryType, SearchResult
from .store import DEFAULT_EMBEDDER, Embedder, MemoryStore

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_EMBEDDER",
    "AlreadyRunningError",
    "AsyncMemoryClient",
    "BusyError",
    "ClosedError",
    "Config",
    "ConfigError",
    "CorruptionError",
    "DaemonUnavailableError",
    "Embedder",
    "FormatVersionError",
    "Memory",
    "MemoryClient",
    "MemoryManager",
    "MemoryStore",
    "MemoryType",
    "ModelError",
    "ModelMismatchError",
    "ModelUnavailableError",
    "NotFoundError",
    "OnnxEmbedder",
    "ProtocolError",
    "ReachyMemoryError",
    "ReadOnlyError",
    "RemoteError",
    "RequestTimeoutError",
    "SearchResult",
    "ServiceError",
    "StorageError",
    "StorageFullError",
    "StoreLockedError",
    "TooLargeError",
    "ValidationError",
    "load_config",
    "load_embedder",
]
