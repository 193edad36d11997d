"""Power cuts under a serving daemon: every write it acknowledged is on the disk.

The daemon answers a write once the sync thread's fsync covering its journal frame has
returned (``tests/test_durable_replies.py``); meanwhile its engine goes on writing,
background compactions switch journals, and several clients write at once.
:class:`FsyncRecorder` records, at every fsync and fdatasync of the process, what a power
cut right after it would leave: each file as of the *start* of its latest completed fsync
(what an fsync that started earlier cannot have missed; bytes written while it ran are
not counted as durable), and the directory's entries as of its last fsync, or as they
stand.  Each acknowledgement is counted when the daemon is about to send it
(``Lanes.record_done``, called just before the reply goes out), so a cut point owes
every acknowledgement counted before the next fsync returned.
"""

from __future__ import annotations

import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import MemoryClient, MemoryStore
from reachy_memory.config import Config
from reachy_memory.daemon.server import Daemon
from reachy_memory.errors import ReachyMemoryError
from reachy_memory.storage import journal as jr
from tests.daemon_util import DaemonProcess
from tests.store_util import Disk, cut_variants, files_by_inode

pytestmark = pytest.mark.timeout(300)
WAIT = 20.0

Effect = tuple[str, str, str]  # (kind, key, value): put id content | del id | person name | ctx key value


@dataclass
class FsyncRecorder:
    """Records a :class:`Disk` at every completed fsync of a file in ``directory`` (flat)."""

    directory: Path
    slowness: float = 0.0  # seconds: each fsync takes up to this long (a slow card)
    acks: list[Effect] = field(default_factory=list)
    cuts: list[Disk] = field(default_factory=list)
    _synced: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # inode -> (start seq, content)
    _entries: tuple[int, dict[str, int]] = (0, {})  # (start seq, name -> inode) at the last directory fsync
    _open: tuple[dict[str, int], dict[str, int], str] | None = None
    _seq: int = 0
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self, fd: int) -> tuple[int, int, Any]:
        """Before an fsync: what it cannot miss (the file's bytes, a directory's entries)."""
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            seen: Any = self._listing() if info.st_ino == self.directory.stat().st_ino else None
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                seen = f.read()
        with self._lock:
            self._seq += 1
            return self._seq, info.st_ino, seen

    def finished(self, token: tuple[int, int, Any], is_dir: bool) -> None:
        """An fsync returned: what it covered is durable; a new cut point opens."""
        seq, ino, seen = token
        with self._lock:
            if self._done:
                return
            self._close()
            if is_dir:
                if seen is not None and seq > self._entries[0]:
                    self._entries = (seq, seen)
            elif seq > self._synced.get(ino, (0, b""))[0]:
                self._synced[ino] = (seq, seen)
            self._open = (dict(self._entries[1]), self._listing(), f"fsync #{seq}")

    def ack(self, effects: list[Effect]) -> None:
        with self._lock:
            self.acks.extend(effects)

    def finish(self) -> list[Disk]:
        with self._lock:
            self._close()
            self._done = True
        return list(self.cuts)

    def _close(self) -> None:
        if self._open is None:
            return
        for files, label in cut_variants(self._open, lambda ino: self._synced.get(ino, (0, b""))[1]):
            self.cuts.append(Disk(files, len(self.acks), label))
        self._open = None

    def _listing(self) -> dict[str, int]:
        return files_by_inode(self.directory)


@contextmanager
def recording(directory: Path, slowness: float = 0.0) -> Iterator[FsyncRecorder]:
    """Every fsync and fdatasync of the process goes through a recorder of ``directory``,
    each taking up to ``slowness`` seconds more."""
    rec = FsyncRecorder(directory, slowness)
    listing = files_by_inode(directory)
    rec._entries = (0, listing)
    for name, ino in listing.items():
        rec._synced[ino] = (0, (directory / name).read_bytes())
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def wrapped(real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            token = rec.started(fd)
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            time.sleep(rec.slowness * random.random())  # a slow card: writes pile up meanwhile
            real(fd)
            rec.finished(token, is_dir)
        return call

    with pytest.MonkeyPatch.context() as mp:
        for seam in (os, jr._os):
            mp.setattr(seam, "fsync", wrapped(real_fsync))
            mp.setattr(seam, "fdatasync", wrapped(real_fdatasync))
        yield rec
    rec.finish()


def effects_of(op: str, args: dict[str, Any]) -> list[Effect]:
    """What an acknowledged request promises to find after a crash."""
    if op in ("store", "record_turn"):
        return [("put", args["id"], args["content"])]
    if op == "store_batch":
        return [("put", item["id"], item["content"]) for item in args["items"]]
    if op == "forget":
        return [("del", args["id"], "")]
    if op == "add_person":
        return [("person", args["name"], "")]
    if op == "resolve_person":
        return [("person", args["reference"], "")]
    if op == "set_context":
        return [("ctx", args["key"], args["value"])]
    return []


@contextmanager
def serving(config: Config, rec: FsyncRecorder, tmp_path: Path) -> Iterator[Daemon]:
    """A words-only daemon serving on a thread of this process; each acknowledgement it
    is about to send is counted in ``rec``."""
    store = MemoryStore(config=config, embedder=None)
    daemon = Daemon(config, store=store, endpoint=f"ipc://{tmp_path}/run/m.sock", clock_sync=lambda: None)
    record_done = daemon.lanes.record_done

    def counted(job: Any) -> None:
        record_done(job)
        if job.done:
            rec.ack(effects_of(job.op.name, job.args))

    daemon.lanes.record_done = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=daemon.serve, daemon=True)
    thread.start()
    try:
        with MemoryClient(daemon.endpoint, config=config, timeout=WAIT) as c:
            c.ping()
        yield daemon
    finally:
        daemon.stop()
        thread.join(WAIT)
        assert not thread.is_alive()


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _word(n: int) -> str:
    out = ""
    while True:
        out, n = _LETTERS[n % 26] + out, n // 26
        if not n:
            return out


def _writer(daemon: Daemon, config: Config, w: int, rounds: int, sent: list[Effect], lock: threading.Lock) -> None:
    """One client writing: stores, batches, turns with ids, forgets of its own acknowledged
    memories, persons, named context, now and then a compaction; every request is noted in
    ``sent`` before it goes (a forget sent is never checked as present again)."""
    rnd = random.Random(w)
    mine: list[str] = []
    with MemoryClient(daemon.endpoint, config=config, timeout=WAIT) as c:
        for i in range(rounds):
            kind = rnd.choice(["store", "store", "batch", "turn", "turn", "forget", "person", "ctx", "compact"])
            tag = f"w{w}i{i}"
            if kind == "forget" and mine:
                victim = mine.pop(rnd.randrange(len(mine)))
                with lock:
                    sent.append(("del", victim, ""))
                c.forget(victim)
            elif kind == "batch":
                items = [{"content": f"batch {tag} item {k} about the garden", "id": f"{tag}b{k}"} for k in range(3)]
                c.store_batch(items)
                mine.extend(item["id"] for item in items)
            elif kind == "turn":
                c.record_turn("user", f"turn {tag}: what a day in the kitchen", id=f"{tag}t")
                mine.append(f"{tag}t")
            elif kind == "person":
                name = f"Zora {_word(w)}{_word(i + 100)}".title()
                if i % 2:
                    c.add_person(name)
                else:
                    c.resolve_person(name)
            elif kind == "ctx":
                with lock:
                    sent.append(("ctx", f"mood{w}", f"{i}"))
                c.set_context(f"mood{w}", f"{i}")
            elif kind == "compact" and w == 0:
                c.compact()
            else:
                c.store(f"fact {tag} about the garden gate", id=tag)
                mine.append(tag)


def _check(where: Path, config: Config, cut: Disk, acks: list[Effect], sent: list[Effect]) -> None:
    """Open the cut's disk: every acknowledged effect holds."""
    forgotten_later = {key for kind, key, _ in sent if kind == "del"}
    owed = acks[: cut.acked]
    with MemoryStore(config=config.replace("memory", path=str(where)), embedder=None) as store:
        names = {p.name for p in store.people()}
        problems = []
        for kind, key, value in owed:
            if kind == "put" and key not in forgotten_later:
                m = store.get(key)
                if m is None:
                    problems.append(f"lost {key}")
            elif kind == "del" and store.get(key) is not None:
                problems.append(f"back {key}")
            elif kind == "person" and key not in names:
                problems.append(f"lost person {key}")
            elif kind == "ctx":
                now = store.get_context(key)
                if now is None or int(now) < int(value):
                    problems.append(f"context {key}={now}, acknowledged {value}")
    assert not problems, f"after a power cut at {cut.label}: {problems[:10]} ({len(problems)} in all)"


def _write_disk(cut: Disk, where: Path) -> None:
    where.mkdir(mode=0o700)
    for name, content in cut.files.items():
        (where / name).write_bytes(content)
        (where / name).chmod(0o600)


def _sample(cuts: list[Disk], most: int) -> list[Disk]:
    if len(cuts) <= most:
        return cuts
    step = len(cuts) / most
    return [cuts[int(k * step)] for k in range(most)] + cuts[-4:]


@pytest.mark.parametrize("slowness", [0.0, 0.004])
def test_every_write_a_serving_daemon_acknowledged_survives_a_power_cut(config: Config, tmp_path: Path,
                                                                        slowness: float) -> None:
    """On a fast disk, and on a slow one (an SD card: more writes journaled during each fsync)."""
    cfg = config.replace("memory", compact_journal_bytes=3000).replace("embedding", enabled=False)
    data = Path(cfg.memory.path)
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    sent: list[Effect] = []
    lock = threading.Lock()
    with recording(data, slowness) as rec, serving(cfg, rec, tmp_path) as daemon, ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(_writer, daemon, cfg, w, 40, sent, lock) for w in range(6)]
        for job in jobs:
            job.result(120)
    cuts = rec.cuts
    assert len(rec.acks) >= 200 and len(cuts) > 100
    assert any("journal.prev.rmj" in cut.files for cut in cuts)  # journals were switched mid-stream
    for n, cut in enumerate(_sample(cuts, 400)):
        where = tmp_path / f"cut-{n}"
        _write_disk(cut, where)
        _check(where, cfg, cut, rec.acks, sent)


# -- kill -9 of a real daemon process mid-stream ------------------------------------------------


def _hammer(d: DaemonProcess, w: int, acked: list[Effect], stop: threading.Event) -> None:
    """Write until the daemon dies (or ``stop``): stores, batches, turns, forgets of this
    writer's acknowledged memories; each acknowledgement noted after its reply."""
    rnd, mine, i = random.Random(w), [], 0
    with d.client(timeout=3.0) as c:
        while not stop.is_set():
            i += 1
            tag, kind = f"k{w}i{i}", rnd.choice(["store", "batch", "turn", "forget"])
            try:
                if kind == "forget" and mine:
                    victim = mine.pop(rnd.randrange(len(mine)))
                    acked.append(("sent-del", victim, ""))
                    c.forget(victim)
                    acked.append(("del", victim, ""))
                elif kind == "batch":
                    items = [{"content": f"batch {tag} {k}", "id": f"{tag}b{k}"} for k in range(3)]
                    c.store_batch(items)
                    acked.extend(("put", item["id"], "") for item in items)
                    mine.extend(item["id"] for item in items)
                elif kind == "turn":
                    c.record_turn("user", f"turn {tag}", id=f"{tag}t")
                    acked.append(("put", f"{tag}t", ""))
                    mine.append(f"{tag}t")
                else:
                    c.store(f"fact {tag} about the garden", id=tag)
                    acked.append(("put", tag, ""))
                    mine.append(tag)
            except ReachyMemoryError:
                return  # killed: the reply in flight never came


def test_every_write_acknowledged_before_a_kill_9_is_there_after_it(tmp_path: Path) -> None:
    for trial in range(3):
        (tmp_path / f"trial-{trial}").mkdir()
        d = DaemonProcess(tmp_path / f"trial-{trial}", embedding={"enabled": False},
                          memory={"compact_journal_bytes": 4000})
        d.start()
        acked: list[Effect] = []
        stop = threading.Event()
        try:
            threads = [threading.Thread(target=_hammer, args=(d, w, acked, stop)) for w in range(4)]
            for t in threads:
                t.start()
            time.sleep(0.6 + 0.4 * trial)
            d.kill()
        finally:
            stop.set()
            d.kill()
        for t in threads:
            t.join(WAIT)
        sent_del = {key for kind, key, _ in acked if kind == "sent-del"}
        with MemoryStore(d.data, config=d.config, embedder=None) as store:
            lost = [k for kind, k, _ in acked if kind == "put" and k not in sent_del and store.get(k) is None]
            back = [k for kind, k, _ in acked if kind == "del" and store.get(k) is not None]
        assert len(acked) > 50 and (lost, back) == ([], []), f"trial {trial}: lost {lost[:5]}, back {back[:5]}"
