"""The command line against a real daemon: output, --json, exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import (
    ClosedError,
    DaemonUnavailableError,
    MemoryClient,
    MemoryStore,
    ReachyMemoryError,
    RequestTimeoutError,
    ValidationError,
)
from reachy_memory.cli import _stats_text
from reachy_memory.storage import backup as bk
from reachy_memory.storage import journal as jr
from tests.daemon_util import ROOT, DaemonProcess, words_only_daemon
from tests.daemon_util import run_cli as cli
from tests.store_util import BAD_DATA_DIRS, bad_data_dir

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("cli")) as d:
        yield d


def test_store_search_get_forget(daemon: DaemonProcess) -> None:
    out = cli(daemon, "store", "The robot's charger is in the hallway", "--meta", "room=hallway", "--json")
    assert out.returncode == 0, out.stderr
    memory = json.loads(out.stdout)
    found = json.loads(cli(daemon, "search", "where is the charger", "--json").stdout)
    assert found[0]["id"] == memory["id"] and found[0]["metadata"] == {"room": "hallway"}
    assert "charger" in cli(daemon, "get", memory["id"]).stdout
    assert cli(daemon, "forget", memory["id"]).returncode == 0
    assert cli(daemon, "get", memory["id"]).returncode == 3  # not found
    assert cli(daemon, "forget", memory["id"]).returncode == 3


def test_remember_with_an_id_run_again_stores_nothing_twice(daemon: DaemonProcess) -> None:
    # `store` had --id, `remember` none: a shell command run again after a timeout or a daemon
    # restart (it may have been kept) kept the fact twice.
    # (no person named: one would come first in test_export_import_is_idempotent's export)
    argv = ("remember", "the spare bike key hangs in the shed", "--id", "cli-bike-key", "--json")
    first = cli(daemon, *argv)
    assert first.returncode == 0, first.stderr
    again = cli(daemon, *argv)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout)  # the memory kept first
    assert [m["id"] for m in json.loads(first.stdout)] == ["cli-bike-key"]
    other = cli(daemon, "remember", "the spare bike key hangs in the hall", "--id", "cli-bike-key")
    assert other.returncode == 2 and "cli-bike-key" in other.stderr  # the id holds another fact: nothing stored
    with daemon.client() as c:
        hits = c.search("spare bike key shed hall", limit=20, min_score=0.0)
        assert [h.memory.id for h in hits if "spare bike key" in h.memory.content] == ["cli-bike-key"]


@pytest.mark.parametrize(("piped", "stored"), [
    (b"The spare key is under the blue pot\n", "The spare key is under the blue pot"),  # echo's newline dropped
    (b"two lines\nof text\r\n", "two lines\nof text"),  # only the final line end goes
    ("caf\u00e9 au lait".encode(), "caf\u00e9 au lait"),  # UTF-8
    ("\U0001f600".encode() * 16_000 + b"\r\n", "\U0001f600" * 16_000),  # at the limit, in 4-byte characters
])
def test_store_dash_reads_standard_input(daemon: DaemonProcess, piped: bytes, stored: str) -> None:
    out = cli(daemon, "store", "-", "--json", stdin=piped)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["content"] == stored


@pytest.mark.parametrize("piped", [
    b"\xff\xfe not UTF-8",  # refused, not stored as mojibake
    b"",  # nothing piped: empty content
    b"x" * 16_001,  # over memory.max_content_chars
    "\u5b57".encode() * 30_000,  # too long, cut inside a character: "not UTF-8" before
    b"x" * (8 << 20),  # 8 MB: refused by the command itself after 64 KB, never sent
])
def test_store_dash_refuses_bad_standard_input(daemon: DaemonProcess, piped: bytes) -> None:
    before = json.loads(cli(daemon, "stats", "--json").stdout)["stats"]["store"]["memories"]
    out = cli(daemon, "store", "-", stdin=piped)
    assert out.returncode == 2 and out.stderr.startswith("error:") and "Traceback" not in out.stderr
    if len(piped) > 16_001:
        assert "standard input holds more than" in out.stderr
    assert json.loads(cli(daemon, "stats", "--json").stdout)["stats"]["store"]["memories"] == before


def test_stats_text_is_for_a_human_and_json_stays_as_it_was(daemon: DaemonProcess) -> None:
    # It printed the per-type counts and the last cleanup as Python dicts.
    assert cli(daemon, "cleanup").returncode == 0
    text = cli(daemon, "stats").stdout
    assert not any(ch in text for ch in "{}'"), text
    assert re.search(r"^by type: \d+ conversation, \d+ fact, \d+ context$", text, re.MULTILINE), text
    assert re.search(r"^last cleanup: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, \d+ expired deleted", text, re.MULTILINE)
    data = json.loads(cli(daemon, "stats", "--json").stdout)
    assert set(data["stats"]["store"]["by_type"]) == {"conversation", "fact", "context"}
    assert set(data["health"]["last_cleanup"]) >= {"time", "deleted", "duration_ms"}


# The daemon's last_cleanup, and how stats shows it.
CLEANUPS = [
    (None, "last cleanup: not run yet"),  # before the first sweep: "None"
    ({"time": 0.0, "deleted": 3, "duration_ms": 1.234}, "last cleanup: 1970-01-01 00:00:00 UTC, 3 expired deleted "
     "in 1.2 ms"),  # a scheduled sweep
    ({"time": 0.0, "deleted": 0, "duration_ms": None}, "last cleanup: 1970-01-01 00:00:00 UTC, 0 expired deleted"),
    # ^ a sweep asked for (the cleanup command): no duration
    ({"time": 0.0, "deleted": 0, "duration_ms": None, "deferred_s": 3600.4},
     "last cleanup: 1970-01-01 00:00:00 UTC, deferred (the wall clock stepped 3600 s forward)"),  # a clock step
]


@pytest.mark.parametrize(("cleanup", "shown"), CLEANUPS)
def test_stats_text_shows_the_last_cleanup_in_words(cleanup: dict[str, Any] | None, shown: str) -> None:
    health = {"status": "ok", "memories": 4, "uptime_s": 12.0, "embedder": {"state": "ready"}, "last_cleanup": cleanup}
    store = {"by_type": {"conversation": 3, "fact": 1, "context": 0}, "journal_bytes": 10, "snapshot_bytes": 0}
    text = _stats_text({"health": health, "stats": {"store": store, "ops": {}}}).splitlines()
    assert text[1:] == ["by type: 3 conversation, 1 fact, 0 context", "journal 10 B  snapshot 0 B", shown]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["store", "   "], 2),  # empty content: bad input
        (["store", "x", "--meta", "novalue"], 2),  # malformed --meta
        (["search", "x", "--where", '{"a": {"$regex": "b"}}'], 2),  # unknown operator
        (["get", "no-such-id"], 3),  # not found
        (["verify", "/nonexistent/backup.rms"], 3),  # a missing path is not found (it was 5, damage)
        (["stats", "--endpoint", "ipc:///nonexistent/dir/sock", "--timeout", "0.3"], 4),  # no daemon
    ],
)
def test_exit_codes(daemon: DaemonProcess, args: list[str], code: int) -> None:
    out = cli(daemon, *args)
    assert out.returncode == code, (out.stdout, out.stderr)
    assert out.stderr.startswith("error:") and "Traceback" not in out.stderr


def test_context_commands(daemon: DaemonProcess) -> None:
    assert cli(daemon, "context", "add", "user", "hello robot").returncode == 0
    assert "user: hello robot" in cli(daemon, "context", "show").stdout
    out = cli(daemon, "context", "set", "task", "tidy up")
    assert out.returncode == 0 and out.stdout.strip() == "task set to tidy up"  # it printed the window: "(empty)"
    assert json.loads(cli(daemon, "context", "set", "task", "tidy up", "--json").stdout) == {
        "key": "task", "value": "tidy up"}
    assert cli(daemon, "context", "get", "task").stdout.strip() == "tidy up"
    assert cli(daemon, "context", "get", "absent").returncode == 3
    assert cli(daemon, "context", "clear").returncode == 0
    assert "(empty)" in cli(daemon, "context", "show").stdout


def test_export_import_is_idempotent(daemon: DaemonProcess, tmp_path: Path) -> None:
    for i in range(5):
        cli(daemon, "store", f"exported note {i}", "--type", "conversation")
    dump = tmp_path / "dump.jsonl"
    assert cli(daemon, "export", str(dump)).returncode == 0
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(lines) >= 5 and {"id", "content", "type", "created_at", "metadata"} <= set(lines[0])
    before = json.loads(cli(daemon, "stats", "--json").stdout)["health"]["memories"]
    assert cli(daemon, "import", str(dump)).returncode == 0
    assert json.loads(cli(daemon, "stats", "--json").stdout)["health"]["memories"] == before
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "no id"}\n')
    assert cli(daemon, "import", str(bad)).returncode == 2


def test_import_into_a_fresh_daemon_keeps_ids_and_timestamps(daemon: DaemonProcess, tmp_path: Path) -> None:
    cli(daemon, "store", "a fact worth keeping", "--meta", "n=1")
    dump = tmp_path / "dump.jsonl"
    cli(daemon, "export", str(dump))
    (tmp_path / "other").mkdir()
    other = DaemonProcess(tmp_path / "other").start()
    try:
        assert cli(other, "import", str(dump)).returncode == 0
        again = tmp_path / "again.jsonl"
        cli(other, "export", str(again))
        assert sorted(dump.read_text().splitlines()) == sorted(again.read_text().splitlines())
    finally:
        other.stop()


def test_backup_keep_verify_restore(daemon: DaemonProcess, tmp_path: Path) -> None:
    folder = tmp_path / "backups"
    folder.mkdir()
    for name in ("memory-20000101T000000Z.rms", "memory-20000102T000000Z.rms"):
        (folder / name).write_bytes(jr.header(jr.SNAPSHOT) + b"old")  # a backup's head, damaged after it
    out = cli(daemon, "backup", str(folder), "--keep", "2", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    kept = sorted(p.name for p in folder.iterdir())
    assert len(kept) == 2 and Path(info["path"]).name in kept and "memory-20000101T000000Z.rms" not in kept
    assert cli(daemon, "verify", info["path"]).returncode == 0
    assert cli(daemon, "verify", str(folder / "memory-20000102T000000Z.rms")).returncode == 5  # junk file
    # restore refuses the live store, works into a new directory
    assert cli(daemon, "restore", info["path"]).returncode == 4
    target = tmp_path / "restored"
    out = cli(daemon, "restore", info["path"], "--data-dir", str(target))
    assert out.returncode == 0, out.stderr
    assert cli(daemon, "verify", str(target)).returncode == 0


def _backup_file(path: Path) -> Path:
    path.write_bytes(jr.header(jr.SNAPSHOT) + b"...")  # prune reads names and heads only
    return path


@pytest.mark.parametrize(("name", "content"), [
    ("memory-notes.rms", jr.header(jr.SNAPSHOT)),  # a user's file named like ours, but not by the clock
    ("memory-20000101T000000Z.rms", b"my own notes"),  # our name, not a backup (glob 'memory-*.rms' took both)
    ("memory-20000101T000000Z.rms.txt", jr.header(jr.SNAPSHOT)),  # our name with more after it
    ("Memory-20000101T000000Z.rms", jr.header(jr.SNAPSHOT)),  # another case
], ids=["similar-name", "our-name-not-a-backup", "suffix", "case"])
def test_prune_deletes_only_our_timestamped_backups(tmp_path: Path, name: str, content: bytes) -> None:
    (tmp_path / name).write_bytes(content)
    old = _backup_file(tmp_path / "memory-20010101T000000Z.rms")
    new = _backup_file(tmp_path / "memory-20020101T000000Z.rms")
    assert bk.prune(tmp_path, 1, written=new) == [str(old)]
    assert (tmp_path / name).read_bytes() == content and new.exists()


def test_prune_keeps_the_backup_just_written_whatever_the_clock_said(tmp_path: Path) -> None:
    later = [_backup_file(tmp_path / f"memory-2026110{i}T000000Z.rms") for i in range(1, 4)]
    # a robot without a real-time clock, booted before its time was set: the new backup sorts first
    written = _backup_file(tmp_path / "memory-19700101T000012Z.rms")
    assert bk.prune(tmp_path, 2, written=written) == [str(p) for p in later[:2]]
    assert sorted(tmp_path.iterdir()) == [written, later[2]]
    assert bk.prune(tmp_path, 1, written=written) == [str(later[2])]


def test_prune_keeps_n_when_the_backup_just_written_is_not_in_the_listing(tmp_path: Path) -> None:
    # a daemon reached over tcp:// (or in another mount namespace) wrote it where this side
    # cannot see it: --keep 1 deleted every backup here
    here = [_backup_file(tmp_path / f"memory-2026110{i}T000000Z.rms") for i in range(1, 4)]
    elsewhere = tmp_path / "other-machine" / "memory-20261104T000000Z.rms"
    assert bk.prune(tmp_path, 1, written=elsewhere) == [str(p) for p in here[:2]]
    assert sorted(tmp_path.glob("memory-*.rms")) == [here[2]]


def test_prune_removes_the_temp_files_of_backups_whose_writer_died(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()
    left = tmp_path / f".memory-20000101T000000Z.rms.tmp-{dead}-1"  # a daemon killed mid-backup
    writing = tmp_path / f".memory-20000101T000000Z.rms.tmp-{os.getpid()}-1"  # a backup being written
    other = tmp_path / f".notes.tmp-{dead}-1"  # not a backup's temp file
    for path in (left, writing, other):
        path.write_bytes(b"part of a backup")
    written = _backup_file(tmp_path / "memory-20010101T000000Z.rms")
    assert bk.prune(tmp_path, 1, written=written) == [str(left)]
    assert writing.exists() and other.exists() and written.exists()


def _on_a_terminal(d: DaemonProcess, *argv: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """``reachy-memory ARGV`` with its stderr on a pseudo-terminal: (result, what it wrote there)."""
    master, slave = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REACHY_MEMORY_ENDPOINT", None)
    proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", *argv, "--config", str(d.config_path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once the child closed its end
        while chunk := os.read(master, 4096):
            seen += chunk
    os.close(master)
    out, _ = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), ""), seen.decode(errors="replace")


def test_a_backup_on_a_terminal_shows_its_progress(tmp_path: Path) -> None:
    """A long job shows progress: on a terminal, the bytes the daemon has written so
    far (from its health) until the backup's reply; piped, nothing but the result."""
    d = words_only_daemon(tmp_path, 30_000).start()
    try:
        shown, progress = _on_a_terminal(d, "backup", str(tmp_path / "b.rms"))
        piped = cli(d, "backup", str(tmp_path / "c.rms"))
    finally:
        assert d.stop() == 0
    assert shown.returncode == 0 and "backup of 30000 memories written" in shown.stdout
    assert "writing the backup: " in progress and " MB, " in progress
    assert piped.returncode == 0 and piped.stderr == ""


class _FakeClient:
    """What ``reachy-memory backup`` sees of a daemon, in process: the backup is answered
    ``outcome`` once every health answer in ``healths`` was given (a ReachyMemoryError or
    KeyboardInterrupt in either is raised; None: never answered); closed, a call in
    flight raises ClosedError."""

    def __init__(self, healths: list[Any], outcome: Any) -> None:
        self.healths, self.outcome, self.closed, self.ended = healths, outcome, threading.Event(), threading.Event()

    def __enter__(self) -> _FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed.set()

    def backup(self, path: str, force: bool, timeout: float) -> Any:
        try:
            while (self.healths or self.outcome is None) and not self.closed.wait(0.01):
                pass
            if self.closed.is_set():
                raise ClosedError("MemoryClient closed during the call")
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        finally:
            self.ended.set()

    def health(self, timeout: float) -> Any:
        answer = self.healths.pop(0) if self.healths else {"backup_running": None}
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _backup_on_a_fake_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                               healths: list[Any], outcome: Any, tty: bool = True) -> tuple[int, str, str, _FakeClient]:
    """``reachy-memory backup DEST`` in process against fake clients, stderr a terminal or
    not: (exit code, stdout, stderr, the client that took the backup)."""
    from reachy_memory import cli

    clients = [_FakeClient(healths, outcome), _FakeClient(healths, outcome)]  # the backup's, the watcher's
    made = iter(clients)
    monkeypatch.setattr(cli, "_client", lambda args: next(made))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    code = cli.main(["backup", str(tmp_path / "b.rms"), "--data-dir", str(tmp_path / "data")])
    out, err = capsys.readouterr()
    return code, out, err, clients[0]


def _screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text`` (a carriage return overwrites from the line's start)."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return lines


WRITTEN = {"path": "", "bytes": 7_000_000, "memories": 30_000}


@pytest.mark.timeout(30)
def test_a_backup_on_a_terminal_shows_what_a_daemon_of_an_earlier_version_tells(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A daemon started before the upgrade (its health has no 'bytes': ``pip install -U``,
    daemon not restarted yet) or a malformed answer: the seconds are shown, and the backup
    is reported as written (it was a KeyError traceback, exit 1, the backup's own client
    closed under it while the daemon went on writing)."""
    dest = str(tmp_path.resolve() / "b.rms")
    healths = [{"backup_running": {"path": dest, "seconds": 2.2}}, {"backup_running": ["not", "a", "map"]}, []]
    code, out, err, _ = _backup_on_a_fake_terminal(monkeypatch, capsys, tmp_path, healths, WRITTEN | {"path": dest})
    assert code == 0 and "backup of 30000 memories written" in out, err
    assert _screen(err) == ["writing the backup: 2 s", ""]


@pytest.mark.timeout(30)
def test_a_backup_answered_at_once_on_a_terminal_shows_no_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A backup answered before the first health poll (a small store): nothing on stderr,
    not even a blank line."""
    dest = str(tmp_path.resolve() / "b.rms")
    code, out, err, _ = _backup_on_a_fake_terminal(monkeypatch, capsys, tmp_path, [], WRITTEN | {"path": dest})
    assert code == 0 and "backup of 30000 memories written" in out and err == ""


@pytest.mark.timeout(30)
def test_a_backup_waiting_behind_another_does_not_show_the_others_progress_as_its_own(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One backup is written at a time: while ours waits, health shows the other's path and
    bytes, which were shown as ours (45 MB, then back to 0.1 MB, and the shorter line left
    the longer one's last characters on the screen)."""
    dest = str(tmp_path.resolve() / "b.rms")
    healths = [{"backup_running": {"path": "/srv/other.rms", "seconds": 12.0, "bytes": 45_000_000}},
               {"backup_running": {"path": dest, "seconds": 0.4, "bytes": 100_000}}]
    code, out, err, _ = _backup_on_a_fake_terminal(monkeypatch, capsys, tmp_path, healths, WRITTEN | {"path": dest})
    assert code == 0 and "backup of 30000 memories written" in out
    assert "45.0 MB" not in err and "waiting for another backup (12 s so far)" in err
    assert _screen(err) == ["writing the backup: 0.1 MB, 0 s", ""]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("when", ["polling", "writing the line"])
def test_ctrl_c_during_a_backup_on_a_terminal_exits_130_on_a_line_of_its_own(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, when: str) -> None:
    """Ctrl-C while the progress line is shown, waiting for health or as the line is
    written: exit 130 and 'interrupted' on a line of its own, as for any command (it was
    appended to the progress line), and the request on the worker thread ends (its
    client closed), so nothing waits at exit."""
    dest = str(tmp_path.resolve() / "b.rms")
    running = {"backup_running": {"path": dest, "seconds": 1.0, "bytes": 2_000_000}}
    healths: list[Any] = [running, KeyboardInterrupt()] if when == "polling" else [running]
    if when == "writing the line":
        flushes = iter([KeyboardInterrupt()])
        monkeypatch.setattr(sys.stderr, "flush", lambda: next(flushes, None) and _raise(KeyboardInterrupt()))
    code, out, err, taker = _backup_on_a_fake_terminal(monkeypatch, capsys, tmp_path, healths, None)
    assert code == 130 and out == "" and taker.ended.wait(5)
    assert _screen(err) == ["writing the backup: 2.0 MB, 1 s", "interrupted", ""]


def _raise(exc: BaseException) -> None:
    raise exc


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("error", "exit_code"), [
    (ValidationError("backup target is inside the data directory", field="path"), 2),  # bad input
    (RequestTimeoutError("no reply to 'backup' within 120 s"), 4),  # try again later
    (DaemonUnavailableError("no reachy-memory daemon at ipc:///x"), 4),
    # the daemon stopping abandoned it: try again later (it was exit 1, a plain error)
    (ClosedError("the store is closing: the backup was abandoned (nothing written)"), 4),
])
def test_a_failed_backup_is_reported_alike_on_a_terminal_and_piped(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        error: ReachyMemoryError, exit_code: int) -> None:
    """The worker thread hands the backup's error to the main thread: the same exit code
    and message as without a terminal, the progress line ended first."""
    dest = str(tmp_path.resolve() / "b.rms")
    running = {"backup_running": {"path": dest, "seconds": 3.0, "bytes": 1_000_000}}
    shown = _backup_on_a_fake_terminal(monkeypatch, capsys, tmp_path, [running], error)
    piped = _backup_on_a_fake_terminal(monkeypatch, capsys, tmp_path, [], error, tty=False)
    assert shown[0] == piped[0] == exit_code and shown[1] == piped[1] == ""
    assert _screen(shown[2]) == ["writing the backup: 1.0 MB, 3 s", *_screen(piped[2])]


def test_prune_races_another_prune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = tmp_path / "memory-20000101T000000Z.rms"  # listed, then deleted by the other prune first
    newer = _backup_file(tmp_path / "memory-20010101T000000Z.rms")
    monkeypatch.setattr(bk, "_backups_in", lambda _: [gone, newer], raising=False)
    monkeypatch.setattr(Path, "glob", lambda *_: iter([gone, newer]))  # the same listing for the code before
    assert bk.prune(tmp_path, 1) == [str(gone)]  # FileNotFoundError (exit 3) after a backup that worked


def test_backup_keep_needs_a_directory(daemon: DaemonProcess, tmp_path: Path) -> None:
    old = _backup_file(tmp_path / "memory-20000101T000000Z.rms")
    out = cli(daemon, "backup", str(tmp_path / "named.rms"), "--keep", "1")
    assert out.returncode == 2 and "directory" in out.stderr  # it pruned the folder, the named file not counted
    assert old.exists() and not (tmp_path / "named.rms").exists()


def test_verify_repair_keeps_valid_prefix(tmp_path: Path) -> None:
    from reachy_memory import Config, MemoryStore

    data = tmp_path / "data"
    store = MemoryStore(config=Config().replace("memory", path=str(data)), embedder=None)
    for i in range(3):
        store.remember_fact(f"fact {i}")
    store._storage.journal.close()
    store._dir_lock.release()  # a crash: everything is in the journal
    journal = data / "journal.rmj"
    raw = bytearray(journal.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    journal.write_bytes(bytes(raw))
    d = DaemonProcess(tmp_path)
    assert cli(d, "verify", str(data)).returncode == 5
    out = cli(d, "verify", str(data), "--repair")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "moved to" in out.stdout and list(data.glob("journal.rmj.damaged-*"))
    with MemoryStore(config=Config().replace("memory", path=str(data)), embedder=None) as again:
        assert 0 < len(again) < 3


@pytest.mark.parametrize("argv", [
    ["search", "x", "--where", "{bad"],  # was a JSONDecodeError traceback, exit 1
    ["search", "x", "--timeout", "inf"],  # was an OverflowError traceback
    ["search", "x", "--timeout", "nan"],  # silently meant "no timeout"
    ["stats", "--timeout", "-1"],  # a negative wait
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from reachy_memory.cli import main

    try:
        code = main([*argv, "--endpoint", "ipc:///nonexistent/memory.sock"])
    except SystemExit as exc:  # argparse's own refusal
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.strip()


def _cli_options_first(daemon: DaemonProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    """``reachy-memory --config <daemon's config> ARGV``: the common options before the command."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REACHY_MEMORY_ENDPOINT", None)
    return subprocess.run([sys.executable, "-m", "reachy_memory.cli", "--config", str(daemon.config_path), *argv],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("argv", [
    ["--json", "stats"],  # was "invalid choice: '<config path>'", exit 2: --config was a command's option only
    ["stats", "--json"],  # options on both sides of the command
    ["--json", "context", "show"],  # a nested action keeps what came before the command
    ["context", "--json", "show"],
])
def test_common_options_go_before_or_after_the_command(daemon: DaemonProcess, argv: list[str]) -> None:
    out = _cli_options_first(daemon, *argv)
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)  # --json was taken wherever it stood


def test_an_option_after_the_command_overrides_the_one_before(daemon: DaemonProcess) -> None:
    out = _cli_options_first(daemon, "--endpoint", "ipc:///nonexistent/memory.sock", "stats",
                             "--endpoint", daemon.endpoint, "--json")
    assert out.returncode == 0, out.stderr
    out = _cli_options_first(daemon, "--endpoint", "ipc:///nonexistent/memory.sock", "--timeout", "0.5", "stats")
    assert out.returncode != 0 and "nonexistent" in out.stderr  # the option before the command was used


def test_retention_shows_then_applies_the_daemons_ttl_only_with_consent(tmp_path: Path) -> None:
    """`retention` previews; `--apply` refuses while it would delete turns unless
    `--yes`; then the stored turns carry the daemon's TTL (7 days, not the 30 they
    were written with) and the old one is gone."""
    daemon = DaemonProcess(tmp_path, memory={"conversation_ttl_days": 7})
    now = time.time()
    with MemoryStore(config=daemon.config.replace("memory", conversation_ttl_days=30), embedder=None) as s:
        old, recent = s.store_batch([
            {"content": "we flew a kite", "memory_type": "conversation", "created_at": now - 20 * 86400},
            {"content": "we watched trains", "memory_type": "conversation", "created_at": now - 2 * 86400}])
    with daemon:
        shown = cli(daemon, "retention")
        assert shown.returncode == 0, shown.stderr
        assert "of the 2 stored conversation turns, 2 would expire earlier, 0 later, 1 at once" in shown.stdout
        refused = cli(daemon, "retention", "--apply")
        assert refused.returncode == 2 and "run again with --yes" in refused.stderr, refused.stderr
        assert cli(daemon, "retention", "--yes").returncode == 2  # --yes alone is a usage error
        assert cli(daemon, "get", old.id).returncode == 0  # refused: nothing changed
        done = cli(daemon, "retention", "--apply", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert (result["conversation_days"], result["applied"], result["expire_now"]) == (7, True, 1)
        assert cli(daemon, "get", old.id).returncode == 3
        kept = json.loads(cli(daemon, "get", recent.id, "--json").stdout)
        assert kept["expires_at"] == (recent.created_at + timedelta(days=7)).isoformat()
        assert "already in force for the 1 stored conversation turn\n" in cli(daemon, "retention").stdout


def test_import_reads_what_export_wrote_and_refuses_a_bad_file_whole(daemon: DaemonProcess, tmp_path: Path) -> None:
    """U+2028 in a text split the line at import (splitlines); a bad line, an id given twice
    or bytes that are not UTF-8 are errors naming the file and line, with nothing imported."""
    cli(daemon, "store", "line one\u2028line two\u0085three", "--type", "conversation")
    dump = tmp_path / "dump.jsonl"
    assert cli(daemon, "export", str(dump)).returncode == 0
    done = cli(daemon, "import", str(dump))
    assert done.returncode == 0, done.stderr
    before = json.loads(cli(daemon, "stats", "--json").stdout)["health"]["memories"]
    good = json.dumps({"id": "new-1", "content": "a new fact", "type": "fact",
                       "created_at": "2026-01-02T00:00:00+00:00"})
    for name, lines, says in [
        ("late.jsonl", [good] * 2 + [good.replace("2026-01-02", "2026-02-30")], "late.jsonl line 3"),  # bad date
        ("twice.jsonl", [good, good.replace("a new fact", "another")], "also on line 1"),  # one id, two texts
        ("loop.jsonl", [good.replace('"type"', '"superseded_by": "new-2", "type"'),  # new-1 -> new-2 -> new-1
                        good.replace("new-1", "new-2").replace('"type"', '"superseded_by": "new-1", "type"')],
         "loop.jsonl: superseded_by links loop"),
    ]:
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        out = cli(daemon, "import", str(tmp_path / name))
        assert out.returncode == 2 and says in out.stderr, out.stderr
    (tmp_path / "latin1.jsonl").write_bytes(good.replace("a new fact", "caf\xe9").encode("latin-1"))
    assert "not UTF-8" in cli(daemon, "import", str(tmp_path / "latin1.jsonl")).stderr
    assert json.loads(cli(daemon, "stats", "--json").stdout)["health"]["memories"] == before


@pytest.mark.parametrize("fmt", ["jsonl", "markdown"])
def test_export_from_a_daemon_older_than_merge_redirects_warns_and_exports(
        daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    """A daemon still running the previous version after an upgrade answers "unknown op"
    to person_redirects: the export failed whole (exit 2); it now exports without them."""
    from reachy_memory import cli as cli_module

    with MemoryClient(endpoint=daemon.endpoint, timeout=10) as c:
        kept = c.store("exported from an older daemon").id

    def older(self: MemoryClient, **_: Any) -> Any:
        raise ValidationError("unknown op 'person_redirects'")

    monkeypatch.setattr(MemoryClient, "person_redirects", older)
    dest = tmp_path / ("out.jsonl" if fmt == "jsonl" else "md")
    code = cli_module.main(["export", str(dest), "--format", fmt, "--endpoint", daemon.endpoint])
    err = capsys.readouterr().err
    assert code == 0 and "daemon is older" in err, err
    written = dest.read_text() if fmt == "jsonl" else "".join(p.read_text() for p in dest.rglob("*.md"))
    assert kept in written


def test_a_failed_export_leaves_the_earlier_file(daemon: DaemonProcess, tmp_path: Path) -> None:
    earlier = tmp_path / "prev.jsonl"
    earlier.write_text('{"kept": true}\n')
    out = cli(daemon, "export", str(earlier), "--endpoint", "ipc:///nonexistent/dir/sock", "--timeout", "0.5")
    assert out.returncode == 4 and earlier.read_text() == '{"kept": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["prev.jsonl"]  # no partial file left behind


def test_import_fits_the_daemons_message_and_batch_limits(tmp_path: Path) -> None:
    """Requests were cut at 200 memories whatever their size or memory.max_batch: 25 long
    notes made one request over server.max_message_bytes (too_large), and max_batch 10
    refused it, after the persons were written."""
    daemon = DaemonProcess(tmp_path, server={"max_message_bytes": 65536}, memory={"max_batch": 10})
    rows = [{"kind": "person", "id": "p1", "name": "Ann", "created_at": "2026-01-01T00:00:00+00:00"}]
    rows += [{"id": f"n{i}", "content": f"note {i} " + "lorem ipsum " * 400, "type": "fact",
              "created_at": f"2026-01-01T00:{i:02d}:00+00:00", "subjects": ["p1"]} for i in range(25)]
    dump = tmp_path / "big.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with daemon:
        out = cli(daemon, "import", str(dump))
        assert out.returncode == 0, out.stderr
        assert "imported 1 people and 25 memories" in out.stderr


def test_import_leaves_out_and_names_the_links_to_a_person_the_memorys_owner_does_not_see(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    """An export of a store written before a memory's persons had to be ones its owner sees
    (an unscoped fact about Alice's person): imported, without that link, named on a line
    of its own; the same import again changes nothing and leaves nothing out."""
    at = "2026-01-01T00:00:00+00:00"
    rows = [{"kind": "person", "id": "lo-p1", "name": "Lou", "owner": "alice", "created_at": at},
            {"kind": "person", "id": "lo-p2", "name": "Mo", "created_at": at},
            {"id": "lo-m1", "content": "Lou and Mo play chess", "type": "fact", "created_at": at,
             "subjects": ["lo-p1", "lo-p2"]},
            {"id": "lo-m2", "content": "Lou likes jazz", "type": "fact", "created_at": at, "subjects": ["lo-p1"],
             "owner": "alice"}]
    dump = tmp_path / "older.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = cli(daemon, "import", str(dump))
    assert out.returncode == 0, out.stderr
    assert ("1 link to a person their memory's owner does not see was left out (memory -> person): "
            "lo-m1 -> lo-p1\n") in out.stderr
    assert "imported 2 people and 2 memories" in out.stderr
    with daemon.client() as c:
        assert (c.get("lo-m1").subjects, c.get("lo-m2").subjects) == (("lo-p2",), ("lo-p1",))
    again = cli(daemon, "import", str(dump))
    assert again.returncode == 0 and "left out" not in again.stderr, again.stderr
    assert "imported 0 people and 0 memories" in again.stderr


def test_export_writes_through_a_symlink_and_keeps_a_private_mode(daemon: DaemonProcess, tmp_path: Path) -> None:
    """The temp-and-rename replaced a symlink (as root, /dev/stdout itself) and left 0644."""
    real = tmp_path / "real.jsonl"
    real.write_text("")
    (tmp_path / "link.jsonl").symlink_to(real)
    assert cli(daemon, "export", str(tmp_path / "link.jsonl")).returncode == 0
    assert (tmp_path / "link.jsonl").is_symlink() and real.read_text().count("\n") >= 1
    assert cli(daemon, "export", str(tmp_path / "new.jsonl")).returncode == 0
    assert (tmp_path / "new.jsonl").stat().st_mode & 0o777 == 0o600
    real.chmod(0o640)
    assert cli(daemon, "export", str(real)).returncode == 0 and real.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(("name", "text", "says"), [
    ("ids.jsonl", '{"id": "", "content": "x", "type": "fact", "created_at": "2026-01-01T00:00:00+00:00"}\n',
     "ids.jsonl line 1: id"),  # an empty id: refused by the daemon only, after earlier requests
    ("deep.jsonl", '{"id": "d", "metadata": ' + "[" * 100000 + "]" * 100000 + "}\n",
     "deep.jsonl line 1: not JSON"),  # RecursionError was a traceback
])
def test_import_refuses_what_only_the_daemon_refused(daemon: DaemonProcess, tmp_path: Path, name: str, text: str,
                                                     says: str) -> None:
    (tmp_path / name).write_text(text, encoding="utf-8")
    out = cli(daemon, "import", str(tmp_path / name))
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_markdown_folder_over_the_stores_limits_imports_nothing(daemon: DaemonProcess, tmp_path: Path) -> None:
    folder = tmp_path / "md"
    folder.mkdir()
    (folder / "world.md").write_text("# World\n\n- the kettle is in the kitchen\n- " + "long " * 4000 + "\n",
                                     encoding="utf-8")
    before = json.loads(cli(daemon, "stats", "--json").stdout)["health"]["memories"]
    out = cli(daemon, "import", str(folder))
    assert out.returncode == 2 and "content is" in out.stderr, out.stderr
    assert json.loads(cli(daemon, "stats", "--json").stdout)["health"]["memories"] == before


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REACHY_MEMORY_ENDPOINT"}
    return subprocess.run([sys.executable, "-m", "reachy_memory.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


@pytest.mark.parametrize(("kind", "says"), BAD_DATA_DIRS)
def test_serve_on_a_data_dir_it_cannot_use_is_a_configuration_error(tmp_path: Path, kind: str, says: str) -> None:
    with bad_data_dir(kind, tmp_path) as path:
        out = _run("serve", "--data-dir", str(path), "--endpoint", f"ipc://{tmp_path}/memory.sock")
    assert out.returncode == 2, out.stderr  # as ConfigError always is; was 1, an "error"
    assert re.search(f"error: data directory .* cannot be used: .*({says})", out.stderr), out.stderr
    assert "Traceback" not in out.stderr


def test_data_dir_naming_another_store_than_the_daemons_is_refused(daemon: DaemonProcess, tmp_path: Path) -> None:
    """With $XDG_RUNTIME_DIR the default endpoint does not depend on --data-dir: a command
    meant for a scratch store was silently served by the robot's daemon."""
    out = cli(daemon, "store", "meant for the scratch store", "--data-dir", str(tmp_path / "scratch"))
    assert out.returncode == 2 and "serves" in out.stderr, out.stderr
    assert not (tmp_path / "scratch").exists()
    assert cli(daemon, "stats", "--data-dir", str(daemon.data)).returncode == 0  # its own store: fine


def test_no_daemon_is_said_at_once_with_how_to_start_one(tmp_path: Path) -> None:
    """It waited the whole --timeout, then said only 'no reply'."""
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()  # the file stays, nobody accepts: a daemon killed with -9
    for endpoint, says in [(f"ipc://{tmp_path}/none.sock", "no socket there"), (f"ipc://{stale}", "stopped")]:
        out = _run("stats", "--endpoint", endpoint, "--timeout", "600", "--json", timeout=30)
        assert out.returncode == 4 and says in out.stderr and "reachy-memory serve" in out.stderr, out.stderr
        assert json.loads(out.stdout)["error"]["exit_code"] == 4  # --json: the error as JSON too
    # the way to start the daemon the command looked for: a bare `serve` served another endpoint and store
    out = _run("store", "x", "--endpoint", f"ipc://{tmp_path}/none.sock", "--data-dir", str(tmp_path / "my data"))
    assert f"`reachy-memory serve --data-dir '{tmp_path}/my data' --endpoint ipc://{tmp_path}/none.sock`" \
        in out.stderr, out.stderr


def test_serve_never_deletes_a_file_at_its_endpoint(tmp_path: Path) -> None:
    """It unlinked whatever was there (an endpoint mistyped onto the journal lost the store)."""
    precious = tmp_path / "journal.rmj"
    precious.write_text("acknowledged writes")
    out = _run("serve", "--data-dir", str(tmp_path / "data"), "--endpoint", f"ipc://{precious}")
    assert out.returncode == 2 and "not a socket" in out.stderr, out.stderr
    assert precious.read_text() == "acknowledged writes"


@pytest.mark.parametrize(("argv", "code", "says"), [
    (["serve", "--log-level", "verbose"], 2, "invalid choice"),  # was a ValueError traceback
    (["serve", "--endpoint", "ipc://"], 2, "needs a socket path"),  # was a ValueError traceback
    (["import", "/nonexistent/dump.jsonl"], 3, "No such file"),  # was exit 1
    (["restore", "/nonexistent/backup.rms"], 3, "No such file"),  # was exit 1, "does not verify"
    (["reindex"], 3, "no data directory"),  # a mistyped --data-dir: made an empty store, "re-embedded 0", exit 0
])
def test_first_run_mistakes_get_an_error_not_a_traceback(tmp_path: Path, argv: list[str], code: int,
                                                         says: str) -> None:
    out = _run(*argv, "--data-dir", str(tmp_path / "data"), "--timeout", "2")
    assert out.returncode == code and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_options_before_a_context_action_are_kept(daemon: DaemonProcess) -> None:
    """The action's own copy of the options reset them: --json before 'get' printed plain text."""
    cli(daemon, "context", "set", "task", "tidy up")
    out = cli(daemon, "context", "--json", "get", "task")
    assert json.loads(out.stdout) == {"key": "task", "value": "tidy up"}


def test_a_daemon_on_a_relative_data_dir_is_recognised_from_elsewhere(tmp_path: Path) -> None:
    """health gave the daemon's relative path, compared from the CLI's own directory:
    the right store was refused, and a different one named the same way accepted."""
    (tmp_path / "robot").mkdir()
    daemon = DaemonProcess(tmp_path / "robot", memory={"path": "data"})  # relative to the daemon's directory
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("REACHY_MEMORY_ENDPOINT", None)
    daemon.proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "serve", "--config",
                                    str(daemon.config_path)], cwd=tmp_path / "robot", env=env,
                                   stdout=subprocess.DEVNULL, stderr=open(daemon.log, "a"))  # noqa: SIM115
    try:
        daemon.wait_ready()
        right = _run("stats", "--endpoint", daemon.endpoint, "--data-dir", str(tmp_path / "robot" / "data"))
        other = _run("stats", "--endpoint", daemon.endpoint, "--data-dir", str(tmp_path / "data"))
        assert right.returncode == 0, right.stderr
        assert other.returncode == 2 and "serves" in other.stderr
    finally:
        daemon.stop()


def test_model_info_says_what_the_running_daemon_does_without_a_model(daemon: DaemonProcess,
                                                                      tmp_path: Path) -> None:
    ready = cli(daemon, "model", "info")
    assert ready.returncode == 0 and "running daemon" not in ready.stderr  # this daemon has its model
    with DaemonProcess(tmp_path, embedding={"enabled": False}) as lexical:
        out = cli(lexical, "model", "info")
        assert out.returncode == 0, out.stderr
        assert "embedding turned off" in out.stderr


@pytest.mark.parametrize("command", [
    "backup",  # waited at least 120 s whatever --timeout said
    "import",  # ...and at least 60 s per request
])
def test_backup_and_import_wait_no_longer_than_timeout_says(tmp_path: Path, command: str) -> None:
    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps({"id": "m1", "content": "a note", "type": "fact",
                               "created_at": "2026-01-02T00:00:00+00:00"}) + "\n")
    target = {"backup": str(tmp_path / "b.rms"), "import": str(data)}[command]
    with DaemonProcess(tmp_path) as frozen:
        assert frozen.proc is not None
        frozen.proc.send_signal(signal.SIGSTOP)  # the socket accepts, nobody answers
        try:
            started = time.monotonic()
            out = _run(command, target, "--config", str(frozen.config_path), "--timeout", "1", timeout=50)
            took = time.monotonic() - started
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
    assert out.returncode == 4 and "no reply" in out.stderr, out.stderr
    assert took < 40, took


def test_importing_an_obsidian_vault_names_the_front_matter_keys_it_left_out(daemon: DaemonProcess,
                                                                             tmp_path: Path) -> None:
    """Any front matter key not ours refused the whole folder; now the notes import and
    the keys left out are named, file by file."""
    from tests.test_markdown import OBSIDIAN

    for rel, text in OBSIDIAN.items():
        (tmp_path / "vault" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "vault" / rel).write_text(text, encoding="utf-8")
    done = cli(daemon, "import", str(tmp_path / "vault"))
    assert done.returncode == 0, done.stderr
    assert "notes/Wifi.md: front matter keys ignored (no field of ours): tags, cssclasses, created\n" in done.stderr
    assert "world.md: front matter keys ignored (no field of ours): up\n" in done.stderr
    assert "imported 1 people and 5 memories" in done.stderr
    with daemon.client() as c:
        note = c.note("router")  # Obsidian's alias is the note's alias
    assert note is not None and note.name == "Wifi" and note.content.startswith("The password is on the fridge")


def test_stats_counts_leave_out_expired_unswept_memories(tmp_path: Path) -> None:
    """``health``/``stats`` and ``reachy-memory stats`` counted an expired memory (hidden
    from every reader) until the hourly sweep; they now say how many the sweep deletes."""
    with words_only_daemon(tmp_path, 0) as daemon, daemon.client() as c:
        c.store("the robot's name is Reachy")
        c.store_batch([{"content": "hello robot", "memory_type": "conversation",
                        "created_at": time.time() - 60 * 86400}])  # past the 30-day TTL at once
        assert c.health()["memories"] == 1
        store = c.stats()["store"]
        assert store["memories"] == 1 and store["by_type"] == {"conversation": 0, "fact": 1, "context": 0}
        assert store["expired_unswept"] == 1
        text = cli(daemon, "stats").stdout
        assert "memories 1 " in text and "deleted by the next cleanup: 1" in text, text
        assert c.cleanup_expired() == 1 and c.stats()["store"]["expired_unswept"] == 0


@pytest.mark.parametrize(("count", "named", "more"), [
    (1, 1, ""),  # one link: named, singular
    (20, 20, ""),  # as many as are named: all of them
    (25, 20, ", and 5 more"),  # an older store's big import: the line stays readable
])
def test_the_links_an_import_left_out_are_named_on_one_bounded_line(
        capsys: pytest.CaptureFixture[str], count: int, named: int, more: str) -> None:
    from reachy_memory.cli import _say_links_left_out

    _say_links_left_out([{"memory_id": f"m{i}", "person_id": "P9"} for i in range(count)])
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.count(" -> P9") == named
    assert line.rstrip().endswith(f"m{named - 1} -> P9{more}")
