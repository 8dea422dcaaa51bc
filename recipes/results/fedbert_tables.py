"""Prints the tables of recipes/results/fedbert.md from finished FedBERT runs.

    .venv/bin/python recipes/results/fedbert_tables.py runs/fedbert-roberta
    .venv/bin/python recipes/results/fedbert_tables.py runs/fedbert-gpt2
"""

import sys
from pathlib import Path

import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from fedlm.models.cut import Cut, SplitModel
from fedlm.run.downstream import downstream_scores
from fedlm.run.recorder import read_metrics, slug

METHODS = ["start (untrained)", "Centralized", "method=FedAvg", "method=Head-Emd Share",
           "method=Head-Emd Share carry", "method=EmdAvg",
           "method=Head-Emd Avg", "method=Parallel FedAvg", "Single client"]
DOWNSTREAM = [("sst2 accuracy", "SST-2 acc"), ("mrpc accuracy", "MRPC acc"), ("rte accuracy", "RTE acc"),
              ("stsb pearson", "STS-B Pearson"), ("sst2-probe accuracy", "SST-2 probe acc")]


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


def main(root: Path) -> None:
    lm = "roberta" in root.name
    metric = "perplexity"
    cols = DOWNSTREAM if lm else []
    print(f"| method | test {metric} (start -> final) | " + " | ".join(c for _, c in cols)
          + (" | " if cols else "") + "client trains | MB up / down per client per round (params + boundary) |")
    print("|---|---|" + "---|" * len(cols) + "---|---|")
    for label in METHODS:
        run_dir = root / slug(label)
        if not run_dir.is_dir():
            continue
        records = read_metrics(run_dir)
        final = records[-1].get("test_perplexity", records[-1].get("test_perplexity_mean"))
        start = records[0].get("test_perplexity", records[0].get("test_perplexity_mean"))
        trained_rounds = [r for r in records if r["round"] > 0]
        trained = f"{start:.0f} -> {final:.1f}" if trained_rounds else f"{start:.0f} (no training)"
        scores = downstream_scores(run_dir) if cols else {}
        cells = [f"{scores[k]:.3f}" if k in scores else "-" for k, _ in cols]
        clients = max(len(trained_rounds[-1]["clients"]), 1) if trained_rounds else 1
        if trained_rounds and trained_rounds[-1]["bytes_up"]:
            up = sum(r["bytes_up"] for r in trained_rounds) / len(trained_rounds) / clients / 1e6
            down = sum(r["bytes_down"] for r in trained_rounds) / len(trained_rounds) / clients / 1e6
            sent = f"{up:.1f} / {down:.1f}"
        else:
            sent = "-"
        name = label.removeprefix("method=")
        print(f"| {name} | {trained} | " + " | ".join(cells) + (" | " if cells else "")
              + f"{client_share(run_dir)} | {sent} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
