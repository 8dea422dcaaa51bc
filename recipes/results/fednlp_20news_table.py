"""Prints the tables of recipes/results/fednlp-20news.md from finished runs of recipes/fednlp-20news.yaml: final
test accuracy per partition and method (mean ± sd over the seeds found, 95% interval; under eval.select: best the
selected round's), the mean learning curve, the spread of local accuracy across clients, the curve roughness
FedNLP's Fig. 8 speaks of (the sd of a run's round-to-round changes of test accuracy), and the paired differences
the paper's claims compare, with the verdicts of the rules fixed in recipes/fednlp-20news.yaml's header before the
rerun (issue 36 item 4). Partitions without runs are left out; give each grid once (runs of one partition, method
and seed in two roots would overwrite each other). ``--plot PNG``: every run's test accuracy per round, one panel
per partition.

    .venv/bin/python recipes/results/fednlp_20news_table.py runs/fednlp-20news runs/fednlp-20news-seeds
    .venv/bin/python recipes/results/fednlp_20news_table.py runs/fednlp-20news-v2 --plot fednlp-20news-v2.png
"""

import argparse
import itertools
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib
import yaml
from fedsplitbert_long import FEW_SEEDS, NOT_RUN, OTHER_SIDE, equivalence_verdict, interval
from matplotlib.ticker import MaxNLocator

from fedlm.run.recorder import read_metrics
from fedlm.run.report import summarize
from fedlm.run.seeds import SeedStats, equivalence

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PARTITIONS = [("iid", "uniform"), ("alpha=1.0", "alpha = 1"), ("alpha=5.0", "alpha = 5"), ("alpha=10.0", "alpha = 10"),
              ("beta=0.5", "quantity beta = 0.5")]
METHODS = ["FedAvg", "FedProx", "FedOpt"]
PROX_BAND = 0.02  # target 2's band for FedProx - FedAvg, fixed 2026-11-23 before the first runs


def setting(run_dir: Path) -> tuple[str, str, int]:
    """(partition, method, seed) of a run: the method is its grid label, or 'Centralized'."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    partition = config["partition"]
    name = {"iid": "iid", "quantity_dirichlet": f"beta={float(partition.get('beta', 0))}"}.get(
        partition["kind"], f"alpha={float(partition.get('alpha', 0))}")
    method = config.get("tags", {}).get("method") or config["protocol"]["kind"].capitalize()
    return name, method, int(config["seed"])


def roughness(records: list[dict], key: str = "test_accuracy") -> float:
    """The sd of a run's round-to-round changes of ``key`` over its trained rounds (0 for a straight line)."""
    values = [r[key] for r in records if key in r and r["round"] > 0]
    steps = [b - a for a, b in itertools.pairwise(values)]
    return statistics.stdev(steps) if len(steps) > 1 else float("nan")


def joint(words: list[str], wanted: str) -> str:
    """A claim made of several differences: it holds when every interval lies on the ``wanted`` side of 0, does
    not hold when any lies on the other side, and is within noise otherwise (fewer than 2 seeds: not measurable;
    no part or any part without a paired seed: not run)."""
    if not words or NOT_RUN in words:
        return NOT_RUN
    if "not measurable" in words:
        return FEW_SEEDS
    if all(word == wanted for word in words):
        return "holds"
    return "does not hold here" if OTHER_SIDE[wanted] in words else "within noise"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+")
    parser.add_argument("--plot", type=Path, help="write every run's test accuracy per round here")
    args = parser.parse_args()
    runs: dict[tuple[str, str], dict[int, list[dict]]] = defaultdict(dict)
    selected: dict[int, float] = {}  # id(records) -> the final test accuracy under the run's eval.select
    for root in args.roots:
        for run_dir in sorted(p.parent for p in root.glob("*/summary.md")):
            partition, method, seed = setting(run_dir)
            records = runs[(partition, method)][seed] = read_metrics(run_dir)
            select = yaml.safe_load((run_dir / "config.yaml").read_text()).get("eval", {}).get("select", "last")
            selected[id(records)] = summarize(records, "accuracy", "max", select=select)["final accuracy"]

    def final(records: list[dict], key: str = "test_accuracy") -> float:
        if key == "test_accuracy":
            return selected[id(records)]
        return next(r[key] for r in reversed(records) if key in r)

    def stats(partition: str, method: str, key: str = "test_accuracy") -> SeedStats:
        return SeedStats(tuple(final(recs, key) for recs in runs.get((partition, method), {}).values()))

    central = [final(recs) for (_, method), seeds in runs.items() if method == "Centralized" for recs in seeds.values()]
    partitions = [(key, label) for key, label in PARTITIONS if any((key, m) in runs for m in METHODS)]
    print("| partition | " + " | ".join(METHODS) + " | Centralized |\n|---|---|---|---|---|")
    for key, label in partitions:
        cells = [stats(key, m).fixed(3, interval=True) for m in METHODS]
        print(f"| {label} | " + " | ".join(cells) + f" | {SeedStats(tuple(central)).fixed(3, interval=True)} |")

    print("\n| partition | " + " | ".join(f"{m} curve" for m in METHODS) + " | local acc. std, "
          + " / ".join(METHODS) + " |\n|---|---|---|---|---|")
    for key, label in partitions:
        curves = []
        for method in METHODS:
            seeds = list(runs.get((key, method), {}).values())
            evaluated = [[r["test_accuracy"] for r in recs if "test_accuracy" in r] for recs in seeds]
            curves.append(" ".join(f"{sum(c) / len(c):.2f}".lstrip("0") for c in zip(*evaluated, strict=True)))
        spread = " / ".join(f"{stats(key, m, 'local_accuracy_std').mean:.2f}" for m in METHODS)
        print(f"| {label} | " + " | ".join(curves) + f" | {spread} |")

    print("\n| partition | " + " | ".join(f"{m} curve roughness" for m in METHODS) + " |\n|---|---|---|---|")
    for key, label in partitions:
        cells = [SeedStats(tuple(roughness(recs) for recs in runs.get((key, m), {}).values())).fixed(3, interval=True)
                 for m in METHODS]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for method in METHODS:
        diffs = SeedStats(tuple(paired(runs.get(("alpha=1.0", method), {}), runs.get(("iid", method), {}), roughness)))
        print(f"  {method}: roughness alpha = 1 - uniform, paired by seed = {diffs.fixed(3, interval=True)}")

    print("\npaired by seed (same partition, same sampled clients):")
    for key, label in partitions:
        for a, b in (("FedOpt", "FedAvg"), ("FedProx", "FedAvg")):
            diffs = SeedStats(tuple(paired(runs.get((key, a), {}), runs.get((key, b), {}), final)))
            print(f"  {label}: {a} - {b} = {diffs.fixed(3, interval=True)}")
    for method in METHODS:
        print(f"  {method}: uniform {stats('iid', method).fixed(3, interval=True)} vs alpha = 1 "
              f"{stats('alpha=1.0', method).fixed(3, interval=True)}")
    verdicts(runs, final, partitions)
    if args.plot:
        plot(runs, partitions, args.plot)


def paired(left: dict[int, list[dict]], right: dict[int, list[dict]], value) -> list[float]:
    """value(run of ``left``) - value(run of ``right``) for each seed both have."""
    return [value(left[s]) - value(right[s]) for s in sorted(left) if s in right]


def verdicts(runs: dict, final, partitions: list[tuple[str, str]]) -> None:
    """The header's three rules, each difference paired by seed with its 95% t-interval, and target 2's
    equivalence of FedProx and FedAvg (two one-sided tests: the whole interval inside the band)."""
    print("\n| claim | partition | difference [95% interval] | its side | verdict |\n|---|---|---|---|---|")
    for key, label in partitions:
        words = []
        for other in ("FedAvg", "FedProx"):
            text, word = interval(paired(runs.get((key, "FedOpt"), {}), runs.get((key, other), {}), final))
            words.append(word)
            print(f"| FedOpt best: FedOpt - {other} | {label} | {text} | {word} | |")
        print(f"| **FedOpt best** | {label} | | | **{joint(words, 'above 0')}** |")
    for key, label in partitions:
        found = equivalence(paired(runs.get((key, "FedProx"), {}), runs.get((key, "FedAvg"), {}), final), PROX_BAND)
        print(f"| **FedProx like FedAvg** (band ±{PROX_BAND}) | {label} | {found.text(3)} | | "
              f"**{equivalence_verdict(found)}** |")
    skewed = [(key, label) for key, label in partitions if key in ("alpha=1.0", "beta=0.5")]
    for method in METHODS:
        words = []
        for key, label in skewed:
            text, word = interval(paired(runs.get((key, method), {}), runs.get(("iid", method), {}), final))
            words.append(word)
            print(f"| non-IID costs {method}: {label} - uniform | {label} | {text} | {word} | |")
        print(f"| **non-IID costs {method}** | {' and '.join(lb for _, lb in skewed)} | | | "
              f"**{joint(words, 'below 0')}** |")
    for method in METHODS:
        text, word = interval(paired(runs.get(("alpha=1.0", method), {}), runs.get(("iid", method), {}), roughness))
        print(f"| **more skew, rougher curves** {method}: roughness alpha = 1 - uniform | alpha = 1 | {text} | {word} "
              f"| **{joint([word], 'above 0')}** |")


def plot(runs: dict, partitions: list[tuple[str, str]], out: Path) -> None:
    panels = [(f"20news, {label}", {method: [{r["round"]: r["test_accuracy"] for r in records if "test_accuracy" in r}
                                             for records in runs.get((key, method), {}).values()]
                                    for method in METHODS}) for key, label in partitions]
    plot_panels(panels, "test accuracy", out)


def plot_panels(panels: list[tuple[str, dict[str, list[dict[int, float]]]]], ylabel: str, out: Path,
                xlabel: str = "round") -> None:
    """One panel per (title, method -> one curve (round -> value) per seed), two to a row, a colour per method
    (the same in every panel); fednlp_tagging_v2.py and fdapt_ner_select.py draw their figures with it too."""
    rows, columns = (len(panels) + 1) // 2, min(len(panels), 2)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, methods) in zip(axes.flat, panels, strict=False):
        for i, (method, curves) in enumerate(methods.items()):
            for n, curve in enumerate(curves):
                ax.plot(list(curve), list(curve.values()), color=f"C{i}", alpha=0.8, label=method if n == 0 else None)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
