"""FL-GLM's DialogSum comparison (recipes/fl-glm-dialogsum.yaml) over seeds: each method's start and final
ROUGE-L and test loss (mean ± sd, per seed), and the same-seed differences the recipe's targets name.

    .venv/bin/python recipes/results/fl_glm_seeds.py RUNS/fl-glm-dialogsum RUNS/fl-glm-dialogsum-seeds [...]

Runs are grouped by their method (``tags.method``; a baseline by its directory name) and seed.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import yaml

from fedlm.run.recorder import read_metrics
from fedlm.run.rundir import run_dirs
from fedlm.run.seeds import SeedStats, paired_difference, setting_label

SPLIT, FEDAVG, CENTRAL = "FL-GLM split (1,1)", "FedAvg P-Tuning v2", "Centralized P-Tuning v2"


def results(roots: list[Path]) -> dict[str, dict[int, dict[str, float]]]:
    """method -> seed -> start / final ROUGE-L and test loss of each finished run under the grid directories."""
    out: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for run in run_dirs(roots):
        config = yaml.safe_load((run / "config.yaml").read_text())
        scored = [m for m in read_metrics(run) if m.get("test_rougeL") is not None]
        if len(scored) < 2 or scored[-1]["round"] != config["protocol"]["rounds"]:
            continue  # unfinished
        method = (config.get("tags") or {}).get("method") or setting_label(run.name).replace("_", " ")
        out[method][config["seed"]] = {"start_rougeL": scored[0]["test_rougeL"], "rougeL": scored[-1]["test_rougeL"],
                                       "start_loss": scored[0]["test_loss"], "loss": scored[-1]["test_loss"]}
    return out


def method_table(res: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = ["| method | seeds | start ROUGE-L | final ROUGE-L | final test loss | per seed: ROUGE-L / loss |",
             "|---|---:|---:|---:|---:|---|"]
    for method in sorted(res):
        runs = dict(sorted(res[method].items()))

        def stats(key: str, runs: dict[int, dict[str, float]] = runs) -> str:
            return SeedStats(tuple(r[key] for r in runs.values())).fixed().removesuffix(" (1 seed)")

        per_seed = ", ".join(f"s{s}: {r['rougeL']:.3f} / {r['loss']:.3f}" for s, r in runs.items())
        lines.append(f"| {method} | {len(runs)} | {stats('start_rougeL')} | {stats('rougeL')} | {stats('loss')} | "
                     f"{per_seed} |")
    return "\n".join(lines)


def differences(res: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = ["| same seed | ROUGE-L difference [95% interval] | test loss difference [95% interval] | "
             "per seed (ROUGE-L) |", "|---|---|---|---|"]
    # (what, runs, baseline runs, which scores of the baseline: its final ones or its start's)
    pairs = [(f"{SPLIT} minus {FEDAVG}", res.get(SPLIT, {}), res.get(FEDAVG, {}), ""),
             (f"{SPLIT} minus {CENTRAL}", res.get(SPLIT, {}), res.get(CENTRAL, {}), ""),
             (f"{CENTRAL} minus the start", res.get(CENTRAL, {}), res.get(CENTRAL, {}), "start_")]
    for what, a, b, base in pairs:
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        rouge = [a[s]["rougeL"] - b[s][f"{base}rougeL"] for s in seeds]
        loss = [a[s]["loss"] - b[s][f"{base}loss"] for s in seeds]
        lines.append(f"| {what} | {paired_difference(rouge, words=('higher', 'lower'))} | "
                     f"{paired_difference(loss, words=('higher', 'lower'))} | "
                     + ", ".join(f"s{s}: {d:+.3f}" for s, d in zip(seeds, rouge, strict=True)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+", help="grid directories of recipes/fl-glm-dialogsum.yaml")
    res = results(parser.parse_args().roots)
    print(method_table(res), end="\n\n")
    print(differences(res))


if __name__ == "__main__":
    main()
