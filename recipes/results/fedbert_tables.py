"""Prints the tables of recipes/results/fedbert.md from finished FedBERT runs, one row per method with mean ± sd
over the seeds found, then one verdict line per compared pair ("within noise" when the 95% intervals overlap).

    .venv/bin/python recipes/results/fedbert_tables.py runs/fedbert-roberta [more grid dirs of the same recipe]
    .venv/bin/python recipes/results/fedbert_tables.py runs/fedbert-gpt2
"""

import re
import sys
from pathlib import Path

import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from fedlm.models.cut import Cut, SplitModel
from fedlm.run.downstream import downstream_scores
from fedlm.run.recorder import read_metrics, slug
from fedlm.run.seeds import SeedStats, verdict

METHODS = ["start (untrained)", "Centralized", "method=FedAvg", "method=Head-Emd Share",
           "method=Head-Emd Share carry", "method=EmdAvg",
           "method=Head-Emd Avg", "method=Parallel FedAvg", "Single client"]
DOWNSTREAM = [("sst2 accuracy", "SST-2 acc"), ("mrpc accuracy", "MRPC acc"), ("rte accuracy", "RTE acc"),
              ("stsb pearson", "STS-B Pearson"), ("sst2-probe accuracy", "SST-2 probe acc")]
# the pairs the paper's claims compare (lower perplexity is better)
PAIRS = [("Centralized", "Head-Emd Share carry"), ("Head-Emd Share carry", "Head-Emd Share"),
         ("Head-Emd Avg", "EmdAvg"), ("FedAvg", "Head-Emd Avg"), ("FedAvg", "Parallel FedAvg"),
         ("Head-Emd Share", "Head-Emd Avg"), ("Single client", "FedAvg"), ("Single client", "Head-Emd Avg"),
         ("Single client", "EmdAvg")]


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


def main(roots: list[Path]) -> None:
    lm = "roberta" in roots[0].name
    cols = DOWNSTREAM if lm else []
    print("| method | test perplexity: start -> final, mean ± sd (seeds) | final per seed | per round (seed mean) | "
          + " | ".join(c for _, c in cols) + (" | " if cols else "")
          + "client trains | MB up / down per client per round |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|---|")
    finals: dict[str, SeedStats] = {}
    spread_note: list[str] = []
    for label in METHODS:
        runs = seed_dirs(roots, label)
        if not runs:
            continue
        name = label.removeprefix("method=")
        records = [read_metrics(r) for r in runs]
        starts = [perplexity(rec[0]) for rec in records]
        ends = [perplexity(rec[-1]) for rec in records]
        finals[name] = stats(ends)
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
    print()
    for a, b in PAIRS:
        if a in finals and b in finals:
            print(f"- {verdict(a, finals[a], b, finals[b], 'min')}")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
