"""Prints the tables of recipes/results/fednlp-20news.md from finished runs of recipes/fednlp-20news.yaml: final
test accuracy per partition and method (mean ± sd over the seeds found, 95% interval; under eval.select: best the
selected round's), the mean learning curve, the spread of local accuracy across clients, the curve roughness
FedNLP's Fig. 8 speaks of (the sd of a run's round-to-round changes of test accuracy), and the paired differences
the paper's claims compare.

    .venv/bin/python recipes/results/fednlp_20news_table.py runs/fednlp-20news runs/fednlp-20news-seeds
"""

import itertools
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from fedlm.run.recorder import read_metrics
from fedlm.run.report import summarize
from fedlm.run.seeds import SeedStats

PARTITIONS = [("iid", "uniform"), ("alpha=1.0", "alpha = 1"), ("alpha=5.0", "alpha = 5"), ("alpha=10.0", "alpha = 10"),
              ("beta=0.5", "quantity beta = 0.5")]
METHODS = ["FedAvg", "FedProx", "FedOpt"]


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


def main() -> None:
    runs: dict[tuple[str, str], dict[int, list[dict]]] = defaultdict(dict)
    selected: dict[int, float] = {}  # id(records) -> the final test accuracy under the run's eval.select
    for root in map(Path, sys.argv[1:]):
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
    print("| partition | " + " | ".join(METHODS) + " | Centralized |\n|---|---|---|---|---|")
    for key, label in PARTITIONS:
        cells = [stats(key, m).fixed(3, interval=True) for m in METHODS]
        print(f"| {label} | " + " | ".join(cells) + f" | {SeedStats(tuple(central)).fixed(3, interval=True)} |")

    print("\n| partition | " + " | ".join(f"{m} curve" for m in METHODS) + " | local acc. std, "
          + " / ".join(METHODS) + " |\n|---|---|---|---|---|")
    for key, label in PARTITIONS:
        curves = []
        for method in METHODS:
            seeds = list(runs.get((key, method), {}).values())
            evaluated = [[r["test_accuracy"] for r in recs if "test_accuracy" in r] for recs in seeds]
            curves.append(" ".join(f"{sum(c) / len(c):.2f}".lstrip("0") for c in zip(*evaluated, strict=True)))
        spread = " / ".join(f"{stats(key, m, 'local_accuracy_std').mean:.2f}" for m in METHODS)
        print(f"| {label} | " + " | ".join(curves) + f" | {spread} |")

    print("\n| partition | " + " | ".join(f"{m} curve roughness" for m in METHODS) + " |\n|---|---|---|---|")
    for key, label in PARTITIONS:
        cells = [SeedStats(tuple(roughness(recs) for recs in runs.get((key, m), {}).values())).fixed(3, interval=True)
                 for m in METHODS]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for method in METHODS:
        skewed, uniform = runs.get(("alpha=1.0", method), {}), runs.get(("iid", method), {})
        diffs = SeedStats(tuple(roughness(skewed[s]) - roughness(uniform[s]) for s in sorted(skewed) if s in uniform))
        print(f"  {method}: roughness alpha = 1 - uniform, paired by seed = {diffs.fixed(3, interval=True)}")

    print("\npaired by seed (same partition, same sampled clients):")
    for key, label in PARTITIONS:
        for a, b in (("FedOpt", "FedAvg"), ("FedProx", "FedAvg")):
            left, right = runs.get((key, a), {}), runs.get((key, b), {})
            diffs = SeedStats(tuple(final(left[s]) - final(right[s]) for s in sorted(left) if s in right))
            print(f"  {label}: {a} - {b} = {diffs.fixed(3, interval=True)}")
    for method in METHODS:
        print(f"  {method}: uniform {stats('iid', method).fixed(3, interval=True)} vs alpha = 1 "
              f"{stats('alpha=1.0', method).fixed(3, interval=True)}")


if __name__ == "__main__":
    main()
