"""The swap of a restore: a backup's files put in place of a store's, whole or
not at all, across a power cut or a ``kill -9``.

Steps (``docs/FORMAT.md``, "Backups and restore"):

1. stage: the backup's snapshot and an empty journal of its generation are
   written as ``snapshot.rms.restoring`` and ``journal.rmj.restoring`` (each
   fsynced, then the directory).  The old store is untouched.
2. intent: ``restore.intent`` (journal format: one checksummed frame naming
   each old file and the name it is set aside under) is written and fsynced
   with the directory.  From here on the swap is decided.
3. swap: every old file is renamed aside, then each staged file into place,
   the directory fsynced after each rename (so a cut leaves a prefix of them).
4. the intent is removed, the directory fsynced.

Whoever takes the directory's lock next (:func:`settle`: store open, verify,
``verify --repair``, restore) finishes a swap whose intent it finds (every
step is skipped once done, so a cut while finishing is finished again), or,
with no intent, removes the staged files and keeps the old store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reachy_memory.errors import CorruptionError, FormatVersionError, StorageError
from reachy_memory.storage import journal as jr
from reachy_memory.storage.files import (
    GRAPH_FILE,
    HEAD_FILE,
    JOURNAL_FILE,
    NEXT_JOURNAL_FILE,
    PREV_JOURNAL_FILE,
    PREV_SNAPSHOT_FILE,
    RESTORE_INTENT_FILE,
    SNAPSHOT_FILE,
)

log = logging.getLogger(__name__)

# final name -> the name the backup's copy is staged under; installed in this order
STAGED = {SNAPSHOT_FILE: f"{SNAPSHOT_FILE}.restoring", JOURNAL_FILE: f"{JOURNAL_FILE}.restoring"}
# Every file of a store's generations: a restore moves them all aside, so the restored
# snapshot is never rebuilt (verify --repair) from another store's previous generation.
REPLACED = (SNAPSHOT_FILE, JOURNAL_FILE, PREV_SNAPSHOT_FILE, PREV_JOURNAL_FILE, NEXT_JOURNAL_FILE, HEAD_FILE)
ASIDE = "before-restore"
Moves = list[tuple[str, str]]  # (a store file's name, the name it is set aside under)


def store_files(directory: Path) -> list[Path]:
    """The files of the store in ``directory`` a restore sets aside (graph caches too).
    Raises StorageError when the directory cannot be listed."""
    try:
        return sorted(p for p in directory.iterdir() if _is_store_file(p.name))
    except OSError as exc:
        raise StorageError(f"cannot list {directory}: {exc.strerror}", path=str(directory)) from exc


def plan(directory: Path) -> Moves:
    """Each store file in ``directory`` and a new, unused name to set it aside under
    (``jr.side_path``: a fixed ``<name>.before-restore-<epoch>`` let a second restore
    within the same second rename the first restore's files over the original store's)."""
    return [(p.name, jr.side_path(p, ASIDE).name) for p in store_files(directory)]


def pending(directory: Path) -> bool:
    """True when a restore left its intent or staged files in ``directory``."""
    return any((directory / name).exists() for name in (RESTORE_INTENT_FILE, *STAGED.values()))


def stage(directory: Path, snapshot: Iterable[bytes | memoryview], generation: int, seq: int = 0) -> None:
    """Write the backup's ``snapshot`` and an empty journal of its ``generation`` (its frames
    numbered above the backup's ``seq``) under their staged names, durably.  Raises
    StorageError (StorageFullError); whatever the failure, the staged files are removed
    and nothing else was touched."""
    try:
        jr.write_atomic(directory / STAGED[SNAPSHOT_FILE], snapshot)
        jr.write_atomic(directory / STAGED[JOURNAL_FILE], jr.journal_chunks(
            {"kind": "journal", "generation": generation}, seq))
    except BaseException:
        _discard(directory)
        raise


def swap(directory: Path, moves: Moves) -> None:
    """Put the staged files in place of the store's, setting its files aside as
    ``moves`` names them.  The caller holds the lock and staged the files (:func:`stage`).

    Raises StorageError.  A failure before the intent is durable removes the staged
    files (the old store is untouched); after it, the swap is decided: the intent
    stays and the next holder of the lock finishes it (:func:`settle`).
    """
    try:
        jr.write_atomic(directory / RESTORE_INTENT_FILE, [jr.header(jr.JOURNAL), jr.encode_frame(
            {"kind": "restore", "moves": [list(m) for m in moves]})])
    except BaseException:
        _discard(directory)
        raise
    try:
        _roll_forward(directory, moves)
    except StorageError as exc:
        raise StorageError(f"the restore stopped halfway ({exc.message}); the next open, 'verify' or "
                           "'restore' of this directory finishes it", path=str(directory)) from exc


def settle(directory: Path) -> None:
    """Finish or undo a restore cut short in ``directory``; the caller holds its lock
    and has read no store file yet.  With ``restore.intent`` on disk the swap is
    finished; without it, the staged files are removed (the old store never changed).
    Raises CorruptionError (nothing changed) for an unreadable intent or a staged
    snapshot gone, StorageError when a rename fails."""
    intent = directory / RESTORE_INTENT_FILE
    if not intent.exists():
        _discard(directory)
        return
    moves = _read_intent(intent)
    aside = dict(moves).get(SNAPSHOT_FILE)  # the old store's snapshot, if it had one
    installed = (directory / SNAPSHOT_FILE).exists() and (aside is None or (directory / aside).exists())
    if not (installed or (directory / STAGED[SNAPSHOT_FILE]).exists()):
        raise CorruptionError(f"{intent}: a restore was cut short and the backup's copy "
                              f"{STAGED[SNAPSHOT_FILE]} is gone; nothing was changed (run 'restore' again)",
                              path=str(intent), offset=0)
    _roll_forward(directory, moves)
    log.warning("finished a restore cut short by a crash in %s (the old store's files: %s)",
                directory, ", ".join(aside for _, aside in moves) or "none")


def _roll_forward(directory: Path, moves: Moves) -> None:
    """Steps 3 and 4 from wherever a cut left them: a file already set aside (its side
    name exists) or already installed (its staged name is gone) is skipped.  Sound
    because every rename is durable before the next one starts.  Raises CorruptionError
    (nothing renamed) when a file this swap did not leave stands where a staged copy
    goes (:func:`_written_since`), StorageError when a rename fails."""
    written = _written_since(directory, moves)
    if written:
        raise CorruptionError(
            f"{directory}: a restore was cut short, and {', '.join(written)} were written after it set the old "
            "store aside (by an older reachy-memory, which does not finish restores?); nothing was changed. "
            f"Remove {RESTORE_INTENT_FILE} to keep them and give up the restore, or move them away to finish it",
            path=str(directory / written[0]), offset=0)
    for old, aside in moves:
        if (directory / old).exists() and not (directory / aside).exists():
            _rename(directory, old, aside)
    for final, staged in STAGED.items():
        if (directory / staged).exists():
            _rename(directory, staged, final)
    try:
        (directory / RESTORE_INTENT_FILE).unlink(missing_ok=True)
        jr.fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot remove {directory / RESTORE_INTENT_FILE}: {exc.strerror}",
                           path=str(directory)) from exc


def _written_since(directory: Path, moves: Moves) -> list[str]:
    """The names a staged copy is still to be installed under that hold a file the swap
    did not leave there: its old file already set aside, or none planned (the swap puts
    nothing there before the staged copy).  An older version, blind to the intent, opens
    such a directory as a store and writes there; a rename over it lost those writes."""
    aside = dict(moves)
    return [final for final, staged in STAGED.items()
            if (directory / staged).exists() and (directory / final).exists()
            and (final not in aside or (directory / aside[final]).exists())]


def _rename(directory: Path, src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` in ``directory`` durably (fsync of the directory: the
    next rename never reaches the disk before this one).  Raises StorageError."""
    try:
        os.replace(directory / src, directory / dst)
        jr.fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot rename {src} to {dst} in {directory}: {exc.strerror}",
                           path=str(directory)) from exc


def _discard(directory: Path) -> None:
    """Remove the staged files of a restore that never wrote its intent (a removal a
    cut undoes is redone by the next holder of the lock: nothing reads them)."""
    for staged in STAGED.values():
        try:
            (directory / staged).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove %s, left by a restore that did not finish: %s",
                        directory / staged, exc.strerror)


def _read_intent(path: Path) -> Moves:
    """The moves ``restore.intent`` names.  Raises CorruptionError when it is unreadable
    or names anything but store files and their side names (nothing is renamed then)."""
    try:
        frames = jr.read_file(path, jr.JOURNAL).frames
    except (CorruptionError, FormatVersionError) as exc:
        raise _bad_intent(path, exc.message) from exc
    head: Any = frames[0] if len(frames) == 1 else None
    moves = head.get("moves") if isinstance(head, dict) and head.get("kind") == "restore" else None
    if not isinstance(moves, list) or not all(_is_move(m) for m in moves):
        raise _bad_intent(path, f"{len(frames)} frames, not one naming the files to set aside")
    return [(old, aside) for old, aside in moves]


def _is_move(move: Any) -> bool:
    """A plain store file name and a side name of it (a damaged or forged intent must
    not rename anything else)."""
    if not (isinstance(move, list) and len(move) == 2 and all(isinstance(n, str) and "/" not in n for n in move)):
        return False
    old, aside = move
    return _is_store_file(old) and aside.startswith(f"{old}.{ASIDE}-")


def _is_store_file(name: str) -> bool:
    """A file of the live store: its generations, or a graph cache file (``vectors.hnsw``,
    ``vectors.hnsw.<group>``, ``vectors.hnsw.meta``), not one set aside before (a prefix
    test took ``vectors.hnsw.fact.before-restore-<epoch>`` for a store file: moved again
    under a second suffix, and counted as a store to refuse without ``--force``)."""
    group = name.removeprefix(f"{GRAPH_FILE}.")
    return name in REPLACED or name == GRAPH_FILE or (group != name and "." not in group)


def _bad_intent(path: Path, why: str) -> CorruptionError:
    return CorruptionError(
        f"{path}: a restore was cut short and its intent is unreadable ({why}); nothing was changed. "
        f"The backup's copy is {STAGED[SNAPSHOT_FILE]}; files named *.{ASIDE}-<epoch> are the old store's",
        path=str(path), offset=0)
