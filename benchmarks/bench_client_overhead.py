"""Per-client overhead of the in-process simulator: a FedAvg round against a centralized epoch over the same batches.

Both arms run the very same batches (each client's rows in the order its seed draws them) through the same model,
collate, forward, backward, clipping and AdamW step; the centralized epoch keeps one optimizer over all of them,
so what the round costs beyond it is the per-client work: receiving and loading the parameters, a fresh optimizer,
seeding, the finite-update check, snapshot, encode/decode and folding into the aggregate.

(a) tiny BERT (``model.preset tiny``), 1,000 clients per round with one batch of 16 SST-2 sentences each:
    (round - epoch) / clients in ms, target <= 10 ms.
(b) MiniLM (``model.checkpoint minilm``), 10 clients x 4 batches of 8: (round - epoch) / epoch, target <= 5%.

The two arms take turns in one process (epoch, round, then round, epoch, ...) after a short warm-up of both; each
repeat's overhead is its round less its epoch, and the verdict takes the median over the repeats. Times are CPU
seconds of this process (user + system, page faults included), which other jobs on a shared machine inflate far
less than wall time; wall times are printed beside them. ``--threads`` sets torch's intra-op threads (default 1,
the steadiest on a shared 2-core machine).

    python benchmarks/bench_client_overhead.py [--quick] [--repeats 3] [--threads 1] [--only tiny|minilm]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from fedlm.config import validate
from fedlm.data.sources import resolve_data_dir
from fedlm.federation.client_round import fit_client
from fedlm.federation.codecs import get_codec
from fedlm.federation.engine import RoundEngine, RoundPlan
from fedlm.federation.local_training import LocalSettings, batch_order, clip_and_step, local_seed, make_optimizer
from fedlm.federation.params import NamedTensors, load_into, snapshot, trainable_names
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import FedAvg
from fedlm.run.prepare import Prepared, prepare

SEED = 0
WARM_UP_SHARE = 20  # the warm-up takes every 20th client's share (at least 2 clients)


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float  # this process's CPU seconds, user + system

    def __sub__(self, other: Timing) -> Timing:
        return Timing(self.wall - other.wall, self.cpu - other.cpu)


def timed(work: Callable[[], object]) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return Timing(time.perf_counter() - wall, time.process_time() - cpu)


def prepared(model: dict[str, Any], examples: int, batch_size: int) -> tuple[Prepared, LocalSettings]:
    """``examples`` SST-2 sentences tokenised once, as one client (so preparation stays cheap)."""
    config = validate({
        "name": "bench", "seed": SEED,
        "data": {"source": "glue/sst2", "max_train_examples": examples, "max_test_examples": 32},
        "partition": {"kind": "iid", "num_clients": 1},
        "model": {"family": "bert", "max_length": 64, **model},
        "train": {"batch_size": batch_size, "lr": 1e-4},
    })
    return prepare(config, resolve_data_dir(None)), LocalSettings.from_config(config.train)


class SideBySide:
    """A FedAvg round over ``clients`` consecutive shares of the prepared rows, and a centralized epoch over the
    same clients' batches."""

    def __init__(self, prep: Prepared, settings: LocalSettings, clients: int, share: int) -> None:
        pooled = list(prep.client_train[0])
        self.client_rows = {cid: pooled[cid * share:(cid + 1) * share] for cid in range(clients)}
        self.prep, self.settings = prep, settings
        self.start: NamedTensors = snapshot(prep.model, trainable_names(prep.model))
        codec = get_codec("fp32")
        executor = InProcessExecutor(prep.model, prep.task, self.client_rows, codec, ClientStore({}), [],
                                     fit_fn=partial(fit_client, borrow=True))  # as fedlm run's simulator
        self.engine = RoundEngine(FedAvg(), executor, codec, list(self.client_rows), settings,
                                  RoundPlan(rounds=1, clients_per_round=clients, seed=SEED))

    def fedavg_round(self) -> Timing:
        """One FedAvg round over all clients, aggregation included."""
        return timed(lambda: self.engine.run_round(1, self.start))

    def centralized_epoch(self) -> Timing:
        """One optimizer through every client's batches, drawn as the round's clients draw them."""
        load_into(self.prep.model, self.start)
        return timed(self._train_through)

    def _train_through(self) -> None:
        model, task, settings = self.prep.model, self.prep.task, self.settings
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(trainable, settings)
        for cid, rows in self.client_rows.items():
            generator = torch.Generator().manual_seed(local_seed(SEED, 1, cid))
            for batch_rows in batch_order(len(rows), settings, generator):
                loss, _ = task.loss(model, task.collate([rows[i] for i in batch_rows], generator))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                clip_and_step(optimizer, trainable, settings.max_grad_norm)
                float(loss.detach())  # the round's clients read each loss too


def measure(label: str, prep: Prepared, settings: LocalSettings, clients: int, share: int,
            repeats: int) -> list[tuple[Timing, Timing]]:
    """(round, epoch) of each repeat, the two taking turns, after a warm-up of both over a few clients."""
    warm = SideBySide(prep, settings, max(2, clients // WARM_UP_SHARE), share)
    warm.centralized_epoch(), warm.fedavg_round()
    side = SideBySide(prep, settings, clients, share)
    runs = []
    for repeat in range(repeats):
        if repeat % 2 == 0:
            epoch = side.centralized_epoch()
            runs.append((side.fedavg_round(), epoch))
        else:
            fed = side.fedavg_round()
            runs.append((fed, side.centralized_epoch()))
    params = sum(t.numel() for t in side.start.values())
    print(f"{label}: {params / 1e6:.2f}M trainable params, {clients} clients x {share} examples, "
          f"batch {settings.batch_size}")
    for fed, epoch in runs:
        print(f"  fedavg round {fed.cpu:7.2f} s cpu ({fed.wall:6.2f} s wall)   centralized epoch {epoch.cpu:7.2f} s "
              f"cpu ({epoch.wall:6.2f} s wall)   round - epoch {fed.cpu - epoch.cpu:+6.2f} s cpu")
    return runs


def median_overhead(runs: list[tuple[Timing, Timing]]) -> tuple[float, float]:
    """The median repeat's (round - epoch, epoch), in CPU seconds."""
    fed, epoch = sorted(runs, key=lambda run: run[0].cpu - run[1].cpu)[len(runs) // 2]
    return fed.cpu - epoch.cpu, epoch.cpu


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 100 tiny clients, 3 MiniLM, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=["tiny", "minilm"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else args.repeats
    print(f"torch threads: {args.threads}; {repeats} repeat(s) after a warm-up; the median repeat decides")
    if args.only != "minilm":
        clients = 100 if args.quick else 1000
        prep, settings = prepared({"preset": "tiny", "vocab_size": 8000}, clients * 16, 16)
        extra, epoch = median_overhead(measure("(a) tiny BERT", prep, settings, clients, 16, repeats))
        print(f"  per-client overhead: {extra / clients * 1e3:.2f} ms cpu (a client's own batch: "
              f"{epoch / clients * 1e3:.1f} ms)  target <= 10 ms: {verdict(extra / clients <= 0.010)}")
    if args.only != "tiny":
        clients = 3 if args.quick else 10
        prep, settings = prepared({"checkpoint": "minilm", "preset": None}, clients * 32, 8)
        extra, epoch = median_overhead(measure("(b) MiniLM", prep, settings, clients, 32, repeats))
        print(f"  per-client overhead: {extra / clients * 1e3:.1f} ms cpu = {extra / epoch * 100:.2f}% of the "
              f"epoch (a client's own batches: {epoch / clients:.2f} s)  target <= 5%: "
              f"{verdict(extra <= 0.05 * epoch)}")


if __name__ == "__main__":
    main()
