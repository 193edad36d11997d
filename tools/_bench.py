"""Helpers shared by the benchmark scripts: timing, percentiles, RSS, corpora."""

from __future__ import annotations

import json
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SHARED = Path(__file__).resolve().parents[2] / "shared"


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50/p90/p99/max in milliseconds of samples in seconds."""
    arr = np.asarray(samples) * 1000.0
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max()), "n": len(arr)}


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Wall time of each of ``repeat`` calls."""
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def runs(fn: Callable[[], Any], repeat: int, n_runs: int = 3) -> dict[str, float]:
    """Several runs; reports the median across runs of each percentile."""
    per_run = [percentiles(timed(fn, repeat)) for _ in range(n_runs)]
    return {k: float(np.median([r[k] for r in per_run])) for k in per_run[0]} | {"runs": n_runs}


def timed_each(fn: Callable[..., Any], args_list: list[tuple[Any, ...]]) -> list[float]:
    """Wall time of ``fn(*args)`` for each ``args`` in turn."""
    out = []
    for args in args_list:
        start = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - start)
    return out


def memory_mb(pid: int | str = "self") -> tuple[float, float]:
    """(resident, peak resident) set size of a process in MB, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def rss_mb() -> float:
    """Current resident set size in MB (from /proc)."""
    try:
        return memory_mb()[0]
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _locomo() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((SHARED / "data" / "locomo-dev").glob("*.json"))]


def dialogue_lines() -> list[str]:
    """Every turn's text in the LoCoMo dev conversations, in order."""
    return [turn["text"] for conv in _locomo() for key, turns in conv.items()
            if key.startswith("session_") and isinstance(turns, list) for turn in turns]


def questions() -> list[str]:
    """Every question of the LoCoMo dev conversations."""
    return [q["question"] for conv in _locomo() for q in conv["qa"]]


def vocabulary() -> list[str]:
    """Words of the LoCoMo dialogues, for realistic synthetic texts."""
    words = [word for line in dialogue_lines() for word in line.split()]
    return words or ["robot", "memory", "tea", "coffee", "garden", "music", "dinosaur", "kitchen"]


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` synthetic dialogue-like lines."""
    rng = random.Random(seed)
    vocab = vocabulary()
    return [" ".join(rng.choices(vocab, k=rng.randint(6, 18))) for _ in range(n)]


def row(name: str, stats: dict[str, float], target: str = "") -> str:
    return (f"{name:<46} p50 {stats['p50']:8.3f}  p90 {stats['p90']:8.3f}  p99 {stats['p99']:8.3f}  "
            f"max {stats['max']:8.3f} ms  {target}")


def model_cosines(cosines: Callable[[Callable[[list[str]], np.ndarray]], np.ndarray],
                  precisions: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``cosines(embed)`` with the real model at each of ``precisions`` (the built model cache)."""
    from reachy_memory import load_config, load_embedder

    cache = Path.home() / ".cache" / "reachy-memory" / "built"
    out = {}
    for precision in precisions:
        config = load_config(embedding={"precision": precision, "cache_dir": str(cache)})
        out[precision] = cosines(load_embedder(config).embed)
    return out


def pairs_main(argv: list[str] | None, doc: str | None, data: Path, run: Callable[[Path], dict[str, Any]],
               print_report: Callable[[dict[str, Any]], None]) -> int:
    """The command line of a labelled-pairs evaluation: ``--data``, and ``--json`` for the report
    ``run(data)`` makes (else ``print_report`` prints it)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=data)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.data)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0
