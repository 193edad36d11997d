"""The endpoint's ipc path: ``~`` and ``$VAR`` expanded alike for the daemon and its clients."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from reachy_memory import ConfigError, MemoryClient, load_config
from reachy_memory.daemon.endpoint import ENV_ENDPOINT, expand_endpoint, resolve_endpoint
from tests.daemon_util import run_cli, words_only_daemon


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME is ``<tmp>/home``; BASE an absolute folder, REL a relative one, TILDE starts
    with ``~``, EMPTY is empty and UNSET is not set."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BASE", "/srv/robot")
    monkeypatch.setenv("ROBOT", "reachy")
    monkeypatch.setenv("REL", "run")
    monkeypatch.setenv("TILDE", "~/run")
    monkeypatch.setenv("EMPTY", "")
    monkeypatch.delenv("UNSET", raising=False)
    monkeypatch.delenv(ENV_ENDPOINT, raising=False)
    return tmp_path / "home"


@pytest.mark.parametrize(("written", "expected"), [
    ("ipc://~/run/memory.sock", "ipc://{home}/run/memory.sock"),  # was bound as ./~/run/memory.sock
    ("ipc://$BASE/memory.sock", "ipc:///srv/robot/memory.sock"),  # a variable, as memory.path expands them
    ("ipc://${BASE}/memory.sock", "ipc:///srv/robot/memory.sock"),  # ...in either spelling
    ("ipc:///run/$ROBOT.sock", "ipc:///run/reachy.sock"),  # a variable inside the path
    ("ipc://$TILDE/memory.sock", "ipc://{home}/run/memory.sock"),  # variables first, then ~ (as memory.path)
    ("ipc:///run/memory.sock", "ipc:///run/memory.sock"),  # absolute, nothing to expand: untouched
    ("ipc://run/memory.sock", "ipc://run/memory.sock"),  # written relative: the working directory's, as before
    ("ipc://@memory", "ipc://@memory"),  # a Linux abstract socket: a name, not a path
    ("ipc://@$ROBOT", "ipc://@$ROBOT"),  # ...so nothing in it is expanded
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),  # not a path at all
])
def test_an_ipc_path_is_expanded(env: Path, written: str, expected: str) -> None:
    assert expand_endpoint(written) == expected.format(home=env)


@pytest.mark.parametrize(("written", "message"), [
    ("ipc://$UNSET/memory.sock", r"\$UNSET is not set"),  # was a file named '$UNSET' in the working directory
    ("ipc://${UNSET}/memory.sock", r"\$UNSET is not set"),  # the same, braced
    ("ipc://$EMPTY/memory.sock", r"\$EMPTY is not set \(or is empty\)"),  # would be /memory.sock
    ("ipc:///run/$UNSET.sock", r"\$UNSET is not set"),  # inside the path too
    ("ipc://$REL/memory.sock", "expands to the relative path 'run/memory.sock'"),  # / for systemd, . for the CLI
    ("ipc://~no-such-user-here/memory.sock", "relative path '~no-such-user-here/memory.sock'"),  # unknown user
])
def test_an_ipc_path_that_cannot_expand_to_an_absolute_one_is_refused(env: Path, written: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        expand_endpoint(written)
    assert info.value.key == "server.endpoint"


def test_every_way_of_giving_the_endpoint_is_expanded(env: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump({"server": {"endpoint": "ipc://~/file.sock"}}))
    from_file = load_config(config_file)
    assert from_file.server.endpoint == "ipc://~/file.sock"  # kept as written (not read from the file's folder)
    assert resolve_endpoint(None, from_file) == f"ipc://{env}/file.sock"  # the config file
    monkeypatch.setenv(ENV_ENDPOINT, "ipc://$HOME/env.sock")
    assert resolve_endpoint(None, from_file) == f"ipc://{env}/env.sock"  # $REACHY_MEMORY_ENDPOINT
    assert resolve_endpoint("ipc://~/flag.sock", from_file) == f"ipc://{env}/flag.sock"  # --endpoint
    assert MemoryClient("ipc://~/flag.sock", config=from_file).endpoint == f"ipc://{env}/flag.sock"  # a client
    with pytest.raises(ConfigError, match="UNSET"):
        MemoryClient("ipc://$UNSET/x.sock", config=from_file)  # refused when made, not at its first call


@pytest.mark.timeout(120)
def test_the_daemon_and_its_clients_meet_at_the_expanded_socket(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # before the fix the daemon bound ./~/run/memory.sock: keep that out of the repo
    (tmp_path / "d").mkdir()
    daemon = words_only_daemon(tmp_path / "d", 0, server={"endpoint": "ipc://~/run/memory.sock"})
    assert daemon.endpoint == "ipc://~/run/memory.sock"  # as written: each side expands it
    with daemon:  # ready once a client of the unexpanded endpoint gets an answer
        assert (env / "run" / "memory.sock").is_socket()
        with daemon.client() as client:
            assert client.health()["endpoint"] == f"ipc://{env}/run/memory.sock"
        done = run_cli(daemon, "stats", "--json")  # the CLI, a child process with the same HOME
        assert done.returncode == 0, done.stderr
    assert not os.path.exists(tmp_path / "~")


def test_a_first_serve_makes_the_data_dir_and_its_socket_dir_private_from_the_start() -> None:
    # The default socket folder is <data dir>/run; made with parents at the umask's mode, the
    # data directory was 0755 until the store tightened it, with a warning, on every first start.
    with tempfile.TemporaryDirectory(prefix="rm-", dir="/tmp") as short:  # the socket path stays < 108 bytes
        _first_serve(Path(short))


def _first_serve(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for name in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY", ENV_ENDPOINT, "REACHY_MEMORY_CONFIG"):
        env.pop(name, None)
    previous = os.umask(0o022)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "reachy_memory.cli", "serve"],
                                env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    finally:
        os.umask(previous)
    data = home / ".reachy" / "memory"
    try:
        deadline = time.monotonic() + 60
        while not (data / "run" / "memory.sock").exists():
            if proc.poll() is not None or time.monotonic() >= deadline:
                raise AssertionError(f"the daemon did not start: {proc.communicate(timeout=10)[0].decode()[-1500:]}")
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700 and stat.S_IMODE((data / "run").stat().st_mode) == 0o700
    assert b"readable by others" not in out, out.decode()[-1000:]
