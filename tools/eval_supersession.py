"""Precision / recall of automatic supersession rules on the labelled pairs.

    python tools/eval_supersession.py [--data tests/data/supersession_pairs.jsonl] [--json]

Each pair is (old fact, new fact, label conflicting|compatible), both about
the same subject.  Cosines come from the real all-MiniLM-L6-v2, fp32 and int8.
Candidates: the spec's rule (cosine >= 0.75), a cosine threshold sweep, and
``reachy_memory.engine.supersession.decide`` with a sweep of similarity gates.

Choice, precision first (a wrong supersession hides a true fact): the
candidate with the highest precision among those with recall >= MIN_RECALL,
ties to higher recall, then to the lower threshold.  To keep the choice
honest the set is split in two halves (even / odd lines): choose on one, report
on the other, both ways, then on the whole set.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reachy_memory.engine.supersession import GATE, decide  # noqa: E402
from tools._bench import model_cosines, pairs_main  # noqa: E402

DATA = ROOT / "tests" / "data" / "supersession_pairs.jsonl"
SPEC_THRESHOLD = 0.75
MIN_RECALL = 0.5  # a rule that almost never fires is useless however precise
COSINE_SWEEP = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
GATE_SWEEP = (0.0, *COSINE_SWEEP)


@dataclass(frozen=True)
class Pair:
    old: str
    new: str
    conflicting: bool
    kind: str
    topic: str
    set: str  # "dev": the rule was built looking at these; "fresh": written after it was frozen


@dataclass(frozen=True)
class Score:
    precision: float
    recall: float
    f1: float
    fired: int


Rule = Callable[[Pair, float], bool]


def load_pairs(path: Path = DATA) -> list[Pair]:
    """The labelled pairs, in file order."""
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            pairs.append(Pair(row["old"], row["new"], row["label"] == "conflicting", row["kind"], row["topic"],
                              row.get("set", "dev")))
    return pairs


def cosines(pairs: Sequence[Pair], embed: Callable[[list[str]], np.ndarray]) -> np.ndarray:
    """Cosine of each pair's two embeddings (the embedder L2-normalises)."""
    old = embed([p.old for p in pairs])
    new = embed([p.new for p in pairs])
    return np.einsum("ij,ij->i", old, new)


def score(pairs: Sequence[Pair], sims: Sequence[float] | np.ndarray, rule: Rule) -> Score:
    """Precision / recall / F1 of ``rule`` for the 'conflicting' class."""
    tp = fp = fn = 0
    for pair, sim in zip(pairs, sims, strict=True):
        fired = rule(pair, float(sim))
        tp += fired and pair.conflicting
        fp += fired and not pair.conflicting
        fn += (not fired) and pair.conflicting
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return Score(precision, recall, f1, tp + fp)


def cosine_rule(threshold: float) -> Rule:
    """The spec's kind of rule: conflict when cosine >= threshold."""
    return lambda _pair, sim: sim >= threshold


def decide_rule(gate: float) -> Rule:
    """reachy_memory's rule with a given similarity gate."""
    return lambda pair, sim: decide(pair.new, pair.old, sim, gate=gate).conflict


def candidates() -> dict[str, Rule]:
    """Every rule the table compares, by name."""
    rules = {f"cosine>={t:.2f}": cosine_rule(t) for t in COSINE_SWEEP}
    rules |= {f"decide gate={g:.2f}": decide_rule(g) for g in GATE_SWEEP}
    return rules


def choose(pairs: Sequence[Pair], sims: Sequence[float] | np.ndarray, names: Sequence[str]) -> str:
    """Precision first among candidates with recall >= MIN_RECALL (see module doc)."""
    rules = candidates()
    scored = [(score(pairs, sims, rules[n]), n) for n in names]
    eligible = [(s, n) for s, n in scored if s.recall >= MIN_RECALL] or scored
    # Sort key: precision, then recall; the sweep order breaks ties to the lower threshold.
    return max(eligible, key=lambda item: (round(item[0].precision, 6), round(item[0].recall, 6)))[1]


def halves(pairs: Sequence[Pair], sims: np.ndarray) -> tuple[tuple[list[Pair], np.ndarray], ...]:
    """(even lines, odd lines): each topic's pairs land in both halves."""
    return ((list(pairs[0::2]), sims[0::2]), (list(pairs[1::2]), sims[1::2]))


def split_report(pairs: Sequence[Pair], sims: np.ndarray, family: str) -> list[dict[str, Any]]:
    """Choose within ``family`` on one half, score on the other, both ways."""
    names = [n for n in candidates() if n.startswith(family)]
    (a_pairs, a_sims), (b_pairs, b_sims) = halves(pairs, sims)
    out = []
    for label, (cp, cs), (rp, rs) in (("even->odd", (a_pairs, a_sims), (b_pairs, b_sims)),
                                      ("odd->even", (b_pairs, b_sims), (a_pairs, a_sims))):
        chosen = choose(cp, cs, names)
        out.append({"split": label, "family": family, "chosen": chosen,
                    "held_out": score(rp, rs, candidates()[chosen]).__dict__})
    return out


def evaluate(pairs: Sequence[Pair], sims_by_precision: dict[str, np.ndarray]) -> dict[str, Any]:
    """The whole report as a JSON-friendly dict."""
    rules = candidates()
    table = {name: {prec: score(pairs, sims, rule).__dict__ for prec, sims in sims_by_precision.items()}
             for name, rule in rules.items()}
    fp32 = sims_by_precision["fp32"]
    splits = split_report(pairs, fp32, "cosine") + split_report(pairs, fp32, "decide")
    chosen = {fam: choose(pairs, fp32, [n for n in rules if n.startswith(fam)]) for fam in ("cosine", "decide")}
    return {"pairs": len(pairs), "conflicting": sum(p.conflicting for p in pairs), "table": table,
            "splits": splits, "chosen_on_all": chosen, "by_set": by_set(pairs, fp32),
            "errors": errors(pairs, fp32, decide_rule(GATE))}


def by_set(pairs: Sequence[Pair], sims: np.ndarray) -> dict[str, dict[str, Any]]:
    """The spec's rule and the shipped rule (decide at GATE) on each set, dev and fresh."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({p.set for p in pairs}):
        idx = [i for i, p in enumerate(pairs) if p.set == name]
        sub, sub_sims = [pairs[i] for i in idx], sims[idx]
        out[name] = {"pairs": len(sub), f"cosine>={SPEC_THRESHOLD:.2f}": score(sub, sub_sims,
                     cosine_rule(SPEC_THRESHOLD)).__dict__, f"decide gate={GATE:.2f}": score(sub, sub_sims,
                     decide_rule(GATE)).__dict__}
    return out


def errors(pairs: Sequence[Pair], sims: np.ndarray, rule: Rule) -> list[dict[str, Any]]:
    """The pairs the rule gets wrong, for reading."""
    wrong = []
    for pair, sim in zip(pairs, sims, strict=True):
        fired = rule(pair, float(sim))
        if fired != pair.conflicting:
            reason = decide(pair.new, pair.old, float(sim), gate=0.0).reason
            wrong.append({"old": pair.old, "new": pair.new, "label": pair.conflicting, "cosine": round(float(sim), 3),
                          "kind": pair.kind, "rule_reason": reason})
    return wrong


def print_report(report: dict[str, Any]) -> None:
    """The table, the split choices and the errors, as text."""
    print(f"{report['pairs']} pairs, {report['conflicting']} conflicting\n")
    print(f"{'rule':<20} {'fp32 P':>7} {'R':>6} {'F1':>6} {'fired':>5} | {'int8 P':>7} {'R':>6} {'F1':>6}")
    for name, by_prec in report["table"].items():
        a, b = by_prec["fp32"], by_prec["int8"]
        mark = "  <- spec" if name == f"cosine>={SPEC_THRESHOLD:.2f}" else ""
        print(f"{name:<20} {a['precision']:7.3f} {a['recall']:6.3f} {a['f1']:6.3f} {a['fired']:5d} | "
              f"{b['precision']:7.3f} {b['recall']:6.3f} {b['f1']:6.3f}{mark}")
    print("\nchosen on one half, scored on the other (fp32):")
    for row in report["splits"]:
        h = row["held_out"]
        print(f"  {row['split']:<10} {row['chosen']:<20} P={h['precision']:.3f} R={h['recall']:.3f} F1={h['f1']:.3f}")
    print(f"\nchosen on the whole set: {report['chosen_on_all']}")
    print("\nspec rule vs shipped rule per set (fp32; 'fresh' was written after the rule was frozen):")
    for name, row in report["by_set"].items():
        cells = "  ".join(f"{rule}: P={v['precision']:.3f} R={v['recall']:.3f} F1={v['f1']:.3f}"
                          for rule, v in row.items() if rule != "pairs")
        print(f"  {name:<6} ({row['pairs']:3d} pairs)  {cells}")
    print(f"\nerrors of the shipped rule, decide gate={GATE:.2f} (fp32):")
    for e in report["errors"]:
        what = "missed" if e["label"] else "FALSE SUPERSESSION"
        print(f"  {what:<18} cos={e['cosine']:.3f} [{e['kind']}] {e['old']!r} -> {e['new']!r} ({e['rule_reason']})")


def load_sims(pairs: Sequence[Pair]) -> dict[str, np.ndarray]:
    """Cosines with the real model at both precisions."""
    return model_cosines(lambda embed: cosines(pairs, embed), ("fp32", "int8"))


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints the report (or JSON with --json)."""
    def run(data: Path) -> dict[str, Any]:
        pairs = load_pairs(data)
        return evaluate(pairs, load_sims(pairs))

    return pairs_main(argv, __doc__, DATA, run, print_report)


if __name__ == "__main__":
    sys.exit(main())
