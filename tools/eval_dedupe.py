"""Precision / recall of the restatement rule on the labelled pairs.

    python tools/eval_dedupe.py [--data tests/data/dedupe_pairs.jsonl] [--json]

Each pair is two memories of one owner and type, labelled ``merge`` (a restatement:
exact, case and whitespace, punctuation, a filler such as "I know that", a light
paraphrase) or ``keep`` (a contrast: a negation, a number, a date, a name, a person,
an object, a refinement, roles swapped, a code's case).  A pair may name the memory's
person or owner for each side (``person_a``/``person_b``, ``owner_a``/``owner_b``):
two persons or owners are never the same memory (the store's rule, before the text's).
Cosines come from the real all-MiniLM-L6-v2, int8 (the default) and fp32.

The threshold of :func:`reachy_memory.engine.restating.decide` is chosen by the cross rule
of the other tuned settings (``tools/eval_supersession.py``, ``tools/eval_locomo.py
--cross``): choose on one half of the pairs (even lines), report on the other (odd
lines), then the other way round.  The choice, precision first (a wrong merge loses a
fact): the threshold with the best recall among those whose precision is at least
``PRECISION``, ties to the higher threshold; the cosine-only rule is shown for
comparison.  ``set: fresh`` pairs were written after the rule was frozen.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reachy_memory.engine.restating import THRESHOLD, decide  # noqa: E402
from tools._bench import model_cosines, pairs_main  # noqa: E402

DATA = ROOT / "tests" / "data" / "dedupe_pairs.jsonl"
PRECISION = 0.99  # the target: at most one wrong merge in a hundred
ATTACKS = "redteam"  # contrasts a reviewer wrote to break the rule: not a sample of what users tell
SWEEP = tuple(round(0.80 + 0.01 * i, 2) for i in range(20))


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    merge: bool
    kind: str
    topic: str
    apart: bool  # another person or owner on each side
    set: str
    row: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # as the file holds it


@dataclass(frozen=True)
class Score:
    precision: float
    recall: float
    merged: int
    wrong: int


Rule = Callable[[Pair, float], bool]


def load_pairs(path: Path = DATA) -> list[Pair]:
    """The labelled pairs, in file order."""
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            apart = any(row.get(f"{f}_a") != row.get(f"{f}_b") for f in ("person", "owner"))
            pairs.append(Pair(row["a"], row["b"], row["label"] == "merge", row["kind"], row["topic"], apart,
                              row.get("set", "dev"), row))
    return pairs


def cosines(pairs: Sequence[Pair], embed: Callable[[list[str]], np.ndarray]) -> np.ndarray:
    """The cosine of each pair's two embeddings (the embedder L2-normalises), each text
    embedded alone as a store embeds one write: int8 activations are quantized per call,
    so a text embedded in a batch gets a slightly different vector (cosines move ~0.01)."""
    vectors = {text: embed([text])[0] for text in {t for p in pairs for t in (p.a, p.b)}}
    return np.array([float(vectors[p.a] @ vectors[p.b]) for p in pairs])


def rule(threshold: float) -> Rule:
    """The store's rule: never across persons or owners, then :func:`decide` (b written after a)."""
    return lambda pair, sim: not pair.apart and decide(pair.b, pair.a, sim, threshold).same


def cosine_only(threshold: float) -> Rule:
    """The naive rule, for comparison: the same when the cosine reaches ``threshold``."""
    return lambda pair, sim: not pair.apart and sim >= threshold


def score(pairs: Sequence[Pair], sims: Sequence[float] | np.ndarray, merges: Rule) -> Score:
    """Precision and recall of merging."""
    tp = fp = fn = 0
    for pair, sim in zip(pairs, sims, strict=True):
        fired = merges(pair, float(sim))
        tp += fired and pair.merge
        fp += fired and not pair.merge
        fn += (not fired) and pair.merge
    return Score(tp / (tp + fp) if tp + fp else 1.0, tp / (tp + fn) if tp + fn else 1.0, tp + fp, fp)


def choose(pairs: Sequence[Pair], sims: np.ndarray, family: Callable[[float], Rule] = rule) -> float:
    """The threshold with the best recall among those of precision >= PRECISION (ties: the
    higher threshold); the most precise one if none reaches it."""
    scored = [(score(pairs, sims, family(t)), t) for t in SWEEP]
    good = [(s, t) for s, t in scored if s.precision >= PRECISION]
    if good:
        return max(good, key=lambda item: (round(item[0].recall, 6), item[1]))[1]
    return max(scored, key=lambda item: (round(item[0].precision, 6), round(item[0].recall, 6), item[1]))[1]


def halves(pairs: Sequence[Pair], sims: np.ndarray) -> tuple[tuple[list[Pair], np.ndarray], ...]:
    """(even lines, odd lines): the file is grouped by kind, so both halves hold every kind."""
    return (list(pairs[0::2]), sims[0::2]), (list(pairs[1::2]), sims[1::2])


def cross(pairs: Sequence[Pair], sims: np.ndarray, family: Callable[[float], Rule] = rule) -> list[dict[str, Any]]:
    """Choose on one half, score on the other, both ways."""
    (a_pairs, a_sims), (b_pairs, b_sims) = halves(pairs, sims)
    out = []
    for name, (cp, cs), (rp, rs) in (("even->odd", (a_pairs, a_sims), (b_pairs, b_sims)),
                                     ("odd->even", (b_pairs, b_sims), (a_pairs, a_sims))):
        chosen = choose(cp, cs, family)
        out.append({"split": name, "chosen": chosen, "tuning": score(cp, cs, family(chosen)).__dict__,
                    "held_out": score(rp, rs, family(chosen)).__dict__})
    return out


def pooled(pairs: Sequence[Pair], sims: np.ndarray, family: Callable[[float], Rule] = rule) -> Score:
    """Both folds of :func:`cross` at once (the two-fold estimate): every pair scored with
    the threshold chosen on the half it is not in."""
    (a_pairs, a_sims), (b_pairs, b_sims) = halves(pairs, sims)
    chosen = {id(p): choose(b_pairs, b_sims, family) for p in a_pairs} | \
        {id(p): choose(a_pairs, a_sims, family) for p in b_pairs}
    return score(pairs, sims, lambda pair, sim: family(chosen[id(pair)])(pair, sim))


def by_kind(pairs: Sequence[Pair], sims: np.ndarray, threshold: float) -> dict[str, dict[str, Any]]:
    """For each kind: pairs, and how many the shipped rule merged."""
    out: dict[str, dict[str, Any]] = {}
    merges = rule(threshold)
    for pair, sim in zip(pairs, sims, strict=True):
        row = out.setdefault(pair.kind, {"label": "merge" if pair.merge else "keep", "pairs": 0, "merged": 0})
        row["pairs"] += 1
        row["merged"] += merges(pair, float(sim))
    return out


def errors(pairs: Sequence[Pair], sims: np.ndarray, threshold: float) -> list[dict[str, Any]]:
    """The pairs the shipped rule gets wrong, with its reason."""
    wrong = []
    for pair, sim in zip(pairs, sims, strict=True):
        if rule(threshold)(pair, float(sim)) != pair.merge:
            reason = decide(pair.b, pair.a, float(sim), threshold).reason if not pair.apart else "another person"
            wrong.append({"a": pair.a, "b": pair.b, "label": "merge" if pair.merge else "keep", "kind": pair.kind,
                          "cosine": round(float(sim), 3), "reason": reason})
    return wrong


def sample(pairs: Sequence[Pair], sims: np.ndarray) -> tuple[list[Pair], np.ndarray]:
    """The pairs the rule is tuned and scored on: all but a reviewer's attacks (set
    ``ATTACKS``), which were written against the rule, found where it failed, and are
    reported apart (``by_set``, ``errors``)."""
    keep = [i for i, p in enumerate(pairs) if p.set != ATTACKS]
    return [pairs[i] for i in keep], sims[keep]


def evaluate(pairs: Sequence[Pair], sims_by_precision: dict[str, np.ndarray]) -> dict[str, Any]:
    """The whole report as a JSON-friendly dict."""
    report: dict[str, Any] = {"pairs": len(pairs), "merge": sum(p.merge for p in pairs), "threshold": THRESHOLD,
                              "attacks": sum(p.set == ATTACKS for p in pairs)}
    for precision, every in sims_by_precision.items():
        tuned, sims = sample(pairs, every)
        report[precision] = {
            "sweep": {f"{t:.2f}": score(tuned, sims, rule(t)).__dict__ for t in SWEEP},
            "cross": cross(tuned, sims), "pooled": pooled(tuned, sims).__dict__, "chosen_on_all": choose(tuned, sims),
            "cosine_only_cross": cross(tuned, sims, cosine_only),
            "shipped": score(tuned, sims, rule(THRESHOLD)).__dict__,
            "by_set": {name: score([p for p in pairs if p.set == name],
                                   [s for p, s in zip(pairs, every, strict=True) if p.set == name],
                                   rule(THRESHOLD)).__dict__ for name in sorted({p.set for p in pairs})},
            "by_kind": by_kind(pairs, every, THRESHOLD), "errors": errors(pairs, every, THRESHOLD)}
    return report


def print_report(report: dict[str, Any]) -> None:
    """The report as text."""
    print(f"{report['pairs']} pairs ({report['merge']} restatements); {report['attacks']} are a reviewer's attacks "
          f"(set {ATTACKS}: reported apart, below); shipped threshold {report['threshold']:.2f}")
    for precision in ("int8", "fp32"):
        part = report[precision]
        print(f"\n== {precision} vectors")
        for row in part["cross"]:
            h, t = row["held_out"], row["tuning"]
            print(f"  rule, {row['split']}: threshold {row['chosen']:.2f} (tuning P={t['precision']:.3f} "
                  f"R={t['recall']:.3f}) -> held out P={h['precision']:.3f} R={h['recall']:.3f} "
                  f"({h['merged']} merged, {h['wrong']} wrong)")
        h = part["pooled"]
        print(f"  rule, both halves held out (pooled): P={h['precision']:.3f} R={h['recall']:.3f} "
              f"({h['merged']} merged, {h['wrong']} wrong)")
        for row in part["cosine_only_cross"]:
            h = row["held_out"]
            print(f"  cosine alone, {row['split']}: threshold {row['chosen']:.2f} -> held out "
                  f"P={h['precision']:.3f} R={h['recall']:.3f}")
        s = part["shipped"]
        print(f"  chosen on all pairs: {part['chosen_on_all']:.2f}; shipped {report['threshold']:.2f} on all pairs: "
              f"P={s['precision']:.3f} R={s['recall']:.3f}")
        for name, sc in part["by_set"].items():
            print(f"    set {name}: P={sc['precision']:.3f} R={sc['recall']:.3f} ({sc['merged']} merged)")
        kinds = part["by_kind"].items()
        print("  by kind (shipped), merged/pairs: " + ", ".join(f"{k} {v['merged']}/{v['pairs']}" for k, v in kinds))
        for e in part["errors"]:
            what = "missed" if e["label"] == "merge" else "WRONG MERGE"
            print(f"    {what:<11} cos={e['cosine']:.3f} [{e['kind']}] {e['a']!r} / {e['b']!r} ({e['reason']})")


def load_sims(pairs: Sequence[Pair]) -> dict[str, np.ndarray]:
    """Cosines with the real model at both precisions."""
    return model_cosines(lambda embed: cosines(pairs, embed), ("int8", "fp32"))


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints the report (or JSON with --json)."""
    def run(data: Path) -> dict[str, Any]:
        pairs = load_pairs(data)
        return evaluate(pairs, load_sims(pairs))

    return pairs_main(argv, __doc__, DATA, run, print_report)


if __name__ == "__main__":
    sys.exit(main())
