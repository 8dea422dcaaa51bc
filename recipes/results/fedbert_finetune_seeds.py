"""Prints fedbert.md's Table 6 fine-tuning columns over seeds 0-2: mean ± sd per method and task, each method's
paired difference against the untrained start, Centralized's against every row on the SST-2 probe, and which
columns cannot rank the methods at all. Every seed comes from run directories of seeded grids of
recipes/fedbert-roberta.yaml (issue 36 item 2: seed 0 is no longer read back from the md it fills); the seeds may
be split over several grids, run side by side:

    .venv/bin/fedlm run recipes/fedbert-roberta.yaml name=fedbert-roberta-seeds 'seeds=[0, 1]'
    .venv/bin/fedlm run recipes/fedbert-roberta.yaml name=fedbert-roberta-seeds-2 'seeds=[2]'
    .venv/bin/python recipes/results/fedbert_finetune_seeds.py runs/fedbert-roberta-seeds runs/fedbert-roberta-seeds-2 \
        [--check recipes/results/fedbert.md]

``--check MD``: the rerun's seed-0 scores against the seed-0 row of MD's Table 6 (the recipe header's
reproduction check), each score to the table's 3 digits; a mismatch is printed, not fixed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from fedbert_tables import seed_dirs
from fedsplitbert_long import interval

from fedlm.run.downstream import downstream_scores
from fedlm.run.seeds import SeedStats, equivalence, overlap, paired_difference

# method -> its run directories' label in the grid (baselines by their label, grid entries as method=<label>)
LABELS = {"start (untrained)": "start (untrained)", "Centralized": "Centralized", "FedAvg": "method=FedAvg",
          "Head-Emd Share": "method=Head-Emd Share", "Head-Emd Share carry": "method=Head-Emd Share carry",
          "EmdAvg": "method=EmdAvg", "Head-Emd Avg": "method=Head-Emd Avg",
          "Parallel FedAvg": "method=Parallel FedAvg"}
TASKS = [("sst2 accuracy", "SST-2 acc"), ("mrpc accuracy", "MRPC acc"), ("rte accuracy", "RTE acc"),
         ("stsb pearson", "STS-B Pearson"), ("sst2-probe accuracy", "SST-2 probe acc")]
START, PROBE = "start (untrained)", "sst2-probe accuracy"
CENTRAL, CARRY = "Centralized", "Head-Emd Share carry"
PROBE_BAND = 0.02  # carry ~ Centralized on the probe: accuracy, fixed 2026-11-24 05:35 UTC before the runs


def table6_seed0(md: Path) -> dict[str, dict[str, float]]:
    """Table 6's seed-0 fine-tuning scores as printed: method -> task key -> score (the table's columns 3-7)."""
    text = md.read_text()
    section = text[text.index("## Table 6"):].splitlines()
    first = next(i for i, line in enumerate(section) if line.startswith("| method |"))
    last = next(i for i in range(first, len(section)) if not section[i].startswith("|"))
    scores: dict[str, dict[str, float]] = {}
    for line in section[first:last]:  # the section's first table only (later ones are probes of other kinds)
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if cells[0] in LABELS and len(cells) >= 7 and cells[2] != "-":
            scores[cells[0]] = {key: float(cells[2 + i]) for i, (key, _) in enumerate(TASKS)}
    return scores


def all_scores(roots: list[Path]) -> dict[str, dict[int, dict[str, float]]]:
    """method -> seed -> task key -> final score, for every finished run with downstream scores under ``roots``."""
    scores: dict[str, dict[int, dict[str, float]]] = {}
    for method, label in LABELS.items():
        for run_dir in seed_dirs(roots, label):
            found = downstream_scores(run_dir)
            if found:
                seed = int(yaml.safe_load((run_dir / "config.yaml").read_text())["seed"])
                scores.setdefault(method, {})[seed] = found
    return scores


def reproduction(scores: dict[str, dict[int, dict[str, float]]], md: Path) -> list[str]:
    """The seed-0 scores that differ from Table 6's printed seed-0 row at its 3 digits, one line each."""
    printed = table6_seed0(md)
    found = []
    for method, row in printed.items():
        rerun = scores.get(method, {}).get(0)
        for key, name in TASKS:
            now = f"{rerun[key]:.3f}" if rerun and key in rerun else "not run"
            if now != f"{row[key]:.3f}":
                found.append(f"{method} {name}: Table 6 {row[key]:.3f}, rerun {now}")
    return found


def diffs(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], key: str) -> list[float]:
    """a's score minus b's on ``key``, for every seed both have."""
    return [a[s][key] - b[s][key] for s in sorted(a) if s in b and key in a[s] and key in b[s]]


def paired(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], key: str) -> str:
    """a minus b on the seeds both have (``paired_difference``)."""
    return paired_difference(diffs(a, b, key), words=("higher", "lower"))


def centralized_best_on_probe(scores: dict[str, dict[int, dict[str, float]]]) -> str:
    """The rule fixed before the runs: holds when Centralized has the highest probe mean and its paired difference
    against every other row lies above 0; within noise when highest but some interval covers 0; does not hold
    when another row's paired difference against Centralized lies above 0 (or it is highest and not
    Centralized)."""
    if CENTRAL not in scores:
        return "not run"
    sides = [interval(diffs(scores[CENTRAL], scores[m], PROBE))[1] for m in scores if m != CENTRAL]
    if "not measurable" in sides:
        return "not measurable here (fewer than 2 seeds)"
    means = {m: SeedStats(tuple(s[PROBE] for s in by_seed.values() if PROBE in s)).mean
             for m, by_seed in scores.items()}
    if "below 0" in sides:
        return "does not hold here"
    if max(means, key=means.get) != CENTRAL:
        return "does not hold here (another row has the highest mean)"
    return "holds" if all(side == "above 0" for side in sides) else "within noise"


def helps(scores: dict[str, dict[int, dict[str, float]]]) -> list[str]:
    """(method, task) pairs whose paired difference against the untrained start lies above 0."""
    if START not in scores:
        return []
    return [f"{method} {name}" for method in scores if method != START for key, name in TASKS
            if interval(diffs(scores[method], scores[START], key))[1] == "above 0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+",
                        help="the seeded grid directories (runs/fedbert-roberta-seeds runs/fedbert-roberta-seeds-2)")
    parser.add_argument("--check", type=Path, help="fedbert.md: compare seed 0 with its Table 6")
    args = parser.parse_args()
    scores = all_scores(args.roots)
    if args.check:
        differing = reproduction(scores, args.check)
        print("Seed 0 against Table 6's printed row: " + ("reproduced to the digit" if not differing else
              "DIFFERS in " + "; ".join(differing)) + "\n")
    stats = {m: {key: SeedStats(tuple(s[key] for s in by_seed.values() if key in s)) for key, _ in TASKS}
             for m, by_seed in scores.items()}
    print("| method | " + " | ".join(name for _, name in TASKS) + " |")
    print("|---|" + "---|" * len(TASKS))
    for method in LABELS:
        if method in stats:
            print(f"| {method} | " + " | ".join(stats[method][key].fixed(3) for key, _ in TASKS) + " |")
    print()
    print("Paired against the untrained start (same seed), row minus start:")
    print()
    print("| method | " + " | ".join(name for _, name in TASKS) + " |")
    print("|---|" + "---|" * len(TASKS))
    for method in LABELS:
        if method != START and method in scores and START in scores:
            print(f"| {method} | " + " | ".join(paired(scores[method], scores[START], key) for key, _ in TASKS)
                  + " |")
    print()
    print("SST-2 probe, Centralized minus each row (same seed):")
    for method in LABELS:
        if method != "Centralized" and method in scores and "Centralized" in scores:
            print(f"- vs {method}: {paired(scores['Centralized'], scores[method], PROBE)}")
    print()
    print(f"- Centralized best on the probe: {centralized_best_on_probe(scores)}")
    carry = equivalence(diffs(scores.get(CENTRAL, {}), scores.get(CARRY, {}), PROBE), PROBE_BAND)
    print(f"- Head-Emd Share carry close to Centralized on the probe (Centralized - carry): {carry.text(3)}")
    print(f"- Pre-training helps (paired difference against the start above 0): {', '.join(helps(scores)) or 'none'}")
    for key, name in TASKS:
        rows = [stats[m][key] for m in LABELS if m in stats and stats[m][key].n > 1]
        ranked = any(overlap(a, b) is False for i, a in enumerate(rows) for b in rows[i + 1:])
        best = max((m for m in LABELS if m in stats), key=lambda m: stats[m][key].mean)
        print(f"- {name}: highest mean {best} ({stats[best][key].mean:.3f}); "
              + ("some 95% intervals are disjoint" if ranked else "every 95% interval overlaps every other: "
                 "cannot rank"))


if __name__ == "__main__":
    main()
