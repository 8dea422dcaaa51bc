"""FFDAPT against FDAPT round by round in one process: the two take turns, so machine load hits both alike.

FDAPT's claim (Jiang et al., Table 3): freezing a rotating window of blocks on each client (FFDAPT) shortens a
round by I = (T - T_F) / T_F, 12.1% on average. Timing two separate runs, as ``recipes/results/fdapt.md`` first
did, lets the machine's load pick the winner; here both arms live in one process and their rounds alternate
in ABBA order (warm-up round: FDAPT then FFDAPT, pair 1: FFDAPT then FDAPT, pair 2: FDAPT then FFDAPT,
...), so drift cancels too. Besides wall seconds it counts the process's CPU seconds, which leave out the time
spent waiting for a core (measured here they still move with load, less than wall seconds do).

Each arm is what ``fedlm run recipes/fdapt.yaml`` builds: the recipe's config as the file reads when the
benchmark starts (masked LM on biomedical-abstracts, max_length 128, AdamW, its batch size and lr, one local
epoch per round, its number of abstracts unless ``--abstracts``), with ``model.checkpoint: minilm`` (the
recipe's own MiniLM start has the same shape, so the same cost, and may not be trained yet), prepared once by
``fedlm.run.prepare``, and per arm its own sharing policy (``run_policy``; FFDAPT adds the recipe's
``sharing.freeze_window: {epsilon: 2, gamma: 1.0}``), strategy, codec, client store, ``InProcessExecutor``
and ``RoundEngine``, with ``policy.frozen_for`` as the engine's hook, as ``run_single`` wires them. The arms
share the model object (each client loads what it is sent, as in a run) but keep their own global weights,
so each trains as it would in its own run. Nothing is evaluated: the engine's ``train_s`` (downlink encode +
the clients' local training, upload encode and decode) is T, its ``wall_s`` adds the aggregation.
Round 1 of each arm is a warm-up and not counted; the FFDAPT window rotates with the real round index.

    OMP_NUM_THREADS=1 python benchmarks/bench_ffdapt_rounds.py [--clients 2,8] [--partitions iid,...] [--abstracts N]
        [--pairs 4] [--quick]

With several scenarios (client counts x partitions) it ends with the paper's aggregate: each scenario's median I,
and their mean over the scenarios (FDAPT reports I per scenario and their average, 12.1%).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedlm.config import ExperimentConfig
from fedlm.config.experiment import read_yaml, set_dotted, validate
from fedlm.data.sources import resolve_data_dir
from fedlm.federation.engine import EngineHooks, RoundEngine
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport, Executor
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import NamedTensors, snapshot
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import make_client_store
from fedlm.metrics import mean_interval
from fedlm.run.policy import run_policy
from fedlm.run.prepare import Prepared, prepare
from fedlm.run.single import round_plan, run_codec, run_strategy

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "fdapt.yaml"
WINDOW = {"epsilon": 2, "gamma": 1.0}  # the recipe's FFDAPT settings


def recipe_config(recipe: dict, clients: int, abstracts: int | None, rounds: int,
                  window: dict | None, partition: str = "iid") -> ExperimentConfig:
    """The recipe's base config (grid, baselines, downstream and seeds dropped) at this benchmark's scale; the
    checkpoint is the bundled MiniLM (the same shape as any MiniLM the recipe starts from: time does not depend on
    the weights, and a run directory the recipe points at may not exist yet)."""
    raw = copy.deepcopy(recipe)
    for key in ("grid", "baselines", "downstream", "seeds"):
        raw.pop(key, None)
    changes: dict[str, Any] = {"model.checkpoint": "minilm", "partition.kind": partition,
                               "partition.num_clients": clients, "data.max_test_examples": max(16, clients),
                               "protocol.rounds": rounds,
                               "sharing.freeze_window": window}
    if abstracts is not None:
        changes["data.max_train_examples"] = abstracts
    for dotted, value in changes.items():
        set_dotted(raw, dotted.split("."), value)
    return validate(raw)


class CpuTimed(Executor):
    """The executor, with the process CPU seconds of each ``run`` (the round's clients) kept in ``last_s``:
    with one thread, CPU time leaves out the time spent waiting for a core (though not what sharing a core's
    caches and memory bandwidth costs, so load still moves it)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.last_s = 0.0

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        began = time.process_time()
        try:
            return list(self.executor.run(jobs))
        finally:
            self.last_s = time.process_time() - began

    def close(self) -> None:
        self.executor.close()


@dataclass
class Arm:
    """One arm's run: its engine and its own global weights, advanced one round at a time."""

    label: str
    policy: SharingPolicy
    engine: RoundEngine
    executor: CpuTimed
    global_params: NamedTensors
    records: list[dict[str, Any]] = field(default_factory=list)

    def round(self, round_idx: int) -> dict[str, Any]:
        """Run one round; its engine record, with the CPU seconds of its clients."""
        self.global_params = self.engine.run_round(round_idx, self.global_params)
        record = self.records[-1]
        record["cpu_train_s"] = self.executor.last_s
        return record


def build_arm(label: str, prep: Prepared, config: ExperimentConfig, initial: NamedTensors, store_dir: Path) -> Arm:
    """The pieces ``run_single`` builds for a FedAvg run in this process, under ``config``'s sharing section."""
    arm_prep = dataclasses.replace(prep, config=config)
    policy = run_policy(arm_prep)
    n_clients = config.num_clients()
    plan = round_plan(config, n_clients)
    store = make_client_store({n: initial[n] for n in policy.local_names}, n_clients, config.sharing.local_store,
                              store_dir)
    codec = run_codec(config.protocol)
    settings = LocalSettings.from_config(config.train)
    records: list[dict[str, Any]] = []
    hooks = EngineHooks(record=lambda record: records.append(record.to_dict()))
    executor = CpuTimed(InProcessExecutor(prep.model, prep.task, prep.client_train, codec, store,
                                          policy.local_names))
    engine = RoundEngine(strategy=run_strategy(arm_prep, plan), executor=executor, codec=codec,
                         client_ids=list(range(n_clients)), settings=settings, plan=plan, hooks=hooks, sharing=policy)
    return Arm(label, policy, engine, executor, {n: initial[n].clone() for n in policy.global_names}, records)


def spread(values: list[float]) -> str:
    """median [min-max]"""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def bench_setting(recipe: dict, clients: int, partition: str, abstracts: int | None, pairs: int,
                  data_dir: Path) -> dict[str, Any]:
    """Both arms from the same starting weights; round 1 of each a warm-up, then ``pairs`` ABBA pairs."""
    rounds = pairs + 1
    base = recipe_config(recipe, clients, abstracts, rounds, None, partition)
    torch.manual_seed(base.seed)
    prep = prepare(base, data_dir)
    initial = snapshot(prep.model)
    with tempfile.TemporaryDirectory() as tmp:
        arms = (build_arm("FDAPT", prep, base, initial, Path(tmp) / "a"),
                build_arm("FFDAPT", prep, recipe_config(recipe, clients, abstracts, rounds, WINDOW, partition), initial,
                          Path(tmp) / "b"))
        loads: list[float] = []
        for round_idx in range(1, rounds + 1):
            for arm in arms if round_idx % 2 else arms[::-1]:  # AB (warm-up), BA, AB, ...
                rec = arm.round(round_idx)
                print(f"  {clients} clients {partition}, round {round_idx}, {arm.label}: train {rec['train_s']:.2f} s "
                      f"(CPU {rec['cpu_train_s']:.2f} s), round {rec['wall_s']:.2f} s, "
                      f"{rec['bytes_up'] / 1e6:.2f} MB up, loss {rec['train_loss']:.3f}", flush=True)
            loads.append(os.getloadavg()[0])
    batch = base.train.batch_size
    return {"clients": clients, "partition": partition, "timed": {arm.label: arm.records[1:] for arm in arms},
            "loads": loads,
            "blocks": sum(len(rows) for rows in prep.client_train.values()),
            "steps": sum(-(-len(rows) // batch) for rows in prep.client_train.values()),
            "abstracts": len(prep.loaded.splits["train"]), "window": arms[1].policy.window}


def gains(full: list[dict], frozen: list[dict], key: str) -> list[float]:
    """I = (T - T_F) / T_F in percent, pair by pair."""
    return [100 * (a[key] - b[key]) / b[key] for a, b in zip(full, frozen, strict=True)]


def report(result: dict[str, Any]) -> None:
    full, frozen = result["timed"]["FDAPT"], result["timed"]["FFDAPT"]
    window = result["window"]
    counts = sorted({window.count(c) for c in window.sizes})
    up, up_f = (statistics.median(r["bytes_up"] for r in arm) for arm in (full, frozen))
    print(f"\n{result['clients']} clients, {result['partition']}: {result['abstracts']} abstracts, "
          f"{result['blocks']} blocks of 128 tokens, {result['steps']} local steps per round in all; "
          f"FFDAPT clients freeze {counts} of "
          f"{window.blocks} blocks each; {len(full)} timed pairs; load average "
          f"{min(result['loads']):.1f}-{max(result['loads']):.1f}")
    print("| arm | client training s (wall) | client training s (CPU) | whole round s (wall) | MB up per round |")
    print("|---|---|---|---|---|")
    for label, arm, size in (("FDAPT", full, up), ("FFDAPT (epsilon 2, gamma 1.0)", frozen, up_f)):
        print(f"| {label} | {spread([r['train_s'] for r in arm])} | {spread([r['cpu_train_s'] for r in arm])} | "
              f"{spread([r['wall_s'] for r in arm])} | {size / 1e6:.2f} |")
    for what, key in (("client training, wall", "train_s"), ("client training, CPU", "cpu_train_s"),
                      ("whole round, wall", "wall_s")):
        values = gains(full, frozen, key)
        print(f"I = (T - T_F) / T_F, {what}: {', '.join(f'{i:+.1f}%' for i in values)}; "
              f"median {statistics.median(values):+.1f}%")
    print(f"bytes up per round, FFDAPT / FDAPT: {up_f / up:.3f} (paper's I: 12.1% on average)")


def average(results: list[dict[str, Any]]) -> None:
    """The paper's aggregate (FDAPT §5: I computed per scenario, then averaged over the scenarios): the mean of
    the scenarios' median I, beside each scenario's, so that no one scenario stands for the claim."""
    print("\n| scenario | I, client training wall (median of pairs) | I, client training CPU | pairs faster (wall) |")
    print("|---|---:|---:|---:|")
    medians: dict[str, list[float]] = {"train_s": [], "cpu_train_s": []}
    for result in results:
        full, frozen = result["timed"]["FDAPT"], result["timed"]["FFDAPT"]
        pairs = {key: gains(full, frozen, key) for key in medians}
        for key, kept in medians.items():
            kept.append(statistics.median(pairs[key]))
        faster = sum(i > 0 for i in pairs["train_s"])
        print(f"| {result['clients']} clients, {result['partition']} | {medians['train_s'][-1]:+.1f}% | "
              f"{medians['cpu_train_s'][-1]:+.1f}% | {faster} of {len(full)} |")
    cells = []
    for values in medians.values():
        mean, _, half = mean_interval(values)
        cells.append(f"**{mean:+.1f}%** [{mean - half:+.1f}, {mean + half:+.1f}]")
    print(f"| **average over the {len(results)} scenarios** [95% t-interval over them] | {cells[0]} | {cells[1]} | |")
    print(f"(paper: 12.1% on average over its scenarios; scenario medians range {min(medians['train_s']):+.1f}% to "
          f"{max(medians['train_s']):+.1f}% here)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="2,8", help="comma-separated client counts (default 2,8)")
    parser.add_argument("--partitions", default="iid",
                        help="comma-separated partition kinds, each timed at every client count (default iid; the "
                             "paper's scenarios: iid,fdapt_quantity,fdapt_length,fdapt_vocab)")
    parser.add_argument("--abstracts", type=int, help="training abstracts in all (default: the recipe's)")
    parser.add_argument("--pairs", type=int, default=4, help="timed FDAPT/FFDAPT round pairs per setting")
    parser.add_argument("--data-dir", help="dataset directory (default: as fedlm run finds it)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 abstracts, 1 pair")
    args = parser.parse_args()
    if args.quick:
        args.abstracts, args.pairs = 8, 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    recipe = read_yaml(RECIPE)  # read once: every setting times the same recipe
    data_dir = resolve_data_dir(args.data_dir)
    began = time.perf_counter()
    base = recipe_config(recipe, 2, args.abstracts, 1, None)
    print(f"{RECIPE.name} (checkpoint minilm): masked LM on {base.data.source}, {base.data.max_train_examples} "
          f"training abstracts, max_length {base.model.max_length}, {base.train.optimizer} lr {base.train.lr:g} "
          f"batch {base.train.batch_size}, {base.train.local_epochs} local epoch(s) per round; {args.pairs} ABBA "
          f"pairs after a warm-up round; {torch.get_num_threads()} thread(s); load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results = [bench_setting(recipe, int(c), kind, args.abstracts, args.pairs, data_dir)
               for c in args.clients.split(",") for kind in args.partitions.split(",")]
    for result in results:
        report(result)
    if len(results) > 1:
        average(results)
    print(f"\ntotal {time.perf_counter() - began:.0f} s; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
