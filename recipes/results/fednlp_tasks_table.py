"""Tables and the curve plot of recipes/results/fednlp-tasks.md from finished run directories.

Each run's ``config.yaml`` names its setting (dataset tag, partition, method, FedOpt server lr, seed) and its
``metrics.jsonl`` holds the test scores per evaluated round; settings run under several seeds are shown as
mean ± sample sd (n).  Usage:

    python recipes/results/fednlp_tasks_table.py RUNS_ROOT [RUNS_ROOT ...] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import yaml

from fedlm.run.seeds import SeedStats, paired_difference, verdict

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
    'loss_curve': {round: test loss}, empty when the task reports none}."""
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
        loss = {r["round"]: r["test_loss"] for r in rows if "test_loss" in r}
        runs[setting(config)].append({"seed": config["seed"], "task": task, "curve": curve,
                                      "em": last.get("test_exact_match"), "rounds": config["protocol"]["rounds"],
                                      "loss_curve": loss})
    return runs


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({len(values)})"


def final(rec: dict) -> float:
    return rec["curve"][max(rec["curve"])]


def loss_ends(rec: dict) -> tuple[float, float] | None:
    """(start, final) test loss of a run, or None without one."""
    curve = rec["loss_curve"]
    return (curve[min(curve)], curve[max(curve)]) if curve else None


MEASURES = {"headline": final, "test loss": lambda rec: loss_ends(rec)[1] if rec["loss_curve"] else math.nan}


def tables(runs: dict[tuple[str, str, str], list[dict]]) -> str:
    """Per dataset: partition rows x method columns of the final headline score and test loss, then the curves."""
    out = []
    for dataset in sorted({k[0] for k in runs}):
        keys = [k for k in runs if k[0] == dataset]
        methods = sorted({k[2] for k in keys if k[2] != "centralized"})
        start = [rec["curve"][0] for k in keys for rec in runs[k] if 0 in rec["curve"]]
        out.append(f"### {dataset}\n\nround 0 (start, every run): {min(start):.3f}-{max(start):.3f}\n")
        for measure, get in MEASURES.items():
            out.append(f"| {measure}: partition | " + " | ".join(methods) + " | centralized |")
            out.append("|---" * (len(methods) + 2) + "|")
            central = runs.get((dataset, "-", "centralized"), [])
            central_text = fmt([get(r) for r in central]) if central else "-"
            for part in sorted({k[1] for k in keys if k[1] != "-"}):
                cells = [fmt([get(r) for r in runs[(dataset, part, m)]]) if (dataset, part, m) in runs else "-"
                         for m in methods]
                out.append(f"| {part} | " + " | ".join(cells) + f" | {central_text} |")
            out.append("")
        out.append("curves (mean over seeds; round: score)\n")
        for key in sorted(keys):
            recs = runs[key]
            rounds = sorted(set.intersection(*(set(r["curve"]) for r in recs)))
            points = " ".join(f"{t}:{statistics.mean(r['curve'][t] for r in recs):.3f}" for t in rounds)
            em = [r["em"] for r in recs if r["em"] is not None]
            extra = f"  (final EM {fmt(em)})" if em else ""
            losses = [loss_ends(r) for r in recs if r["loss_curve"]]
            if losses:
                extra += (f"  test loss {statistics.mean(a for a, _ in losses):.2f} -> "
                          f"{statistics.mean(b for _, b in losses):.2f}")
            out.append(f"- {key[1]} / {key[2]} [seeds {sorted(r['seed'] for r in recs)}]: {points}{extra}")
        out.append("")
    return "\n".join(out)


def paired(runs: dict[tuple[str, str, str], list[dict]], a: tuple[str, str, str], b: tuple[str, str, str],
           get) -> str:
    """a minus b over the seeds both ran (same seed = same subsample, test set and initialisation)."""
    left, right = ({r["seed"]: get(r) for r in runs.get(k, [])} for k in (a, b))
    return paired_difference([left[s] - right[s] for s in sorted(left.keys() & right.keys())],
                             words=("higher", "lower"))


def differences(runs: dict[tuple[str, str, str], list[dict]]) -> str:
    """The paired differences behind FedNLP's claims: centralized vs FedAvg, non-IID vs uniform per method,
    FedProx and FedOpt vs FedAvg per partition."""
    lines = ["| dataset | difference (same seed) | headline | test loss |", "|---|---|---|---|"]
    for dataset in sorted({k[0] for k in runs}):
        parts = sorted({k[1] for k in runs if k[0] == dataset and k[1] != "-"})
        methods = sorted({k[2] for k in runs if k[0] == dataset and k[2] != "centralized"})
        uniform, skewed = "iid", next((p for p in parts if p != "iid"), None)
        pairs = [(f"centralized - fedavg {uniform}", (dataset, "-", "centralized"), (dataset, uniform, "fedavg"))]
        if skewed:
            pairs += [(f"{m}: {skewed} - {uniform}", (dataset, skewed, m), (dataset, uniform, m)) for m in methods]
        pairs += [(f"{m} - fedavg, {p}", (dataset, p, m), (dataset, p, "fedavg"))
                  for p in parts for m in methods if m != "fedavg"]
        for name, a, b in pairs:
            cells = [paired(runs, a, b, get) for get in MEASURES.values()]
            lines.append(f"| {dataset} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def share(fed: tuple[float, float], central: tuple[float, float]) -> float:
    """The part of centralized's (start, final) change that a federated (start, final) run reaches."""
    return (fed[1] - fed[0]) / (central[1] - central[0])


def gap_shares(runs: dict[tuple[str, str, str], list[dict]]) -> str:
    """FedNLP's "the gap is larger for the harder tasks": per seed, the share of centralized's gain over the start
    that FedAvg (uniform) reaches, on the test loss and on the headline (not for seq2seq, whose ROUGE-L is not
    monotone in training here); each run against its own round 0. Tasks compared by their 95% t-intervals."""
    shares: dict[str, dict[str, SeedStats]] = {}
    lines = ["| dataset | measure | share per seed | mean ± sd [95% interval] |", "|---|---|---|---|"]
    for dataset in sorted({k[0] for k in runs}):
        fed = {r["seed"]: r for r in runs.get((dataset, "iid", "fedavg"), [])}
        central = {r["seed"]: r for r in runs.get((dataset, "-", "centralized"), [])}
        seeds = sorted(fed.keys() & central.keys())
        if not seeds:
            continue
        # (FedAvg's, centralized's) (start, final); "at equal examples" stops centralized after its first epoch,
        # which saw fewer examples than any federated run here
        measures = {"test loss": lambda f, c: (loss_ends(f), loss_ends(c)),
                    "test loss, centralized epoch 1": lambda f, c: (loss_ends(f), (c["loss_curve"][0],
                                                                                   c["loss_curve"][1]))}
        if fed[seeds[0]]["task"] != "seq2seq":
            measures["headline"] = lambda f, c: ((f["curve"][0], final(f)), (c["curve"][0], final(c)))
        for measure, get in measures.items():
            values = [share(*get(fed[s], central[s])) for s in seeds]
            stats = shares.setdefault(measure, {})[dataset] = SeedStats(tuple(values))
            per_seed = " / ".join(f"{v:.2f}" for v in values)
            lines.append(f"| {dataset} | {measure} | {per_seed} (seeds {seeds}) | {stats.fixed(2, interval=True)} |")
    lines.append("")
    for measure, by_dataset in shares.items():
        names = sorted(by_dataset, key=lambda d: -by_dataset[d].mean)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                lines.append(f"- {measure}: " + verdict(a, by_dataset[a], b, by_dataset[b], "max"))
    return "\n".join(lines)


def plot(runs: dict[tuple[str, str, str], list[dict]], path: Path) -> None:
    """One panel per dataset: each setting's mean curve over its seeds with a ± sd band (solid: uniform /
    centralized, dashed: non-IID)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({k[0] for k in runs})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for key in sorted(k for k in runs if k[0] == dataset):
            recs = runs[key]
            common = sorted(set.intersection(*(set(r["curve"]) for r in recs)))
            scores = [statistics.mean(r["curve"][t] for r in recs) for t in common]
            rounds = common
            if key[2] == "centralized":  # epochs, drawn over the federated round axis' span
                span = max(max(r["rounds"] for r in v) for k, v in runs.items() if k[0] == dataset)
                rounds = [t * span / max(rounds) for t in rounds]
            style = "--" if key[1] not in ("-", "iid") else "-"
            name = f"{key[2]} {key[1] if key[1] != '-' else ''}".strip()
            (line,) = ax.plot(rounds, scores, style, marker=".", label=f"{name} (n={len(recs)})")
            if len(recs) > 1:  # the seeds' spread: mean ± sd
                sd = [statistics.stdev(r["curve"][t] for r in recs) for t in common]
                ax.fill_between(rounds, [m - d for m, d in zip(scores, sd, strict=True)],
                                [m + d for m, d in zip(scores, sd, strict=True)], color=line.get_color(), alpha=0.12)
        ax.set_title(f"{dataset}: mean ± sd over seeds")
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
    print("Paired differences, mean [95% t-interval]\n")
    print(differences(runs))
    print()
    print("FedAvg (uniform)'s share of centralized's gain over the start\n")
    print(gap_shares(runs))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
