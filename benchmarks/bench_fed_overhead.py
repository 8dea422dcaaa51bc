"""Federated overhead: one FedAvg round over 10 clients vs one centralized epoch over the same examples.

Both process exactly the same examples with the same model and batch size (each client's share is a
multiple of the batch size, so neither side gets extra partial batches). The ratio is
wall(FedAvg round: 10 x [receive, train, snapshot, encode] + aggregate) / wall(centralized epoch).
Target: <= 1.05. Runs alternate and the best of several repeats is kept, to damp a noisy shared machine.

    python benchmarks/bench_fed_overhead.py [--preset small] [--examples 1280] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from fedlm.config import validate
from fedlm.data.sources import resolve_data_dir
from fedlm.federation.codecs import get_codec
from fedlm.federation.engine import RoundEngine, RoundPlan
from fedlm.federation.local_training import LocalSettings, train_locally
from fedlm.federation.params import snapshot, trainable_names
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import FedAvg
from fedlm.run.prepare import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--examples", type=int, default=1280)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = validate({
        "name": "bench", "seed": 0,
        "data": {"source": "glue/sst2", "max_train_examples": args.examples, "max_test_examples": 32},
        "partition": {"kind": "iid", "num_clients": args.clients},
        "model": {"family": "bert", "preset": args.preset, "vocab_size": 8000, "max_length": 64},
        "train": {"batch_size": args.batch_size, "lr": 1e-4},
    })
    prep = prepare(config, resolve_data_dir(None))
    sizes = [len(r) for r in prep.client_train.values()]
    usable = min(sizes) // args.batch_size * args.batch_size
    client_rows = {cid: rows[:usable] for cid, rows in prep.client_train.items()}
    pooled = [row for rows in client_rows.values() for row in rows]
    settings = LocalSettings.from_config(config.train)
    names = trainable_names(prep.model)
    start = snapshot(prep.model, names)
    codec = get_codec("fp32")
    executor = InProcessExecutor(prep.model, prep.task, client_rows, codec, ClientStore({}), [])
    engine = RoundEngine(FedAvg(), executor, codec, list(client_rows), settings,
                         RoundPlan(rounds=1, clients_per_round=args.clients, seed=0))

    def centralized() -> float:
        t0 = time.perf_counter()
        train_locally(prep.model, prep.task, pooled, settings, seed=1)
        return time.perf_counter() - t0

    def federated() -> float:
        t0 = time.perf_counter()
        engine.run_round(1, start)
        return time.perf_counter() - t0

    federated()  # warm-up (allocator, first-touch)
    cen, fed = [], []
    for _ in range(args.repeats):
        cen.append(centralized())
        fed.append(federated())
    params = sum(t.numel() for t in start.values())
    print(f"model: bert-{args.preset}, {params / 1e6:.1f}M trainable params; {len(pooled)} examples, "
          f"{args.clients} clients x {usable}, batch {args.batch_size}")
    print(f"centralized epoch: best {min(cen):.2f}s  runs {[round(x, 2) for x in cen]}")
    print(f"fedavg round:      best {min(fed):.2f}s  runs {[round(x, 2) for x in fed]}")
    ratio = min(fed) / min(cen)
    print(f"federated overhead ratio (fedavg / centralized): {ratio:.3f}  target <= 1.05: "
          f"{'PASS' if ratio <= 1.05 else 'FAIL'}")


if __name__ == "__main__":
    main()
