"""Prints recipes/results/fedsplitbert.md's bytes-to-target table from a finished runs/fedsplitbert grid."""

from pathlib import Path

import yaml

from fedlm.run.recorder import read_metrics
from fedlm.run.report import summarize

ROOT = Path("runs/fedsplitbert")
GOALS = {"sst2": 0.79, "mrpc": 0.65, "ag_news": 0.85, "sst2-10clients": 0.75}  # local-test accuracy
METHODS = ["fedavg", "fedprox", "fedadam", "c=0 (isolated)", "c=2", "c=4", "c=4 +fp16"]


def main() -> None:
    cells: dict[tuple[str, str], str] = {}
    for config in sorted(ROOT.glob("*/config.yaml")):
        tags = yaml.safe_load(config.read_text())["tags"]
        if tags["method"] not in METHODS:
            continue
        records = read_metrics(config.parent)
        reach = summarize(records, "accuracy", "max", GOALS[tags["dataset"]], "local")
        per_round = (records[1]["bytes_up"] + records[1]["bytes_down"]) / 1e6
        got = ("not reached" if reach["MB to target"] is None
               else f"{reach['MB to target']:.0f} MB, round {reach['round to target']}")
        cells[tags["dataset"], tags["method"]] = f"{per_round:.0f} ({got})"
    print("| MB per round, up+down (MB to reach target, round) | target | " + " | ".join(METHODS) + " |")
    print("|---|---|" + "---|" * len(METHODS))
    for dataset, goal in GOALS.items():
        print(f"| {dataset} | {goal} | " + " | ".join(cells[dataset, m] for m in METHODS) + " |")


if __name__ == "__main__":
    main()
