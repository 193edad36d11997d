"""The ``reachy-memory`` command and ``python -m reachy_memory``.

This module only imports the command line (``cli``), whose modules load numpy, zmq
and onnxruntime for about half a second: a Ctrl-C during that time ends the command
with "interrupted" and exit code 130, as it does later, instead of Python's
traceback.  The package's ``__init__`` loads nothing, so this runs first.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """Run the command line (``cli.main``) on ``argv`` (default: ``sys.argv[1:]``) and
    return its exit code; 130 after printing "interrupted" for a Ctrl-C that came while
    it loaded or built its parser (before its own handling of Ctrl-C)."""
    try:
        cli_main = _load_cli()
    except _Interrupted:
        return _interrupted()
    try:
        return cli_main(argv)
    except KeyboardInterrupt:  # cli.main handles it around the command, not while it parses
        return _interrupted()


class _Interrupted(Exception):
    """Ctrl-C came while the command line loaded."""


def _load_cli() -> Callable[[list[str] | None], int]:
    """``cli.main``, imported; _Interrupted when a Ctrl-C came meanwhile, whatever became
    of its KeyboardInterrupt: a C extension may turn it into another error (numpy's
    'could not import module "datetime"', an ImportError without it as cause) or an
    import may swallow it.  Other errors propagate."""
    seen: list[int] = []
    previous = None
    try:
        previous = _note_ctrl_c(seen)
        from reachy_memory.cli import main as cli_main
    except BaseException as exc:
        if seen:
            raise _Interrupted from exc
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if seen:
        raise _Interrupted
    return cli_main


def _note_ctrl_c(seen: list[int]) -> Any:
    """Have SIGINT also append to ``seen`` (it raises KeyboardInterrupt as before); the
    handler to put back, or None when SIGINT is not Python's default (ignored, as in a
    background job without job control: it stays so) or this is not the main thread."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None

    def note(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        signal.default_int_handler(signum, frame)

    try:
        return signal.signal(signal.SIGINT, note)
    except ValueError:  # not the main thread: signals cannot be handled here
        return None


def _interrupted() -> int:
    print("interrupted", file=sys.stderr)
    return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
