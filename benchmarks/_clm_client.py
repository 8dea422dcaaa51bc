"""What the LoRA benchmarks on a causal LM share: RTE text as causal-LM rows, and one timed local step."""

from __future__ import annotations

import csv
import time
from pathlib import Path

from fedlm.federation.local_training import LocalSettings, train_locally

RTE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "glue" / "RTE" / "train.tsv"


def rte_texts(n: int) -> list[str]:
    """The first ``n`` RTE pairs as one text each (premise, question, hypothesis)."""
    with RTE.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [f"{r['sentence1']} Question: {r['sentence2']} True or false?" for r in rows[:n]]


def step(model, task, rows: list[dict], seed: int, batch: int) -> float:
    """One local step (a one-step local round, fresh AdamW, as a FedAvg client does it); wall seconds."""
    settings = LocalSettings(lr=1e-4, batch_size=batch, local_steps=1)
    chunk = rows[seed * batch:(seed + 1) * batch]
    began = time.perf_counter()
    train_locally(model, task, chunk, settings, seed=seed)
    return time.perf_counter() - began
