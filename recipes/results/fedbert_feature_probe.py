"""Frozen-feature probes of pre-trained encoders on GLUE: a check, beside full fine-tuning, of whether the
representations themselves carry what pre-training learned.

Each model's encoder runs frozen; every layer's hidden states are mean-pooled over the non-padding tokens
(CLS is untrained by RoBERTa-style MLM, mean pooling is not) and a linear model is fitted on the standardized
features of GLUE training examples: logistic regression for SST-2 / MRPC / RTE (accuracy), ridge regression
for STS-B (Pearson r). Scores are on the GLUE dev sets. "last" uses the last layer, "all" every layer.

    .venv/bin/python recipes/results/fedbert_feature_probe.py runs/fedbert-roberta/* [OTHER_RUN_DIR ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from scipy.stats import pearsonr
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.preprocessing import StandardScaler
from transformers import AutoModel, AutoTokenizer

from fedlm.data.sources import load_source, resolve_data_dir

TASKS = {"SST-2": "glue/sst2", "MRPC": "glue/mrpc", "RTE": "glue/rte", "STS-B": "glue/stsb"}


def pooled_features(model: torch.nn.Module, tokenizer, split, max_length: int) -> np.ndarray:
    """Mean over non-padding tokens of every layer's hidden states, concatenated (layers x width)."""
    pair = split["text_pair"] if "text_pair" in split.column_names else None
    out = []
    for i in range(0, len(split), 128):
        enc = tokenizer(split["text"][i:i + 128], pair[i:i + 128] if pair else None, truncation=True,
                        max_length=max_length, padding=True, return_tensors="pt")
        with torch.no_grad():
            states = model(**enc, output_hidden_states=True).hidden_states
        mask = enc["attention_mask"].unsqueeze(-1).float()
        out.append(torch.cat([(h * mask).sum(1) / mask.sum(1) for h in states], -1).numpy())
    return np.concatenate(out)


def probe(train_x: np.ndarray, train_y, test_x: np.ndarray, test_y, regression: bool) -> float:
    scaler = StandardScaler().fit(train_x)
    train_x, test_x = scaler.transform(train_x), scaler.transform(test_x)
    if regression:
        return float(pearsonr(Ridge(alpha=10.0).fit(train_x, train_y).predict(test_x), test_y)[0])
    return float(LogisticRegression(C=0.1, max_iter=2000).fit(train_x, train_y).score(test_x, test_y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories (those without a saved model/ are "
                                                           "skipped)")
    parser.add_argument("--max-train", type=int, default=6000, help="GLUE training examples per task")
    parser.add_argument("--max-length", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    runs = [run for run in args.runs if (run / "model" / "config.json").is_file()]
    data = {name: load_source(source, resolve_data_dir(), seed=0, max_train_examples=args.max_train)
            for name, source in TASKS.items()}
    print("| run | " + " | ".join(f"{t} last | {t} all" for t in TASKS) + " |")
    print("|---|" + "---|---|" * len(TASKS))
    for run in runs:
        folder = run / "model"
        model, tokenizer = AutoModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
        width = model.config.hidden_size
        cells = []
        for loaded in data.values():
            train, test = loaded.splits["train"], loaded.splits["test"]
            train_x = pooled_features(model, tokenizer, train, args.max_length)
            test_x = pooled_features(model, tokenizer, test, args.max_length)
            regression = loaded.kind == "regression"
            for columns in (slice(-width, None), slice(None)):
                cells.append(probe(train_x[:, columns], train["label"], test_x[:, columns], test["label"], regression))
        print(f"| {run.name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
