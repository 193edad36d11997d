"""tools/bench_vs_spec.py end to end on a tiny workload, when the spec's environment
(ChromaDB + sentence-transformers + torch, built by the tool in .bench/spec-venv) exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_util import ROOT

SPEC_PYTHON = ROOT / ".bench" / "spec-venv" / "bin" / "python"


def _spec_env_ready() -> bool:
    probe = [str(SPEC_PYTHON), "-c", "import chromadb, sentence_transformers, torch, matplotlib"]
    return SPEC_PYTHON.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0


pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not _spec_env_ready(), reason="the spec's environment is not built: run "
                       "'python -m tools.bench_vs_spec' once (it builds .bench/spec-venv, a few minutes)"),
]


def test_tiny_workload_runs_through_all_three_systems(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tools.bench_vs_spec", "--memories", "40", "--queries", "4",
                           "--stores", "2", "--rounds", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads((tmp_path / "bench_vs_spec.json").read_text())
    assert set(table) == {"spec", "engine", "daemon"}
    for system, row in table.items():
        assert row["search_p50"] > 0 and row["store_p50"] > 0 and row["rss_mb"] > 50, system
        assert row["disk_mb"] > 0 and row["hits"] > 0, system  # each system found what it stored
    assert "loading 40 memories into spec" in done.stderr  # progress is shown
    assert "| search, p50 |" in (tmp_path / "BENCH_VS_SPEC.md").read_text()
    assert (tmp_path / "bench_vs_spec.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
