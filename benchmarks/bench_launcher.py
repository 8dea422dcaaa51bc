"""What the `fedlm run --workers N` launcher costs before its workers start (issue 33 item 5), side by side.

Each arm is a fresh interpreter, taking turns, best of ``--repeats``:

- launcher: ``from fedlm.cli.workers import check_workers; check_workers(2)``, all the launcher does before it
  starts the workers (on a machine without a GPU driver it never imports torch);
- torch: ``import torch; torch.cuda.device_count()``, what the launcher did before 2026-11-28.

Prints the wall seconds of each and the launcher / torch ratio (below 1: the workers start that much sooner).

    .venv/bin/python benchmarks/bench_launcher.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

ARMS = {
    "launcher": "from fedlm.cli.workers import check_workers; check_workers(2)",
    "torch": "import torch; torch.cuda.device_count()",
}


def seconds(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm, code in ARMS.items():
            times[arm].append(seconds(code))
    best = {arm: min(values) for arm, values in times.items()}
    for arm, values in times.items():
        print(f"{arm:9s} best {best[arm]:.2f} s wall  (runs: {', '.join(f'{v:.2f}' for v in values)})")
    print(f"launcher / torch: {best['launcher'] / best['torch']:.2f}")


if __name__ == "__main__":
    main()
