"""What people-aware memory costs, in-process, with the real model (int8 default).

A store of ``--memories`` memories (LoCoMo dialogue lines: half facts about a
few dozen persons, half conversation turns), then, alternating in each round
so the machine's noise hits both sides alike:

* ``search`` (one embedding + hybrid ranking) vs ``context_for`` (one embedding,
  three ranked searches, people, the prompt text within 800 tokens);
* ``store`` of a fact vs ``remember`` of a fact about a person (person
  resolution and the supersession check included).

Prints p50/p90/p99 per operation and the difference of the medians.

    .venv/bin/python -m tools.bench_people --memories 10000 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from reachy_memory import MemoryStore, load_config
from tools._bench import dialogue_lines, percentiles, questions, timed_each

NAMES = ["Sarah", "John", "Maria", "Tom", "Ana", "Leo", "Kim", "Paul", "Rosa", "Bea", "Alex", "Lily"]


def build(path: Path, count: int) -> MemoryStore:
    cfg = load_config(memory={"path": str(path), "fsync": "never"})
    store = MemoryStore(config=cfg)
    lines = dialogue_lines()
    for name in NAMES:
        store.add_person(name)
    for start in range(0, count, 500):
        batch = []
        for i in range(start, min(start + 500, count)):
            kind = "fact" if i % 2 == 0 else "conversation"
            batch.append({"content": f"{NAMES[i % len(NAMES)]}: {lines[i % len(lines)]}", "memory_type": kind})
        store.store_batch(batch)
        print(f"  built {min(start + 500, count):,} / {count:,}", flush=True)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=40)
    args = parser.parse_args()
    qs = questions()
    with tempfile.TemporaryDirectory() as tmp:
        store = build(Path(tmp) / "data", args.memories)
        samples: dict[str, list[float]] = {"search": [], "context_for": [], "store": [], "remember": []}
        for r in range(args.rounds):
            batch = qs[r * 2 * args.per_round : (r + 1) * 2 * args.per_round]  # distinct questions: no cache hit
            samples["search"] += timed_each(store.search, [(q,) for q in batch[0::2]])
            samples["context_for"] += timed_each(store.context_for, [(q,) for q in batch[1::2]])
            batch = batch[0::2]
            facts = [(f"fact {r}-{i}: {q}",) for i, q in enumerate(batch)]
            samples["store"] += timed_each(store.store, facts)
            samples["remember"] += timed_each(lambda c: store.remember(c, subjects=[NAMES[len(c) % len(NAMES)]]),
                                         [(f"note {r}-{i}: {q}",) for i, q in enumerate(batch)])
            print(f"  round {r + 1} done", flush=True)
        store.close()
    stats = {k: percentiles(v) for k, v in samples.items()}
    print(f"\n{args.memories:,} memories, {args.rounds} rounds x {args.per_round}, in-process, int8:")
    for name, s in stats.items():
        print(f"  {name:<12} p50 {s['p50']:.2f} ms  p90 {s['p90']:.2f} ms  p99 {s['p99']:.2f} ms  (n={s['n']})")
    extra = statistics.median(samples["context_for"]) - statistics.median(samples["search"])
    print(f"  context_for - search (medians): {extra * 1000:+.2f} ms")
    extra = statistics.median(samples["remember"]) - statistics.median(samples["store"])
    print(f"  remember - store (medians): {extra * 1000:+.2f} ms")


if __name__ == "__main__":
    main()
