"""FedAvg's running sum: fp32 updates added to float64 sums straight (torch's mixed-dtype path, which converts a
whole tensor at once) against ``RunningMean``'s chunked conversion through one reused buffer; side by side.

MiniLM-sized tensors (a 30,522 x 384 embedding, 6 blocks' matrices, 60 vectors), weight 3, 1 thread, CPU seconds
per update (median of the repeats, the two taking turns), and a check that both sums are bitwise equal.

    python benchmarks/bench_running_mean.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedlm.federation.params import RunningMean

SHAPES = [(30522, 384)] + [(384, 384)] * 24 + [(1536, 384)] * 12 + [(384,)] * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    update = {f"t{i}": torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in
              enumerate(SHAPES)}
    straight = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in update.items()}
    chunked = RunningMean()
    times: dict[str, list[float]] = {"straight": [], "chunked": []}
    for _ in range(args.repeats):
        began = time.process_time()
        for name, value in update.items():
            straight[name].add_(value, alpha=3.0)
        times["straight"].append(time.process_time() - began)
        began = time.process_time()
        chunked.add(update, 3.0)
        times["chunked"].append(time.process_time() - began)
    equal = all(torch.equal(straight[n], chunked.sums[n]) for n in update)
    a, b = statistics.median(times["straight"]), statistics.median(times["chunked"])
    print(f"{sum(v.numel() for v in update.values()) / 1e6:.1f}M values, {args.repeats} repeats, 1 thread")
    print(f"straight {a * 1e3:.0f} ms, chunked {b * 1e3:.0f} ms per update: {a / b:.2f}x; sums bitwise equal: {equal}")


if __name__ == "__main__":
    main()
