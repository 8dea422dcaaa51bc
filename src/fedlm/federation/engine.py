"""The one round loop: sample clients -> local work -> encode -> aggregate -> evaluate -> record.

Every protocol (centralized, isolated, FedAvg, FedProx, FedOpt) is this loop with a different strategy and
a different split of parameters into global (sent, aggregated) and local (kept by each client). Where the
clients run is the executor's business: in this process for simulation, or behind Flower for deployment.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.local_training import LocalSettings, local_seed, round_lr
from fedlm.federation.params import NamedTensors
from fedlm.federation.strategies.base import ClientUpdate, Strategy, sample_clients

log = logging.getLogger("fedlm")


@dataclass(frozen=True)
class ClientJob:
    """One client's instructions for one round."""

    client_id: int
    round_idx: int
    params: Encoded
    settings: LocalSettings
    seed: int
    timeout_s: float | None = None
    frozen: tuple[str, ...] = ()  # global parameters this client neither trains nor uploads this round

    def deadline(self) -> float | None:
        """The ``time.monotonic()`` value local training must finish by, counted from now (None: no limit)."""
        return time.monotonic() + self.timeout_s if self.timeout_s else None


@dataclass(frozen=True)
class ClientFailure:
    client_id: int
    reason: str


@dataclass
class ClientReport:
    """An update as the server received it: decoded params plus what it cost to send."""

    update: ClientUpdate
    upload_bytes: int  # parameters sent, scale metadata included
    upload_meta_bytes: int = 0
    boundary_up: int = 0  # split learning: activations and gradients the client sent to the trunk
    boundary_down: int = 0  # ... and received from it
    download_extra: int = 0  # received besides the round's downlink (split: an optimizer state handed on)


class Executor(Protocol):
    """Where a round's clients run: in this process (simulation), on Flower nodes, or against a split trunk.
    ``run`` returns one result per job, in job order; ``close`` releases what it holds (servers, threads)."""

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]: ...

    def close(self) -> None: ...


class RoundFailed(RuntimeError):
    """Too few clients reported, even after the allowed retries; ``record`` is what the run records of it."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


@runtime_checkable
class RoundAccounting(Protocol):
    """A strategy that also keeps a ledger per round (differential privacy's epsilon): ``account`` is told the
    round's updates once it is aggregated, and what it returns joins the round's record."""

    def account(self, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]: ...


@dataclass
class RoundPlan:
    """The protocol-level settings the loop needs, decoupled from the config classes."""

    rounds: int
    clients_per_round: int
    min_clients: int = 1
    max_retries: int = 2
    timeout_s: float | None = None
    seed: int = 0
    count_bytes: bool = True
    eval_every: int = 1
    checkpoint_every: int = 1
    lr_schedule: str = "constant"  # train.lr_schedule: the clients' lr per round (local_training.round_lr)


@dataclass
class EngineHooks:
    """Where the loop hands off: evaluation, recording and checkpointing live outside it."""

    evaluate: Callable[[int, NamedTensors, list[int]], dict[str, Any]] | None = None
    record: Callable[[dict[str, Any]], None] | None = None
    checkpoint: Callable[[int, NamedTensors], None] | None = None
    on_round: Callable[[int, dict[str, Any]], None] | None = None
    frozen_for: Callable[[int, list[int], int], tuple[str, ...]] | None = None  # (round, clients, client)
    downlink: Callable[[NamedTensors], NamedTensors] | None = None  # what clients get (split: never the trunk)
    begin_round: Callable[[int, NamedTensors], None] | None = None  # server-side state (the split trunk) takes it
    server_params: Callable[[], NamedTensors] | None = None  # global parameters the server trained itself this
    # round (split: the one trunk, the parts handed client to client); they replace the aggregate's values


@dataclass
class RoundEngine:
    strategy: Strategy
    executor: Executor
    codec: Codec
    client_ids: list[int]
    settings: LocalSettings
    plan: RoundPlan
    hooks: EngineHooks = field(default_factory=EngineHooks)

    def run(self, global_params: NamedTensors, start_round: int = 1) -> NamedTensors:
        if start_round == 1:
            self.evaluate_start(global_params)
        for round_idx in range(start_round, self.plan.rounds + 1):
            global_params = self.run_round(round_idx, global_params)
        return global_params

    def evaluate_start(self, global_params: NamedTensors) -> None:
        """Round 0: the starting point (untrained or original model), so every curve shows what was gained."""
        if self.hooks.evaluate is None or self.hooks.record is None:
            return
        clients = sample_clients(self.client_ids, self.plan.clients_per_round, self.plan.seed, 0)
        record: dict[str, Any] = {"round": 0, "train_loss": None, "clients": [], "failed": [],
                                  "train_examples": 0, "bytes_down": 0, "bytes_up": 0, "bytes_down_meta": 0,
                                  "bytes_up_meta": 0}
        started = time.perf_counter()
        record.update(self.hooks.evaluate(0, global_params, clients))
        record["wall_s"] = time.perf_counter() - started
        self.hooks.record(record)

    def run_round(self, round_idx: int, global_params: NamedTensors) -> NamedTensors:
        started = time.perf_counter()
        sent = self.codec.encode(self.hooks.downlink(global_params) if self.hooks.downlink else global_params)
        settings = LocalSettings(**{**self.settings.__dict__, **self.strategy.client_config(),
                                    "lr": round_lr(self.settings.lr, self.plan.lr_schedule, round_idx,
                                                   self.plan.rounds)})
        download_bytes = download_meta = 0
        failures: list[ClientFailure] = []
        for attempt in range(self.plan.max_retries + 1):
            sampled = sample_clients(self.client_ids, self.plan.clients_per_round, self.plan.seed,
                                     round_idx, attempt)
            jobs = [ClientJob(cid, round_idx, sent, settings, local_seed(self.plan.seed, round_idx, cid),
                              self.plan.timeout_s, self._frozen(round_idx, sampled, cid)) for cid in sampled]
            download_bytes += sent.total_bytes * len(jobs)
            download_meta += sent.meta_bytes * len(jobs)
            if self.hooks.begin_round is not None:
                self.hooks.begin_round(round_idx, global_params)
            results = self.executor.run(jobs)
            reports = [r for r in results if isinstance(r, ClientReport)]
            failed = [r for r in results if isinstance(r, ClientFailure)]
            for failure in failed:
                log.warning("round %d: client %d left out: %s", round_idx, failure.client_id, failure.reason)
            failures.extend(failed)
            if len(reports) >= self.plan.min_clients:
                break
            log.warning("round %d: %d of %d clients reported, need %d; retrying (attempt %d)", round_idx,
                        len(reports), len(jobs), self.plan.min_clients, attempt + 1)
        else:
            raise self._failed(round_idx, len(reports), failures)
        updates = [r.update for r in reports]
        train_s = time.perf_counter() - started  # clients' share of the round (FFDAPT's saving shows here)
        if global_params:
            global_params = self.strategy.aggregate(global_params, updates)
            if self.hooks.server_params is not None:
                global_params = {**global_params, **self.hooks.server_params()}
        record = self._round_record(round_idx, reports, failures, (download_bytes, download_meta), sent.total_bytes)
        record["train_s"] = train_s
        if isinstance(self.strategy, RoundAccounting):
            record.update(self.strategy.account(round_idx, updates))
        if self._due(round_idx, self.plan.eval_every) and self.hooks.evaluate is not None:
            record.update(self.hooks.evaluate(round_idx, global_params, [u.client_id for u in updates]))
        record["wall_s"] = time.perf_counter() - started
        if self.hooks.record is not None:
            self.hooks.record(record)
        if self._due(round_idx, self.plan.checkpoint_every) and self.hooks.checkpoint is not None:
            self.hooks.checkpoint(round_idx, global_params)
        if self.hooks.on_round is not None:
            self.hooks.on_round(round_idx, record)
        return global_params

    def _failed(self, round_idx: int, reported: int, failures: list[ClientFailure]) -> RoundFailed:
        """The round could not complete: its record (written to the run's metrics) and the error to stop on."""
        attempts = self.plan.max_retries + 1
        record = {"round": round_idx, "round_failed": True, "reported": reported, "needed": self.plan.min_clients,
                  "attempts": attempts, "failed": [{"client": f.client_id, "reason": f.reason} for f in failures]}
        if self.hooks.record is not None:
            self.hooks.record(record)
        reasons = "; ".join(f"client {f.client_id}: {f.reason}" for f in failures[-5:])
        return RoundFailed(f"round {round_idx}: fewer than {self.plan.min_clients} clients reported after "
                           f"{attempts} attempts (last attempt: {reported} reported; {reasons})".replace("\n", " "),
                           record)

    def _frozen(self, round_idx: int, sampled: list[int], client_id: int) -> tuple[str, ...]:
        return self.hooks.frozen_for(round_idx, sampled, client_id) if self.hooks.frozen_for else ()

    def _due(self, round_idx: int, every: int) -> bool:
        return round_idx % every == 0 or round_idx == self.plan.rounds

    def _round_record(self, round_idx: int, reports: list[ClientReport], failures: list[ClientFailure],
                      down: tuple[int, int], sent_bytes: int) -> dict[str, Any]:
        """Bytes per direction: total (what crossed the wire), the scale metadata part of it and, for split
        learning, the activation/gradient part (``boundary``) and each reporting client's own totals."""
        count = 1 if self.plan.count_bytes else 0
        updates = [r.update for r in reports]
        examples = sum(u.num_examples for u in updates)
        loss = sum(u.metrics.get("train_loss", math.nan) * u.num_examples for u in updates) / max(examples, 1)
        boundary_up = sum(r.boundary_up for r in reports)
        boundary_down = sum(r.boundary_down for r in reports)
        extra_down = sum(r.download_extra for r in reports)
        record = {
            "round": round_idx,
            "train_loss": loss,
            "clients": [u.client_id for u in updates],
            "failed": [{"client": f.client_id, "reason": f.reason} for f in failures],
            "train_examples": examples,
            "bytes_down": (down[0] + boundary_down + extra_down) * count,
            "bytes_up": (sum(r.upload_bytes for r in reports) + boundary_up) * count,
            "bytes_down_meta": down[1] * count,
            "bytes_up_meta": sum(r.upload_meta_bytes for r in reports) * count,
        }
        if boundary_up or boundary_down:
            record["bytes_up_boundary"] = boundary_up * count
            record["bytes_down_boundary"] = boundary_down * count
            record["bytes_by_client"] = {
                str(r.update.client_id): {"up": (r.upload_bytes + r.boundary_up) * count,
                                          "down": (sent_bytes + r.boundary_down + r.download_extra) * count}
                for r in reports}
        return record
