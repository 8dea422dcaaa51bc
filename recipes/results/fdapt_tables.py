"""Prints recipes/results/fdapt.md's tables (and draws fdapt.png) from finished runs of recipes/fdapt-head.yaml,
recipes/fdapt.yaml and recipes/fdapt-ner.yaml under one output directory.

    .venv/bin/python recipes/results/fdapt_tables.py runs --plot recipes/results/fdapt.png
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

import yaml

from fedlm.run.recorder import read_metrics
from fedlm.run.report import summarize
from fedlm.run.seeds import SeedStats, overlap, paired_difference

SKEWS = ("iid", "quantity", "length", "vocabulary")
DAPT_SETTINGS = ["original model", "centralized DAPT",
                 *(f"{method} {n} clients {skew}" for n in (2, 8) for method in ("FDAPT", "FFDAPT") for skew in SKEWS),
                 "general-text control"]
CONTROL = "general-text control"  # the original model + centralized MLM on ~as many wikitext-2 tokens (root/control)


def tags_of(run_dir: Path) -> tuple[dict, int]:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return config.get("tags", {}), int(config.get("seed", 0))


def dapt_seed_runs(root: Path) -> dict[str, dict[int, list[dict]]]:
    """Setting label -> seed -> metrics records of its finished pre-training run (recipes/fdapt.yaml, under any
    name starting with fdapt: fdapt, fdapt8, fdapt-ffskew, fdapt-seed1, ...)."""
    runs: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    grids = [grid for grid in [*root.glob("fdapt*/"), root / "control" / "fdapt"] if (grid / "grid.yaml").is_file()]
    for run_dir in sorted(run_dir for grid in grids for run_dir in grid.glob("*/")):
        if (run_dir / "model").is_dir():
            tags, seed = tags_of(run_dir)
            runs[tags["setting"]][seed] = read_metrics(run_dir)
    return runs


def seed_zero(seed_runs: dict[str, dict[int, list[dict]]]) -> dict[str, list[dict]]:
    """Setting label -> metrics records of its seed-0 pre-training run: the models every NER table fine-tunes."""
    return {label: seeds[0] for label, seeds in seed_runs.items() if 0 in seeds}


def pretraining_seeds_table(seed_runs: dict[str, dict[int, list[dict]]]) -> None:
    """Final perplexity of the settings pre-trained under several seeds, and the targets' same-seed ratios (T2,
    T5 at 2 clients IID, T4 for each FDAPT skew against IID at its client count)."""
    final = {label: {seed: summarize(records, "perplexity", "min")["final perplexity"]
                     for seed, records in seeds.items()}
             for label, seeds in seed_runs.items() if len(seeds) > 1}
    if not final:
        return
    print("| setting | final perplexity, mean ± sd (seeds) | per seed |")
    print("|---|---|---|")
    for label, by_seed in final.items():
        values = [by_seed[s] for s in sorted(by_seed)]
        print(f"| {label} | {SeedStats(tuple(values)).fixed(digits=1)} | "
              + ", ".join(f"s{s}: {by_seed[s]:.1f}" for s in sorted(by_seed)) + " |")
    print()
    print("| same seed, final perplexity | ratio - 1, % [95% interval] | per seed |")
    print("|---|---|---|")
    pairs = [("FDAPT 2 clients iid", "centralized DAPT"), ("FFDAPT 2 clients iid", "FDAPT 2 clients iid"),
             *((f"FDAPT {n} clients {skew}", f"FDAPT {n} clients iid") for n in (2, 8) for skew in SKEWS[1:])]
    for label, base in pairs:
        seeds = sorted(set(final.get(label, {})) & set(final.get(base, {})))
        ratios = [100 * (final[label][s] / final[base][s] - 1) for s in seeds]
        if ratios:
            print(f"| {label} / {base} | {paired_difference(ratios, digits=1, words=('higher', 'lower'))} | "
                  + ", ".join(f"s{s}: {r:+.1f}%" for s, r in zip(seeds, ratios, strict=True)) + " |")
    print()


def ner_scores(root: Path) -> dict[str, list[tuple[int, float]]]:
    """Model label -> (seed, final test entity F1) of each finished fine-tuning run (recipes/fdapt-ner.yaml),
    from root/fdapt-ner and root/<batch>/fdapt-ner (the seeds ran as separate batches, see fdapt.md)."""
    scores: dict[str, dict[int, float]] = defaultdict(dict)
    for run_dir in sorted([*root.glob("fdapt-ner/*/"), *root.glob("*/fdapt-ner/*/")]):
        if not (run_dir / "model").is_dir():
            continue
        tags, seed = tags_of(run_dir)
        f1 = summarize(read_metrics(run_dir), "f1", "max")["final f1"]
        known = scores[tags["pretrained"]].setdefault(seed, f1)  # a rerun (a reproduction check) counts once
        if known != f1:
            print(f"note: {tags['pretrained']} seed {seed} scored {known} and {f1} in two runs ({run_dir})")
    return {k: sorted(v.items()) for k, v in scores.items()}


def head_table(root: Path, dapt: dict[str, list[dict]]) -> None:
    """The original model's two stages (recipes/fdapt-head.yaml) and where DAPT starts."""
    head = summarize(read_metrics(root / "fdapt-head"), "perplexity", "min")
    encoder = summarize(read_metrics(root / "fdapt-head" / "downstream" / "encoder"), "perplexity", "min")
    bio = dapt["original model"][0]["test_perplexity"] if "original model" in dapt else math.nan
    print("| model | MLM perplexity, wikitext-2 test (400 paragraphs) | held-out biomedical abstracts (24) |")
    print("|---|---|---|")
    print(f"| MiniLM as shipped, random MLM head | {head['start perplexity']:.0f} | - |")
    print(f"| stage 1: head trained, encoder as shipped | {head['final perplexity']:.1f} | - |")
    print(f"| stage 2: + blocks and head, 1 epoch (the original model) | {encoder['final perplexity']:.1f} "
          f"| {bio:.1f} |")
    print()


def general_text_table(root: Path, dapt: dict[str, list[dict]]) -> None:
    """Wikitext-2 perplexity of pre-trained models (rounds: 0 runs of recipes/fdapt-head.yaml on them, under
    root/wiki-check): did DAPT adapt to the domain, or just train the MLM more on any text?"""
    runs = sorted((root / "wiki-check").glob("*/*/metrics.jsonl"))
    if not runs:
        return
    original = summarize(read_metrics(root / "fdapt-head" / "downstream" / "encoder"), "perplexity", "min")
    print("| model | wikitext-2 test perplexity | biomedical held-out perplexity |")
    print("|---|---|---|")
    bio = dapt["original model"][0]["test_perplexity"] if "original model" in dapt else math.nan
    print(f"| original model | {original['final perplexity']:.1f} | {bio:.1f} |")
    for path in runs:
        label = tags_of(path.parent)[0]["pretrained"]
        bio = summarize(dapt[label], "perplexity", "min")["final perplexity"] if label in dapt else math.nan
        print(f"| {label} | {read_metrics(path.parent)[0]['test_perplexity']:.1f} | {bio:.1f} |")
    print()


def main_table(dapt: dict[str, list[dict]], ner: dict[str, list[tuple[int, float]]]) -> None:
    print("| setting | perplexity round 0 -> 10 (best) | change | MB up / down | NCBI-disease NER F1, "
          "mean ± sd (seeds) [95% interval] | per seed |")
    print("|---|---|---|---|---|---|")
    for label in DAPT_SETTINGS:
        records = dapt.get(label)
        if records is None:
            continue
        summary = summarize(records, "perplexity", "min")
        start = summary["start perplexity"]
        if summary["rounds"]:
            final, best = summary["final perplexity"], summary["best perplexity"]
            ppl = f"{start:.1f} -> {final:.1f} ({best:.1f})"
            ppl = f"wikitext-2 test: {ppl}" if label == CONTROL else ppl
            change = f"{100 * (final - start) / start:+.0f}%"
        else:
            ppl, change = f"{start:.1f} (no training)", "-"
        seeds = ner.get(label, [])
        f1 = SeedStats(tuple(s for _, s in seeds)).fixed(interval=True) if seeds else "not run"
        per_seed = ", ".join(f"{s:.3f}" for _, s in seeds) or "-"
        mb = f"{summary['MB up']:.0f} / {summary['MB down']:.0f}"
        print(f"| {label} | {ppl} | {change} | {mb} | {f1} | {per_seed} |")
    print()


def paired(ner: dict[str, list[tuple[int, float]]], label: str, base: str) -> str:
    """NER F1 of ``label`` minus ``base`` on the same seeds, in F1 points (``paired_difference``)."""
    mine, theirs = dict(ner.get(label, [])), dict(ner.get(base, []))
    diffs = [100 * (mine[s] - theirs[s]) for s in sorted(mine) if s in theirs]
    return "-" if label == base else paired_difference(diffs, digits=1)


def paired_table(ner: dict[str, list[tuple[int, float]]]) -> None:
    """NER F1 differences on the same seed (same subsample, data order and head initialisation), in F1 points:
    mean [95% t-interval] over the seeds both settings have; 'better' / 'worse' only where it excludes 0."""
    bases = [b for b in ("original model", "centralized DAPT", "FDAPT 2 clients iid") if b in ner]
    print("| F1 points, row minus column | " + " | ".join(f"vs {b}" for b in bases) + " |")
    print("|---|" + "---|" * len(bases))
    for label in DAPT_SETTINGS[1:]:
        if label in ner:
            print(f"| {label} | " + " | ".join(paired(ner, label, base) for base in bases) + " |")
    print()


def skews_table(dapt: dict[str, list[dict]], ner: dict[str, list[tuple[int, float]]]) -> None:
    """Targets T4 and T5 in every setting: FFDAPT against FDAPT of the same skew and client count, and each skew
    against IID of the same method and count (final perplexity change; NER F1 paired by seed)."""
    final = {k: summarize(v, "perplexity", "min")["final perplexity"] for k, v in dapt.items()}

    def ppl_change(label: str, base: str) -> str:
        if label not in final or base not in final:
            return "-"
        return f"{final[label]:.1f} vs {final[base]:.1f} ({100 * (final[label] - final[base]) / final[base]:+.1f}%)"

    print("| clients, skew | T5 FFDAPT vs FDAPT: perplexity | T5: NER F1 points | T4 FDAPT skew vs iid: "
          "perplexity | T4: NER | T4 FFDAPT skew vs iid: perplexity | T4: NER |")
    print("|---|---|---|---|---|---|---|")
    for n in (2, 8):
        for skew in SKEWS:
            fd, ff = f"FDAPT {n} clients {skew}", f"FFDAPT {n} clients {skew}"
            fd_iid, ff_iid = f"FDAPT {n} clients iid", f"FFDAPT {n} clients iid"
            cells = [ppl_change(ff, fd), paired(ner, ff, fd)]
            if skew == "iid":
                cells += ["-"] * 4
            else:
                cells += [ppl_change(fd, fd_iid), paired(ner, fd, fd_iid), ppl_change(ff, ff_iid),
                          paired(ner, ff, ff_iid)]
            print(f"| {n}, {skew} | " + " | ".join(cells) + " |")
    print()


def verdicts(dapt: dict[str, list[dict]], ner: dict[str, list[tuple[int, float]]]) -> None:
    """The numbers each of recipes/fdapt.yaml's targets T1-T5 is judged on."""
    final = {k: summarize(v, "perplexity", "min")["final perplexity"] for k, v in dapt.items()}
    start = dapt["original model"][0]["test_perplexity"] if "original model" in dapt else math.nan
    f1 = {k: SeedStats(tuple(s for _, s in v)) for k, v in ner.items()}
    for label in DAPT_SETTINGS[1:-1]:
        if label in final:
            print(f"T1/T3 ppl {label}: {final[label]:.2f} vs original {start:.2f} "
                  f"({100 * (final[label] - start) / start:+.1f}%)")
    pairs = [("FDAPT 2 clients iid", "centralized DAPT"), ("FFDAPT 2 clients iid", "FDAPT 2 clients iid"),
             ("FFDAPT 2 clients quantity", "FDAPT 2 clients quantity"), ("FDAPT 8 clients iid", "FDAPT 2 clients iid")]
    pairs += [(f"FDAPT 2 clients {skew}", "FDAPT 2 clients iid") for skew in ("quantity", "length", "vocabulary")]
    for a, b in pairs:
        if a in final and b in final:
            print(f"ppl {a} vs {b}: {final[a]:.2f} vs {final[b]:.2f} ({100 * (final[a] - final[b]) / final[b]:+.1f}%)")
        if a in f1 and b in f1:
            same = overlap(f1[a], f1[b])
            print(f"F1 {a} vs {b}: {f1[a].mean:.3f} vs {f1[b].mean:.3f} "
                  f"(diff {100 * (f1[a].mean - f1[b].mean):+.1f} points; intervals overlap: {same})")
    if "original model" in f1:
        for label in DAPT_SETTINGS[1:]:
            if label in f1:
                same = overlap(f1[label], f1["original model"])
                print(f"F1 {label} vs original: {100 * (f1[label].mean - f1['original model'].mean):+.1f} points "
                      f"(intervals overlap: {same})")


def plot(dapt: dict[str, list[dict]], ner: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (two, eight, right) = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1, 1, 1.4]})
    for axes, clients in ((two, "2 clients"), (eight, "8 clients")):
        for label in DAPT_SETTINGS[:-1]:  # the control's perplexity is on wikitext-2: not on this axis
            if clients not in label and label not in ("original model", "centralized DAPT"):
                continue
            records = [r for r in dapt.get(label, []) if r.get("test_perplexity") is not None]
            if len(records) > 1:
                style = "--" if label.startswith("FFDAPT") else "-"  # FDAPT and FFDAPT of one skew: one colour
                color = next((f"C{i + 1}" for i, skew in enumerate(SKEWS) if label.endswith(skew)), "C0")
                axes.plot([r["round"] for r in records], [r["test_perplexity"] for r in records], style, color=color,
                          label=label)
        axes.set_xlabel("round (centralized: epoch)")
        axes.set_ylabel("MLM perplexity, held-out biomedical abstracts")
        axes.set_title(f"Domain-adaptive pre-training, {clients}")
        axes.legend(fontsize=7)
    labels = [k for k in DAPT_SETTINGS if k in ner]
    for i, label in enumerate(labels):
        values = [s for _, s in ner[label]]
        stats = SeedStats(tuple(values))
        low, high = stats.interval or (stats.mean, stats.mean)
        right.errorbar([i], [stats.mean], yerr=[[stats.mean - low], [high - stats.mean]], fmt="o", capsize=4)
        right.scatter([i] * len(values), values, s=10, color="grey", zorder=3)
    right.set_xticks(range(len(labels)))
    right.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    right.set_ylabel("NCBI-disease entity F1\n(mean, 95% interval; grey: seeds)")
    right.set_title("Downstream NER after fine-tuning")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the output directory holding fdapt-head/, fdapt/, fdapt-ner/")
    parser.add_argument("--plot", type=Path, help="write the figure here")
    args = parser.parse_args()
    seed_runs, ner = dapt_seed_runs(args.root), ner_scores(args.root)
    dapt = seed_zero(seed_runs)
    head_table(args.root, dapt)
    general_text_table(args.root, dapt)
    main_table(dapt, ner)
    pretraining_seeds_table(seed_runs)
    paired_table(ner)
    skews_table(dapt, ner)
    verdicts(dapt, ner)
    if args.plot:
        plot(dapt, ner, args.plot)


if __name__ == "__main__":
    main()
