"""Scale check for the partitioners: 1,000,000 labelled examples into 10,000 clients.

Prints wall seconds, tracemalloc peak (numpy allocations included) and the process's peak RSS for
IID, quantity Dirichlet, label Dirichlet and both combined, and PASS/FAIL against the 10 s target.
Timing and memory tracing run separately because tracemalloc slows allocation-heavy code.

    .venv/bin/python benchmarks/bench_partition.py [--examples N] [--clients K] [--labels L]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc

import numpy as np

from fedlm.data.partition import PartitionInput, build_partitioner

SPECS = {
    "iid": {"kind": "iid"},
    "quantity_dirichlet": {"kind": "quantity_dirichlet", "beta": 0.5},
    "label_dirichlet": {"kind": "label_dirichlet", "alpha": 0.5},
    "label+quantity": {"kind": "label_dirichlet", "alpha": 0.5, "beta": 0.5},
}


def skewed_labels(n: int, num_labels: int) -> np.ndarray:
    """Labels with Zipf-like class sizes, so label Dirichlet runs some classes dry and must reassign."""
    weights = 1.0 / np.arange(1, num_labels + 1)
    return np.random.default_rng(0).choice(num_labels, size=n, p=weights / weights.sum()).astype(np.int32)


def timed(spec: dict, data: PartitionInput, clients: int) -> tuple[float, int]:
    """Seconds for one partition, and how many examples were left out (must be 0)."""
    partitioner = build_partitioner(spec)
    start = time.perf_counter()
    partition = partitioner.partition(data, clients, seed=1)
    seconds = time.perf_counter() - start
    assert partition.sizes().sum() + partition.left_out == data.n
    return seconds, partition.left_out


def traced_peak(spec: dict, data: PartitionInput, clients: int) -> int:
    """Peak bytes allocated while partitioning."""
    partitioner = build_partitioner(spec)
    tracemalloc.start()
    partitioner.partition(data, clients, seed=1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--labels", type=int, default=20)
    parser.add_argument("--target", type=float, default=10.0, help="seconds allowed per partitioner")
    args = parser.parse_args()

    data = PartitionInput(n=args.examples, labels=skewed_labels(args.examples, args.labels))
    sizes = f"{args.examples:,} examples, {args.labels} labels, {args.clients:,} clients"
    print(f"{sizes}; target {args.target} s each")
    print(f"baseline peak RSS {peak_rss_mib():.0f} MiB")
    failed = False
    for name, spec in SPECS.items():
        seconds, left_out = timed(spec, data, args.clients)
        peak = traced_peak(spec, data, args.clients)
        ok = seconds < args.target and left_out == 0
        failed |= not ok
        print(
            f"{name:20s} {seconds:6.2f} s  tracemalloc peak {peak / 2**20:7.1f} MiB "
            f"({peak / args.examples:5.1f} B/example)  peak RSS {peak_rss_mib():6.0f} MiB  "
            f"left out {left_out}  {'PASS' if ok else 'FAIL'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
