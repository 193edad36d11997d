"""The ``reachy-memory`` command's entry (``__main__``) and the package's lazy names: a
Ctrl-C while the command still loads its modules says "interrupted" (exit 130), not
Python's traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import reachy_memory
from tests.daemon_util import ROOT

pytestmark = pytest.mark.timeout(60)

# Prepended to the child's code: Ctrl-C acts as in a terminal (a shell without job
# control starts background children with SIGINT ignored), and the first import of
# numpy, deep in the command line's imports, marks a file and waits there for the
# SIGINT: it lands mid-import every time, not when a race lets it.  $AFTER says what
# that import then does with the KeyboardInterrupt.
STALL_IN_IMPORT = """
import importlib.abc, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
class Stall(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            open(os.environ["STALLED"], "w").close()
            try:
                time.sleep(60)
            except KeyboardInterrupt:
                if os.environ["AFTER"] == "raise":
                    raise
                if os.environ["AFTER"] == "replace":
                    raise ImportError('PyCapsule_Import could not import module "datetime"') from None
        return None
sys.meta_path.insert(0, Stall())
"""


def _console_script() -> str:
    """What pip's ``reachy-memory`` script runs, from pyproject.toml's entry point."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["reachy-memory"]
    module, _, func = entry.partition(":")
    return f"import sys\nfrom {module} import {func}\nsys.exit({func}())"


RUN_AS = {
    "console script": _console_script(),
    "python -m": "import runpy\nrunpy.run_module('reachy_memory', run_name='__main__', alter_sys=True)",
}


def _child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    env.pop("REACHY_MEMORY_ENDPOINT", None)
    return env


@pytest.mark.parametrize(("run_as", "after"), [
    ("console script", "raise"),  # the KeyboardInterrupt propagates (the usual case)
    ("python -m", "raise"),  # the same through runpy
    ("console script", "replace"),  # numpy's C init turns it into an ImportError (seen 3 times in 150 tries)
    ("console script", "swallow"),  # an import eats it and the loading goes on: still interrupted
])
def test_ctrl_c_while_the_command_loads_says_interrupted(tmp_path: Path, run_as: str, after: str) -> None:
    stalled = tmp_path / "stalled"
    argv = ["stats", "--endpoint", f"ipc://{tmp_path}/none.sock"]  # would fail fast (exit 4) if it got there
    proc = subprocess.Popen([sys.executable, "-c", STALL_IN_IMPORT + RUN_AS[run_as], *argv], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_child_env(STALLED=str(stalled), AFTER=after))
    try:
        deadline = time.monotonic() + 30
        while not stalled.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stalled.exists(), f"never reached the import of numpy: {proc.poll()=}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert "Traceback" not in err
    assert (proc.returncode, err, out) == (130, "interrupted\n", "")


def test_the_command_runs_as_python_m(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "reachy_memory", "stats", "--endpoint",
                           f"ipc://{tmp_path}/none.sock"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=_child_env())
    assert done.returncode == 4 and "no reachy-memory daemon" in done.stderr  # reached the command itself


def test_every_package_is_installed_by_pip() -> None:
    """pyproject.toml named only ``reachy_memory``: ``pip install`` (not ``-e``) left out
    ``reachy_memory.integrations``, so ``reachy-memory mcp`` and ``MemoryBridge`` failed
    with ModuleNotFoundError on the robot's install."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "reachy_memory").rglob("__init__.py")}
    assert found == listed


def test_importing_the_package_loads_nothing_heavy(tmp_path: Path) -> None:
    # what lets __main__ catch the Ctrl-C: it runs before numpy, zmq and onnxruntime load
    code = ("import sys, reachy_memory\n"
            "print(hasattr(reachy_memory, '__main__'))\n"  # a dunder is never imported as a submodule
            "import reachy_memory.__main__\n"
            "print(sorted(m for m in ('numpy', 'zmq', 'onnxruntime', 'reachy_memory.cli') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=_child_env())
    assert (done.returncode, done.stdout.split()) == (0, ["False", "[]"]), done.stderr


def test_every_public_name_is_there_as_before() -> None:
    from reachy_memory.engine import store

    assert set(reachy_memory._EXPORTS) == set(reachy_memory.__all__)  # one list of the lazy names
    for name in reachy_memory.__all__:
        value = getattr(reachy_memory, name)
        assert value is getattr(getattr(reachy_memory, reachy_memory._EXPORTS[name]), name)  # the submodule's
    assert reachy_memory.MemoryStore is store.MemoryStore
    assert set(reachy_memory.__all__) <= set(dir(reachy_memory))
    namespace: dict[str, object] = {}
    exec("from reachy_memory import *", namespace)
    assert set(reachy_memory.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no_such_name"):
        reachy_memory.no_such_name  # noqa: B018


def test_ctrl_c_while_the_command_builds_its_parser_says_interrupted(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # cli.main turns Ctrl-C into "interrupted" around the command only, not while it parses
    from reachy_memory import __main__ as entry
    from reachy_memory import cli

    def parse(argv: list[str] | None = None) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", parse)
    assert entry.main(["stats"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
