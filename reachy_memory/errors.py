"""The one error tree of reachy-memory.

Every error a caller can see derives from :class:`ReachyMemoryError`.  Errors
from hnswlib, msgpack, onnxruntime and zmq are translated where they happen
(``raise Ours(...) from exc``) so callers never need to catch a foreign type.

::

    ReachyMemoryError                 code
    ├── ConfigError(key)              bad_request
    ├── ValidationError(field)        bad_request
    │   ├── TooLargeError(field, size, limit)   too_large
    │   └── RememberingPausedError(paused_until)  bad_request   nothing stored: remembering is paused
    ├── NotFoundError(memory_id)      not_found
    ├── ClosedError                   unavailable
    ├── StorageError(path)            internal
    │   ├── StorageFullError(path)    unavailable   disk full: nothing written, retry when space returns
    │   ├── ReadOnlyError(path)       unavailable   an fsync failed: writes refused until reopened
    │   ├── StoreLockedError(path)    unavailable
    │   ├── CorruptionError(path, offset)
    │   └── FormatVersionError(path, found, expected)
    ├── ModelError                    unavailable
    │   ├── ModelUnavailableError
    │   └── ModelMismatchError(stored, configured)
    └── ServiceError                  (daemon and client side)
        ├── AlreadyRunningError(where)
        ├── BusyError                 busy
        ├── RequestTimeoutError       timeout
        ├── DaemonUnavailableError    unavailable
        ├── ProtocolError             bad_request
        └── RemoteError(code, message)  internal

``code`` is the protocol's error code for the class (see ``protocol``).
"""

from __future__ import annotations

from typing import Any


class ReachyMemoryError(Exception):
    """Base class of every error raised by reachy-memory."""

    code = "internal"

    def __init__(self, message: str, /, **fields: Any) -> None:
        """``fields`` are also attributes, ``message`` and ``fields`` kept whatever their names
        (``message`` positional: a daemon's error field named ``self`` is a field, not a TypeError)."""
        super().__init__(message)
        for name, value in fields.items():
            setattr(self, name, value)
        self.message = message
        self.fields = fields


class ConfigError(ReachyMemoryError):
    """A configuration key is unknown, missing or of the wrong type (``key``)."""

    code = "bad_request"


class ValidationError(ReachyMemoryError):
    """Input was refused (``field`` names what was wrong); nothing was stored."""

    code = "bad_request"


class TooLargeError(ValidationError):
    """Input exceeds a configured limit (``field``, ``size``, ``limit``)."""

    code = "too_large"


class RememberingPausedError(ValidationError):
    """Remembering is paused (``pause_remembering``) until ``paused_until`` (epoch
    seconds): the memory or person was not stored.  Not worth retrying before then."""


class NotFoundError(ReachyMemoryError):
    """No live memory has that id (``memory_id``)."""

    code = "not_found"


class ClosedError(ReachyMemoryError):
    """The store or client was used after ``close()``."""

    code = "unavailable"


class StorageError(ReachyMemoryError):
    """The data directory cannot be read or written (``path``)."""


class StorageFullError(StorageError):
    """The disk is full (``path``): the write was rolled back, nothing was stored;
    the store stays usable and later writes succeed once space returns."""

    code = "unavailable"


class ReadOnlyError(StorageError):
    """An fsync failed (``path``): the kernel may have dropped written data, so
    the store refuses every write until it is reopened (``health`` says why)."""

    code = "unavailable"


class StoreLockedError(StorageError):
    """Another process holds the data directory (``path``, ``holder``)."""

    code = "unavailable"


class CorruptionError(StorageError):
    """A file is damaged at ``offset``; run ``reachy-memory verify --repair``."""


class FormatVersionError(StorageError):
    """A file has an unknown magic or format version (``found``, ``expected``)."""


class ModelError(ReachyMemoryError):
    """The embedding model cannot be used."""

    code = "unavailable"


class ModelUnavailableError(ModelError):
    """No model files could be found, fetched or built."""


class ModelMismatchError(ModelError):
    """The store was built with another model (``stored``, ``configured``)."""


class ServiceError(ReachyMemoryError):
    """Errors of the daemon and of its clients."""

    code = "unavailable"


class AlreadyRunningError(ServiceError):
    """Another daemon already serves this data directory or endpoint (``where``)."""


class BusyError(ServiceError):
    """The daemon's queues are full; retry later."""

    code = "busy"


class RequestTimeoutError(ServiceError):
    """No reply arrived before the deadline; the client stays usable."""

    code = "timeout"


class DaemonUnavailableError(ServiceError):
    """The daemon cannot serve the request now (for example while stopping)."""


class ProtocolError(ServiceError):
    """A message did not follow the protocol."""

    code = "bad_request"


class RemoteError(ServiceError):
    """The daemon failed with an unexpected internal error (``remote_code``)."""

    code = "internal"


def error_class(name: Any) -> type[ReachyMemoryError] | None:
    """The ReachyMemoryError subclass called ``name`` (any depth of the tree), or None."""
    pending: list[type[ReachyMemoryError]] = [ReachyMemoryError]
    while pending:
        cls = pending.pop()
        if cls.__name__ == name:
            return cls
        pending.extend(cls.__subclasses__())
    return None


#: protocol error code -> class used by clients to re-raise a daemon's error
#: whose ``type`` they do not know (an older or newer daemon).
ERROR_BY_CODE: dict[str, type[ReachyMemoryError]] = {
    "bad_request": ValidationError,
    "too_large": TooLargeError,
    "not_found": NotFoundError,
    "busy": BusyError,
    "unavailable": DaemonUnavailableError,
    "timeout": RequestTimeoutError,
    "internal": RemoteError,
}
