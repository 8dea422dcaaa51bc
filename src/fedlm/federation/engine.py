"""The one round loop: sample clients -> local work -> fold each report into the aggregate -> evaluate -> record.

Every protocol (centralized, isolated, FedAvg, FedProx, FedOpt, split learning) is this loop with a different
strategy, a different split of parameters into global (sent, aggregated) and local (kept by each client), and a
different executor: where the clients run (in this process, on Flower nodes, against a split trunk) and what the
server holds itself is the executor's business (``fedlm.federation.executor``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.collective import LOCAL, Collective
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport, Executor
from fedlm.federation.local_training import LocalSettings, local_seed, round_lr
from fedlm.federation.observer import SILENT, RoundObserver
from fedlm.federation.params import NamedTensors
from fedlm.federation.records import Boundary, FailedRound, RoundRecord, Suspect
from fedlm.federation.screening import Growth, UpdateScreen
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.strategies.base import Aggregation, Audited, ClientUpdate, Strategy, sample_clients

log = logging.getLogger("fedlm")


class RoundFailed(RuntimeError):
    """Too few clients reported, even after the allowed retries, or every client failed in a way no retry can fix
    (``lasting``); ``record`` is what the run records of it."""

    def __init__(self, message: str, record: FailedRound, lasting: bool = False) -> None:
        super().__init__(message)
        self.record = record
        self.lasting = lasting


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
    eval_start: bool = True  # eval.start: round 0 scores the starting point (off: no round-0 record)
    checkpoint_every: int = 1
    lr_schedule: str = "constant"  # train.lr_schedule: the clients' lr per round (local_training.round_lr)
    max_update_growth: float | None = 1000.0  # protocol.max_update_growth: the screen's limit (screening.py)


def round_settings(base: LocalSettings, strategy: Strategy, plan: RoundPlan, round_idx: int) -> LocalSettings:
    """What every client of round ``round_idx`` trains with: the run's settings as the strategy configures them
    (FedProx's mu, DP-SGD's noise), at the round's learning rate. The engine and the audit's replay both ask here."""
    configured = strategy.configure(base)
    return dataclasses.replace(configured, lr=round_lr(base.lr, plan.lr_schedule, round_idx, plan.rounds))


@dataclass
class EngineHooks:
    """Where the loop hands off: evaluation, recording and checkpointing live outside it."""

    evaluate: Callable[[int, NamedTensors, list[int]], dict[str, Any]] | None = None
    record: Callable[[RoundRecord | FailedRound], None] | None = None
    checkpoint: Callable[[int, NamedTensors], None] | None = None


@dataclass
class RoundTally:
    """A round's reports as they arrive: everything its record needs, without holding any update's tensors."""

    reported: list[ClientUpdate] = field(default_factory=list)  # each report's counts and metrics, params dropped
    loss_sum: float = 0.0
    bytes_up: int = 0
    meta_up: int = 0
    boundary_up: int = 0
    boundary_down: int = 0
    extra_down: int = 0
    by_client: dict[str, tuple[int, int]] = field(default_factory=dict)  # (sent, received beyond the downlink)
    growth: dict[int, Growth] = field(default_factory=dict)  # each report's growth past the global model's scale

    def add(self, report: ClientReport) -> None:
        update = report.update
        self.reported.append(dataclasses.replace(update, params={}))
        self.loss_sum += update.metrics.get("train_loss", math.nan) * update.num_examples
        self.bytes_up += report.upload_bytes
        self.meta_up += report.upload_meta_bytes
        self.boundary_up += report.boundary_up
        self.boundary_down += report.boundary_down
        self.extra_down += report.download_extra
        self.by_client[str(update.client_id)] = (report.upload_bytes + report.boundary_up,
                                                 report.boundary_down + report.download_extra)

    @property
    def examples(self) -> int:
        return sum(u.num_examples for u in self.reported)

    @classmethod
    def merged(cls, parts: list[RoundTally], order: list[int]) -> RoundTally:
        """The tallies of the processes that shared a round, as one: reports in ``order`` (the round's clients)."""
        rank = {client_id: i for i, client_id in enumerate(order)}
        merged = cls(reported=sorted((u for part in parts for u in part.reported), key=lambda u: rank[u.client_id]))
        for part in parts:
            merged.loss_sum += part.loss_sum
            merged.bytes_up += part.bytes_up
            merged.meta_up += part.meta_up
            merged.boundary_up += part.boundary_up
            merged.boundary_down += part.boundary_down
            merged.extra_down += part.extra_down
            merged.by_client.update(part.by_client)
            merged.growth.update(part.growth)
        merged.by_client = {str(u.client_id): merged.by_client[str(u.client_id)] for u in merged.reported}
        return merged


@dataclass
class RoundEngine:
    strategy: Strategy
    executor: Executor
    codec: Codec
    client_ids: list[int]
    settings: LocalSettings
    plan: RoundPlan
    hooks: EngineHooks = field(default_factory=EngineHooks)
    observer: RoundObserver = SILENT
    sharing: SharingPolicy | None = None  # who freezes what in a round (FFDAPT's window); None: nothing
    collective: Collective = LOCAL  # the processes sharing each round's clients (fedlm run --workers)
    _last_growth: tuple[int, dict[int, Growth]] = field(default=(0, {}), init=False, repr=False)  # to name a poisoner

    def run(self, global_params: NamedTensors, start_round: int = 1) -> NamedTensors:
        if start_round == 1 and self.plan.eval_start:
            self.evaluate_start(global_params)
        for round_idx in range(start_round, self.plan.rounds + 1):
            global_params = self.run_round(round_idx, global_params)
        return global_params

    def evaluate_start(self, global_params: NamedTensors) -> None:
        """Round 0: the starting point (untrained or original model), so every curve shows what was gained."""
        if self.hooks.evaluate is None or self.hooks.record is None:
            return
        clients = sample_clients(self.client_ids, self.plan.clients_per_round, self.plan.seed, 0)
        started = time.perf_counter()
        record = RoundRecord(round=0, scores=self._evaluate(0, global_params, clients))
        record.wall_s = time.perf_counter() - started
        self.hooks.record(record)

    def run_round(self, round_idx: int, global_params: NamedTensors) -> NamedTensors:
        started = time.perf_counter()
        sent = self.codec.encode(self.executor.downlink(global_params))
        settings = round_settings(self.settings, self.strategy, self.plan, round_idx)
        download_bytes = download_meta = 0
        failures: list[ClientFailure] = []
        screen = UpdateScreen.of(global_params, self.plan.max_update_growth)
        for attempt in range(self.plan.max_retries + 1):
            jobs = self._jobs(round_idx, attempt, sent, settings)
            download_bytes += sent.total_bytes * len(jobs)
            download_meta += sent.meta_bytes * len(jobs)
            aggregation, tally, failed = self._attempt(round_idx, jobs, global_params, screen)
            failures.extend(failed)
            if len(tally.reported) >= self.plan.min_clients:
                break
            if not tally.reported and failed and all(f.lasting for f in failed):
                raise self._failed(round_idx, 0, failures, failed, attempt + 1, lasting=True)
            log.warning("round %d: %d of %d clients reported, need %d; retrying (attempt %d)", round_idx,
                        len(tally.reported), len(jobs), self.plan.min_clients, attempt + 1)
        else:
            raise self._failed(round_idx, len(tally.reported), failures, failed, self.plan.max_retries + 1)
        self._last_growth = (round_idx, tally.growth)
        train_s = time.perf_counter() - started  # clients' share of the round (FFDAPT's saving shows here)
        if aggregation is not None:
            global_params = {**aggregation.result(), **self.executor.server_params()}
        record = self._round_record(round_idx, tally, failures, (download_bytes, download_meta), sent.total_bytes)
        record.update_norms = {str(u.client_id): tally.growth[u.client_id].change for u in tally.reported
                               if u.client_id in tally.growth}
        if isinstance(aggregation, Audited):
            record.defence = aggregation.audit()
        record.train_s = train_s
        record.ledger = self.strategy.account(round_idx, tally.reported)
        if self._due(round_idx, self.plan.eval_every) and self.hooks.evaluate is not None:
            record.scores = self._evaluate(round_idx, global_params, record.clients)
        record.wall_s = time.perf_counter() - started
        if self.hooks.record is not None:
            self.hooks.record(record)
        if self._due(round_idx, self.plan.checkpoint_every) and self.hooks.checkpoint is not None:
            self.hooks.checkpoint(round_idx, global_params)
        self.observer.round_done(record)
        return global_params

    def _jobs(self, round_idx: int, attempt: int, sent: Encoded, settings: LocalSettings) -> list[ClientJob]:
        sampled = sample_clients(self.client_ids, self.plan.clients_per_round, self.plan.seed, round_idx, attempt)
        return [ClientJob(cid, round_idx, sent, settings, local_seed(self.plan.seed, round_idx, cid),
                          self.plan.timeout_s, self._frozen(round_idx, sampled, cid)) for cid in sampled]

    def _attempt(self, round_idx: int, jobs: list[ClientJob], global_params: NamedTensors,
                 screen: UpdateScreen) -> tuple[Aggregation | None, RoundTally, list[ClientFailure]]:
        """One try at the round: each report screened, then folded into a fresh aggregate as the executor hands
        it over; returns the aggregate, the tally and the clients left out."""
        self.executor.begin_round(round_idx, global_params)
        self.observer.clients_started(round_idx, jobs)
        aggregation = self.strategy.aggregation(global_params) if global_params else None
        tally, failed = RoundTally(), []
        for result in self.executor.run(jobs):
            if isinstance(result, ClientFailure):
                failed.append(result)
                continue
            growth = screen.growth(result.update.params)
            refusal = screen.refusal(growth)
            if refusal is not None:
                failed.append(ClientFailure(result.update.client_id, refusal))
                continue
            tally.add(result)
            if growth is not None:
                tally.growth[result.update.client_id] = growth
            if aggregation is not None:
                aggregation.add(result.update)
        if self.collective.world > 1:  # each process trained its share: combine them
            order = [job.client_id for job in jobs]
            position = {client_id: i for i, client_id in enumerate(order)}
            parts = self.collective.all_gather((tally, failed))
            tally = RoundTally.merged([part[0] for part in parts], order)
            failed = sorted((f for part in parts for f in part[1]), key=lambda f: position[f.client_id])
            if aggregation is not None:
                aggregation.merge(self.collective)
        for failure in failed:
            log.warning("round %d: client %d left out: %s", round_idx, failure.client_id, failure.reason)
        return aggregation, tally, failed

    def _evaluate(self, round_idx: int, global_params: NamedTensors, clients: list[int]) -> dict[str, Any]:
        assert self.hooks.evaluate is not None
        self.observer.evaluation_started(round_idx)
        try:
            return self.hooks.evaluate(round_idx, global_params, clients)
        finally:
            self.observer.evaluation_done()

    def _failed(self, round_idx: int, reported: int, failures: list[ClientFailure], last: list[ClientFailure],
                attempts: int, lasting: bool = False) -> RoundFailed:
        """The round could not complete: its record (written to the run's metrics) and the error to stop on.
        ``lasting``: every client of the ``last`` attempt failed in a way no retry can fix."""
        suspect = self._poisoner(last)
        record = FailedRound(round_idx, reported, self.plan.min_clients, attempts, failures, suspect)
        if self.hooks.record is not None:
            self.hooks.record(record)
        if lasting:  # one client's reason says it all: they failed alike
            return RoundFailed(f"round {round_idx}: every client failed with an error no retry can fix (client "
                               f"{last[0].client_id}: {last[0].reason}): a bug, or a model or setting fedlm cannot "
                               "run this way, not the clients' doing; stopped without retrying"
                               .replace("\n", " "), record, lasting=True)
        reasons = "; ".join(f"client {f.client_id}: {f.reason}" for f in failures[-5:])
        blame = "" if suspect is None else f"; {suspect.describe()}"
        return RoundFailed(f"round {round_idx}: fewer than {self.plan.min_clients} clients reported after "
                           f"{attempts} attempts (last attempt: {reported} reported; {reasons}){blame}"
                           .replace("\n", " "), record)

    def _poisoner(self, last: list[ClientFailure]) -> Suspect | None:
        """When every client of the last attempt diverged (a non-finite update), the model they started from is
        at fault, not they: the client whose report grew most in the round that made that model."""
        previous, growth = self._last_growth
        if not last or not growth or not all(f.reason.startswith("non-finite update") for f in last):
            return None
        client = max(growth, key=lambda c: growth[c].severity)
        return Suspect(previous, client, growth[client].tensor, growth[client].factor)

    def _frozen(self, round_idx: int, sampled: list[int], client_id: int) -> tuple[str, ...]:
        return self.sharing.frozen_for(round_idx, sampled, client_id) if self.sharing is not None else ()

    def _due(self, round_idx: int, every: int) -> bool:
        return round_idx % every == 0 or round_idx == self.plan.rounds

    def _round_record(self, round_idx: int, tally: RoundTally, failures: list[ClientFailure],
                      down: tuple[int, int], sent_bytes: int) -> RoundRecord:
        """Bytes per direction: total (what crossed the wire), the scale metadata part of it and, for split
        learning, the activation/gradient part (``boundary``) and each reporting client's own totals."""
        count = 1 if self.plan.count_bytes else 0
        examples = tally.examples
        record = RoundRecord(
            round=round_idx, train_loss=tally.loss_sum / max(examples, 1),
            clients=[u.client_id for u in tally.reported], failed=list(failures), train_examples=examples,
            bytes_down=(down[0] + tally.boundary_down + tally.extra_down) * count,
            bytes_up=(tally.bytes_up + tally.boundary_up) * count, bytes_down_meta=down[1] * count,
            bytes_up_meta=tally.meta_up * count)
        if tally.boundary_up or tally.boundary_down:
            record.boundary = Boundary(tally.boundary_up * count, tally.boundary_down * count, {
                client: {"up": up * count, "down": (sent_bytes + down_own) * count}
                for client, (up, down_own) in tally.by_client.items()})
        return record
