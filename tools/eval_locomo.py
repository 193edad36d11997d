"""Retrieval quality on LoCoMo (Maharana et al., ACL 2024; snap-research/locomo).

For each conversation file: a fresh store, every turn stored as a CONVERSATION
memory ("Speaker: text", plus the shared photo's caption), then every question
searched (no type filter, min_score=0).  Reports recall@1/5/10 of the evidence
dia_ids, per category and overall, for lexical-only, vector-only and hybrid.

    python tools/eval_locomo.py                       # ../shared/data/locomo-dev/*.json
    python tools/eval_locomo.py FILE.json ... [--json]
    python tools/eval_locomo.py --grid                # sweep fusion weights (tuning)
    python tools/eval_locomo.py --cross [--param P]   # tune P on one file, report on the other
    python tools/eval_locomo.py --latency [--param P] [--value V]  # search time, P at 0 vs V
    python tools/eval_locomo.py --dedupe [--as-facts] [FILE.json ...]  # hybrid recall, memory.dedupe off vs on

Each turn is stored with its session date as ``created_at`` and questions are
searched with ``now`` = the day after the last session (the time they are asked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reachy_memory import Config, MemoryStore, load_config, load_embedder

_SHARED = os.environ.get("REACHY_MEMORY_SHARED", Path(__file__).resolve().parents[2] / "shared")
DEFAULT_DIR = Path(_SHARED) / "data" / "locomo-dev"  # same override as tests/conftest.py
KS = (1, 5, 10)
MODES = ("lexical", "vector", "hybrid")


def turns_of(conv: dict[str, Any]) -> list[dict[str, Any]]:
    """Store items for every turn, in conversation order."""
    items = []
    session = 1
    while f"session_{session}" in conv:
        date = conv.get(f"session_{session}_date_time", "")
        for turn in conv[f"session_{session}"]:
            content = f"{turn['speaker']}: {turn['text']}"
            if turn.get("blip_caption"):
                content += f" [shares a photo: {turn['blip_caption']}]"
            items.append({"content": content, "memory_type": "conversation",
                          "created_at": session_time(date),
                          "metadata": {"dia_id": turn["dia_id"], "speaker": turn["speaker"],
                                       "session": session, "session_date": date}})
        session += 1
    return items


def session_time(date: str) -> datetime | None:
    """LoCoMo's "1:56 pm on 8 May, 2023" as a UTC datetime (None if unparsable)."""
    try:
        return datetime.strptime(date.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)
    except ValueError:
        return None


def asked_at(conv: dict[str, Any]) -> datetime | None:
    """The day after the conversation's last session: when its questions are asked."""
    times = [t["created_at"] for t in turns_of(conv) if t["created_at"] is not None]
    return max(times) + timedelta(days=1) if times else None


def evidence_of(question: dict[str, Any]) -> set[str]:
    ids: set[str] = set()
    for ev in question.get("evidence", []):
        ids.update(part.strip() for part in str(ev).replace(",", ";").split(";") if part.strip())
    return ids


def recall(store: MemoryStore, qa: list[dict[str, Any]], mode: str,
           now: datetime | None = None) -> dict[str, dict[int, list[float]]]:
    """category -> k -> per-question recall values."""
    out: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for q in qa:
        evidence = evidence_of(q)
        if not evidence or not q.get("question"):
            continue
        hits = store.search(q["question"], limit=max(KS), min_score=0, mode=mode, now=now)
        found = [h.memory.metadata.get("dia_id") for h in hits]
        for k in KS:
            value = len(evidence & set(found[:k])) / len(evidence)
            out[str(q.get("category", "?"))][k].append(value)
            out["overall"][k].append(value)
    return out


def merge(into: dict[str, dict[int, list[float]]], part: dict[str, dict[int, list[float]]]) -> None:
    for cat, per_k in part.items():
        for k, values in per_k.items():
            into.setdefault(cat, {}).setdefault(k, []).extend(values)


def summarise(results: dict[str, dict[int, list[float]]]) -> dict[str, dict[str, float]]:
    return {cat: {f"R@{k}": sum(v) / len(v) for k, v in sorted(per_k.items())} | {"n": len(per_k[1])}
            for cat, per_k in sorted(results.items())}


def open_store(tmp: Path, name: str, embedder: Any, config: Config) -> MemoryStore:
    # Retention is not under test: LoCoMo spans months, longer than the 30-day
    # conversation lifetime, so turns must outlive the time the questions are asked.
    memory = {"path": str(tmp / name), "fsync": "never", "conversation_ttl_days": 36500.0}
    return MemoryStore(config=config.replace("memory", **memory), embedder=embedder)


def evaluate(files: list[Path], config: Config, embedder: Any) -> dict[str, dict[str, dict[str, float]]]:
    totals: dict[str, dict[str, dict[int, list[float]]]] = {m: {} for m in MODES}
    with tempfile.TemporaryDirectory(prefix="rm-locomo-") as tmp:
        for path in files:
            conv = json.loads(path.read_text())
            with open_store(Path(tmp), path.stem, embedder, config) as store:
                store.store_batch(turns_of(conv))
                for mode in MODES:
                    merge(totals[mode], recall(store, conv["qa"], mode, asked_at(conv)))
    return {mode: summarise(res) for mode, res in totals.items()}


def built_stores(files: list[Path], tmp: Path, config: Config, embedder: Any) -> list[tuple[Path, Any, Any]]:
    """One store per conversation file, every turn stored: (path, store, conversation)."""
    out = []
    for path in files:
        conv = json.loads(path.read_text())
        store = open_store(tmp, path.stem, embedder, config)
        store.store_batch(turns_of(conv))
        out.append((path, store, conv))
    return out


def grid(files: list[Path], config: Config, embedder: Any) -> None:
    """Sweep the fusion parameters on stores built once (tuning aid)."""
    with tempfile.TemporaryDirectory(prefix="rm-locomo-") as tmp:
        stores = [(store, conv["qa"]) for _, store, conv in built_stores(files, Path(tmp), config, embedder)]
        for w in (0.2, 0.3, 0.4, 0.5, 0.6):
            for boost in (0.0, 0.03, 0.06):
                res: dict[str, dict[int, list[float]]] = {}
                for store, qa in stores:
                    store._config = config.replace("search", vector_weight=w, entity_boost=boost)
                    merge(res, recall(store, qa, "hybrid"))
                o = summarise(res)["overall"]
                print(f"vector_weight {w:.1f} entity_boost {boost:.2f}: "
                      f"R@1 {o['R@1']:.3f} R@5 {o['R@5']:.3f} R@10 {o['R@10']:.3f}")
        for store, _ in stores:
            store.close()


GRIDS = {"temporal_boost": (0.0, 0.02, 0.05, 0.1, 0.2), "neighbour_boost": (0.0, 0.05, 0.1, 0.2, 0.3),
         "feedback_weight": (0.0, 0.1, 0.2, 0.4, 0.6, 0.8), "entity_boost": (0.0, 0.01, 0.03, 0.06, 0.1),
         "diversity": (0.0, 0.05, 0.1, 0.2, 0.3, 0.5), "bm25_b": (0.0, 0.3, 0.5, 0.75, 0.9),
         "vector_weight": (0.2, 0.3, 0.4, 0.5), "previous_turn_weight": (0.0, 0.25, 0.5, 0.75, 1.0)}
# Applied when a memory is indexed: --cross and --latency build a store per value.
INDEX_TIME = frozenset({"previous_turn_weight"})
# The value --cross compares against (0: the feature off); BM25's textbook b for
# bm25_b; the shipped fusion weight for vector_weight (0 would be lexical only).
GRID_BASE = {"bm25_b": 0.75, "vector_weight": 0.3}


def cross(files: list[Path], config: Config, embedder: Any, param: str) -> None:
    """Tune ``search.<param>`` on each file over its grid, report hybrid recall on the others
    (against the same file with the parameter at its GRID_BASE value, 0 unless named there,
    every other setting at its value)."""
    grid = GRIDS[param]
    scored = {}
    with tempfile.TemporaryDirectory(prefix="rm-locomo-") as tmp:
        for name, value, per_cat in _sweep(files, Path(tmp), config, embedder, param):
            scored[name, value] = per_cat["overall"]
            hop = per_cat.get("1", {"R@5": 0.0, "R@10": 0.0})  # multi-hop, the category issue 12 targets
            print(f"{name} {param} {value:.2f}: R@5 {scored[name, value]['R@5']:.3f} "
                  f"R@10 {scored[name, value]['R@10']:.3f} (multi-hop {hop['R@5']:.3f}/{hop['R@10']:.3f})", flush=True)
    names = [path.name for path in files]
    for name in names:
        best = max(grid, key=lambda v: (scored[name, v]["R@5"] + scored[name, v]["R@10"], -v))
        for other in names:
            if other != name:
                base, got = scored[other, GRID_BASE.get(param, 0.0)], scored[other, best]
                print(f"tune on {name}: {param} {best:.2f} -> {other}: "
                      f"R@5 {base['R@5']:.3f} -> {got['R@5']:.3f}, R@10 {base['R@10']:.3f} -> {got['R@10']:.3f}")


def _sweep(files: list[Path], tmp: Path, config: Config, embedder: Any,
           param: str) -> Iterator[tuple[str, float, dict[str, dict[str, float]]]]:
    """(file name, value, hybrid recall by category) for each file and each value of
    ``param``'s grid.  Stores are built once, or once per value for a parameter
    applied when memories are indexed (:data:`INDEX_TIME`)."""
    grid = GRIDS[param]
    for values in ([[v] for v in grid] if param in INDEX_TIME else [grid]):
        at_build = config.replace("search", **{param: values[0]})
        for path, store, conv in built_stores(files, tmp / f"{param}-{values[0]}", at_build, embedder):
            with store:
                for value in values:
                    store._config = config.replace("search", **{param: value})
                    yield path.name, value, summarise(recall(store, conv["qa"], "hybrid", asked_at(conv)))


def latency(files: list[Path], config: Config, embedder: Any, param: str, value: float | None = None,
            repeat: int = 5) -> None:
    """Search time with ``search.<param>`` at 0 and at ``value`` (default: its configured
    value), interleaved in one run, one store each (built with that value).  Query
    vectors are computed once, so the figure is the ranking alone."""
    values = (0.0, getattr(config.search, param) if value is None else value)
    with tempfile.TemporaryDirectory(prefix="rm-locomo-") as tmp:
        for path in files:
            with contextlib.ExitStack() as opened:
                built = {v: built_stores([path], Path(tmp) / f"{param}-{v}", config.replace("search", **{param: v}),
                                         embedder)[0] for v in values}
                stores = {v: opened.enter_context(store) for v, (_, store, _) in built.items()}
                _time_searches(path, stores, built[0.0][2], param, repeat)


def _time_searches(path: Path, stores: dict[float, Any], conv: dict[str, Any], param: str, repeat: int) -> None:
    """Every question searched ``repeat`` times in each store, interleaved; prints p50/p95 per store."""
    first = next(iter(stores.values()))
    qs = [(q["question"], first.embed_query(q["question"])) for q in conv["qa"] if q.get("question")]
    now = asked_at(conv)
    times: dict[float, list[float]] = {v: [] for v in stores}
    for _ in range(repeat):
        for v, store in stores.items():
            for text, qvec in qs:
                t0 = time.perf_counter()
                store.search_vector(text, qvec, limit=10, min_score=0, now=now)
                times[v].append(time.perf_counter() - t0)
    for v, out in times.items():
        out.sort()
        print(f"{path.name} {len(first)} memories, {param} {v:.2f}: "
              f"p50 {1e3 * out[len(out) // 2]:.3f} ms  p95 {1e3 * out[int(len(out) * 0.95)]:.3f} ms")


def dedupe_effect(files: list[Path], config: Config, embedder: Any, as_facts: bool = False) -> None:
    """Hybrid recall with ``memory.dedupe`` off and on, a store built with each, in one run:
    what the restatement check on writes and the collapse of copies on reads cost.  The
    turns are conversation memories, which are never merged; ``as_facts`` stores them as
    facts instead (the worst case: repeated lines such as "Thanks!" merged, their copies'
    dia_ids gone from the results)."""
    results: dict[bool, dict[str, dict[int, list[float]]]] = {False: {}, True: {}}
    with tempfile.TemporaryDirectory(prefix="rm-locomo-") as tmp:
        for path in files:
            conv = json.loads(path.read_text())
            for on in (False, True):
                cfg = config.replace("memory", dedupe=on)
                items = [t | {"memory_type": "fact"} for t in turns_of(conv)] if as_facts else turns_of(conv)
                # the same vectors for both stores: int8 activations are quantized per batch of 8, and
                # texts the embedder's cache answers would leave the second store other batches
                getattr(embedder, "_cache", {}).clear()
                with open_store(Path(tmp), f"{path.stem}-{on}", embedder, cfg) as store:
                    store.store_batch(items)
                    part = recall(store, conv["qa"], "hybrid", asked_at(conv))
                    kept = len(store)
                merge(results[on], part)
                o = summarise(part)["overall"]
                print(f"{path.name} dedupe {'on ' if on else 'off'}: {kept} of {len(items)} memories kept, "
                      f"R@1 {o['R@1']:.3f} R@5 {o['R@5']:.3f} R@10 {o['R@10']:.3f}", flush=True)
    off, on = (summarise(results[v])["overall"] for v in (False, True))
    print("all files, on / off: " + "  ".join(f"{k} {on[k]:.3f}/{off[k]:.3f} ({on[k] / off[k]:.3f}x)"
                                              for k in ("R@1", "R@5", "R@10")))


def print_table(summary: dict[str, dict[str, dict[str, float]]]) -> None:
    cats = list(next(iter(summary.values())).keys())
    print(f"{'mode':<8} {'category':<9} {'n':>4}  {'R@1':>6} {'R@5':>6} {'R@10':>6}")
    for mode, per_cat in summary.items():
        for cat in cats:
            r = per_cat[cat]
            print(f"{mode:<8} {cat:<9} {int(r['n']):>4}  {r['R@1']:6.3f} {r['R@5']:6.3f} {r['R@10']:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--config", type=Path, help="YAML config (search and embedding sections are used)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--grid", action="store_true", help="sweep fusion weights")
    parser.add_argument("--latency", action="store_true", help="search time, --param at 0 vs its configured value")
    parser.add_argument("--cross", action="store_true", help="tune --param on one file, report on the other")
    parser.add_argument("--dedupe", action="store_true", help="hybrid recall with memory.dedupe off vs on")
    parser.add_argument("--as-facts", action="store_true", help="--dedupe: store the turns as facts (worst case)")
    parser.add_argument("--param", choices=sorted(GRIDS), default="neighbour_boost",
                        help="the search setting --cross and --latency vary (default: neighbour_boost)")
    parser.add_argument("--value", type=float, help="--latency: the value compared with 0 (default: configured)")
    parser.add_argument("--precision", choices=("fp32", "int8"), help="embedding precision (int8: 1 thread)")
    parser.add_argument("--no-neighbour", action="store_true", help="embed turns without the previous turn")
    args = parser.parse_args()
    files = args.files or sorted(DEFAULT_DIR.glob("*.json"))
    if not files:  # a silent run over nothing reads like a pass
        parser.error(f"no LoCoMo files in {DEFAULT_DIR}: pass FILE.json ... or set REACHY_MEMORY_SHARED")
    config = load_config(args.config)
    if args.no_neighbour:
        config = config.replace("embedding", neighbour_context=False)
    if args.precision:
        config = config.replace("embedding", precision=args.precision, threads=1 if args.precision == "int8" else 2)
    embedder = load_embedder(config)
    started = time.perf_counter()
    if args.latency:
        latency(files, config, embedder, args.param, args.value)
        return
    if args.cross:
        cross(files, config, embedder, args.param)
        return
    if args.dedupe:
        dedupe_effect(files, config, embedder, args.as_facts)
        return
    if args.grid:
        grid(files, config, embedder)
        return
    summary = evaluate(files, config, embedder)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"LoCoMo retrieval, {len(files)} conversation(s): {', '.join(f.name for f in files)}")
        print_table(summary)
        print(f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
