"""Preparing many clients: their SST-2 rows tokenized once for the split and handed out, against each client's share
tokenized alone (a ``datasets.map`` per client, what ``prepare`` did before), side by side in one process.

Both build the same rows (checked); the ratio is per-client seconds / once seconds. Then the whole of ``prepare``
(load, partition, tokenizer, model, rows) for a larger population, in seconds.

    python benchmarks/bench_prepare.py [--clients 200] [--examples 20000] [--population 10000]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedlm.config import validate
from fedlm.data.sources import resolve_data_dir
from fedlm.run.prepare import prepare, split_rows


def config(clients: int, examples: int | None):
    return validate({
        "name": "bench", "seed": 0,
        "data": {"source": "glue/sst2", "max_train_examples": examples, "max_test_examples": 872},
        "partition": {"kind": "label_dirichlet", "alpha": 1.0, "num_clients": clients},
        "model": {"family": "bert", "preset": "tiny", "vocab_size": 2000, "max_length": 64},
        "eval": {"local": False},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--population", type=int, default=10000, help="clients for the whole prepare (all of SST-2)")
    args = parser.parse_args()
    data_dir = resolve_data_dir(None)
    prep = prepare(config(args.clients, args.examples), data_dir)
    train, task, part, tokenizer = prep.loaded.splits["train"], prep.task, prep.train_partition, prep.tokenizer
    started = time.perf_counter()
    once = split_rows(task, train, part, tokenizer, 64, task.preprocess(train, tokenizer, 64).to_list())
    once_s = time.perf_counter() - started
    started = time.perf_counter()
    alone = split_rows(task, train, part, tokenizer, 64, None)
    alone_s = time.perf_counter() - started
    assert once == alone, "the two ways built different rows"
    print(f"{args.clients} clients, {len(train)} SST-2 sentences: each share tokenized alone {alone_s:.2f} s, the "
          f"split once {once_s:.2f} s: {alone_s / once_s:.1f}x ({1000 * alone_s / args.clients:.1f} vs "
          f"{1000 * once_s / args.clients:.2f} ms per client)")
    started = time.perf_counter()
    prepare(config(args.population, None), data_dir)
    print(f"prepare, {args.population} clients, all of SST-2: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
