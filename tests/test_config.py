from pathlib import Path

import pytest
import yaml

from reachy_memory import ConfigError, load_config
from reachy_memory.config import Config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_default_yaml_equals_builtin_defaults() -> None:
    shipped = yaml.safe_load((ROOT / "config" / "default.yaml").read_text())
    assert shipped == to_dict(Config())


def test_yaml_overrides_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("memory:\n  context_window_size: 7\n  fsync: batch\nsearch:\n  vector_weight: 1\n")
    cfg = load_config(path)
    assert cfg.memory.context_window_size == 7
    assert cfg.memory.fsync == "batch"
    assert cfg.search.vector_weight == 1.0  # ints widen to float
    assert cfg.memory.path == "~/.reachy/memory"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("memory:\n  colour: red\n", "memory.colour"),  # unknown key in a section
        ("nonsense: {}\n", "nonsense"),  # unknown section
        ("memory:\n  context_window_size: five\n", "memory.context_window_size"),  # wrong type
        ("memory:\n  context_window_size: true\n", "memory.context_window_size"),  # bool is not int
        ("memory:\n  fsync: sometimes\n", "memory.fsync"),  # not in the Literal
        ("memory:\n  cleanup_interval: -1\n", "memory.cleanup_interval"),  # negative
        ("embedding:\n  model_dir: 5\n", "embedding.model_dir"),  # Optional[str] gets int
        ("memory: 3\n", "memory"),  # section is not a mapping
        ("memory:\n  conversation_ttl_days: 3000000\n", "memory.conversation_ttl_days"),  # expiry past 2300
        ("memory:\n  cleanup_interval: 0\n", "memory.cleanup_interval"),  # would spin
        ("memory:\n  timezone: Mars/Olympus\n", "memory.timezone"),  # not a real zone
        ("memory:\n  conversation_ttl_days: .nan\n", "memory.conversation_ttl_days"),  # not finite
        ("server:\n  queue_size: 0\n", "server.queue_size"),  # nothing could ever be queued
        ("server:\n  log_level: LOUD\n", "server.log_level"),  # not a logging level
        ("search:\n  vector_weight: 1.5\n", "search.vector_weight"),  # a weight is in [0, 1]
        ("embedding:\n  threads: 0\n", "embedding.threads"),  # onnxruntime needs one
        ("embedding:\n  model: bge-small\n", "embedding.model"),  # a model the builder does not know
        ("decay:\n  threshold: 2\n", "decay.threshold"),  # a confidence is in [0, 1]
        ("server:\n  heap_trim_seconds: 0.05\n", "server.heap_trim_seconds"),  # a trim at every idle tick
        ("search:\n  bm25_b: 1.5\n", "search.bm25_b"),  # BM25's b is in [0, 1]
        ("search:\n  previous_turn_weight: -0.5\n", "search.previous_turn_weight"),  # a field weight is in [0, 1]
        ("memory:\n  embedding_model: bge-small\n", "embedding.model"),  # the spec's name, an unknown model
        # the spec's name and ours, disagreeing
        ("memory:\n  embedding_model: all-MiniLM-L6-v2\nembedding:\n  model: other\n", "memory.embedding_model"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert key in str(info.value)


def test_env_var_selects_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("memory:\n  path: /somewhere\n")
    monkeypatch.setenv("REACHY_MEMORY_CONFIG", str(path))
    assert load_config().memory.path == "/somewhere"


def test_missing_and_invalid_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("memory: [unclosed\n")
    with pytest.raises(ConfigError):
        load_config(bad)


SPEC_DEFAULT_YAML = """\
# config/default.yaml
memory:
  path: ~/.reachy/memory
  context_window_size: 5
  embedding_model: all-MiniLM-L6-v2
  cleanup_interval: 3600  # seconds, run cleanup hourly
"""  # spec 000's "Configuration" section, verbatim


def test_the_spec_config_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC_DEFAULT_YAML)
    cfg = load_config(path)
    assert cfg.embedding.model == "all-MiniLM-L6-v2"
    assert (cfg.memory.path, cfg.memory.context_window_size, cfg.memory.cleanup_interval) == \
        ("~/.reachy/memory", 5, 3600)
    path.write_text(SPEC_DEFAULT_YAML + "embedding:\n  model: all-MiniLM-L6-v2\n  threads: 2\n")
    assert load_config(path).embedding.threads == 2  # both names, agreeing: fine


def test_first_run_config_mistakes_are_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("# Zo\xe9's robot\nmemory:\n  cleanup_interval: 60\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):  # was a UnicodeDecodeError traceback
        load_config(latin1)
    with pytest.raises(ConfigError, match=r"memory\.path"):  # "" made the working directory the store
        load_config(memory={"path": ""})
    monkeypatch.setenv("ROBOT_DATA", str(tmp_path / "robot"))
    assert load_config(memory={"path": "$ROBOT_DATA/memory"}).data_dir == tmp_path / "robot" / "memory"


@pytest.mark.parametrize(("text", "expected"), [
    ("1e2", 100.0),  # YAML 1.2 exponent without a dot: PyYAML (YAML 1.1) read the string '1e2'
    ("3.6E+3", 3600.0),  # with a dot and a signed exponent: a float in either YAML
    ("-2.5e-1", None),  # negative: read as a number, then refused by the key's range
])
def test_numbers_with_an_exponent_are_numbers(tmp_path: Path, text: str, expected: float | None) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"memory:\n  cleanup_interval: {text}\n")
    if expected is None:
        with pytest.raises(ConfigError, match="cleanup_interval"):
            load_config(path)
    else:
        assert load_config(path).memory.cleanup_interval == expected


def test_strings_that_look_like_exponents_stay_strings_when_quoted(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text('memory:\n  path: "1e2"\n')
    assert load_config(path).memory.path == str(tmp_path / "1e2")  # a string, so a path from the file's folder


@pytest.mark.parametrize(("written", "expected"), [
    ("store", "{conf}/store"),  # relative: from the config file's folder (was the working directory)
    ("./a/../store", "{conf}/a/../store"),  # still relative, kept as written under the folder
    ("/srv/memory", "/srv/memory"),  # absolute: untouched
    ("~/memory", "{home}/memory"),  # the home folder, expanded later as before
    ("$MEMORY_ROOT/m", "{env}/m"),  # a variable, expanded later as before
])
def test_a_relative_path_in_a_config_file_is_read_from_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, expected: str) -> None:
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "memory.yaml").write_text(yaml.safe_dump({
        "memory": {"path": written},
        "embedding": {"model_dir": "models", "cache_dir": "/var/cache/x"},
        "server": {"curve_secret_key": "keys/server.key_secret"}}))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MEMORY_ROOT", str(tmp_path / "env"))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # under systemd the working directory is /
    config = load_config("../etc/memory.yaml")  # a relative config path works too
    values = {"conf": str(conf), "home": str(tmp_path / "home"), "env": str(tmp_path / "env")}
    assert config.data_dir == Path(expected.format(**values))
    assert config.embedding.model_dir == str(conf / "models")
    assert config.embedding.cache_dir == "/var/cache/x"
    assert config.server.curve_secret_key == str(conf / "keys/server.key_secret")


def test_a_relative_override_stays_relative_to_the_working_directory(tmp_path: Path) -> None:
    # --data-dir and the like are command-line words: read from where the command runs
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"memory": {"path": "from-file"}}))
    assert load_config(tmp_path / "c.yaml", memory={"path": "given"}).data_dir == Path("given")


@pytest.mark.parametrize(("written", "expected"), [
    ("ipc://run/memory.sock", "ipc://{conf}/run/memory.sock"),  # relative: from the file's folder (was the cwd)
    ("ipc:///run/memory.sock", "ipc:///run/memory.sock"),  # absolute: untouched
    ("ipc://@memory", "ipc://@memory"),  # a Linux abstract socket: not a path
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
])
def test_a_relative_ipc_endpoint_in_a_config_file_is_read_from_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, expected: str) -> None:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"server": {"endpoint": written}}))
    monkeypatch.chdir(tmp_path.parent)  # the daemon under systemd runs in /, the CLI in a shell
    assert load_config(tmp_path / "c.yaml").server.endpoint == expected.format(conf=tmp_path)
