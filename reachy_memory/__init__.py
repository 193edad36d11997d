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

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# The names below load on first use (PEP 562): importing the package costs ~1 ms, not the
# ~0.4 s of numpy, zmq and onnxruntime, so the ``reachy-memory`` command (__main__.py)
# is running its own code, which turns Ctrl-C into "interrupted", before they load.
if TYPE_CHECKING:  # what type checkers and editors see: the same names, eagerly
    from reachy_memory.client import AsyncMemoryClient, MemoryClient
    from reachy_memory.config import Config, load_config
    from reachy_memory.embedding.embedder import OnnxEmbedder, load_embedder
    from reachy_memory.engine.store import DEFAULT_EMBEDDER, Embedder, MemoryStore
    from reachy_memory.errors import (
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
        RememberingPausedError,
        RemoteError,
        RequestTimeoutError,
        ServiceError,
        StorageError,
        StorageFullError,
        StoreLockedError,
        TooLargeError,
        ValidationError,
    )
    from reachy_memory.manager import MemoryManager
    from reachy_memory.model import Memory, MemoryType, SearchResult

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
    "RememberingPausedError",
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

# name -> the submodule defining it; a test keeps this equal to __all__
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["AsyncMemoryClient", "MemoryClient"], "client"),
    **dict.fromkeys(["Config", "load_config"], "config"),
    **dict.fromkeys(["OnnxEmbedder", "load_embedder"], "embedding.embedder"),
    **dict.fromkeys(["AlreadyRunningError", "BusyError", "ClosedError", "ConfigError", "CorruptionError",
                     "DaemonUnavailableError", "FormatVersionError", "ModelError", "ModelMismatchError",
                     "ModelUnavailableError", "NotFoundError", "ProtocolError", "ReachyMemoryError",
                     "ReadOnlyError", "RememberingPausedError", "RemoteError", "RequestTimeoutError", "ServiceError",
                     "StorageError", "StorageFullError", "StoreLockedError", "TooLargeError", "ValidationError"],
                    "errors"),
    "MemoryManager": "manager",
    **dict.fromkeys(["Memory", "MemoryType", "SearchResult"], "model"),
    **dict.fromkeys(["DEFAULT_EMBEDDER", "Embedder", "MemoryStore"], "engine.store"),
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its submodule on first use (then cached here), or a
    submodule not imported yet (``reachy_memory.engine.store`` worked after ``import
    reachy_memory`` while the package imported them all); AttributeError otherwise."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    # not for dunders: hasattr(module, "__main__") must not run the command line's module
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the ones not loaded yet included."""
    return sorted({*globals(), *_EXPORTS})
