"""Tables and the curve plot of recipes/results/fednlp-tasks.md from finished run directories.

Each run's ``config.yaml`` names its setting (dataset tag, partition, method, FedOpt server lr, seed) and its
``metrics.jsonl`` holds the test scores per evaluated round; settings run under several seeds are shown as
mean ± sample sd (n).  Usage:

    python recipes/results/fednlp_tasks_table.py RUNS_ROOT [RUNS_ROOT ...] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import yaml

HEADLINE = {"tagging": "test_f1", "qa": "test_f1", "seq2seq": "test_rougeL", "classification": "test_accuracy"}


def setting(config: dict) -> tuple[str, str, str]:
    """(dataset, partition, method) of one run; FedOpt is named with its server lr."""
    tags = config.get("tags") or {}
    dataset = tags.get("dataset") or config["data"]["source"]
    proto = config["protocol"]
    method = proto["kind"]
    if method == "fedopt":
        method = f"fedopt(lr={proto['server_lr']:g})"
    if method == "centralized":
        return dataset, "-", method
    part = config["partition"]
    label = part["kind"] if part["kind"] != "label_dirichlet" else f"alpha={part['alpha']:g}"
    if part["kind"] == "clustered":
        label = f"clustered(k={part['clusters']}, alpha={part['alpha']:g})"
    return dataset, label, method


def load(roots: list[Path]) -> dict[tuple[str, str, str], list[dict]]:
    """setting -> one record per seed: {'seed', 'task', 'curve': {round: score}, 'em': final EM or None,
    'loss': (start, final) test loss or None}."""
    runs: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for metrics in sorted(p for root in roots for p in root.rglob("metrics.jsonl")):
        config = yaml.safe_load((metrics.parent / "config.yaml").read_text())
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        task = config["task"] if config["task"] != "auto" else "classification"
        key = HEADLINE[task]
        curve = {r["round"]: r[key] for r in rows if key in r}
        if len(curve) < 2 or max(curve) < config["protocol"]["rounds"]:  # unfinished or evaluation-only
            continue
        last = rows[-1]
        loss = [r["test_loss"] for r in rows if "test_loss" in r]
        runs[setting(config)].append({"seed": config["seed"], "task": task, "curve": curve,
                                      "em": last.get("test_exact_match"), "rounds": config["protocol"]["rounds"],
                                      "loss": (loss[0], loss[-1]) if loss else None})
    return runs


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({len(values)})"


def final(rec: dict) -> float:
    return rec["curve"][max(rec["curve"])]


def tables(runs: dict[tuple[str, str, str], list[dict]]) -> str:
    """One markdown table per dataset: partition rows x method columns (final score), then the curves."""
    out = []
    for dataset in sorted({k[0] for k in runs}):
        keys = [k for k in runs if k[0] == dataset]
        methods = sorted({k[2] for k in keys if k[2] != "centralized"})
        start = [rec["curve"][0] for k in keys for rec in runs[k] if 0 in rec["curve"]]
        out.append(f"### {dataset}\n\nround 0 (start, every run): {min(start):.3f}-{max(start):.3f}\n")
        out.append("| partition | " + " | ".join(methods) + " | centralized |")
        out.append("|---" * (len(methods) + 2) + "|")
        central = runs.get((dataset, "-", "centralized"), [])
        central_text = fmt([final(r) for r in central]) if central else "-"
        for part in sorted({k[1] for k in keys if k[1] != "-"}):
            cells = [fmt([final(r) for r in runs[(dataset, part, m)]]) if (dataset, part, m) in runs else "-"
                     for m in methods]
            out.append(f"| {part} | " + " | ".join(cells) + f" | {central_text} |")
        out.append("\ncurves (mean over seeds; round: score)\n")
        for key in sorted(keys):
            recs = runs[key]
            rounds = sorted(set.intersection(*(set(r["curve"]) for r in recs)))
            points = " ".join(f"{t}:{statistics.mean(r['curve'][t] for r in recs):.3f}" for t in rounds)
            em = [r["em"] for r in recs if r["em"] is not None]
            extra = f"  (final EM {fmt(em)})" if em else ""
            losses = [r["loss"] for r in recs if r["loss"]]
            if losses:
                extra += (f"  test loss {statistics.mean(a for a, _ in losses):.2f} -> "
                          f"{statistics.mean(b for _, b in losses):.2f}")
            out.append(f"- {key[1]} / {key[2]} [seeds {sorted(r['seed'] for r in recs)}]: {points}{extra}")
        out.append("")
    return "\n".join(out)


def plot(runs: dict[tuple[str, str, str], list[dict]], path: Path) -> None:
    """One panel per dataset: each setting's mean curve (solid: uniform / centralized, dashed: non-IID)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({k[0] for k in runs})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for key in sorted(k for k in runs if k[0] == dataset):
            recs = runs[key]
            rounds = sorted(set.intersection(*(set(r["curve"]) for r in recs)))
            scores = [statistics.mean(r["curve"][t] for r in recs) for t in rounds]
            if key[2] == "centralized":  # epochs, drawn over the federated round axis' span
                span = max(max(r["rounds"] for r in v) for k, v in runs.items() if k[0] == dataset)
                rounds = [t * span / max(rounds) for t in rounds]
            style = "--" if key[1] not in ("-", "iid") else "-"
            ax.plot(rounds, scores, style, marker=".", label=f"{key[2]} {key[1] if key[1] != '-' else ''}".strip())
        ax.set_title(dataset)
        ax.set_xlabel("round (centralized: epochs, stretched)")
        ax.set_ylabel(HEADLINE[runs[next(k for k in runs if k[0] == dataset)][0]["task"]])
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    runs = load(args.roots)
    print(tables(runs))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
