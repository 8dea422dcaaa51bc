"""Scaling over processes: the same FedAvg job as 1 process x 1 thread, 1 process x 2 threads and 2 workers x 1
thread (``fedlm run --workers 2``), side by side.

Each arm is ``fedlm run`` in a fresh process tree on the same config (SST-2, label-Dirichlet, every client in
every round, no evaluation but the start's and the last round's), timed by the rounds' own clocks in
metrics.jsonl (``train_s``: the clients' training and the aggregation, startup and preparation left out), and
checked to train the same model (final test accuracy equal). Arms alternate when repeated; the best of the
repeats is kept, to damp a shared machine. Target (issue 33): 2 workers >= 1.7x faster than 1 x 1 on 2 cores.

    python benchmarks/bench_workers.py [--presets tiny small] [--clients 100] [--examples 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ARMS = {"1 proc x 1 thread": (1, 1), "1 proc x 2 threads": (1, 2), "2 workers x 1 thread": (2, 1)}


def job(preset: str, clients: int, examples: int, rounds: int, out: Path) -> dict:
    return {
        "name": "bench", "seed": 0, "output_dir": str(out),
        "data": {"source": "glue/sst2", "max_train_examples": clients * examples, "max_test_examples": 256},
        "partition": {"kind": "label_dirichlet", "alpha": 1.0, "num_clients": clients},
        "model": {"family": "bert", "preset": preset, "max_length": 64},
        "train": {"lr": 1e-3, "batch_size": 8, "local_epochs": 1},
        "protocol": {"kind": "fedavg", "rounds": rounds, "clients_per_round": clients},
        "eval": {"every": rounds, "batch_size": 128, "local": False},
    }


def run_arm(config: Path, out: Path, name: str, workers: int, threads: int) -> tuple[float, float, float]:
    """(seconds of the rounds, seconds of the whole command, final test accuracy) of one arm."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "fedlm.cli", "run", str(config), f"name={name}", "--output-dir", str(out)]
    if workers > 1:
        command += ["--workers", str(workers)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    whole = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{name} failed: {done.stderr.strip().splitlines()[-1]}")
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rounds = sum(r["train_s"] for r in records if r["round"] > 0)
    return rounds, whole, records[-1]["test_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--examples", type=int, default=8, help="examples per client")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.clients} clients x {args.examples} "
          f"SST-2 sentences, batch 8, {args.rounds} rounds, all clients per round")
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        out = Path(tmp)
        for preset in args.presets:
            config = out / f"{preset}.yaml"
            config.write_text(yaml.safe_dump(job(preset, args.clients, args.examples, args.rounds, out)))
            best: dict[str, tuple[float, float, float]] = {}
            for repeat in range(args.repeats):
                for arm, (workers, threads) in ARMS.items():
                    name = f"{preset}-{workers}x{threads}-{repeat}"
                    result = run_arm(config, out, name, workers, threads)
                    if arm not in best or result[0] < best[arm][0]:
                        best[arm] = result
            report(preset, best)


def report(preset: str, best: dict[str, tuple[float, float, float]]) -> None:
    print(f"\nBERT preset {preset}: rounds s (whole command s), final test accuracy")
    for arm, (rounds, whole, accuracy) in best.items():
        print(f"  {arm:22s} {rounds:8.2f} s ({whole:6.1f} s)  accuracy {accuracy:.4f}")
    one, threads, workers = (best[arm][0] for arm in ARMS)
    speedup = one / workers
    print(f"  2 workers / 1 x 1: {speedup:.2f}x ({'PASS' if speedup >= 1.7 else 'FAIL'} against 1.7x); "
          f"/ 1 x 2: {threads / workers:.2f}x; 1 x 2 / 1 x 1: {one / threads:.2f}x")
    accuracies = {round(result[2], 6) for result in best.values()}
    print(f"  same final accuracy in every arm: {len(accuracies) == 1}")


if __name__ == "__main__":
    main()
