"""Prints the tables of recipes/results/fedbert.md from finished FedBERT runs, one row per method with mean ± sd
over the seeds found, then (for Table 6's RoBERTa grids) its claims as same-seed (paired) differences of the final
perplexity with their 95% t-intervals, each judged by the rule fixed before its runs (fedbert.md quotes the rules
beside the numbers).

    .venv/bin/python recipes/results/fedbert_tables.py runs/fedbert-roberta [more grid dirs] [--plot curves.png]
    .venv/bin/python recipes/results/fedbert_tables.py runs/fedbert-gpt2

``--plot``: test perplexity per round (log scale), each method's seed mean with its seeds' range.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import matplotlib
import yaml
from fednlp_20news_table import paired as paired_by_seed
from fedsplitbert_long import NOT_RUN, equivalence_verdict, interval, verdict
from matplotlib.ticker import MaxNLocator
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from fedlm.models.cut import Cut, SplitModel
from fedlm.run.downstream import downstream_scores
from fedlm.run.recorder import read_metrics, slug
from fedlm.run.seeds import SeedStats, equivalence

matplotlib.use("Agg")
import matplotlib.pyplot as plt

METHODS = ["start (untrained)", "Centralized", "method=FedAvg", "method=Head-Emd Share",
           "method=Head-Emd Share carry", "method=EmdAvg",
           "method=Head-Emd Avg", "method=Parallel FedAvg", "Single client"]
DOWNSTREAM = [("sst2 accuracy", "SST-2 acc"), ("mrpc accuracy", "MRPC acc"), ("rte accuracy", "RTE acc"),
              ("stsb pearson", "STS-B Pearson"), ("sst2-probe accuracy", "SST-2 probe acc")]
FEDERATED = ["FedAvg", "Head-Emd Share", "Head-Emd Share carry", "EmdAvg", "Head-Emd Avg", "Parallel FedAvg"]
PARALLEL_BAND = 0.03  # Parallel FedAvg ~ FedAvg: a share of FedAvg's mean final perplexity, fixed 2026-11-24


def client_share(run_dir: Path) -> str:
    """Parameters a client trains, as a share of the model: all of it for FedAvg, bottom + top for split runs."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    if not config.get("split"):
        return "100%"
    auto = AutoModelForMaskedLM if config["task"] == "mlm" else AutoModelForCausalLM
    model = auto.from_config(AutoConfig.from_pretrained(run_dir / "model"))
    split = SplitModel(model, Cut(config["split"]["bottom_blocks"], config["split"]["top_blocks"]))
    client = sum(p.numel() for p in split.client_parameters())
    return f"{100 * client / sum(p.numel() for p in model.parameters()):.0f}%"


def seed_dirs(roots: list[Path], label: str) -> list[Path]:
    """Every finished run of the method: the unseeded directory, or one per seed (``<slug>_seed=N``)."""
    pattern = re.compile(re.escape(slug(label)) + r"(_seed=-?\d+)?$")
    return sorted(d for root in roots for d in root.iterdir()
                  if pattern.fullmatch(d.name) and (d / "summary.md").is_file())


def perplexity(record: dict) -> float:
    """The shared-test perplexity: the global model's, or the mean over the clients' own models."""
    return record.get("test_perplexity", record.get("test_perplexity_mean"))


def stats(values: list[float]) -> SeedStats:
    return SeedStats(tuple(values))


def pm(values: list[float], digits: int) -> str:
    return stats(values).fixed(digits)


def traffic(records: list[list[dict]]) -> str:
    """MB up / down per client per round (parameters + boundary messages), mean over rounds and seeds; ``records``
    holds each seed's metric records."""
    ups, downs = [], []
    for run in records:
        trained = [r for r in run if r["round"] > 0 and r.get("bytes_up")]
        for r in trained:
            clients = max(len(r["clients"]), 1)
            ups.append(r["bytes_up"] / clients / 1e6)
            downs.append(r["bytes_down"] / clients / 1e6)
    return f"{sum(ups) / len(ups):.1f} / {sum(downs) / len(downs):.1f}" if ups else "-"


def tables(roots: list[Path], by_method: dict[str, dict[int, list[dict]]]) -> None:
    """The method table from the run directories under ``roots``; for Table 6, its claims on ``by_method``
    (``curves``)."""
    lm = "roberta" in roots[0].name
    cols = DOWNSTREAM if lm else []
    print("| method | test perplexity: start -> final, mean ± sd (seeds) | final per seed | per round (seed mean) | "
          + " | ".join(c for _, c in cols) + (" | " if cols else "")
          + "client trains | MB up / down per client per round |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|---|")
    spread_note: list[str] = []
    for label in METHODS:
        runs = seed_dirs(roots, label)
        if not runs:
            continue
        name = label.removeprefix("method=")
        records = [read_metrics(r) for r in runs]
        starts = [perplexity(rec[0]) for rec in records]
        ends = [perplexity(rec[-1]) for rec in records]
        rounds = min(len(rec) for rec in records)
        curve = " / ".join(f"{stats([perplexity(rec[i]) for rec in records]).mean:.0f}" for i in range(1, rounds))
        trained = f"{stats(starts).mean:.0f} -> {pm(ends, 1)}" if rounds > 1 else f"{pm(starts, 0)} (no training)"
        per_seed = ", ".join(f"{e:.1f}" for e in ends)
        sds = [rec[-1]["test_perplexity_std"] for rec in records if "test_perplexity_std" in rec[-1]]
        if sds:
            spread_note.append(f"{name}: the clients' models differ by a std of {stats(sds).mean:.1f} "
                               "perplexity (mean over seeds of the across-client std)")
        cells = []
        for key, _ in cols:
            scores = [s[key] for s in (downstream_scores(r) for r in runs) if key in s]
            cells.append(pm(scores, 3) if scores else "-")
        print(f"| {name} | {trained} | {per_seed} | {curve or '-'} | " + " | ".join(cells) + (" | " if cells else "")
              + f"{client_share(runs[0])} | {traffic(records)} |")
    print()
    for note in spread_note:
        print(f"- {note}")
    if lm:  # the claims and their rules are Table 6's; Table 8's are fedbert_gpt2_v2.py's
        claims(final_by_seed(by_method))


def curves(roots: list[Path]) -> dict[str, dict[int, list[dict]]]:
    """method -> seed -> metric records, for every finished run under ``roots``."""
    found: dict[str, dict[int, list[dict]]] = {}
    for label in METHODS:
        for run_dir in seed_dirs(roots, label):
            seed = int(yaml.safe_load((run_dir / "config.yaml").read_text()).get("seed", 0))
            found.setdefault(label.removeprefix("method="), {})[seed] = read_metrics(run_dir)
    return found


def final_by_seed(runs: dict[str, dict[int, list[dict]]]) -> dict[str, dict[int, float]]:
    """method -> seed -> final test perplexity, from ``curves``."""
    return {name: {seed: perplexity(records[-1]) for seed, records in seeds.items()} for name, seeds in runs.items()}


def paired(finals: dict[str, dict[int, float]], a: str, b: str) -> list[float]:
    """a's final perplexity minus b's, for every seed both have."""
    return paired_by_seed(finals.get(a, {}), finals.get(b, {}), float)


def claims(finals: dict[str, dict[int, float]]) -> None:
    """Table 6's claims on the final perplexity (lower is better), each a same-seed difference with its 95%
    t-interval, judged by the rule fixed before its runs."""
    print("\n| claim | difference of final perplexity, per seed | mean [95% interval] | verdict |\n|---|---|---|---|")

    def row(claim: str, a: str, b: str, judge) -> None:
        diffs = paired(finals, a, b)
        text, word = interval(diffs, 1)
        print(f"| {claim}: {a} - {b} | {' / '.join(f'{d:+.1f}' for d in diffs) or '-'} | {text} "
              f"| {judge(diffs, word)} |")

    for method in FEDERATED:
        row("Centralized is best", method, "Centralized", lambda d, w: verdict(w))
    row("Head-Emd Share carry close to Centralized", "Head-Emd Share carry", "Centralized",
        lambda d, w: NOT_RUN if w == NOT_RUN else "not measurable here (no equivalence band fixed before the runs)")
    row("Carrying the optimizer state helps Head-Emd Share (not pre-registered)", "Head-Emd Share carry",
        "Head-Emd Share", lambda d, w: verdict(w, wanted="below 0"))
    row("Head-Emd Avg beats EmdAvg", "Head-Emd Avg", "EmdAvg", lambda d, w: verdict(w, wanted="below 0"))
    row("FedAvg about as good as Head-Emd Avg (does not hold if above 0)", "FedAvg", "Head-Emd Avg",
        lambda d, w: "does not hold here" if w == "above 0" else
        w if w == NOT_RUN else "not measurable here (no equivalence band fixed before the runs)")
    fedavg = finals.get("FedAvg", {})
    band = PARALLEL_BAND * sum(fedavg.values()) / len(fedavg) if fedavg else None
    row(f"Parallel FedAvg equals FedAvg (band ±{PARALLEL_BAND:.0%} of FedAvg's mean, ±{band or 0:.1f})",
        "Parallel FedAvg", "FedAvg", lambda d, w: equivalence_verdict(equivalence(d, band)))
    row("Head-Emd Share (fresh AdamW per turn) stalls against Head-Emd Avg", "Head-Emd Share", "Head-Emd Avg",
        lambda d, w: verdict(w))
    single = SeedStats(tuple(finals.get("Single client", {}).values()))
    for method in FEDERATED:
        row("Every federated method beats a single client (Single's 95% interval above the method's mean)",
            method, "Single client", lambda d, w, m=method: single_above(single, finals.get(m)))


def single_above(single: SeedStats, method: dict[int, float] | None) -> str:
    """The single-client rule fixed 2026-11-24 (Table 8's): a federated method beats one client alone when Single
    client's 95% interval over its seeds lies above the method's mean; inside or below it does not hold."""
    if not method or not single.n:
        return NOT_RUN
    if single.interval is None:
        return "not measurable here (fewer than 2 seeds)"
    mean = sum(method.values()) / len(method)
    return "holds" if single.interval[0] > mean else "does not hold here"

def plot(runs: dict[str, dict[int, list[dict]]], out: Path, title: str) -> None:
    """Perplexity per round on a log scale: each method's seed mean, its seeds' range shaded; runs without
    training rounds (the untrained start) are left out."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, seeds) in enumerate(runs.items()):
        records = [seeds[s] for s in sorted(seeds)]
        rounds = min(len(r) for r in records)
        if rounds < 2:
            continue
        values = [[perplexity(r[k]) for r in records] for k in range(rounds)]
        ax.plot(range(rounds), [sum(v) / len(v) for v in values], color=f"C{i}", label=name, marker="o",
                markersize=3)
        ax.fill_between(range(rounds), [min(v) for v in values], [max(v) for v in values], color=f"C{i}", alpha=0.15)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test perplexity (WikiText-2)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"\nwrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+", help="grid directories of one recipe (their seeds pooled)")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    runs = curves(args.roots)
    tables(args.roots, runs)
    if args.plot:
        seeds = sorted({s for by_seed in runs.values() for s in by_seed})
        plot(runs, args.plot, f"FedBERT: {args.roots[0].name}, seeds {', '.join(map(str, seeds))} "
             "(seed mean, range)")


if __name__ == "__main__":
    main()
