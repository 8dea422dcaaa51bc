"""Shared fixtures: a tiny labeled corpus on disk and a tiny-model config, so runs take seconds."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

POSITIVE = ["good", "great", "fine", "lovely", "superb", "happy"]
NEGATIVE = ["bad", "awful", "poor", "sad", "terrible", "boring"]
FILLER = ["the", "movie", "was", "a", "plot", "actor", "scene", "really", "very", "and", "story", "film"]


def make_sentences(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        cue = rng.choice(POSITIVE if label == "pos" else NEGATIVE)
        words = [rng.choice(FILLER) for _ in range(rng.randint(4, 9))]
        words.insert(rng.randrange(len(words)), cue)
        rows.append((" ".join(words), label))
    return rows


@pytest.fixture(scope="session")
def tiny_csv(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tinydata")
    for split, n, seed in (("train", 120, 0), ("test", 40, 1)):
        lines = ["sentence,sentiment"] + [f"{t},{lab}" for t, lab in make_sentences(n, seed)]
        (folder / f"{split}.csv").write_text("\n".join(lines) + "\n")
    return folder


def tiny_config(tmp_path: Path, source: Path, **protocol) -> dict:
    """A raw config dict for a tiny BERT classifier on the tiny corpus."""
    return {
        "name": "tiny",
        "seed": 7,
        "output_dir": str(tmp_path / "runs"),
        "data": {"source": str(source), "columns": {"text": "sentence", "label": "sentiment"}},
        "partition": {"kind": "iid", "num_clients": 4},
        "model": {"family": "bert", "preset": "tiny", "vocab_size": 200, "max_length": 32,
                  "overrides": {"hidden_dropout_prob": 0.1}},
        "train": {"lr": 0.003, "batch_size": 8},
        "protocol": {"kind": "fedavg", "rounds": 2, **protocol},
        "eval": {"batch_size": 32},
    }


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread avoids oversubscription stalls on a shared CPU (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
