"""The choices and verdicts of recipes/fednlp-tagging-v2.yaml (issue 36 item 4) from its finished runs, by the
rules fixed in the recipe's header before the runs.

    .venv/bin/python recipes/results/fednlp_tagging_v2.py choose runs/fednlp-tagging-v2-lr [MORE_ROOTS ...]
    .venv/bin/python recipes/results/fednlp_tagging_v2.py compare runs/fednlp-tagging-v2 [--plot out.png]
    .venv/bin/python recipes/results/fednlp_tagging_v2.py choose --metric accuracy runs/fednlp-20news-lr

The 20news rerun's phase 1 (recipes/fednlp-20news.yaml's header: the same rule, on validation accuracy) is chosen
with ``--metric accuracy``, its grid's labels written as this script's families are.

``choose`` (phase 1) prints, per method family (FedAvg's SGD lr, FedOpt's AdamW lr, FedProx's mu), every grid
value's selected round, validation F1 and test F1, and the choice: the highest validation F1, flagged when it sits
at an edge of its grid (the header's rule then extends the grid). ``compare`` (phase 2) prints each method's test
entity F1 at its selected round per partition (mean ± sd [95% interval] over seeds, the round-0 start beside it),
the precondition, T1-T3 as same-seed differences with their rule's verdict, and the curve roughness (the sd of the
test F1 curve's round-to-round changes, as fednlp_20news_table.py measures it: 0 for a steady rise), with its
clustered - uniform difference (descriptive: no rule was fixed for it). ``--plot``: test F1 per round.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import yaml
from fednlp_20news_table import plot_panels, roughness
from fedsplitbert_long import equivalence_verdict, interval, verdict
from fedsplitbert_targets import stats

from fedlm.run.recorder import read_metrics
from fedlm.run.report import best_validation_round, metric_series
from fedlm.run.seeds import equivalence

METRIC = "f1"
LEARNS = 0.1  # the precondition: test F1 at the selected round above round 0's by this much in every seed
PROX_BAND = 0.03  # T2's equivalence band (F1), fixed in the header
FAMILIES = {"FedAvg": re.compile(r"^FedAvg sgd (\S+)$"), "FedOpt": re.compile(r"^FedOpt adamw (\S+)$"),
            "FedProx": re.compile(r"^FedProx mu (\S+)$")}


def load(roots: list[Path], metric: str = METRIC) -> dict[tuple[str, str], dict[int, dict]]:
    """(partition kind, method label) -> seed -> {'start', 'test', 'val', 'round', 'curve'} of each finished run
    (the test F1 at the round with the best validation F1, the header's selection)."""
    runs: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for path in sorted(p for root in roots for p in root.rglob("metrics.jsonl")):
        config = yaml.safe_load((path.parent / "config.yaml").read_text())
        records = read_metrics(path.parent)
        rounds, test = metric_series(records, f"test_{metric}")
        if not rounds or rounds[-1] < config["protocol"]["rounds"]:
            continue  # unfinished
        picked = best_validation_round(records, metric, "max")
        if picked is None:
            raise SystemExit(f"{path}: no val_{metric}; these runs need a validation split")
        curve = dict(zip(rounds, test, strict=True))
        label = config["tags"]["method"]
        runs[(config["partition"]["kind"], label)][config["seed"]] = {
            "start": curve[0], "test": curve[picked[0]], "val": picked[1], "round": picked[0], "curve": curve,
            "roughness": roughness(records, f"test_{metric}")}
    return runs


def choose(roots: list[Path], metric: str = METRIC) -> None:
    """Phase 1's table and choice per family (seed 0, one partition), on validation ``metric``."""
    runs = load(roots, metric)
    name = "F1" if metric == "f1" else metric
    print(f"| method | selected round | val {name} | test {name} |\n|---|---:|---:|---:|")
    by_family: dict[str, list[tuple[float, str, dict]]] = defaultdict(list)
    for (_, label), seeds in sorted(runs.items()):
        run = seeds[min(seeds)]
        print(f"| {label} | {run['round']} | {run['val']:.3f} | {run['test']:.3f} |")
        for family, pattern in FAMILIES.items():
            if match := pattern.match(label):
                by_family[family].append((float(match.group(1)), label, run))
    print()
    for family, rows in by_family.items():
        rows.sort(key=lambda row: row[0])
        best = max(range(len(rows)), key=lambda i: (rows[i][2]["val"], -i))  # the first of equals
        edge = " (at the grid's edge: extend it)" if best in (0, len(rows) - 1) and len(rows) > 1 else ""
        print(f"- {family}: {rows[best][1]}, val {name} {rows[best][2]['val']:.3f}{edge}")


def _paired(a: dict[int, dict], b: dict[int, dict], key: str = "test") -> list[float]:
    return [a[s][key] - b[s][key] for s in sorted(a.keys() & b.keys())]


def family_of(label: str) -> str:
    return next((family for family, pattern in FAMILIES.items() if pattern.match(label)), label)


def compare(roots: list[Path], plot: Path | None) -> None:
    """Phase 2's table, precondition and T1-T3."""
    runs = load(roots)
    partitions = sorted({p for p, _ in runs}, key=lambda p: p != "iid")
    methods = {family_of(label): label for _, label in runs}
    print("| partition | method | start (round 0) | test F1 at the selected round | selected rounds "
          "| curve roughness |\n|---|---|---:|---:|---|---:|")
    for part in partitions:
        for label in methods.values():
            seeds = runs.get((part, label), {})
            if not seeds:
                continue
            tests = [seeds[s]["test"] for s in sorted(seeds)]
            rough = [seeds[s]["roughness"] for s in sorted(seeds)]
            print(f"| {part} | {label} | {stats([seeds[s]['start'] for s in sorted(seeds)])} | {stats(tests)} "
                  f"| {', '.join(str(seeds[s]['round']) for s in sorted(seeds))} | "
                  f"{sum(rough) / len(rough):.3f} |")
    uniform = {family: runs.get(("iid", label), {}) for family, label in methods.items()}
    learns = all(len(seeds) > 1 and all(r["test"] - r["start"] >= LEARNS for r in seeds.values())
                 for seeds in uniform.values())
    print(f"\nPrecondition (every method's uniform test F1 >= round 0 + {LEARNS} in every seed): "
          f"{'met' if learns else 'NOT met: the comparison is not measurable here'}\n")
    print("| claim | partition | difference [95% interval] | verdict |\n|---|---|---|---|")
    for part in partitions:
        get = {family: runs.get((part, label), {}) for family, label in methods.items()}
        for other in ("FedAvg", "FedProx"):
            text, word = interval(_paired(get["FedOpt"], get[other]))
            print(f"| T1 FedOpt - {other} | {part} | {text} | {verdict(word, learns)} |")
        eq = equivalence(_paired(get["FedProx"], get["FedAvg"]), PROX_BAND)
        print(f"| T2 FedProx ~ FedAvg (band {PROX_BAND}) | {part} | {eq.text(3)} | "
              f"{equivalence_verdict(eq)} |")
    for family, label in methods.items():
        for part in partitions[1:]:
            text, word = interval(_paired(runs.get((part, label), {}), runs.get(("iid", label), {})))
            rule = verdict(word, wanted="below 0")
            print(f"| T3 {part} - uniform costs {family} | {part} | {text} | {rule} |")
    print("\n| curve roughness, clustered - uniform (same seed) | difference [95% interval] |\n|---|---|")
    for family, label in methods.items():
        for part in partitions[1:]:
            text, _ = interval(_paired(runs.get((part, label), {}), runs.get(("iid", label), {}), "roughness"))
            print(f"| {family} | {text} |")
    if plot:
        _plot(runs, partitions, methods, plot)


def _plot(runs: dict, partitions: list[str], methods: dict[str, str], out: Path) -> None:
    def curves(part: str, label: str) -> list[dict[int, float]]:
        seeds = runs.get((part, label), {})
        return [seeds[seed]["curve"] for seed in sorted(seeds)]

    panels = [(f"CoNLL-2003, {part} partition", {label: curves(part, label) for label in methods.values()})
              for part in partitions]
    plot_panels(panels, "test entity F1", out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["choose", "compare"])
    parser.add_argument("roots", type=Path, nargs="+")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--metric", default=METRIC, help="choose on val_METRIC (default f1; 20news: accuracy)")
    args = parser.parse_args()
    choose(args.roots, args.metric) if args.phase == "choose" else compare(args.roots, args.plot)


if __name__ == "__main__":
    main()
