"""The tables, verdict helpers and plot of recipes/results/fedsplitbert.md from a finished fedsplitbert grid.

    .venv/bin/python recipes/results/fedsplitbert_targets.py RUNS/fedsplitbert [...] [--plot PNG]

Every seed draws its own subsample, partition and local test sets, and within a seed all methods share them, so
besides fedlm's unpaired 95% intervals this prints paired differences (method minus reference, seed by seed)
with their own 95% t-intervals: the sharper test of "A beats B" when the seeds' data differ more than the methods.
The targets are the ones fixed in recipes/fedsplitbert.yaml before the runs (each run's eval.target).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import yaml

from fedlm.metrics import mean_interval
from fedlm.run.recorder import read_metrics
from fedlm.run.report import summarize
from fedlm.run.seeds import SeedStats

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ACC = "final accuracy"
PRIOR = "label prior accuracy (local)"
BALANCED = 0.6  # clients whose largest class share is at most this: the label prior gives them (almost) nothing


def load(roots: Sequence[Path]) -> dict[tuple[str, str, int], dict]:
    """(dataset, method, seed) -> the run's summary plus its per-round MB and shared-split accuracy, from one or
    more grid directories of the recipe (e.g. a seed run later as a grid of its own)."""
    runs = {}
    for config_path in sorted(p for root in roots for p in root.glob("*/config.yaml")):
        config = yaml.safe_load(config_path.read_text())
        records = read_metrics(config_path.parent)
        if not records or records[-1].get("round") != config["protocol"]["rounds"]:
            continue  # unfinished
        summary = summarize(records, "accuracy", "max", config["eval"].get("target"), "local")
        last = records[-1]
        summary["shared"] = last.get("test_accuracy_mean", last.get("test_accuracy"))
        summary["clients"] = config["partition"]["num_clients"]
        summary["MB/round"] = (records[1]["bytes_up"] + records[1]["bytes_down"]) / 1e6
        near_even = [str(i) for i, mix in enumerate(config["partition"]["mixes"]) if max(mix) <= BALANCED]
        summary["balanced"] = _mean([last["local_by_client"][c]["accuracy"] for c in near_even])
        summary["balanced prior"] = _mean([last["local_prior_by_client"][c]["accuracy"] for c in near_even])
        runs[config["tags"]["dataset"], config["tags"]["method"], int(config["seed"])] = summary
    return runs


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _first(values: list[float]) -> str:
    return f"{values[0]:.0f}" if values else "-"


def stats(values: Sequence[float]) -> str:
    """'mean ± sd (n seeds) [low, high]' with the 95% t-interval of the mean, over the values that exist."""
    return SeedStats(tuple(v for v in values if v is not None and math.isfinite(v))).fixed(interval=True)


def paired(runs: dict, dataset: str, method: str, reference: str | None, seeds: list[int]) -> str:
    """Method minus reference (another method, or the label prior when None), seed by seed: mean and 95% interval,
    with the verdict the interval gives."""
    diffs = []
    for seed in seeds:
        a = runs.get((dataset, method, seed))
        b = runs.get((dataset, reference, seed)) if reference else a
        if a and b:
            diffs.append(a[ACC] - (b[ACC] if reference else a[PRIOR]))
    if len(diffs) < 2:
        return "-"
    mean, _, half = mean_interval(diffs)
    word = "within noise" if mean - half <= 0 <= mean + half else ("better" if mean > 0 else "worse")
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}] {word}"


def to_target(runs: dict, dataset: str, method: str, seeds: list[int]) -> str:
    """Rounds to the target per seed and the mean MB over the seeds that reached it."""
    cells = [c for s in seeds if (c := runs.get((dataset, method, s)))]
    reached = [c["MB to target"] for c in cells if c.get("MB to target") is not None]
    rounds = ",".join("-" if c.get("round to target") is None else str(c["round to target"]) for c in cells)
    mb = f"{sum(reached) / len(reached):.0f} MB" if reached else "never"
    return f"{mb} ({len(reached)}/{len(cells)} seeds; rounds {rounds})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+", help="grid directories (runs/fedsplitbert ...)")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    runs = load(args.roots)
    datasets = sorted(dict.fromkeys(d for d, _, _ in runs), key=lambda d: next(
        v["clients"] for k, v in runs.items() if k[0] == d))
    methods = list(dict.fromkeys(m for _, m, _ in runs))
    seeds = sorted({s for _, _, s in runs})
    fedavg = next(m for m in methods if "FedAvg" in m)
    isolated = next(m for m in methods if "isolated" in m)

    def column(dataset: str, method: str, key: str) -> list[float]:
        return [runs[dataset, method, s][key] for s in seeds if (dataset, method, s) in runs]

    print(f"Seeds: {seeds}. Cells: mean ± sd [95% t-interval of the mean] over seeds.\n")
    print("| local-test accuracy | " + " | ".join(f"{d}: final local | {d}: shared dev" for d in datasets) + " |")
    print("|---|" + "---|---|" * len(datasets))
    first = methods[0]
    print("| start (round 0) | " + " | ".join(f"{stats(column(d, first, 'start accuracy'))} | -" for d in datasets)
          + " |")
    print("| label prior (majority label of the client's training data) | "
          + " | ".join(f"{stats(column(d, first, PRIOR))} | -" for d in datasets) + " |")
    for m in methods:
        print(f"| {m} | " + " | ".join(f"{stats(column(d, m, ACC))} | {stats(column(d, m, 'shared'))}"
                                       for d in datasets) + " |")

    print("\nPaired differences in final local accuracy (same seed, same data), mean [95% t-interval]:\n")
    print("| minus | " + " | ".join(f"{d}: vs {ref}" for d in datasets
                                    for ref in (fedavg, isolated, "label prior")) + " |")
    print("|---|" + "---|" * (3 * len(datasets)))
    for m in methods:
        cells = [paired(runs, d, m, ref, seeds) if ref != m else "-"
                 for d in datasets for ref in (fedavg, isolated, None)]
        print(f"| {m} | " + " | ".join(cells) + " |")

    print("\nCommunication (Table VI): MB per round (up + down, all clients) and MB to the pre-registered target:\n")
    print("| method | " + " | ".join(f"{d}: MB/round | {d}: to target {runs[d, first, seeds[0]]['target']}"
                                     for d in datasets) + " |")
    print("|---|" + "---|---|" * len(datasets))
    for m in methods:
        print(f"| {m} | " + " | ".join(f"{_first(column(d, m, 'MB/round'))} | {to_target(runs, d, m, seeds)}"
                                       for d in datasets) + " |")
    print(f"\nClients whose mixes are nearly even (largest class <= {BALANCED}), where the label prior gives little:"
          " their mean final local accuracy against their label prior\n")
    print("| method | " + " | ".join(f"{d}: near-even clients | {d}: their prior" for d in datasets) + " |")
    print("|---|" + "---|---|" * len(datasets))
    for m in methods:
        print(f"| {m} | " + " | ".join(f"{stats(column(d, m, 'balanced'))} | {stats(column(d, m, 'balanced prior'))}"
                                       for d in datasets) + " |")
    if args.plot:
        plot(runs, datasets, methods, seeds, args.plot)


def plot(runs: dict, datasets: list[str], methods: list[str], seeds: list[int], path: Path) -> None:
    """Final local accuracy against c, per client setting: mean and 95% interval over seeds, beside the label
    prior's band and the starting point."""
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.2 * len(datasets), 3.8), sharey=True)
    for ax, dataset in zip(list(axes) if len(datasets) > 1 else [axes], datasets, strict=True):
        for key, style, name in ((ACC, "o-", "local test (the paper's score)"),
                                 ("shared", "s:", "shared dev split (each client's model)")):
            xs, means, halves = [], [], []
            for m in methods:
                values = [runs[dataset, m, s][key] for s in seeds if (dataset, m, s) in runs]
                if not values:
                    continue
                mean, _, half = mean_interval(values)
                xs.append(int(m.split("=")[1].split()[0]))
                means.append(mean)
                halves.append(0.0 if math.isnan(half) else half)
                ax.scatter([xs[-1]] * len(values), values, s=8, color="grey", alpha=0.5, zorder=2)
            ax.errorbar(xs, means, yerr=halves, fmt=style, capsize=4, label=name, zorder=3)
        for key, color, name in ((PRIOR, "tab:red", "label prior"), ("start accuracy", "tab:green", "round 0")):
            values = [runs[dataset, methods[0], s][key] for s in seeds if (dataset, methods[0], s) in runs]
            mean, _, half = mean_interval(values)
            ax.axhline(mean, color=color, ls="--", lw=1, label=f"{name} (mean)")
            if not math.isnan(half):
                ax.axhspan(mean - half, mean + half, color=color, alpha=0.1)
        ax.set_title(f"{dataset}: final accuracy after the last round")
        ax.set_xlabel("critical layer c (0: isolated, 6: FedAvg)")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    fig.axes[0].set_ylabel(f"accuracy (mean, 95% interval, {len(seeds)} seeds)")
    fig.axes[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
