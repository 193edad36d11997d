"""Embedder benchmark (issue: on-device embeddings).

    python tools/bench_embed.py [--repeat 300]
    python tools/bench_embed.py --build      # the model build: time and peak RSS, 3 runs
    python tools/bench_embed.py --ops        # where one query's time goes, by operator (int8, 1 thread)
    python tools/bench_embed.py --against OLD.onnx [--rounds 6]   # the built int8 graph against another

Prints, for fp32 and int8 at 1 and 2 threads: embed() latency for one short
query (tokenise + run + pool; fresh texts, so the LRU cache is not hit),
batch throughput on dialogue-length lines, model load time from the built
cache, and the RSS the loaded embedder adds. Each figure is the median of 3 runs.
``--build`` builds each precision from the safetensors weights into a scratch
cache 3 times (the build child the store uses) and prints its wall time and
peak RSS, and the caller's own peak.  ``--against`` times one fresh LoCoMo
question at a time, and batches of 8 dialogue lines, on the configured graph
and on another graph file (an older builder's, say), call by call in turn on
this noisy machine, and prints each round's medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reachy_memory import OnnxEmbedder, load_config, load_embedder
from tools._bench import dialogue_lines, questions, row, runs

PROBE = """
import sys, time, json
sys.path.insert(0, {root!r})
from tools._bench import rss_mb
import numpy, onnxruntime, tokenizers
base = rss_mb()
from reachy_memory import load_config, load_embedder
cfg = load_config(embedding={{"precision": {precision!r}, "threads": 1}})
t = time.perf_counter(); emb = load_embedder(cfg); load = time.perf_counter() - t
emb.embed(["warm up the session"])
print(json.dumps({{"load_s": load, "rss_mb": rss_mb(), "delta_mb": rss_mb() - base}}))
"""


def load_and_rss(precision: str) -> dict[str, float]:
    root = str(Path(__file__).resolve().parents[1])
    results = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", PROBE.format(root=root, precision=precision)],
                             capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: float(np.median([r[k] for r in results])) for k in results[0]}


def build_costs(repeat: int = 3) -> None:
    """Time and peak RSS of the model build child, per precision (``repeat`` builds each)."""
    from reachy_memory.embedding.model_files import ensure_model

    for precision in ("int8", "fp32"):
        times, peaks = [], []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
                cfg = load_config(embedding={"precision": precision, "cache_dir": tmp})
                start = time.perf_counter()
                ensure_model(cfg, progress=lambda _line: None)
                times.append(time.perf_counter() - start)
            # a fresh child per build: RUSAGE_CHILDREN's maximum is the largest child so far
            peaks.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
        print(f"{'build ' + precision:<46} {np.median(times):8.2f} s   child peak RSS {max(peaks):.0f} MB "
              f"(largest so far over {repeat} builds); this process {rss_peak_mb():.0f} MB")


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def throughput(emb: OnnxEmbedder, texts: list[str]) -> float:
    """Texts per second embedding ``texts`` in calls of 64 (median of 3 runs)."""
    rates = []
    for r in range(3):
        start = time.perf_counter()
        for i in range(0, len(texts), 64):
            emb.embed([f"{t} {r}" for t in texts[i : i + 64]])
        rates.append(len(texts) / (time.perf_counter() - start))
    return float(np.median(rates))


OPS_QUERY = "What did Caroline research about adoption agencies last week? 17"


def op_profile(repeat: int) -> None:
    """onnxruntime's own profile of ``repeat`` runs of one query, by operator type."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from reachy_memory.embedding.model_files import ensure_model

    files = ensure_model(load_config())
    tokenizer = Tokenizer.from_file(str(files.tokenizer))
    tokenizer.no_padding()
    ids = np.array([tokenizer.encode(OPS_QUERY).ids], np.int64)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.enable_cpu_mem_arena = 1, 1, False
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        options.profile_file_prefix = str(Path(tmp) / "ops")
        session = ort.InferenceSession(str(files.onnx), options, providers=["CPUExecutionProvider"])
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for _ in range(repeat):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0.0) + e["dur"] / repeat / 1000
    runs_ms = [e["dur"] / 1000 for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    print(f"{files.onnx.name}: one query of {ids.shape[1]} tokens, {repeat} runs, 1 thread, "
          f"model_run median {np.median(runs_ms):.3f} ms (profiling on); by operator (ms per run):")
    for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {op:<26} {ms:7.3f}")


def against(other: Path, rounds: int, repeat: int) -> None:
    """The configured graph (1 thread, no LRU cache) against ``other``: each round
    embeds ``repeat`` fresh questions and ``repeat // 10`` batches of 8 dialogue
    lines on both, call by call in turn (the noise of a shared machine then falls
    on both alike, and who goes first alternates), and prints the medians."""
    from reachy_memory.embedding.model_files import ensure_model

    files = ensure_model(load_config())
    embedders = [OnnxEmbedder(replace(files, onnx=path), lru_size=0) for path in (files.onnx, other)]
    qs, lines = questions(), dialogue_lines()
    ratios: dict[str, list[float]] = {"question": [], "batch of 8": []}
    for emb in embedders:
        emb.embed(["warm up"])
    for r in range(rounds):
        work = {"question": [[f"{qs[(r * repeat + i) % len(qs)]} {r}"] for i in range(repeat)],
                "batch of 8": [[f"{line} {r}" for line in lines[8 * i: 8 * i + 8]] for i in range(repeat // 10)]}
        report = []
        for kind, calls in work.items():
            p50 = _alternated(embedders, calls, r)
            ratios[kind].append(p50[0] / p50[1])
            report.append(f"{kind} p50 {p50[0]:.3f} / {p50[1]:.3f} ms ({ratios[kind][-1]:.3f})")
        print(f"round {r + 1}: " + ", ".join(report))
    for kind, values in ratios.items():
        print(f"{kind}: {files.onnx.name} / {other.name} median ratio {np.median(values):.3f} "
              f"over {rounds} rounds (min {min(values):.3f}, max {max(values):.3f})")


def _alternated(embedders: list[OnnxEmbedder], calls: list[list[str]], offset: int) -> list[float]:
    """Median ms of each embedder over ``calls``, taking turns call by call."""
    times: list[list[float]] = [[] for _ in embedders]
    for i, texts in enumerate(calls):
        order = range(len(embedders)) if (offset + i) % 2 == 0 else reversed(range(len(embedders)))
        for k in order:
            start = time.perf_counter()
            embedders[k].embed(texts)
            times[k].append((time.perf_counter() - start) * 1000)
    return [float(np.median(t)) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--build", action="store_true", help="measure the model build instead")
    parser.add_argument("--ops", action="store_true", help="profile one query by operator instead")
    parser.add_argument("--against", type=Path, metavar="GRAPH", help="time the built int8 graph against this one")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of --against (default 6)")
    args = parser.parse_args()
    if args.against:
        against(args.against, args.rounds, args.repeat)
        return
    if args.build:
        build_costs()
        return
    if args.ops:
        op_profile(args.repeat)
        return
    lines = dialogue_lines()
    for precision in ("fp32", "int8"):
        for threads in (1, 2):
            emb = load_embedder(load_config(embedding={"precision": precision, "threads": threads, "lru_size": 0}))
            lines = lines[:768]
            emb.embed(["warm up"] * 4)
            counter = iter(range(10**9))

            def one(emb: OnnxEmbedder = emb, counter: Iterator[int] = counter) -> None:
                emb.embed([f"What does my wife like? {next(counter)}"])

            stats = runs(one, args.repeat)
            print(row(f"embed() one short query {precision} threads={threads}", stats))
            qs = questions()

            def question(emb: OnnxEmbedder = emb, counter: Iterator[int] = counter, qs: list[str] = qs) -> None:
                n = next(counter)
                emb.embed([f"{qs[n % len(qs)]} {n}"])

            print(row(f"embed() one LoCoMo question {precision} t={threads}", runs(question, args.repeat)))
            short_rate = throughput(emb, [t for t in lines if len(t.split()) <= 10][:512])
            print(f"{'batch throughput, LoCoMo lines (median 30 tok)':<46} {throughput(emb, lines):8.0f} texts/s  "
                  f"({precision}, threads={threads}); lines of <= 10 words: {short_rate:.0f} texts/s")
        info = load_and_rss(precision)
        print(f"{'load from cache ' + precision:<46} {info['load_s']:8.3f} s   RSS added by the embedder "
              f"{info['delta_mb']:.0f} MB (process {info['rss_mb']:.0f} MB)")
    emb = load_embedder(load_config())
    emb.embed(["a repeated text"])
    print(row("embed() LRU hit (repeated text)", runs(lambda: emb.embed(["a repeated text"]), args.repeat)))


if __name__ == "__main__":
    main()
