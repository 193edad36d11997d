"""The store's backups: writing one, and the forgotten memories earlier ones still hold.

:class:`Backups` owns nothing: it reaches the open store's storage through the
engine's core (a backup freezes the state under the store lock, then writes it on
the calling thread) and the purge record (``storage/purge.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from reachy_memory.storage import files


class Backups:
    """Backups of the store at ``path`` (see the module doc)."""

    def __init__(self, core: Any, path: Path) -> None:
        self._core = core
        self._path = path

    def backup(self, dest: str | Path, *, force: bool = False,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Write a consistent snapshot of the whole store to the file ``dest`` (fsynced),
        or to a timestamped file inside ``dest`` when it is a directory; ``progress`` is
        told the bytes written so far.  Any thread: the store lock is held only to
        freeze the state and to thaw it.

        Raises ValidationError (nothing written) for a target inside the data
        directory, a symlink, a missing directory, or an existing file that is
        not a backup (unless ``force``).
        """
        self._core.require_open()
        target = files.backup_target(dest, self._path, force=force)
        size, count = self._core.storage.backup(target, progress)
        return {"path": str(target), "bytes": size, "memories": count}

    def forgotten_in_backups(self, ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The backups this store wrote (still as written) that hold a forgotten memory
        (one of ``ids``, or any), a forgotten person, or (``ids`` None) an expired memory:
        ``[{"path", "made", "forgotten", "persons", "expired"}]``, oldest first.
        :meth:`purge_backups` rewrites them.  Any thread."""
        self._core.require_open()
        return self._core.storage.purge.backups_holding(ids)  # type: ignore[no-any-return]

    def purge_backups(self, paths: Iterable[str | Path] | None = None) -> list[dict[str, Any]]:
        """Rewrite the backups this store wrote, and the backup files (or directories of
        timestamped backups) ``paths``, without every memory and person forgotten and
        every memory expired: ``[{"path", "removed", "persons", "bytes"}]`` (``bytes`` 0:
        left as it was).  Any thread; the store lock is not taken.  Raises
        ValidationError for a path inside the data directory or not a backup, StorageError."""
        self._core.require_open()
        return self._core.storage.purge.purge_backups(paths)  # type: ignore[no-any-return]
