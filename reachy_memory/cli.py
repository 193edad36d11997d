"""``reachy-memory``: the command line. It parses, calls the library or the
daemon, and formats; the logic lives in the modules it calls.

Exit codes: 0 success, 1 error, 2 bad usage or input, 3 not found,
4 daemon unreachable, timed out or the store in use by a daemon, 5 verify
found problems.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeGuard

from reachy_memory.client import MemoryClient
from reachy_memory.config import Config, load_config
from reachy_memory.daemon.endpoint import ipc_listener_gone
from reachy_memory.errors import (
    ClosedError,
    ConfigError,
    DaemonUnavailableError,
    NotFoundError,
    ReachyMemoryError,
    RequestTimeoutError,
    ServiceError,
    StoreLockedError,
    ValidationError,
)
from reachy_memory.model import SEARCH_LIMIT, SEARCH_MIN_SCORE, Memory, SearchResult
from reachy_memory.storage import backup as bk

EXIT = {ValidationError: 2, ConfigError: 2, NotFoundError: 3, RequestTimeoutError: 4, ServiceError: 4,
        StoreLockedError: 4, ClosedError: 4}  # ClosedError: the daemon stopping abandoned the request
DEFAULT_TIMEOUT = 10.0  # seconds a command waits for the daemon's reply, unless --timeout says
SLOW_TIMEOUTS = {"backup": 120.0, "import": 60.0, "dedupe": 120.0}  # ...for one request of these, unless --timeout says


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    # --timeout given or not: backup and import wait longer by default, never longer than asked
    args.timeout_given = getattr(args, "timeout", None) is not None
    if not args.timeout_given:
        args.timeout = DEFAULT_TIMEOUT
    try:
        return int(args.func(args) or 0)
    except ReachyMemoryError as exc:
        code = next((c for cls, c in EXIT.items() if isinstance(exc, cls)), 1)
        return _fail(args, type(exc).__name__, str(exc), code)
    except FileNotFoundError as exc:
        return _fail(args, "NotFoundError", f"{exc.strerror}: {exc.filename or ''}", 3)
    except OSError as exc:
        return _fail(args, type(exc).__name__, f"{exc.strerror or exc}: {exc.filename or ''}", 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _slow_timeout(args: argparse.Namespace, command: str) -> float:
    """The wait for one request of a long command: ``--timeout`` when given, else the
    command's own default (a backup of 100k memories takes minutes on an SD card)."""
    return float(args.timeout) if args.timeout_given else SLOW_TIMEOUTS[command]


def _fail(args: argparse.Namespace, kind: str, message: str, code: int) -> int:
    """Say why a command failed (with --json also as a JSON document on stdout); the exit code."""
    print(f"error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": {"type": kind, "message": message, "exit_code": code}}))
    return code


# -- plumbing ------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> Config:
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "data_dir", None):
        overrides["memory"] = {"path": str(args.data_dir)}
    return load_config(args.config, **overrides)


def _client(args: argparse.Namespace) -> MemoryClient:
    """A client of the daemon the command means: refused at once when no daemon listens
    on the ipc endpoint (instead of after --timeout), and when --data-dir names another
    store than the daemon's (with $XDG_RUNTIME_DIR the endpoint does not depend on it)."""
    config = _config(args)
    # --endpoint is passed explicitly so it beats $REACHY_MEMORY_ENDPOINT (flag > env > file > default)
    client = MemoryClient(args.endpoint, config=config, timeout=args.timeout)
    try:
        gone = ipc_listener_gone(client.endpoint)
        if gone is not None:
            raise DaemonUnavailableError(f"no reachy-memory daemon at {client.endpoint} ({gone}): start it with "
                                         f"`{_serve_command(args)}` (on the robot: sudo systemctl start "
                                         "reachy-memory)", endpoint=client.endpoint)
        if getattr(args, "data_dir", None):
            _check_serves(client, config.data_dir)
    except BaseException:
        client.close()
        raise
    return client


def _serve_command(args: argparse.Namespace) -> str:
    """The ``serve`` command for the daemon this command looked for: with the --config,
    --data-dir and --endpoint it was given (a bare ``serve`` would serve elsewhere)."""
    given = [(f"--{name.replace('_', '-')}", getattr(args, name, None)) for name in ("config", "data_dir", "endpoint")]
    return " ".join(["reachy-memory serve", *(f"{flag} {shlex.quote(str(value))}" for flag, value in given if value)])


def _check_serves(client: MemoryClient, data_dir: Path) -> None:
    served = client.health().get("data_dir")
    if served is not None and Path(served).resolve() != data_dir.expanduser().resolve():
        raise ConfigError(f"the daemon at {client.endpoint} serves {served}, not {data_dir}: pass the endpoint of "
                          f"the daemon that serves it, or start one (reachy-memory serve --data-dir {data_dir} "
                          "--endpoint ipc:///some/path.sock)", key="data_dir")


def _seconds(text: str) -> float:
    """argparse type: a finite, positive number of seconds (argparse turns the error into exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < 86_400:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be between 0 and 86400 seconds, got {text!r}")
    return value


def _minutes(text: str) -> float:
    """argparse type: a number of minutes above 0 and at most a week."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of minutes: {text!r}") from None
    if not 0 < value <= 7 * 24 * 60:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {7 * 24 * 60} minutes (a week), got {text!r}")
    return value


def _json_arg(text: str, option: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"{option} is not valid JSON ({exc.msg} at character {exc.pos})", field=option) from exc


def _out(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False, default=str) if args.json else human(data))


def _progress(label: str) -> Callable[[int, int], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\r{label}: {done}/{total} ({100 * done // max(total, 1)}%)", end=end, file=sys.stderr, flush=True)

    return show


def _memory_line(m: Memory) -> str:
    meta = f"  {json.dumps(m.metadata, ensure_ascii=False)}" if m.metadata else ""
    return f"{m.id}  [{m.memory_type.value}]  {m.created_at:%Y-%m-%d %H:%M}  {m.content}{meta}"


def _stdin_text(max_chars: int) -> str:
    """The text piped in (``store -``), one final newline dropped.  Reads at most what
    the daemon would accept (4 bytes a character) plus one: a larger input is
    refused before it is all read.  Raises ValidationError for text that is not UTF-8
    or too long."""
    raw = sys.stdin.buffer.read(4 * max_chars + 3)  # the longest text allowed, and a \r\n after it
    too_long = ValidationError(f"standard input holds more than memory.max_content_chars ({max_chars}) characters",
                               field="content")
    if len(raw) > 4 * max_chars + 2:
        raise too_long  # before decoding: a cut may fall inside a character
    try:
        text = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"standard input is not UTF-8 text ({exc.reason} at byte {exc.start})",
                              field="content") from exc
    if len(text) > max_chars:
        raise too_long
    return text


def _metadata(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValidationError(f"--meta takes key=value, got {pair!r}", field="metadata")
        try:
            out[key] = json.loads(value)  # numbers, booleans, lists
        except json.JSONDecodeError:
            out[key] = value
    return out


# -- commands ------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from reachy_memory.daemon.server import serve
    from reachy_memory.daemon.systemd import setup_logging

    config = _config(args)
    setup_logging(args.log_level or config.server.log_level)
    serve(config, args.endpoint, insecure_tcp=args.insecure_tcp)
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    content = _stdin_text(_config(args).memory.max_content_chars) if args.content == "-" else args.content
    with _client(args) as c:
        m = c.store(content, args.type, _metadata(args.meta), id=args.id, owner=args.owner, shared=args.shared)
    _out(args, m.to_dict(), lambda d: f"stored {d['id']}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    where = _json_arg(args.where, "--where") if args.where else None
    with _client(args) as c:
        hits: list[SearchResult] = c.search(args.query, args.type, args.limit, args.min_score, where, mode=args.mode)
    _out(args, [{"score": h.score, **h.memory.to_dict()} for h in hits],
         lambda _: "\n".join(f"{h.score:.3f}  {_memory_line(h.memory)}" for h in hits) or "no match")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with _client(args) as c:
        m = c.get(args.id)
    if m is None:
        raise NotFoundError(f"no memory {args.id!r}", memory_id=args.id)
    _out(args, m.to_dict(), lambda _: _memory_line(m))
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    with _client(args) as c:
        deleted = c.forget(args.id)
        backups = [b["path"] for b in c.forgotten_in_backups([args.id])] if deleted else []
    if not deleted:
        raise NotFoundError(f"no memory {args.id!r}", memory_id=args.id)
    _out(args, {"deleted": True, "id": args.id, "backups": backups}, lambda _: _forgot_line(args.id, backups))
    return 0


def _forgot_line(memory_id: str, backups: list[str]) -> str:
    """What ``forget`` prints: done, and the backups made before that still hold it."""
    if not backups:
        return f"forgot {memory_id}"
    return (f"forgot {memory_id}; still held by {len(backups)} backup(s) made before: {', '.join(backups)} "
            "(run 'reachy-memory backup --purge-forgotten' to rewrite them)")


def cmd_cleanup(args: argparse.Namespace) -> int:
    with _client(args) as c:
        n = c.cleanup_expired()
    _out(args, {"deleted": n}, lambda _: f"deleted {n} expired memories")
    return 0


def cmd_retention(args: argparse.Namespace) -> int:
    if args.yes and not args.apply:
        raise ValidationError("--yes goes with --apply", field="yes")
    with _client(args) as c:  # without --yes the daemon refuses, changing nothing, if turns would go now
        try:
            result = c.apply_retention(dry_run=not args.apply, max_deletions=None if args.yes else 0)
        except ValidationError as exc:
            if exc.fields.get("field") != "max_deletions":
                raise
            raise ValidationError(f"{exc.message}; nothing changed: run again with --yes to apply",
                                  field="yes") from exc
    _out(args, result, lambda p: _retention_text(p, applying=args.apply))
    return 0


def _retention_text(p: dict[str, Any], *, applying: bool) -> str:
    turns = f"{p['turns']} stored conversation turn{'' if p['turns'] == 1 else 's'}"
    if not (p["earlier"] or p["later"]):
        return f"memory.conversation_ttl_days {p['conversation_days']:g} is already in force for the {turns}" + (
            f"; {p['deleted']} expired memories deleted" if applying else "")
    verb = "now expire" if applying else "would expire"
    text = (f"memory.conversation_ttl_days {p['conversation_days']:g}: of the {turns}, "
            f"{p['earlier']} {verb} earlier, {p['later']} later, {p['expire_now']} at once")
    return f"{text}; {p['deleted']} expired memories deleted" if applying else f"{text}; add --apply to apply"


def cmd_dedupe(args: argparse.Namespace) -> int:
    with _client(args) as c:
        result = c.dedupe(dry_run=args.dry_run, timeout=_slow_timeout(args, "dedupe"))
    _out(args, result, _dedupe_text)
    return 0


def _dedupe_text(r: dict[str, Any]) -> str:
    verb = "would merge" if r["dry_run"] else "merged"
    lines = [f"{verb} {r['merged']} cop{'y' if r['merged'] == 1 else 'ies'} into {r['kept']} "
             f"memor{'y' if r['kept'] == 1 else 'ies'}" + ("; run without --dry-run to merge" if r["dry_run"]
                                                           and r["merged"] else "")]
    for m in r["merges"]:
        lines.append(f"{m['kept']}  {m['content']}")
        lines += [f"  - {c['id']}  {c['content']}  ({c['reason']})" for c in m["copies"]]
        if m["copies_count"] > len(m["copies"]):
            lines.append(f"  ... and {m['copies_count'] - len(m['copies'])} more")
    if len(r["merges"]) < r["kept"]:
        lines.append(f"(the first {len(r['merges'])} of {r['kept']} shown)")
    return "\n".join(lines)


def cmd_context(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.action == "add":
            c.add_to_context_window(args.role, args.content)
        elif args.action == "clear":
            c.clear_context_window()
        elif args.action == "set":  # says what it set (the window it printed was "(empty)": it looked ignored)
            c.set_context(args.key, args.value)
            _out(args, {"key": args.key, "value": args.value}, lambda d: f"{d['key']} set to {d['value']}")
            return 0
        elif args.action == "get":
            value = c.get_context(args.key)
            _out(args, {"key": args.key, "value": value}, lambda _: value if value is not None else "(not set)")
            return 0 if value is not None else 3
        window = c.get_context_window()
    _out(args, window, lambda w: "\n".join(f"{m['role']}: {m['content']}" for m in w) or "(empty)")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        data = {"health": c.health(), "stats": c.stats()}
    _out(args, data, _stats_text)
    return 0


def _stats_text(d: dict[str, Any]) -> str:
    """The human form of ``stats`` (``--json`` prints ``d`` as it is)."""
    h, s = d["health"], d["stats"]
    lines = [f"status {h['status']}  memories {h['memories']}  uptime {h['uptime_s']:.0f} s  "
             f"embedder {h['embedder'].get('state')}", f"by type: {_type_counts(s['store']['by_type'])}",
             f"journal {s['store']['journal_bytes']} B  snapshot {s['store']['snapshot_bytes']} B",
             f"last cleanup: {_cleanup_text(h['last_cleanup'])}"]
    if isinstance(h.get("remembering"), dict) and h["remembering"].get("paused"):
        lines.append(_remembering_text(h["remembering"]))
    if s["store"].get("expired_unswept"):
        lines.append(f"expired, not counted, deleted by the next cleanup: {s['store']['expired_unswept']}")
    if s["store"].get("unembedded"):
        lines.append(f"memories waiting for a vector: {s['store']['unembedded']} (embedded in idle time)")
    lines += [f"  {op:<24} n={v['count']:<8} err={v['errors']:<5} p50={v['p50_ms']} ms  p99={v['p99_ms']} ms"
              for op, v in s["ops"].items()]
    return "\n".join(lines)


def _type_counts(by_type: dict[str, int]) -> str:
    """``{"conversation": 3, "fact": 1}`` as "3 conversation, 1 fact" (the daemon's order)."""
    return ", ".join(f"{n} {kind}" for kind, n in by_type.items()) or "none"


def _cleanup_text(cleanup: dict[str, Any] | None) -> str:
    """The daemon's ``last_cleanup`` (None before the first sweep) as one phrase: when
    (UTC), how many memories it deleted and in how long, or why it was deferred."""
    if cleanup is None:
        return "not run yet"
    when = datetime.fromtimestamp(cleanup["time"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if cleanup.get("deferred_s") is not None:
        return f"{when}, deferred (the wall clock stepped {cleanup['deferred_s']:.0f} s forward)"
    took = cleanup.get("duration_ms")
    return f"{when}, {cleanup['deleted']} expired deleted" + (f" in {took:.1f} ms" if took is not None else "")


def cmd_backup(args: argparse.Namespace) -> int:
    if args.purge_forgotten:
        return _purge_backups(args)
    if args.dest is None:
        raise ValidationError("backup needs DEST (a file, or a directory for a timestamped file)", field="dest")
    dest = bk.backup_target(args.dest, _config(args).data_dir, force=args.force)
    if args.keep is not None and args.keep < 1:
        raise ValidationError("--keep must be at least 1", field="keep")
    if args.keep is not None and not Path(args.dest).expanduser().is_dir():
        # else the timestamped backups beside a named file were pruned, the named one never counted
        raise ValidationError("--keep rotates the backups in a directory: give DEST as a directory", field="keep")
    with _client(args) as c:
        info = _showing_backup(args, str(dest), lambda: c.backup(str(dest), force=args.force,
                                                                 timeout=_slow_timeout(args, "backup")))
    if args.keep is not None:
        info["pruned"] = bk.prune(Path(info["path"]).parent, args.keep, written=info["path"])
    _out(args, info, lambda i: f"backup of {i['memories']} memories written to {i['path']} ({i['bytes']} bytes)")
    return 0


def _purge_backups(args: argparse.Namespace) -> int:
    """``backup --purge-forgotten [DEST]``: the daemon rewrites the backups it wrote (and
    DEST, a backup file or a directory of them) without what was forgotten or expired."""
    paths = [str(Path(args.dest).expanduser().resolve())] if args.dest else None
    with _client(args) as c:
        done = c.purge_backups(paths, timeout=_slow_timeout(args, "backup"))
    _out(args, done, lambda d: "\n".join(
        f"{r['path']}: {r['removed']} memories and {r['persons']} persons removed" if r["bytes"]
        else f"{r['path']}: nothing to remove" for r in d) or "no backup to purge")
    return 0


def _showing_backup(args: argparse.Namespace, dest: str, call: Callable[[], Any]) -> Any:
    """``call()`` (the backup request to ``dest``); on a terminal, the daemon's progress
    meanwhile, from its ``health`` on a client of its own (a backup of 100k memories on
    an SD card takes tens of seconds).  Raises what ``call`` raises."""
    if args.json or not sys.stderr.isatty():
        return call()
    outcome: dict[str, Any] = {}
    worker = threading.Thread(target=_keep_outcome, args=(call, outcome), daemon=True)
    worker.start()
    line = _StatusLine()
    try:
        with _client(args) as watcher:
            worker.join(0.25)
            while worker.is_alive():
                _show_backup(watcher, dest, line)
                worker.join(0.5)
    finally:  # the progress line ends before the result, an error or "interrupted" (Ctrl-C)
        line.end()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _keep_outcome(call: Callable[[], Any], outcome: dict[str, Any]) -> None:
    try:
        outcome["value"] = call()
    except BaseException as exc:  # handed to the main thread, which reports it as usual
        outcome["error"] = exc


class _StatusLine:
    """One line of stderr rewritten in place (a carriage return, the rest blanked)."""

    def __init__(self) -> None:
        self.width = 0  # set before the line is written: a Ctrl-C during the write still ends it

    def show(self, text: str) -> None:
        shown, self.width = self.width, max(self.width, len(text))
        print(f"\r{text.ljust(shown)}", end="", file=sys.stderr, flush=True)

    def end(self) -> None:
        """Move past the line, if one was shown (once)."""
        if self.width:
            self.width = 0
            print(file=sys.stderr)


def _show_backup(watcher: MemoryClient, dest: str, line: _StatusLine) -> None:
    """The daemon's progress with the backup to ``dest`` on ``line`` (left as it is when
    health tells none, or does not answer within a second)."""
    try:
        health = watcher.health(timeout=1.0)
    except ReachyMemoryError:  # a slow answer: the backup itself is what is waited for
        return
    text = _backup_line(health.get("backup_running") if isinstance(health, dict) else None, dest)
    if text is not None:
        line.show(text)


def _backup_line(running: Any, dest: str) -> str | None:
    """The progress line for a health's ``backup_running``, None when there is none.
    The daemon writes one backup at a time: one to another path is not ours, which
    waits.  Of another shape, what it holds is shown: a daemon started before an
    upgrade tells the seconds and no bytes (its ``KeyError`` ended the command)."""
    if not isinstance(running, dict) or not _number(running.get("seconds")):
        return None
    if running.get("path") != dest:
        return f"waiting for another backup ({running['seconds']:.0f} s so far)"
    written = running.get("bytes")
    size = f"{written / 1e6:.1f} MB, " if _number(written) else ""
    return f"writing the backup: {size}{running['seconds']:.0f} s"


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def cmd_verify(args: argparse.Namespace) -> int:
    if not Path(args.path).expanduser().exists():  # exit 3 as for a missing import file, not 5 (damage)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), args.path)
    repairs = [r.__dict__ for r in bk.repair(args.path, _config(args))] if args.repair else None
    report = bk.verify(args.path, _progress("verifying")).to_dict()
    data = report if repairs is None else {"repair": repairs, "verify": report}  # --json: one document
    _out(args, data, lambda _: "\n".join([*_repair_lines(repairs or []), _verify_text(report)]))
    return 0 if report["ok"] else 5


def _repair_lines(repairs: list[dict[str, Any]]) -> list[str]:
    return [f"{r['path']}: kept {r['kept_frames']} frames"
            + (f", damaged file moved to {r['moved_to']}" if r["moved_to"] else ", no damage") for r in repairs]


def _verify_text(r: dict[str, Any]) -> str:
    return "\n".join([f"{r['path']}: {'OK' if r['ok'] else 'PROBLEMS'}  memories {r['memories']}  "
                      f"vectors {r['vectors']}  journal frames {r['journal_frames']}",
                      *(f"  problem: {p}" for p in r["problems"]), *(f"  note: {n}" for n in r["notes"])])


def cmd_restore(args: argparse.Namespace) -> int:
    if not Path(args.backup).expanduser().exists():  # exit 3 as verify and import say it, not 1 ("does not verify")
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), args.backup)
    info = bk.restore(args.backup, _config(args).data_dir, force=args.force)
    _out(args, info, lambda i: "\n".join([f"restored {i['memories']} memories into {i['data_dir']}",
                                           *(f"  moved aside: {p}" for p in i["moved_aside"])]))
    return 0


def _export_pages(c: MemoryClient) -> Iterator[Memory]:
    cursor = None
    while True:
        page, cursor = c.export_page(cursor, 1000)
        yield from page
        if cursor is None:
            return


def cmd_export(args: argparse.Namespace) -> int:
    from reachy_memory.storage.export import person_entries

    if args.format == "markdown":
        return _export_markdown(args)
    with _output(args.file) as out:  # a file is replaced only once the export is whole
        n = persons = 0
        with _client(args) as c:
            # First: a merge between the two calls then misses one redirect, rather than listing
            # a person both live and merged away (which import refuses).
            redirects = _person_redirects(c)
            for person in person_entries(c.people(), redirects):
                out.write(json.dumps({"kind": "person", **person}, ensure_ascii=False) + "\n")
                persons += 1
            for memory in _export_pages(c):
                out.write(json.dumps(memory.to_dict(), ensure_ascii=False) + "\n")
                n += 1
    print(f"exported {persons} people and {n} memories", file=sys.stderr)
    return 0


def _person_redirects(c: MemoryClient) -> dict[str, str]:
    """The daemon's person merge redirects; none, with a warning, from a daemon started
    before they were exported (still running after ``pip install -U``: "unknown op"
    failed the whole export until it was restarted).  Raises what the call raises."""
    try:
        return dict(c.person_redirects())
    except ValidationError as exc:
        if "unknown op" not in exc.message:
            raise
        print("warning: the daemon is older than this command (restart it after an upgrade): "
              "merged-away person ids are not in this export", file=sys.stderr)
        return {}


@contextlib.contextmanager
def _output(name: str) -> Iterator[Any]:
    """Standard output for "-", else a temporary file beside ``name`` renamed over it on
    success: a failed export (no daemon, a timeout) leaves an earlier file as it was."""
    target = Path(name)
    if name == "-" or target.is_symlink() or (target.exists() and not target.is_file()):
        # stdout, a symlink, a pipe or a device: written through, never replaced
        with contextlib.nullcontext(sys.stdout) if name == "-" else open(target, "w", encoding="utf-8") as out:
            yield out
        return
    tmp = target.with_name(f".{target.name}.partial")
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o600  # a dump of private memories
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w", encoding="utf-8") as out:
            os.chmod(tmp, mode)  # whatever the umask
            yield out
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _export_markdown(args: argparse.Namespace) -> int:
    from reachy_memory.storage.export import person_entries
    from reachy_memory.storage.markdown import render, write_dir

    if args.file == "-":
        raise ValidationError("--format markdown needs a folder", field="file")
    with _client(args) as c:
        redirects = _person_redirects(c)  # before the persons, as cmd_export
        people = person_entries(c.people(), redirects)
        memories = [m.to_dict() for m in _export_pages(c)]
    files = render(memories, people)
    write_dir(files, args.file, force=args.force)
    print(f"exported {len(people)} people and {len(memories)} memories as {len(files)} markdown files "
          f"in {args.file}", file=sys.stderr)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from reachy_memory.storage.export import check_entries, import_requests, read_jsonl

    config = _config(args)
    people: list[dict[str, Any]] = []
    if _is_app_memory(Path(args.file)):
        from reachy_memory.storage.app_memory import read_app_memory

        memories = read_app_memory(Path(args.file), config)  # all checked: nothing sent on an error
    elif Path(args.file).is_dir():
        from reachy_memory.storage.markdown import parse, read_dir

        ignored: dict[str, list[str]] = {}
        memories, people = parse(read_dir(args.file), ignored=ignored)
        check_entries(memories, people, args.file, config)  # the store's limits, before anything is sent
        for path, keys in ignored.items():  # an Obsidian vault's tags, cssclasses...: no field of ours
            print(f"{path}: front matter keys ignored (no field of ours): {', '.join(keys)}", file=sys.stderr)
    else:
        memories, people = read_jsonl(Path(args.file), config)  # every line checked: nothing sent on an error
    progress = _progress("importing")
    done = {"people": 0, "memories": 0}
    left_out: list[dict[str, Any]] = []  # links the daemon left out (a daemon before them tells none)
    with _client(args) as c:
        try:
            for batch, persons in import_requests(memories, people, config):
                got = c.import_memories(batch, persons or None, timeout=_slow_timeout(args, "import"))
                done = {k: done[k] + got[k] for k in done}
                left_out += got.get("left_out_links") or []
                if progress and batch:
                    progress(done["memories"], len(memories))
        except ReachyMemoryError:  # a request refused by the store (a note name it holds...), a timeout
            if any(done.values()):
                print(f"imported {done['people']} people and {done['memories']} memories before the error "
                      "(those stay imported; once the cause is fixed, the same import again adds the rest)",
                      file=sys.stderr)
            raise
        finally:
            _say_links_left_out(left_out)
    print(f"imported {done['people']} people and {done['memories']} memories "
          "(ids already present were kept as they were)", file=sys.stderr)
    return 0


def _is_app_memory(path: Path) -> bool:
    from reachy_memory.storage.app_memory import is_app_memory

    return path.is_file() and is_app_memory(path)


def cmd_conversation_profile(args: argparse.Namespace) -> int:
    from reachy_memory.integrations import conversation_profile as cp

    target = Path(args.dir).expanduser() if args.dir else cp.default_dir()
    if args.action == "install":
        lines = cp.install(target, args.profile)
        print(f"installed the profile {args.profile!r} in {target / 'profiles'} and its tools in "
              f"{target / 'tools'}; add these lines to the conversation app's .env (also in "
              f"{target / 'app.env'}), then restart the app:", file=sys.stderr)
    else:
        lines = cp.env_lines(target, args.profile)
    print("\n".join(lines))
    return 0


LINKS_SHOWN = 20  # links an import left out named on its line


def _say_links_left_out(left_out: list[dict[str, Any]]) -> None:
    """One line naming the links an import left out (memory id -> person id), if any: a
    file written before a memory's persons had to be ones its owner sees, or edited."""
    if left_out:
        shown = LINKS_SHOWN  # one line stays readable after importing a big older store
        links = ", ".join(f"{link.get('memory_id')} -> {link.get('person_id')}" for link in left_out[:shown])
        links += f", and {len(left_out) - shown} more" if len(left_out) > shown else ""
        print(f"{len(left_out)} link{'s' if len(left_out) != 1 else ''} to a person their memory's owner does not "
              f"see {'were' if len(left_out) != 1 else 'was'} left out (memory -> person): {links}", file=sys.stderr)


def cmd_remember(args: argparse.Namespace) -> int:
    with _client(args) as c:
        stored: list[Memory] = c.remember(args.content, subjects=args.about or None, owner=args.owner,
                                          shared=args.shared, name=args.name, aliases=args.alias or None,
                                          id=args.id)
    _out(args, [m.to_dict() for m in stored], lambda _: "\n".join(f"remembered {m.id}" for m in stored))
    return 0


def cmd_recall(args: argparse.Namespace) -> int:
    with _client(args) as c:
        hits: list[SearchResult] = c.recall(args.query, about=args.about, owner=args.owner, limit=args.limit,
                                            include_superseded=args.all)
    _out(args, [{"score": h.score, "about": list(h.subject_names), **h.memory.to_dict()} for h in hits],
         lambda _: "\n".join(f"{h.score:.3f}  {_memory_line(h.memory)}{_about(h)}" for h in hits) or "no match")
    return 0


def _about(hit: SearchResult) -> str:
    return f"  (about {', '.join(hit.subject_names)})" if hit.subject_names else ""


def cmd_people(args: argparse.Namespace) -> int:
    with _client(args) as c:
        people = c.people(args.owner)
    _out(args, [p.to_dict() for p in people],
         lambda _: "\n".join(f"{p.id}  {p.display_name}" + (f" ({p.relation})" if p.relation and p.name else "")
                             + (f"  aka {', '.join(p.aliases)}" if p.aliases else "") for p in people)
         or "(nobody yet)")
    return 0


def cmd_forget_person(args: argparse.Namespace) -> int:
    with _client(args) as c:
        result = c.forget_person(args.reference, dry_run=args.dry_run)
    _out(args, result, _forget_person_text)
    return 0


def _forget_person_text(r: dict[str, Any]) -> str:
    """What ``forget-person`` did (or, with --dry-run, would do), in words."""
    aliases = f" (also called {', '.join(r['aliases'])})" if r["aliases"] else ""
    lines = [f"{'would forget' if r['dry_run'] else 'forgot'} {r['person']['name']}{aliases}: "
             f"{r['memories_deleted']} memories about them and {r['turns_deleted']} of their conversation turns "
             f"{'would go' if r['dry_run'] else 'deleted'}",
             f"their name {'would be' if r['dry_run'] else 'was'} removed from {r['mentions_rewritten']} other "
             f"memories ({r['unlinked']} about them and others, unlinked)",
             f"context window: {r['window_turns_dropped']} turns dropped, {r['window_turns_rewritten']} rewritten"]
    if r["names_kept"]:
        lines.append(f"not removed, as another known person has them too: {', '.join(r['names_kept'])}")
    if r["dry_run"]:
        lines.append("nothing changed: run again without --dry-run to forget")
    return "\n".join(lines)


def cmd_about(args: argparse.Namespace) -> int:
    with _client(args) as c:
        about = c.about_person(args.reference)
    _out(args, about, _about_text)
    return 0


def _about_text(a: dict[str, Any]) -> str:
    p = a["person"]
    name = p["name"] or f"the user's {p['relation']}"
    head = f"{p['id']}  {name}" + (f" ({p['relation']})" if p["relation"] and p["name"] else "")
    head += f"  aka {', '.join(p['aliases'])}" if p["aliases"] else ""
    lines = [head]
    for key, title in (("memories", "about them"), ("shared", "about them and others"), ("turns", "their turns"),
                       ("mentions", "naming them")):
        lines.append(f"{title}: {len(a[key])}")
        lines += [f"  {m['id']}  [{m['type']}]  {m['created_at'][:16].replace('T', ' ')}  {m['content']}"
                  for m in a[key]]
    lines.append(f"in the context window: {len(a['window'])}")
    lines += [f"  {t['role']}: {t['content']}" for t in a["window"]]
    return "\n".join(lines)


def cmd_pause(args: argparse.Namespace) -> int:
    with _client(args) as c:
        status = c.pause_remembering(args.minutes)
    _out(args, status, _remembering_text)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with _client(args) as c:
        status = c.resume_remembering()
    _out(args, status, _remembering_text)
    return 0


def _remembering_text(status: dict[str, Any] | None) -> str:
    """The pause as one phrase (a daemon from before pausing tells none: remembering)."""
    if not isinstance(status, dict) or not status.get("paused"):
        return "remembering"
    until = datetime.fromtimestamp(status["until"]).astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"paused until {until} ({status['seconds_left'] / 60:.0f} min left): turns reach the context window "
            "only, nothing is written")


def cmd_history(args: argparse.Namespace) -> int:
    with _client(args) as c:
        chain: list[Memory] = c.history(args.id)
    _out(args, [m.to_dict() for m in chain],
         lambda _: "\n".join(("  superseded  " if m.superseded_by else "  current     ") + _memory_line(m)
                             for m in chain))
    return 0


def cmd_prompt(args: argparse.Namespace) -> int:
    with _client(args) as c:
        ctx = c.context_for(args.message, owner=args.owner, max_tokens=args.max_tokens)
    _out(args, {"text": ctx.text, "tokens": ctx.tokens, "dropped_lines": ctx.dropped_lines},
         lambda _: ctx.text or "(no context)")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from reachy_memory.embedding.model_files import ensure_model, fetch

    config = _config(args)
    say = (lambda msg: print(msg, file=sys.stderr)) if not args.json else (lambda msg: None)
    if args.action == "fetch":
        fetch(config, say)
    files = ensure_model(config, progress=say)
    _out(args, {"onnx": str(files.onnx), "tokenizer": str(files.tokenizer), **files.identity},
         lambda d: f"model ready: {d['name']} {d['precision']} sha256 {d['sha256'][:12]}… ({d['onnx']})")
    _tell_about_daemon(args, say)
    return 0


def _tell_about_daemon(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    """When a daemon answers and runs without a model, say whether it picks this one up
    (it looks for the weights every few seconds) or needs a restart.  A courtesy: any
    failure to ask, no daemon included, says nothing."""
    from reachy_memory.daemon.server import MODEL_POLL_SECONDS

    if args.json:
        return  # nothing would be said: do not wait for it
    try:
        with _client(args) as c:
            embedder = c.health(timeout=1.0)["embedder"]
            if embedder.get("state") == "ready":
                return
            if embedder.get("error") is None:
                say("the running daemon has embedding turned off (embedding.enabled: false)")
                return
            deadline = time.monotonic() + 2 * MODEL_POLL_SECONDS + 10  # two polls (files settled), then the load
            while time.monotonic() < deadline and embedder.get("state") != "ready":
                time.sleep(0.5)
                embedder = c.health(timeout=1.0)["embedder"]
    except (ReachyMemoryError, OSError):
        return
    say("the running daemon loaded it; what it stored without a model gets its vectors in idle time"
        if embedder.get("state") == "ready" else
        f"the running daemon has not loaded it ({embedder.get('error')}); if it looks for the model elsewhere "
        "(another config), restart it (on the robot: sudo systemctl restart reachy-memory)")


def cmd_reindex(args: argparse.Namespace) -> int:
    from reachy_memory.engine.store import MemoryStore

    config = _config(args)
    if not config.data_dir.is_dir():  # a mistyped --data-dir became a new, empty store: "0 memories"
        raise FileNotFoundError(errno.ENOENT, "no data directory (no store to re-embed)", str(config.data_dir))
    with MemoryStore(config=config, reindex=True) as store:
        if store.embedder is None:
            raise ReachyMemoryError(f"no embedding model: {store.embedder_error}")
        n = store.reindex(progress=_progress("re-embedding"))
    _out(args, {"reindexed": n}, lambda _: f"re-embedded {n} memories")
    return 0


def cmd_web(args: argparse.Namespace) -> int:
    from reachy_memory.web import server

    if getattr(args, "data_dir", None) and getattr(args, "endpoint", None):
        raise ValidationError("give --data-dir (a store opened here) or --endpoint (the daemon), not both",
                              field="data_dir")
    return server.run(_config(args), host=args.host, port=args.port, token_file=args.token_file,
                      in_process=bool(getattr(args, "data_dir", None)), endpoint=getattr(args, "endpoint", None),
                      timeout=args.timeout)


def cmd_mcp(args: argparse.Namespace) -> int:
    from reachy_memory import mcp_server

    return mcp_server.run_from_args(args, _config(args))


# -- parser --------------------------------------------------------------------------------


def _common(late: bool = False) -> argparse.ArgumentParser:
    """The options every command takes, before or after it; ``late``: the copy a command
    or nested action ("context show") takes, with no defaults, so the options given
    before it are not reset by it."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, help="YAML config file (default: $REACHY_MEMORY_CONFIG)")
    common.add_argument("--endpoint", help="daemon endpoint (default: the private ipc socket)")
    common.add_argument("--data-dir", type=Path, help="data directory (overrides memory.path)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--timeout", type=_seconds, default=None,
                        help=f"seconds to wait for the daemon (default {DEFAULT_TIMEOUT:g}; backup "
                             f"{SLOW_TIMEOUTS['backup']:g} and import {SLOW_TIMEOUTS['import']:g} per request)")
    for action in common._actions if late else ():
        action.default = argparse.SUPPRESS
    return common


def _parser() -> argparse.ArgumentParser:
    # The common options go before the command ("reachy-memory --config F stats") or
    # after it: the command's copies have no defaults, so they only override.
    late = _common(late=True)
    parser = argparse.ArgumentParser(prog="reachy-memory", description="Long-term memory for the Reachy Mini robot.",
                                     parents=[_common()])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[late], help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("serve", cmd_serve, "run the daemon in the foreground")
    p.add_argument("--log-level", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--insecure-tcp", action="store_true",
                   help="allow tcp://127.0.0.1 without CURVE (any local user gets full access; logged loudly)")
    p = add("store", cmd_store, "store a memory")
    p.add_argument("content", help="the text, or - to read it from standard input")
    p.add_argument("--type", default="fact", choices=["fact", "conversation", "context"])
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="metadata (repeatable)")
    p.add_argument("--id", help="client-chosen id (makes retries idempotent)")
    p.add_argument("--owner", help="the user of the robot it belongs to")
    p.add_argument("--shared", action="store_true", help="every user sees it")
    p = add("search", cmd_search, "search memories by meaning and words")
    p.add_argument("query")
    p.add_argument("--type", choices=["fact", "conversation", "context"])
    p.add_argument("--limit", type=int, default=SEARCH_LIMIT)
    p.add_argument("--min-score", type=float, default=SEARCH_MIN_SCORE)
    p.add_argument("--where", help='metadata filter as JSON, e.g. \'{"speaker": "alex"}\'')
    p.add_argument("--mode", choices=["hybrid", "vector", "lexical"])
    add("get", cmd_get, "show one memory").add_argument("id")
    add("forget", cmd_forget, "delete one memory").add_argument("id")
    add("cleanup", cmd_cleanup, "delete expired memories now")
    p = add("retention", cmd_retention, "show (or --apply) what the configured conversation TTL means for the "
            "turns already stored: their expiry is otherwise fixed when written")
    p.add_argument("--apply", action="store_true", help="give stored turns the daemon's configured TTL")
    p.add_argument("--yes", action="store_true", help="with --apply: also when that deletes turns at once")
    p = add("dedupe", cmd_dedupe, "merge the copies of facts and context memories already stored (each set keeps "
            "its oldest memory, refreshed)")
    p.add_argument("--dry-run", action="store_true", help="only show what would be merged")
    p = add("context", cmd_context, "the conversation window and named context")
    csub = p.add_subparsers(dest="action", required=True)
    csub.add_parser("show", parents=[late])
    a = csub.add_parser("add", parents=[late])
    a.add_argument("role")
    a.add_argument("content")
    csub.add_parser("clear", parents=[late])
    s = csub.add_parser("set", parents=[late])
    s.add_argument("key")
    s.add_argument("value")
    csub.add_parser("get", parents=[late]).add_argument("key")
    add("stats", cmd_stats, "daemon health and statistics")
    p = add("backup", cmd_backup, "write a consistent backup file (taken by the running daemon)")
    p.add_argument("dest", nargs="?", help="a file, or a directory for a timestamped file")
    p.add_argument("--keep", type=int, help="with a directory: keep only the newest N backups")
    p.add_argument("--purge-forgotten", action="store_true",
                   help="rewrite the backups the daemon wrote (and DEST, a backup or a directory of them) "
                        "without what was forgotten or expired since")
    p.add_argument("--force", action="store_true", help="replace an existing file that is not a backup")
    p = add("verify", cmd_verify, "check a data directory or backup file")
    p.add_argument("path")
    p.add_argument("--repair", action="store_true", help="keep the valid prefix of damaged files (data dir only)")
    p = add("restore", cmd_restore, "rebuild a data directory (--data-dir) from a backup file")
    p.add_argument("backup")
    p.add_argument("--force", action="store_true", help="move an existing (stopped) store aside")
    p = add("export", cmd_export, "export people and memories as JSON Lines, or as a folder of markdown files")
    p.add_argument("file", nargs="?", default="-", help="a file (JSON Lines; - for stdout) or, for markdown, a folder")
    p.add_argument("--format", choices=["jsonl", "markdown"], default="jsonl")
    p.add_argument("--force", action="store_true", help="markdown: move an existing, non-empty folder aside")
    add("import", cmd_import, "import JSON Lines, a markdown folder, or the conversation app's memory.v1.json "
        "(idempotent: ids already present are kept)").add_argument(
        "file", help="an exported JSON Lines file, a markdown folder, or the conversation app's memory.v1.json")
    p = add("conversation-profile", cmd_conversation_profile, "put the memory profile and tools where Pollen's "
            "conversation app looks (install), or print the environment lines pointing it there (print-env)")
    p.add_argument("action", choices=["install", "print-env"])
    p.add_argument("--dir", help="where the profiles/ and tools/ folders go (default: "
                   "$XDG_DATA_HOME/reachy-memory/conversation-app)")
    p.add_argument("--profile", default="reachy_memory", help="the profile's name (default reachy_memory)")
    p = add("remember", cmd_remember, "remember a fact about people (persons resolved or created)")
    p.add_argument("content")
    p.add_argument("--about", action="append", metavar="REF", help="who it is about: 'my wife', 'Sarah' (repeatable)")
    p.add_argument("--owner", help="the user it belongs to")
    p.add_argument("--shared", action="store_true", help="a household fact every user sees")
    p.add_argument("--name", help="a unique note name")
    p.add_argument("--alias", action="append", help="another name of the note (repeatable)")
    p.add_argument("--id", help="client-chosen id (makes retries idempotent: the same command again stores nothing "
                   "twice)")
    p = add("recall", cmd_recall, "facts relevant to a question, optionally about a person")
    p.add_argument("query")
    p.add_argument("--about", help="a person: 'my wife', 'Sarah'")
    p.add_argument("--owner")
    p.add_argument("--limit", type=int, default=SEARCH_LIMIT)
    p.add_argument("--all", action="store_true", help="include superseded facts")
    add("people", cmd_people, "the persons the robot knows").add_argument("--owner")
    add("history", cmd_history, "the supersession chain of a memory").add_argument("id")
    p = add("forget-person", cmd_forget_person, "forget a person and what is kept about them (their name removed "
            "from the memories about others); docs/HOUSEHOLD.md")
    p.add_argument("reference", help="a name, an alias, 'my wife' or a person id")
    p.add_argument("--dry-run", action="store_true", help="say what would go, change nothing")
    add("about", cmd_about, "everything kept about one person").add_argument(
        "reference", help="a name, an alias, 'my wife' or a person id")
    add("pause", cmd_pause, "stop remembering for a while (a guest, a private moment): turns reach the context "
        "window only, nothing is written; ends by itself").add_argument("minutes", type=_minutes,
                                                                         help="how long, in minutes (at most a week)")
    add("resume", cmd_resume, "remember again (end a pause)")
    p = add("prompt", cmd_prompt, "prompt-ready context for a message (context_for)")
    p.add_argument("message")
    p.add_argument("--owner")
    p.add_argument("--max-tokens", type=int, default=800)
    p = add("model", cmd_model, "fetch and build the embedding model")
    p.add_argument("action", choices=["fetch", "build", "info"])
    add("reindex", cmd_reindex, "re-embed every memory with the configured model (daemon stopped)")
    p = add("mcp", cmd_mcp, "serve the memory tools to language models over MCP (stdio, or --http on loopback; "
            "--data-dir opens a store in-process instead of using the daemon)")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP on 127.0.0.1 instead of stdio")
    p.add_argument("--port", type=int, default=8765, help="HTTP port (default 8765)")
    p.add_argument("--token-file", help="HTTP: the file holding the bearer token clients must send (made 0600 "
                   "with a random token if missing; default: mcp-http.token in the private runtime directory)")
    p.add_argument("--owner", help="bind every tool call to this user of the robot: their memories plus shared and "
                   "unscoped ones; facts stored as theirs (the model cannot choose another user)")
    p = add("web", cmd_web, "serve the household's page: who and what the robot remembers, search, forget, pause "
            "(loopback only unless --host; --data-dir opens a store in-process instead of using the daemon)")
    p.add_argument("--port", type=int, default=8767, help="HTTP port (default 8767; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; another address serves the LAN, as plain HTTP)")
    p.add_argument("--token-file", help="the file holding the login token (made 0600 with a random token if missing; "
                   "default: web.token in the private runtime directory)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
