"""reachy-memory side by side with the spec's original design, on one workload.

The spec (000) stores memories in ChromaDB and embeds with sentence-transformers
on torch.  This tool builds that stack once in its own environment
(``.bench/spec-venv``, not the project's ``.venv``), then runs the same workload
through three systems, alternating them over ``--rounds`` rounds:

* ``spec``: the spec's ``MemoryManager`` code in-process (ChromaDB 1.5.9,
  sentence-transformers, CPU torch);
* ``engine``: ``reachy_memory.MemoryStore`` in-process (default config: int8);
* ``daemon``: ``reachy-memory serve`` through ``MemoryClient`` (ipc).

Fairness: the same all-MiniLM-L6-v2 weights (reachy-memory's verified download,
loaded by sentence-transformers as BERT + mean pooling + normalisation), the same
texts, questions and thread count (torch and onnxruntime), embedding included on
both sides, every measured pass in a fresh process (no embedding cache can hit)
with distinct questions inside it, durable writes on both sides (ChromaDB's
default, reachy-memory ``fsync: always``).  Memories: the LoCoMo dev turns, then
synthetic dialogue lines up to ``--memories``; a third each conversation, fact,
context.  Writes ``BENCH_VS_SPEC.md``, ``bench_vs_spec.json`` and
``bench_vs_spec.png`` into ``--out`` (default ``docs/``).

    .venv/bin/python -m tools.bench_vs_spec                     # 3,000 memories, 2 rounds
    .venv/bin/python -m tools.bench_vs_spec --memories 200 --queries 10 --stores 5 --rounds 1 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tools" / "_vs_spec_worker.py"
SPEC_ENV = ROOT / ".bench" / "spec-venv"
SPEC_PACKAGES = ["chromadb==1.5.9", "sentence-transformers", "torch", "matplotlib"]
SYSTEMS = ("spec", "engine", "daemon")
LABELS = {"spec": "spec design (ChromaDB + sentence-transformers)", "engine": "reachy-memory in-process",
          "daemon": "reachy-memory daemon"}
TYPES = ("conversation", "fact", "context")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def spec_python(env: Path) -> Path:
    """The spec environment's python, built on first use (a few minutes, shown)."""
    python = env / "bin" / "python"
    probe = [str(python), "-c", "import chromadb, sentence_transformers, torch, matplotlib"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    say(f"building the spec's environment in {env} (chromadb, sentence-transformers, CPU torch; once) ...")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--progress-bar", "on", *SPEC_PACKAGES], check=True)
    return python


def model_dir() -> Path:
    """The verified weights reachy-memory fetched (``reachy-memory model fetch``)."""
    from reachy_memory import Config
    from reachy_memory.embedding.model_files import find_weights

    found = find_weights(Config())
    if found is None or not (found / "model.safetensors").exists():
        sys.exit("no model weights: run 'reachy-memory model fetch' first")
    return found


def workload(n: int, queries: int, stores: int, rounds: int) -> dict[str, Any]:
    """Memories to preload, and per round: questions, filtered questions, new texts."""
    from tools._bench import dialogue_lines, questions, sentences

    texts = (dialogue_lines() + sentences(n, seed=7))[:n]
    asked = questions()
    per_round = []
    for r in range(rounds):
        start = (r * (2 * queries + 1)) % max(1, len(asked) - 2 * queries - 1)
        chunk = asked[start : start + 2 * queries + 1]
        per_round.append({"queries": chunk[:queries], "filtered": chunk[queries:],
                          "new": sentences(stores, seed=1000 + r)})
    return {"memories": [[t, TYPES[i % 3]] for i, t in enumerate(texts)], "rounds": per_round}


def run_worker(python: Path, job: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """One worker process; returns its JSON result.  Raises RuntimeError with its stderr."""
    path = tmp / f"job-{job['system']}-{job['phase']}.json"
    job = {**job, "src": str(ROOT), "started": time.time()}
    path.write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "MKL_NUM_THREADS": str(job["threads"]),
           "OPENBLAS_NUM_THREADS": str(job["threads"]), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "False"}
    done = subprocess.run([str(python), str(WORKER), str(path)], capture_output=True, text=True, env=env,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{job['system']} {job['phase']} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def disk_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def summarise(passes: list[dict[str, Any]]) -> dict[str, float]:
    """Median over rounds of each pass's percentiles."""
    def med(key: str, q: float) -> float:
        return float(statistics.median(float(np.percentile(p[key], q)) for p in passes))

    return {"search_p50": med("search_ms", 50), "search_p99": med("search_ms", 99),
            "filtered_p50": med("filtered_ms", 50), "store_p50": med("store_ms", 50),
            "store_p99": med("store_ms", 99),
            "cold_start_s": float(statistics.median(p["cold_start_s"] for p in passes)),
            "rss_mb": float(statistics.median(p["rss_mb"] for p in passes)),
            "hits": float(min(sum(p["hits"]) for p in passes))}


def markdown(table: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    rows = [("cold start to first filtered search", "cold_start_s", "s"), ("store one memory, p50", "store_p50", "ms"),
            ("store one memory, p99", "store_p99", "ms"), ("search, p50", "search_p50", "ms"),
            ("search, p99", "search_p99", "ms"), ("search filtered to facts, p50", "filtered_p50", "ms"),
            ("peak RSS", "rss_mb", "MB"), ("data on disk", "disk_mb", "MB")]
    systems = list(table)
    head = "| workload | " + " | ".join(LABELS[s] for s in systems) + " | spec / daemon |"
    lines = [f"`python -m tools.bench_vs_spec --memories {args.memories} --queries {args.queries} "
             f"--stores {args.stores} --rounds {args.rounds} --threads {args.threads}` "
             f"({time.strftime('%Y-%m-%d %H:%M')}, median of {args.rounds} rounds; lower is better)", "",
             head, "|" + "---|" * (len(systems) + 2)]
    for label, key, unit in rows:
        cells = [f"{table[s][key]:,.3g} {unit}" for s in systems]
        ratio = (f"{table['spec'][key] / table['daemon'][key]:.1f}x"
                 if {"spec", "daemon"} <= set(table) and table["daemon"][key] else "")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=3000)
    parser.add_argument("--queries", type=int, default=100, help="searches per pass (and as many filtered)")
    parser.add_argument("--stores", type=int, default=50, help="single stores per pass")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads, both sides")
    parser.add_argument("--env", type=Path, default=SPEC_ENV, help="the spec stack's environment")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    python = spec_python(args.env)
    pythons = {"spec": python, "engine": Path(sys.executable), "daemon": Path(sys.executable)}
    work = workload(args.memories, args.queries, args.stores, args.rounds)
    weights = str(model_dir())
    passes: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    disk: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vs-spec-") as tmp_name:
        tmp = Path(tmp_name)
        base = {"model_dir": weights, "threads": args.threads}
        for system in SYSTEMS:
            (tmp / system).mkdir()
            say(f"loading {len(work['memories'])} memories into {system} ...")
            t0 = time.perf_counter()
            run_worker(pythons[system], {**base, "system": system, "phase": "load", "data": str(tmp / system / "data"),
                                         "memories": work["memories"]}, tmp)
            say(f"  {time.perf_counter() - t0:.1f} s")
        for r, job in enumerate(work["rounds"]):
            for system in SYSTEMS[r % 3 :] + SYSTEMS[: r % 3]:  # alternate who goes first
                say(f"round {r + 1}/{args.rounds}: {system} ...")
                result = run_worker(pythons[system], {**base, **job, "system": system, "phase": "measure",
                                                      "data": str(tmp / system / "data")}, tmp)
                passes[system].append(result)
                say(f"  cold {result['cold_start_s']:.2f} s, search p50 "
                    f"{np.percentile(result['search_ms'], 50):.1f} ms, RSS {result['rss_mb']:.0f} MB")
        for system in SYSTEMS:
            disk[system] = disk_mb(tmp / system / "data")
    table = {s: {**summarise(passes[s]), "disk_mb": disk[s]} for s in SYSTEMS}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_vs_spec.json").write_text(json.dumps(table, indent=2))
    text = markdown(table, args)
    (args.out / "BENCH_VS_SPEC.md").write_text("# reachy-memory vs the spec's design\n\n" + text
                                               + "\n![chart](bench_vs_spec.png)\n")
    subprocess.run([str(python), str(WORKER), "chart", str(args.out / "bench_vs_spec.json"),
                    str(args.out / "bench_vs_spec.png")], check=True)
    print(text)


if __name__ == "__main__":
    main()
