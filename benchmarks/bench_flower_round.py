"""A FedAvg round through a real Flower deployment / the same round in the simulator, side by side.

The Flower side is the deployment of ``deploy/flower/README.md`` on this machine (``fedlm.flower.localdeploy``):
one SuperLink, one SuperNode per client, ``flwr run`` and the ServerApp process, talking over localhost. Both
sides run the same config and seed and record each round's ``wall_s`` (sampling, the clients' work,
aggregation, evaluation) in their ``metrics.jsonl``; this script compares them round by round.

Round 1 through Flower includes each node's one-time start (its worker imports fedlm and prepares the
experiment); the claim (issue 15: a Flower round at most 1.2x the simulator's) is about the rounds after it,
when the workers answer from their prepared state. ``--no-worker`` trains in the ClientApp process itself, as
before the worker (every message re-imports fedlm and re-prepares), to show what the worker saves. The
parameters travel on fedlm's relay beside the messages (``fedlm.flower.relay``); ``--no-relay`` puts them in
Flower's messages, as before the relay.

    .venv/bin/python benchmarks/bench_flower_round.py                      # quickstart, 3 rounds, ~15 min
    .venv/bin/python benchmarks/bench_flower_round.py recipes/quickstart.yaml \\
        --rounds 3 --secure            # with Flower's SecAgg+
    .venv/bin/python benchmarks/bench_flower_round.py --tiny --rounds 3                      # smoke run, ~3 minutes
    .venv/bin/python benchmarks/bench_flower_round.py --set 'sharing={}' --set split.transport=grpc
                                      # the quickstart as FedBERT split learning: turns through Flower / gRPC
                                      # (a round's turns sent at once; --split-dispatch false: one by one)

The quickstart starts 10 SuperNodes and 10 workers holding MiniLM (~1 GB each): use a machine with the memory.
Leave ``OMP_NUM_THREADS`` unset: the simulator then trains on every core, and the deployment divides the
cores among its nodes' workers (node config ``threads``). Every process shares the CPU here, so on one machine
Flower's message handling queues behind the training; across machines each node pays it on its own cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil

from fedlm.config import dump_config, load_config, validate
from fedlm.data.sources import resolve_data_dir
from fedlm.flower.localdeploy import LocalDeployment, flower_binaries_available, trunk_credentials
from fedlm.run.prepare import num_clients_of
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single

ROOT = Path(__file__).resolve().parents[1]


def tiny_experiment(folder: Path) -> tuple[dict, Path]:
    """The test suite's tiny BERT on a synthetic sentiment CSV (no downloads)."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import make_sentences, tiny_config

    data = folder / "tiny-data"
    data.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 400, 0), ("test", 100, 1)):
        rows = ["sentence,sentiment"] + [f"{t},{label}" for t, label in make_sentences(n, seed)]
        (data / f"{split}.csv").write_text("\n".join(rows) + "\n")
    raw = tiny_config(folder, data, clients_per_round=2)
    raw["partition"]["num_clients"] = 2
    return raw, data


# process kinds of a local deployment, by a word of their command line (the first match wins)
KINDS = (("flower-superlink", "SuperLink"), ("flower-supernode", "SuperNodes"), ("flower-superexec", "SuperExecs"),
         ("flwr-clientapp", "ClientApp processes"), ("flwr-serverapp", "ServerApp (trunk, relay)"),
         ("fedlm.flower.worker", "node workers"), ("flwr", "flwr CLI"))


class CpuByKind(threading.Thread):
    """CPU seconds per process kind and round, sampled every ``interval_s`` from every process on the machine.

    The round is the one ``run_dir``'s metrics.jsonl has not yet recorded; processes that are none of ``KINDS``
    (this script, other jobs) count as "other". A process started after the monitor counts from its start; one
    that ends between two samples loses its last interval (ClientApp processes: at most ``interval_s`` each), so
    the figures are slight underestimates."""

    def __init__(self, run_dir: Path, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.interval_s = run_dir, interval_s
        self.cpu: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # round -> kind -> s
        self._last: dict[int, float] = {}
        self._done = threading.Event()
        self._since = time.time()

    def _round(self) -> int:
        # line by line rather than read_metrics: a record half written when the sampler looks must not stop it
        path = self.run_dir / "metrics.jsonl"
        return 1 + sum(1 for line in path.read_text().splitlines() if '"round": 0' not in line) if path.is_file() else 0

    def _sample(self) -> None:
        current = self._round()
        seen = {}
        for process in psutil.process_iter(["pid", "cmdline", "cpu_times", "create_time"]):
            times, command = process.info["cpu_times"], " ".join(process.info["cmdline"] or [])
            if times is None:
                continue
            seen[process.pid] = used = times.user + times.system
            kind = next((name for word, name in KINDS if word in command), "other")
            new = 0.0 if (process.info["create_time"] or 0) >= self._since else used
            self.cpu[current][kind] += used - self._last.get(process.pid, new)
        self._last = seen

    def run(self) -> None:
        self._sample()
        while not self._done.wait(self.interval_s):
            self._sample()

    def stop(self) -> dict[int, dict[str, float]]:
        self._done.set()
        self.join()
        return {r: dict(kinds) for r, kinds in sorted(self.cpu.items())}


def round_times(run_dir: Path) -> list[float]:
    return [r["wall_s"] for r in read_metrics(run_dir) if r.get("round", 0) >= 1 and "wall_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "recipes" / "quickstart.yaml"))
    parser.add_argument("--data-dir", default=None, help="default: $FEDLM_DATA_DIR, else ../shared/data")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, as fedlm run's --set (e.g. split.transport=grpc)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny BERT instead of the config")
    parser.add_argument("--secure", action="store_true", help="Flower side with SecAgg+")
    parser.add_argument("--no-worker", action="store_true", help="train in each ClientApp process (old way)")
    parser.add_argument("--no-relay", action="store_true",
                        help="parameters inside Flower's messages instead of on fedlm's relay")
    parser.add_argument("--split-dispatch", choices=["auto", "true", "false"], default="auto",
                        help="split runs: send a round's turns at once (true, auto here) or one message per turn")
    parser.add_argument("--node-threads", type=int, default=None,
                        help="each node worker's torch threads (default: the cores divided among the nodes; a split "
                             "round sent at once trains one node at a time, so it can give each node every core)")
    parser.add_argument("--cpu", action="store_true",
                        help="also record CPU seconds per process kind and round (SuperNodes, workers, ServerApp, ...)")
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    if not flower_binaries_available():
        raise SystemExit("Flower's programs (flower-superlink, flower-supernode, flwr) are not installed")

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-flower-"))
    out.mkdir(parents=True, exist_ok=True)  # --out may name a folder that does not exist yet
    overrides = [*args.set, f"protocol.rounds={args.rounds}"]
    if args.tiny:
        raw, data_dir = tiny_experiment(out)
        (out / "tiny.yaml").write_text(dump_config(validate(raw)))
        config = load_config(out / "tiny.yaml", overrides)
    else:
        config = load_config(args.config, overrides)
        data_dir = resolve_data_dir(args.data_dir)
    config_path = out / "experiment.yaml"
    config_path.write_text(dump_config(config))

    started, sim_cpu = time.perf_counter(), time.process_time()
    run_single(config, data_dir, out / "sim")
    sim_s, sim_cpu = time.perf_counter() - started, time.process_time() - sim_cpu

    nodes = [{"partition-id": i, "data-dir": str(data_dir), "worker": not args.no_worker,
              **({"threads": args.node_threads} if args.node_threads else {})}
             for i in range(num_clients_of(config))]
    run_config = {"config": str(config_path), "data-dir": str(data_dir), "run-dir": str(out / "flower" / "run"),
                  "node-wait-s": 120.0, "secure-aggregation": args.secure, "split-dispatch": args.split_dispatch}
    relay = not (args.no_relay or args.secure)
    if config.split is not None or relay:  # the trunk's / relay's TLS files and each node's token
        trunk, tokens = trunk_credentials(out / "trunk", [int(node["partition-id"]) for node in nodes])
        run_config.update({**trunk, "relay": str(relay).lower()})
        for node in nodes:
            node["trunk-token"] = tokens[int(node["partition-id"])]
    monitor = CpuByKind(out / "flower" / "run") if args.cpu else None
    if monitor:
        monitor.start()
    started = time.perf_counter()
    with LocalDeployment(out / "flower", nodes) as deployment:
        status = deployment.run(run_config, timeout_s=24 * 3600)
    flower_s = time.perf_counter() - started
    cpu = monitor.stop() if monitor else {}

    sim, flower = round_times(out / "sim"), round_times(out / "flower" / "run")
    if status != 0 or len(flower) != len(sim):  # flwr run --stream exits 0 when the ServerApp raised
        raise SystemExit(f"the Flower run did not finish its {len(sim)} rounds (flwr run: {status}); see "
                         f"{out / 'flower' / 'run.log'}")
    print(f"{'round':>5} {'simulator s':>12} {'flower s':>10} {'ratio':>7}")
    for index, (a, b) in enumerate(zip(sim, flower, strict=True), start=1):
        print(f"{index:>5} {a:12.2f} {b:10.2f} {b / a:7.2f}")
    steady = statistics.mean(flower[1:]) / statistics.mean(sim[1:]) if len(sim) > 1 else float("nan")
    result = {"config": config.name, "rounds": args.rounds, "secure": args.secure, "worker": not args.no_worker,
              "relay": relay, "split_dispatch": args.split_dispatch if config.split is not None else None,
              "simulator_round_s": sim, "flower_round_s": flower, "steady_ratio": steady,
              "first_round_ratio": flower[0] / sim[0], "simulator_total_s": sim_s, "flower_total_s": flower_s,
              "simulator_cpu_s": sim_cpu, "flower_cpu_s_by_round_and_kind": cpu}
    (out / "bench_flower_round.json").write_text(json.dumps(result, indent=2))
    if cpu:
        print(f"CPU seconds (the simulator: {sim_cpu:.0f} s in all, its {len(sim)} rounds and setup)")
        for index, kinds in cpu.items():
            if 1 <= index <= len(flower):
                top = sorted(kinds.items(), key=lambda kv: -kv[1])
                print(f"  Flower round {index}: {sum(kinds.values()):.0f} s: "
                      + ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in top))
    verdict = "PASS" if steady <= 1.2 else "FAIL"
    print(f"rounds 2..{args.rounds}: flower / simulator = {steady:.2f} (target <= 1.2: {verdict}); "
          f"whole runs {flower_s:.0f} s vs {sim_s:.0f} s; details in {out / 'bench_flower_round.json'}")


if __name__ == "__main__":
    main()
