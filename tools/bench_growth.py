"""What opening a large vector matrix and then growing it costs in memory and time.

Each run is a fresh process (peak RSS is per process): it reads a snapshot-like
file of ``--memories`` random 384-d rows with ``journal.read_bytes`` (bf16, as
snapshots hold them now; float32 for a checkout from before bf16),
loads it into a ``VectorIndex`` (as opening a store does), then adds one row
past the end (the first store after opening a full matrix, which doubles it).
Prints, as medians over ``--runs``: the load time, the peak RSS the load adds,
the peak RSS the first add adds, and that add's time.

    .venv/bin/python tools/bench_growth.py --memories 100000 --runs 3
    .venv/bin/python tools/bench_growth.py --against ../other-checkout   # both, alternated
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DIM = 384


def _peak_mb() -> float:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]) / 1024


def one_run(path: Path, rows: int) -> dict[str, float]:
    """Load ``path`` (``.f32``, or its ``.bf16`` twin where the code keeps bf16) into a
    VectorIndex and add one row past the end (in this process)."""
    from reachy_memory.engine.vector_index import VectorIndex
    from reachy_memory.storage import journal as jr

    bf16 = "fmt" in inspect.signature(VectorIndex.load_vectors).parameters
    start = _peak_mb()
    t0 = time.perf_counter()
    data = jr.read_bytes(path.with_suffix(".bf16") if bf16 else path)
    index = VectorIndex(DIM)
    index.load_vectors(data, np.ones(rows, bool), np.zeros(rows, np.int8), *(["bf16"] if bf16 else []))
    del data
    t1 = time.perf_counter()
    opened = _peak_mb()
    index.add(rows, np.ones(DIM, np.float32))
    t2 = time.perf_counter()
    return {"load_ms": 1000 * (t1 - t0), "load_peak_mb": opened - start,
            "first_add_peak_mb": _peak_mb() - opened, "first_add_ms": 1000 * (t2 - t1)}


def in_child(checkout: Path, path: Path, rows: int) -> dict[str, float]:
    """:func:`one_run` in a fresh process importing ``reachy_memory`` from ``checkout``."""
    out = subprocess.run([sys.executable, __file__, "--child", str(path), str(rows)], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(checkout)})
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(one_run(Path(sys.argv[2]), int(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout, measured alternately in the same run")
    args = parser.parse_args()
    checkouts = {"this": ROOT, **({"other": args.against.resolve()} if args.against else {})}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.f32"
        rows = np.random.default_rng(0).standard_normal((args.memories, DIM)).astype(np.float32)
        path.write_bytes(rows.tobytes())
        bits = rows.view(np.uint32)  # the same rows as bf16 (vector_index.to_bf16, for any checkout)
        bf16 = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        path.with_suffix(".bf16").write_bytes(bf16.tobytes())
        results: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
        for run in range(args.runs):
            for name, checkout in checkouts.items():
                results[name].append(in_child(checkout, path, args.memories))
                print(f"\r  run {run + 1}/{args.runs} {name}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    print(f"{args.memories} vectors of {DIM} dimensions, medians of {args.runs} runs (fresh process each)")
    for name, runs in results.items():
        med = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
        print(f"{name:>6} ({checkouts[name]}): load {med['load_ms']:.0f} ms, peak RSS +{med['load_peak_mb']:.0f} MB; "
              f"first add past the end {med['first_add_ms']:.1f} ms, peak RSS +{med['first_add_peak_mb']:.0f} MB")


if __name__ == "__main__":
    main()
