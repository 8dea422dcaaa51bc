"""The tables, verdicts and plot of recipes/results/fedllm-pubmedqa.md from finished runs of
recipes/fedllm-pubmedqa.yaml (any subset of its settings and seeds).

    .venv/bin/python recipes/results/fedllm_pubmedqa_table.py runs/fedllm-pubmedqa \
        --plot recipes/results/fedllm-pubmedqa.png

Prints markdown: final test accuracy and acc_norm per setting (mean ± sample sd over seeds), the untuned bases
(round 0 of the centralized and fp32 runs) and the majority class on each seed's own 150 test items (recomputed
from the data with the run's seed, as the run drew them); same-seed differences with their 95% Student-t
interval; one verdict per pre-registered target (T1-T7 of the recipe's header, equivalence by two one-sided tests
read off the interval); every run's numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from fedlm.data.sources import load_source, resolve_data_dir
from fedlm.metrics import mean_interval
from fedlm.run.seeds import equivalence, paired_difference

SETTINGS = ("centralized", "fedavg iid", "fedavg skew", "fedprox skew", "fedavg iid fp32")
BASE, BASE_FP32, MAJORITY = "untuned base (NF4)", "untuned base (fp32)", "majority class (yes)"


def find_runs(root: Path) -> dict[tuple[str, int], dict]:
    """(setting, seed) -> the run's scores, for every finished run under ``root``."""
    runs = {}
    for config_path in sorted(root.rglob("config.yaml")):
        run = config_path.parent
        config = yaml.safe_load(config_path.read_text())
        setting = (config.get("tags") or {}).get("setting")
        metrics_path = run / "metrics.jsonl"
        if setting is None or not metrics_path.is_file():
            continue
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        final = [r for r in records if r["round"] == config["protocol"]["rounds"] and "test_acc" in r]
        if not final:
            continue  # unfinished
        start = next((r for r in records if r["round"] == 0 and "test_acc" in r), None)
        runs[(setting, config["seed"])] = {
            "dir": str(run), "config": config, "acc": final[0]["test_acc"], "acc_norm": final[0]["test_acc_norm"],
            "start": start and start["test_acc"], "start_norm": start and start["test_acc_norm"],
            "train_loss": [r["train_loss"] for r in records if r["round"] > 0],
            "wall": sum(r.get("wall_s", 0.0) for r in records),
            "mb_up": sum(r.get("bytes_up", 0) for r in records) / 1e6,
        }
    return runs


def majority_rates(runs: dict[tuple[str, int], dict], data_dir: Path) -> dict[int, float]:
    """Each seed's share of "yes" (label 0, the majority of PQA-L's training part) among its test items."""
    rates = {}
    for (_, seed), run in sorted(runs.items()):
        if seed in rates:
            continue
        data = run["config"]["data"]
        loaded = load_source(data["source"], data_dir, seed=seed, max_train_examples=data["max_train_examples"],
                             max_test_examples=data["max_test_examples"])
        labels = loaded.splits["test"]["label"]
        rates[seed] = sum(1 for label in labels if label == 0) / len(labels)
    return rates


class Scores:
    """Per row name (a setting, a base, the majority class) and seed: accuracy and acc_norm."""

    def __init__(self, runs: dict[tuple[str, int], dict], majority: dict[int, float]) -> None:
        self.acc: dict[str, dict[int, float]] = {}
        self.norm: dict[str, dict[int, float]] = {}
        for (setting, seed), run in runs.items():
            self.acc.setdefault(setting, {})[seed] = run["acc"]
            self.norm.setdefault(setting, {})[seed] = run["acc_norm"]
            if run["start"] is not None:
                base = BASE_FP32 if setting == "fedavg iid fp32" else BASE
                self.acc.setdefault(base, {})[seed] = run["start"]
                self.norm.setdefault(base, {})[seed] = run["start_norm"]
        self.acc[MAJORITY] = dict(majority)
        self.norm[MAJORITY] = dict(majority)  # one-token options of 2-5 letters: the same pick either way

    def rows(self) -> list[str]:
        return [r for r in (MAJORITY, BASE, BASE_FP32, *SETTINGS) if r in self.acc]

    def diffs(self, a: str, b: str) -> list[float]:
        seeds = sorted(set(self.acc.get(a, {})) & set(self.acc.get(b, {})))
        return [self.acc[a][s] - self.acc[b][s] for s in seeds]


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f} (1)"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} ({len(values)})"


def score_table(scores: Scores) -> str:
    lines = ["| row | acc | acc_norm | seeds |", "|---|---:|---:|---|"]
    for row in scores.rows():
        seeds = sorted(scores.acc[row])
        lines.append(f"| {row} | {spread([scores.acc[row][s] for s in seeds])} | "
                     f"{spread([scores.norm[row][s] for s in seeds])} | {', '.join(map(str, seeds))} |")
    return "\n".join(lines)


def difference_table(scores: Scores) -> str:
    pairs = [("centralized", BASE), ("centralized", MAJORITY), ("fedavg iid", BASE), ("fedavg iid", MAJORITY),
             ("fedavg iid", "centralized"), ("fedavg skew", "fedavg iid"), ("fedprox skew", "fedavg skew"),
             ("fedavg iid", "fedavg iid fp32"), (BASE, BASE_FP32), ("fedavg iid fp32", BASE_FP32)]
    lines = ["| difference (same seed) | accuracy: mean [95% interval] |", "|---|---|"]
    for a, b in pairs:
        diffs = scores.diffs(a, b)
        if diffs:
            lines.append(f"| {a} - {b} | {paired_difference(diffs, words=('higher', 'lower'))} |")
    return "\n".join(lines)


def above(diffs: list[float]) -> str:
    """'holds' when the interval lies above 0, 'does not hold' when below, else 'within noise'."""
    if len(diffs) < 2:
        return f"not measurable ({len(diffs)} paired seeds)"
    mean, _, half = mean_interval(diffs)
    word = "holds" if mean - half > 0 else "does not hold" if mean + half < 0 else "within noise"
    return f"{word}: {paired_difference(diffs, words=('higher', 'lower'))}"


def equivalent(diffs: list[float], band: float) -> str:
    result = equivalence(diffs, band)
    if result.interval is None:
        return result.text(3)
    word = {"equivalent": "holds", "differs": "does not hold"}.get(result.verdict, result.verdict)
    return f"{word}: {result.text(3)}"


def verdicts(scores: Scores) -> str:
    base = list(scores.acc.get(BASE, {}).values())
    majority = list(scores.acc.get(MAJORITY, {}).values())
    t1 = ("not measurable" if not base else
          f"{'holds' if statistics.fmean(base) < statistics.fmean(majority) else 'does not hold'}: base "
          f"{statistics.fmean(base):.3f} vs majority {statistics.fmean(majority):.3f} (means over seeds "
          f"{', '.join(map(str, sorted(scores.acc[BASE])))})")
    lines = [
        f"- T1 the untuned NF4 base is below the majority class: {t1}",
        f"- T2 centralized beats the untuned base: {above(scores.diffs('centralized', BASE))}",
        f"- T3 centralized beats the majority class: {above(scores.diffs('centralized', MAJORITY))}",
        f"- T4 FedAvg IID equivalent to centralized (±0.05): "
        f"{equivalent(scores.diffs('fedavg iid', 'centralized'), 0.05)}",
        f"- T5 label skew costs FedAvg (skew - IID below 0): "
        f"{above([-d for d in scores.diffs('fedavg skew', 'fedavg iid')])}",
        f"- T6 FedProx equivalent to FedAvg under skew (±0.02): "
        f"{equivalent(scores.diffs('fedprox skew', 'fedavg skew'), 0.02)}",
        f"- T7a FedAvg IID on NF4 equivalent to fp32 (±0.05): "
        f"{equivalent(scores.diffs('fedavg iid', 'fedavg iid fp32'), 0.05)}",
        f"- T7b untuned NF4 base equivalent to untuned fp32 base (±0.05): "
        f"{equivalent(scores.diffs(BASE, BASE_FP32), 0.05)}",
    ]
    return "\n".join(lines)


def run_table(runs: dict[tuple[str, int], dict]) -> str:
    lines = ["| setting | seed | start acc | final acc | final acc_norm | train loss by round | MB up | wall s |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    for (setting, seed), run in sorted(runs.items(), key=lambda kv: (SETTINGS.index(kv[0][0]), kv[0][1])):
        start = "-" if run["start"] is None else f"{run['start']:.3f}"
        loss = " / ".join(f"{v:.3f}" for v in run["train_loss"])
        lines.append(f"| {setting} | {seed} | {start} | {run['acc']:.3f} | {run['acc_norm']:.3f} | {loss} | "
                     f"{run['mb_up']:.1f} | {run['wall']:.0f} |")
    return "\n".join(lines)


def plot(scores: Scores, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = scores.rows()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colours = {seed: f"C{i}" for i, seed in enumerate(sorted({s for row in rows for s in scores.acc[row]}))}
    for y, row in enumerate(rows):
        seeds = sorted(scores.acc[row])
        values = [scores.acc[row][s] for s in seeds]
        ax.scatter(values, [y] * len(values), color=[colours[s] for s in seeds], zorder=3)
        ax.plot([statistics.fmean(values)] * 2, [y - 0.3, y + 0.3], color="black")
    for seed, colour in colours.items():
        ax.scatter([], [], color=colour, label=f"seed {seed}")
    if MAJORITY in scores.acc:
        ax.axvline(statistics.fmean(scores.acc[MAJORITY].values()), color="grey", linestyle=":", label="majority")
    ax.set_yticks(range(len(rows)), rows)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("PubMedQA test accuracy (150 items a seed, the same items for every row of a seed; bar = mean)")
    ax.set_title("Gemma 3 270M + LoRA, PubMedQA, 4 clients")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the grid directory (or a folder above it)")
    parser.add_argument("--plot", type=Path, help="write the per-seed accuracy plot here")
    parser.add_argument("--data-dir", type=Path, default=None, help="default: $FEDLM_DATA_DIR, else ../shared/data")
    args = parser.parse_args()
    runs = find_runs(args.root)
    if not runs:
        raise SystemExit(f"no finished runs of recipes/fedllm-pubmedqa.yaml under {args.root}")
    scores = Scores(runs, majority_rates(runs, args.data_dir or resolve_data_dir()))
    print("Final test accuracy (mean ± sd over seeds):\n")
    print(score_table(scores))
    print("\nSame-seed differences:\n")
    print(difference_table(scores))
    print("\nVerdicts (targets of the recipe's header):\n")
    print(verdicts(scores))
    print("\nEvery run:\n")
    print(run_table(runs))
    if args.plot:
        plot(scores, args.plot)


if __name__ == "__main__":
    main()
