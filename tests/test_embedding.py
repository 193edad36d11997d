"""Parity with sentence-transformers (the shared ground truth) and loader behaviour."""

import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from reachy_memory import Config, ModelUnavailableError, load_config, load_embedder
from reachy_memory.embedding.embedder import OnnxEmbedder
from reachy_memory.embedding.model_files import BUILDER
from tests.conftest import model_cache


def test_fp32_parity_every_text(fp32_embedder: OnnxEmbedder, reference: tuple[list[str], np.ndarray]) -> None:
    sentences, expected = reference
    got = fp32_embedder.embed(sentences)
    assert got.shape == expected.shape and got.dtype == np.float32
    cos = (got * expected).sum(axis=1)
    assert cos.min() >= 0.9999, (cos.argmin(), sentences[int(cos.argmin())][:40])


def test_fp32_parity_one_at_a_time_matches_batch(fp32_embedder: OnnxEmbedder,
                                                 reference: tuple[list[str], np.ndarray]) -> None:
    sentences, expected = reference
    for i in range(0, len(sentences), 23):  # padding must not change a vector
        one = fp32_embedder.embed([sentences[i] + " "])[0]  # a new text: not served by the LRU
        assert float(one @ expected[i]) >= 0.9999


def test_int8_is_the_default_and_close_to_the_reference(embedder: OnnxEmbedder,
                                                         reference: tuple[list[str], np.ndarray]) -> None:
    sentences, expected = reference
    assert embedder.identity["precision"] == "int8"  # the default (issue 11)
    cos = (embedder.embed(sentences) * expected).sum(axis=1)
    assert cos.mean() >= 0.99 and cos.min() >= 0.97


def test_vectors_are_unit_length(embedder: OnnxEmbedder) -> None:
    vecs = embedder.embed(["", " ", "a" * 5000, "東京は日本の首都です", "🤖"])
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_lru_serves_repeated_texts(embedder: OnnxEmbedder) -> None:
    text = f"cache probe {time.time()}"
    first = embedder.embed([text])
    calls = []
    real = embedder._run
    embedder._run = lambda texts: calls.append(texts) or real(texts)  # type: ignore[method-assign]
    try:
        again = embedder.embed([text, text])
    finally:
        embedder._run = real  # type: ignore[method-assign]
    assert calls == [] and np.array_equal(again[0], first[0]) and np.array_equal(again[1], first[0])


def test_identity_names_model_and_weights(fp32_embedder: OnnxEmbedder) -> None:
    assert fp32_embedder.identity == {
        "name": "all-MiniLM-L6-v2",
        "sha256": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "dim": 384, "precision": "fp32",
    }


def test_no_model_gives_the_fix(tmp_path: Path) -> None:
    cfg = load_config(embedding={"download_dir": str(tmp_path / "empty"), "cache_dir": str(tmp_path / "c")})
    with pytest.raises(ModelUnavailableError) as info:
        load_embedder(cfg)
    assert "reachy-memory model fetch" in str(info.value)


def test_store_without_model_runs_lexical_and_says_so(tmp_path: Path) -> None:
    from reachy_memory import MemoryStore

    cfg = load_config(memory={"path": str(tmp_path / "d")},
                      embedding={"download_dir": str(tmp_path / "empty"), "cache_dir": str(tmp_path / "c")})
    with MemoryStore(config=cfg) as store:
        store.remember_fact("the keys are in the kitchen drawer")
        assert store.search("keys kitchen")[0].memory.content == "the keys are in the kitchen drawer"
        stats = store.stats()
        assert stats["embedder"] == "unavailable" and "model fetch" in stats["embedder_error"]


def test_model_dir_with_safetensors_builds_into_cache(tmp_path: Path, base_config: Config) -> None:
    source = Path(base_config.embedding.download_dir or Path.home() / ".cache/reachy-memory") / "all-MiniLM-L6-v2"
    cfg = load_config(embedding={"model_dir": str(source), "cache_dir": str(model_cache())})
    emb = load_embedder(cfg)
    assert emb.identity["sha256"].startswith("53aa51172d14")


@pytest.mark.parametrize(("precision", "floor"), [
    ("fp32", 0.9999),  # the graph is the same computation as sentence-transformers
    ("int8", 0.97),  # weight-only int8: the parity kept by the README's figures
])
def test_a_fresh_build_in_the_child_process_matches_the_reference(
        tmp_path: Path, base_config: Config, reference: tuple[list[str], np.ndarray], precision: str,
        floor: float) -> None:
    """The cached graphs other tests use may predate the builder: build anew here.
    Graphs of older builders are removed, other files are not."""
    built = tmp_path / "built"
    built.mkdir()
    stem = f"all-MiniLM-L6-v2-53aa51172d14-{precision}"
    stale, kept = [built / f"{stem}.onnx", built / f"{stem}-g1.onnx"], built / f"{stem}-notes.onnx"
    for path in (*stale, kept):
        path.write_bytes(b"old")
    emb = load_embedder(base_config.replace("embedding", cache_dir=str(built), precision=precision))
    graph = f"{stem}-{BUILDER}.onnx"
    assert sorted(p.name for p in built.iterdir()) == sorted([graph, f"{graph}.data", f"{graph}.sums", kept.name])
    texts, expected = reference
    got = emb.embed(texts[:40])
    assert float((got * expected[:40]).sum(axis=1).min()) >= floor


def test_a_build_that_fails_in_the_child_is_a_model_error(tmp_path: Path, base_config: Config) -> None:
    source = Path(base_config.embedding.download_dir or Path.home() / ".cache/reachy-memory") / "all-MiniLM-L6-v2"
    broken = tmp_path / "model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((source / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json" + bytes(64))
    cfg = load_config(embedding={"model_dir": str(broken), "cache_dir": str(tmp_path / "built")})
    with pytest.raises(ModelUnavailableError, match="building the ONNX graph"):
        load_embedder(cfg)
    assert not list((tmp_path / "built").iterdir())  # no model, no scratch folder left behind


def test_a_build_child_that_cannot_start_is_a_model_error(tmp_path: Path, base_config: Config,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    cfg = base_config.replace("embedding", cache_dir=str(tmp_path / "built"))
    with pytest.raises(ModelUnavailableError, match="could not start the model build"):
        load_embedder(cfg)


def test_model_dir_missing_files_is_explained(tmp_path: Path) -> None:
    cfg = load_config(embedding={"model_dir": str(tmp_path)})
    with pytest.raises(ModelUnavailableError, match=r"tokenizer\.json"):
        load_embedder(cfg)


_PINNED = """
import json, sys, threadpoolctl
from reachy_memory import MemoryStore, load_config
cfg = load_config(memory={"path": sys.argv[1]}, search={"blas_threads": int(sys.argv[2])})
with MemoryStore(config=cfg, embedder=None):
    print(json.dumps([i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]))
"""


@pytest.mark.parametrize("threads", [1, 2])  # the configured count, whatever the core count says
def test_blas_threads_are_pinned_as_configured(tmp_path: Path, threads: int) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}  # no help from the environment
    done = subprocess.run([sys.executable, "-c", _PINNED, str(tmp_path / "d"), str(threads)], env=env,
                          capture_output=True, text=True, timeout=60)
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts and set(counts) == {threads}, done.stderr


_HEAP = """
import ctypes, json, sys
from reachy_memory._threads import bound_native_heap, release_free_heap
bounded = bound_native_heap() if sys.argv[1] == "bounded" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def churn(size=8 << 20):  # what onnxruntime does with a long batch's activations
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)

churn()  # the first large free raises glibc's adaptive threshold to 8 MB
start = rss()
for _ in range(3):
    churn()
released = release_free_heap() if sys.argv[1] == "released" else False
print(json.dumps({"released": released, "bounded": bounded, "grew": rss() - start}))
"""


@pytest.mark.skipif(sys.platform != "linux" or not os.path.exists("/proc/self/statm") or
                    platform.libc_ver()[0] != "glibc", reason="glibc's malloc on Linux only")
@pytest.mark.parametrize(("mode", "kept"), [
    ("default", True),  # glibc alone keeps a freed 8 MB block on the heap: the test can fail
    ("released", False),  # release_free_heap gives it back to the system
    ("bounded", False),  # the daemon's policy: a block over 4 MiB has its own mapping
])
def test_native_heap_returns_large_blocks(mode: str, kept: bool) -> None:
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", _HEAP, mode], env=env, capture_output=True, text=True, timeout=60)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["released"] == (mode == "released") and result["bounded"] == (mode == "bounded"), done.stderr
    assert (result["grew"] >= 6 << 20) == kept, result


def test_a_large_embedding_call_gives_its_heap_back(embedder: OnnxEmbedder, monkeypatch: pytest.MonkeyPatch) -> None:
    import reachy_memory.embedding.embedder as embedding_module

    calls: list[int] = []
    monkeypatch.setattr(embedding_module, "release_free_heap", lambda: calls.append(1) or True)
    embedder.embed(["a short question"])  # one query: never trimmed (it would cost ~10 ms)
    assert calls == []
    embedder.embed([f"{'a long turn about the garden and the trains ' * 30} {i}" for i in range(16)])  # 16 x 256 tokens
    assert calls == [1]  # one trim for the whole call, not one per batch
