"""What freezing blocks saves: FFDAPT's claim is shorter rounds because frozen layers skip backward work.

A masked-LM training step (forward + backward + AdamW) of a MiniLM-shaped BERT (hidden 384, 6 blocks, 12 heads,
intermediate 1536, vocab 30,522, seq 128, batch 16; random weights) through fedlm's own client code
(``worker.frozen`` + ``client.train_locally``), with 0, 1, 2 and 3 blocks frozen: at the bottom (blocks 1..k)
and mid-stack (blocks 3..). Frozen weights get no weight gradient and no optimizer update; activations still
need gradients through a frozen block whenever something below it trains (the embeddings do), so the saving is
the weight-gradient half of those blocks' backward plus their optimizer step, not the whole backward.

Steps take turns with the unfrozen step so that load from other processes hits them alike; best of repeats.

    python benchmarks/bench_freeze.py [--steps 4] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedlm.federation.client_round import frozen
from fedlm.federation.local_training import LocalSettings, train_locally
from fedlm.federation.sharing import layer_of
from fedlm.models.build import build_model, build_tokenizer
from fedlm.tasks.mlm import MaskedLMTask

MINILM = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}
SEQ, BATCH = 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = [f"patient {i} received dose {i % 7} of drug {i % 13} for disease {i % 5}" for i in range(400)]
    tokenizer = build_tokenizer(None, "bert", texts, 30_522)
    model = build_model("bert", "small", "mlm", tokenizer, overrides={**MINILM, "vocab_size": 30_522}, seed=0)
    task = MaskedLMTask()
    task.bind(tokenizer)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(5, 30_000, (SEQ,), generator=generator).tolist()}
            for _ in range(BATCH * args.steps)]
    settings = LocalSettings(batch_size=BATCH, lr=1e-4)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    windows = {"none": []}
    for k in (1, 2, 3):
        windows[f"blocks 1-{k}"] = [n for n in names if layer_of(n) in range(k)]
    windows["blocks 3-4"] = [n for n in names if layer_of(n) in (2, 3)]

    def step(frozen_names: list[str]) -> float:
        start = time.perf_counter()
        with frozen(model, frozen_names):
            train_locally(model, task, rows, settings, seed=0)
        return time.perf_counter() - start

    best = dict.fromkeys(windows, float("inf"))
    for frozen_names in windows.values():  # warm-up
        step(frozen_names)
    for _ in range(args.repeats):
        for label, frozen_names in windows.items():
            best[label] = min(best[label], step(frozen_names))
    base = best["none"]
    print(f"MiniLM-shaped BERT masked-LM, {args.steps} steps of batch {BATCH} x seq {SEQ}, {args.threads} threads")
    print("| frozen | s per step | saving vs none |\n|---|---|---|")
    for label, seconds in best.items():
        print(f"| {label} | {seconds / args.steps:.3f} | {100 * (base - seconds) / base:.1f}% |")


if __name__ == "__main__":
    main()
