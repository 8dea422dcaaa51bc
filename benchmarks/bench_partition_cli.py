"""`fedlm partition` against the same work through the Python API, on a synthetic labelled CSV.

Writes N rows (5-24 Zipf-distributed words, 4 labels) to a temporary directory, then runs, each in a fresh
subprocess so that imports and peak memory are counted separately:

- api: ``load_source`` -> ``partition_input`` -> label-Dirichlet partition -> ``write_partition_report``;
- cli: ``fedlm.cli.main(["partition", config])``, the same partition and report through the command.

Prints CPU seconds (user + system: on a shared machine wall time says more about the neighbours than about
fedlm), wall seconds and peak RSS of each, best of ``--repeats`` runs taken in turn, and the cli / api ratios;
PASS when the CPU-time ratio is at most ``--target`` (2.0: issue 18 item 7).

    .venv/bin/python benchmarks/bench_partition_cli.py [--rows 1000000] [--clients 1000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
from _child import run_json_child

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    start = time.perf_counter()
    mode, config, out = sys.argv[1:4]
    if mode == "cli":
        from fedlm.cli import main
        rc = main(["partition", config, "--out", out])
    else:
        from pathlib import Path
        from fedlm.config import load_config
        from fedlm.data.inputs import partition_input
        from fedlm.data.partition import build_partitioner
        from fedlm.data.partition_stats import write_partition_report
        from fedlm.data.sources import load_source
        cfg = load_config(config)
        loaded = load_source(cfg.data.source, Path("."), seed=cfg.seed)
        data = partition_input(loaded, "train")
        part = build_partitioner(cfg.partition).partition(data, cfg.partition.num_clients, cfg.seed)
        write_partition_report(Path(out), part, data, loaded.label_names)
        rc = 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"rc": rc, "wall": time.perf_counter() - start, "cpu": usage.ru_utime + usage.ru_stime,
                      "rss_mib": usage.ru_maxrss / 1024}))
""")


def write_csv(path: Path, rows: int, seed: int = 0) -> None:
    """A text,label CSV: short texts over a 5,000-word Zipf vocabulary, labels uniform over 4 classes."""
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(5000)])
    lengths = rng.integers(5, 25, rows)
    words = vocab[rng.zipf(1.3, int(lengths.sum())) % vocab.size]
    ends = np.cumsum(lengths)
    labels = rng.integers(0, 4, rows)
    with path.open("w", encoding="utf-8") as f:
        f.write("text,label\n")
        for i, end in enumerate(ends):
            f.write(" ".join(words[end - lengths[i] : end]) + f",{labels[i]}\n")


def measure(mode: str, config: Path, out: Path) -> dict:
    """Seconds (imports included) and peak RSS of one mode, in a fresh interpreter."""
    return run_json_child([sys.executable, "-c", _CHILD, mode, str(config), str(out)], mode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, in turn; the best counts")
    parser.add_argument("--target", type=float, default=2.0, help="largest cli / api CPU-time ratio that passes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedlm-bench-") as tmp:
        root = Path(tmp)
        write_csv(root / "train.csv", args.rows)
        config = root / "config.yaml"
        config.write_text(f"name: bench\noutput_dir: {root / 'runs'}\ndata: {{source: {root / 'train.csv'}}}\n"
                          f"partition: {{kind: label_dirichlet, alpha: 0.5, num_clients: {args.clients}}}\n")
        runs: dict[str, list[dict]] = {"api": [], "cli": []}
        for _ in range(args.repeats):
            for mode, results in runs.items():
                results.append(measure(mode, config, root / mode))
    best = {mode: min(results, key=lambda r: r["cpu"]) for mode, results in runs.items()}
    api, cli = best["api"], best["cli"]
    ratio = cli["cpu"] / api["cpu"]
    print(f"{args.rows:,} rows, label Dirichlet into {args.clients:,} clients (report includes word statistics)")
    for name, result in best.items():
        print(f"{name}  CPU {result['cpu']:7.1f} s  wall {result['wall']:7.1f} s  "
              f"peak RSS {result['rss_mib']:6.0f} MiB")
    print(f"cli / api: CPU time {ratio:.2f}, wall {cli['wall'] / api['wall']:.2f}, memory "
          f"{cli['rss_mib'] / api['rss_mib']:.2f}  {'PASS' if ratio <= args.target else 'FAIL'}")
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
