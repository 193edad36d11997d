"""Shared fixtures: temporary data dirs, the real model (session-wide), stores."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from reachy_memory import Config, MemoryStore, load_config, load_embedder
from reachy_memory.embedding.embedder import OnnxEmbedder

# tools/check_arm64.sh (pytest --hypothesis-profile=emulated): under qemu a first example can take
# 10-30x longer than the rest, which hypothesis's deadline reads as flaky timing; fewer examples
# keep the emulated run within its time.
settings.register_profile("emulated", deadline=None, max_examples=25)

SHARED = Path(os.environ.get("REACHY_MEMORY_SHARED", Path(__file__).resolve().parents[2] / "shared"))
REFERENCE = SHARED / "data" / "minilm-reference"
LOCOMO = SHARED / "data" / "locomo-dev"


def model_cache() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "reachy-memory" / "built"


@pytest.fixture(scope="session")
def base_config() -> Config:
    """Defaults, with built models cached across test runs instead of per data dir."""
    return load_config(embedding={"cache_dir": str(model_cache())})


@pytest.fixture(scope="session")
def embedder(base_config: Config) -> OnnxEmbedder:
    """The real all-MiniLM-L6-v2 as configured by default (int8, one thread; tools/test.sh fetches it)."""
    return load_embedder(base_config)


@pytest.fixture(scope="session")
def fp32_embedder(base_config: Config) -> OnnxEmbedder:
    """The real model in fp32, for parity with sentence-transformers."""
    return load_embedder(base_config.replace("embedding", precision="fp32"))


@pytest.fixture
def config(base_config: Config, tmp_path: Path) -> Config:
    return base_config.replace("memory", path=str(tmp_path / "data"))


@pytest.fixture
def store(config: Config, embedder: OnnxEmbedder) -> Iterator[MemoryStore]:
    with MemoryStore(config=config, embedder=embedder) as s:
        yield s


@pytest.fixture
def lexical_store(config: Config) -> Iterator[MemoryStore]:
    with MemoryStore(config=config, embedder=None) as s:
        yield s


@pytest.fixture(scope="session")
def reference() -> tuple[list[str], np.ndarray]:
    """The embedding ground truth in shared/ (beside the clone, or $REACHY_MEMORY_SHARED).
    Missing: skipped on a developer's machine, an error in CI, where shared/ is always there.
    ``$REACHY_MEMORY_REFERENCE_EVERY=k`` keeps 1 sentence in k (tools/check_arm64.sh: emulation is slow)."""
    if not (REFERENCE / "sentences.json").exists():
        message = f"embedding ground truth not found in {REFERENCE} (set REACHY_MEMORY_SHARED to the shared/ folder)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    every = int(os.environ.get("REACHY_MEMORY_REFERENCE_EVERY", "1"))
    sentences = json.loads((REFERENCE / "sentences.json").read_text())[::every]
    return sentences, np.load(REFERENCE / "embeddings.npy")[::every]


class HashEmbedder:
    """A deterministic stand-in for failure-path tests (not for quality)."""

    dim = 8

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        if self.fail:
            raise RuntimeError("model crashed")
        rows = [np.random.default_rng(sum(t.encode()) + len(t)).standard_normal(self.dim) for t in texts]
        out = np.array(rows, np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)
