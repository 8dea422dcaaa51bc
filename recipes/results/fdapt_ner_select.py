"""The NER rerun of FDAPT's downstream judgement (issue 36 item 5; recipes/fdapt-ner.yaml's header, rules fixed
2026-11-28 04:55 UTC before any run): each pre-trained model fine-tuned on NCBI-disease with its epoch selected on
NCBI's development split, scored on the full test set, seeds 0-2; the verdicts of T0, T3 and T2.

    .venv/bin/python recipes/results/fdapt_ner_select.py runs/fdapt-ner-select [--plot fdapt-ner-select.png]

Prints per model the test entity F1 at the epoch with the best development F1 (mean ± sd [95% t-interval] over
seeds, each seed's with its epoch), the last epoch's beside it, then T0 (the original model's F1 between 0.2 and
0.8 in the mean, else every verdict is "not measurable here"), T3 (centralized DAPT - original and FDAPT -
original: "holds" when the same-seed interval lies above 0) and T2 (FDAPT - centralized DAPT as an equivalence:
"holds" only when the whole interval lies inside ±0.015). ``--plot``: test and development F1 per epoch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from fednlp_20news_table import paired as paired_by_seed
from fednlp_20news_table import plot_panels
from fedsplitbert_long import equivalence_verdict, interval, verdict

from fedlm.run.recorder import read_metrics
from fedlm.run.report import best_validation_round, metric_series
from fedlm.run.seeds import SeedStats, equivalence

ORIGINAL, CENTRAL, FDAPT = "original model", "centralized DAPT", "FDAPT 2 clients iid"
MODELS = [ORIGINAL, CENTRAL, FDAPT]
T0_RANGE = (0.2, 0.8)
T2_BAND = 0.015  # F1, fixed in the header


def load(root: Path) -> dict[str, dict[int, dict]]:
    """Model -> seed -> {'test', 'epoch', 'dev', 'last', 'curve'} of every finished run under ``root``."""
    runs: dict[str, dict[int, dict]] = {}
    for run_dir in sorted(p.parent for p in root.glob("*/summary.md")):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        records = read_metrics(run_dir)
        picked = best_validation_round(records, "f1", "max")
        if picked is None:
            raise SystemExit(f"{run_dir}: no val_f1; the rerun needs eval.select: best on NCBI's development split")
        rounds, test = metric_series(records, "test_f1")
        curve = dict(zip(rounds, test, strict=True))
        runs.setdefault(config["tags"]["pretrained"], {})[int(config["seed"])] = {
            "test": curve[picked[0]], "epoch": picked[0], "dev": picked[1], "last": test[-1], "curve": curve,
            "dev_curve": dict(zip(*metric_series(records, "val_f1"), strict=True))}
    return runs


def paired(runs: dict, a: str, b: str) -> list[float]:
    """Selected-epoch test F1 of model ``a`` minus ``b`` for every seed both have."""
    return paired_by_seed(runs.get(a, {}), runs.get(b, {}), lambda run: run["test"])


def table(runs: dict) -> None:
    print("| model | test F1 at the best-dev epoch, mean ± sd (seeds) [95% interval] | per seed (epoch) "
          "| last epoch's test F1 |\n|---|---|---|---|")
    for model in MODELS:
        seeds = runs.get(model, {})
        if not seeds:
            print(f"| {model} | not run | | |")
            continue
        order = sorted(seeds)
        print(f"| {model} | {SeedStats(tuple(seeds[s]['test'] for s in order)).fixed(3, interval=True)} | "
              + ", ".join(f"{seeds[s]['test']:.3f} ({seeds[s]['epoch']})" for s in order)
              + f" | {SeedStats(tuple(seeds[s]['last'] for s in order)).fixed(3)} |")


def verdicts(runs: dict) -> None:
    original = SeedStats(tuple(r["test"] for r in runs.get(ORIGINAL, {}).values()))
    # T0 reads the mean; below 2 seeds the differences that follow say 'not measurable' themselves
    measurable = original.n > 0 and T0_RANGE[0] < original.mean < T0_RANGE[1]
    mean = f"{original.mean:.3f} ({original.n} seed{'s' * (original.n != 1)})" if original.n else "not run"
    print(f"\n| claim | difference of test F1 [95% interval] | verdict |\n|---|---|---|\n"
          f"| T0 the original model's F1 lies in {T0_RANGE} | {mean} | {'holds' if measurable else 'fails'} |")
    for model in (CENTRAL, FDAPT):
        text, word = interval(paired(runs, model, ORIGINAL))
        print(f"| T3 {model} beats the original | {text} "
              f"| {verdict(word) if measurable else 'not measurable here (T0)'} |")
    found = equivalence(paired(runs, FDAPT, CENTRAL), T2_BAND)
    print(f"| T2 FDAPT close to centralized DAPT (band ±{T2_BAND}) | {found.text(3)} "
          f"| {equivalence_verdict(found) if measurable else 'not measurable here (T0)'} |")


def plot(runs: dict, out: Path) -> None:
    def curves(model: str, key: str) -> list[dict[int, float]]:
        seeds = runs.get(model, {})
        return [seeds[seed][key] for seed in sorted(seeds)]

    panels = [(f"NCBI-disease, {title} entity F1 per epoch", {model: curves(model, key) for model in MODELS})
              for key, title in (("curve", "test"), ("dev_curve", "development"))]
    plot_panels(panels, "entity F1", out, xlabel="epoch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the rerun's grid directory (runs/fdapt-ner-select)")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    runs = load(args.root)
    table(runs)
    verdicts(runs)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
