"""FL-GLM Table 3 scaled down: the client-batch trunk against the serial (sequential) trunk.

8 clients, each with batch size 1 (sequence 128), train the same number of local steps on a small BERT
(width 256, 4 blocks; FedBERT's cut: embeddings + MLM head on the clients) through fedlm's
:class:`~fedlm.split.executor.SplitExecutor`, in process. ``sequential``: the clients take turns and the trunk
steps once per client batch (8 x steps trunk steps of batch 1). ``client_batch``: the 8 clients' batches go
through the trunk together (steps trunk steps of batch 8). Both rounds run one after another, alternating,
and the table shows the median wall time per round and the speedup.

    OMP_NUM_THREADS=2 python benchmarks/bench_client_batch.py [--steps 8] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import datasets
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _split_round import time_split_round

from fedlm.config import SplitConfig
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import snapshot
from fedlm.models.build import build_model, build_tokenizer
from fedlm.tasks import get_task

CLIENTS, SEQ, WIDTH, BLOCKS, VOCAB = 8, 128, 256, 4, 8000


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(200)) for _ in range(n)]


def one_round(mode: str, model: torch.nn.Module, task, rows: dict[int, list[dict]], steps: int,
              start: dict) -> float:
    settings = LocalSettings(lr=1e-4, batch_size=1, local_steps=steps)
    spec = SplitConfig(trunk_mode=mode, client_parts="average")  # FedBERT's cut: bottom_blocks = top_blocks = 0
    return time_split_round(model, task, rows, start, settings, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="local steps per client (batch size 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 repeat: a smoke run")
    args = parser.parse_args()
    steps, repeats = (2, 1) if args.quick else (args.steps, args.repeats)
    texts = corpus(200)
    tokenizer = build_tokenizer(None, "bert", texts, VOCAB)
    model = build_model("bert", "small", "mlm", tokenizer, seed=0,
                        overrides={"hidden_size": WIDTH, "num_hidden_layers": BLOCKS, "num_attention_heads": 4,
                                   "intermediate_size": 4 * WIDTH})
    task = get_task("mlm")
    blocks = task.preprocess(datasets.Dataset.from_dict({"text": texts}), tokenizer, SEQ).to_list()
    rows = {cid: blocks[cid * steps:(cid + 1) * steps] for cid in range(CLIENTS)}
    start = snapshot(model)
    one_round("client_batch", model, task, rows, 1, start)  # warm-up
    one_round("sequential", model, task, rows, 1, start)
    times: dict[str, list[float]] = {"sequential": [], "client_batch": []}
    for _ in range(repeats):
        for mode in times:
            times[mode].append(one_round(mode, model, task, rows, steps, start))
    seq, batch = statistics.median(times["sequential"]), statistics.median(times["client_batch"])
    print(f"{CLIENTS} clients x {steps} steps of batch 1, seq {SEQ}, BERT width {WIDTH}, {BLOCKS} blocks, "
          f"torch threads {torch.get_num_threads()}")
    print("| trunk mode | trunk steps | trunk batch | s per round (median) | speedup |")
    print("|---|---|---|---|---|")
    print(f"| sequential | {CLIENTS * steps} | 1 | {seq:.2f} | 1.00 |")
    print(f"| client_batch | {steps} | {CLIENTS} | {batch:.2f} | {seq / batch:.2f} |")


if __name__ == "__main__":
    main()
