"""Prints fedbert.md's Table 6 fine-tuning columns over seeds 0-2: mean ± sd per method and task, each method's
paired difference against the untrained start, Centralized's against every row on the SST-2 probe, and which
columns cannot rank the methods at all.

Seeds 1-2 come from the seed directories of fedbert.md (``<dir>/fedbert-roberta-<method>/seed=N``, their
downstream runs added by resuming with the recipe's ``downstream``); seed 0 from Table 6 in fedbert.md itself,
whose run directories a machine restart lost (its values are the ones printed there, to 3 digits).

    .venv/bin/python recipes/results/fedbert_finetune_seeds.py /tmp/fedbert/seeds recipes/results/fedbert.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedlm.run.downstream import downstream_scores
from fedlm.run.seeds import SeedStats, overlap, paired_difference

# method -> the seed grids holding its seeds 1-2 (FedAvg's seeds ran as two grids)
GRIDS = {"start (untrained)": ["start"], "Centralized": ["centralized"], "FedAvg": ["fedavg-s1", "fedavg-s2"],
         "Head-Emd Share": ["share"], "Head-Emd Share carry": ["share-carry"], "EmdAvg": ["emdavg"],
         "Head-Emd Avg": ["heademdavg"], "Parallel FedAvg": ["parallel"]}
TASKS = [("sst2 accuracy", "SST-2 acc"), ("mrpc accuracy", "MRPC acc"), ("rte accuracy", "RTE acc"),
         ("stsb pearson", "STS-B Pearson"), ("sst2-probe accuracy", "SST-2 probe acc")]
START, PROBE = "start (untrained)", "sst2-probe accuracy"


def seed0_from_md(md: Path) -> dict[str, dict[str, float]]:
    """Table 6's seed-0 fine-tuning scores: method -> task key -> score (the table's columns 3-7)."""
    text = md.read_text()
    section = text[text.index("## Table 6"):].splitlines()
    first = next(i for i, line in enumerate(section) if line.startswith("| method |"))
    last = next(i for i in range(first, len(section)) if not section[i].startswith("|"))
    scores: dict[str, dict[str, float]] = {}
    for line in section[first:last]:  # the section's first table only (later ones are probes of other kinds)
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if cells[0] in GRIDS and len(cells) >= 7 and cells[2] != "-":
            scores[cells[0]] = {key: float(cells[2 + i]) for i, (key, _) in enumerate(TASKS)}
    return scores


def all_scores(root: Path, md: Path) -> dict[str, dict[int, dict[str, float]]]:
    """method -> seed -> task key -> final score."""
    scores: dict[str, dict[int, dict[str, float]]] = {m: {0: s} for m, s in seed0_from_md(md).items()}
    for method, grids in GRIDS.items():
        for grid in grids:
            for run_dir in sorted((root / f"fedbert-roberta-{grid}").glob("seed=*")):
                found = downstream_scores(run_dir)
                if found:
                    scores.setdefault(method, {})[int(run_dir.name.split("=")[1])] = found
    return scores


def paired(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], key: str) -> str:
    """a minus b on the seeds both have (``paired_difference``)."""
    diffs = [a[s][key] - b[s][key] for s in sorted(a) if s in b and key in a[s] and key in b[s]]
    return paired_difference(diffs, words=("higher", "lower"))


def main(root: Path, md: Path) -> None:
    scores = all_scores(root, md)
    stats = {m: {key: SeedStats(tuple(s[key] for s in by_seed.values() if key in s)) for key, _ in TASKS}
             for m, by_seed in scores.items()}
    print("| method | " + " | ".join(name for _, name in TASKS) + " |")
    print("|---|" + "---|" * len(TASKS))
    for method in GRIDS:
        if method in stats:
            print(f"| {method} | " + " | ".join(stats[method][key].fixed(3) for key, _ in TASKS) + " |")
    print()
    print("Paired against the untrained start (same seed), row minus start:")
    print()
    print("| method | " + " | ".join(name for _, name in TASKS) + " |")
    print("|---|" + "---|" * len(TASKS))
    for method in GRIDS:
        if method != START and method in scores and START in scores:
            print(f"| {method} | " + " | ".join(paired(scores[method], scores[START], key) for key, _ in TASKS)
                  + " |")
    print()
    print("SST-2 probe, Centralized minus each row (same seed):")
    for method in GRIDS:
        if method != "Centralized" and method in scores and "Centralized" in scores:
            print(f"- vs {method}: {paired(scores['Centralized'], scores[method], PROBE)}")
    print()
    for key, name in TASKS:
        rows = [stats[m][key] for m in GRIDS if m in stats and stats[m][key].n > 1]
        ranked = any(overlap(a, b) is False for i, a in enumerate(rows) for b in rows[i + 1:])
        best = max((m for m in GRIDS if m in stats), key=lambda m: stats[m][key].mean)
        print(f"- {name}: highest mean {best} ({stats[best][key].mean:.3f}); "
              + ("some 95% intervals are disjoint" if ranked else "every 95% interval overlaps every other: "
                 "cannot rank"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
