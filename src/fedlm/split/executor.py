"""Federated split learning as an executor of the one round engine (FedBERT Alg. 2-3, FL-GLM section 3.3).

The engine's global state is the trunk plus whatever client parts are shared; clients are sent only the
shared client parts (``downlink``), never the trunk. Each client trains its bottom and top against the
trunk through a :class:`~fedlm.split.transport.Transport`; what a client reports is chosen so that the
engine's FedAvg aggregation *is* the paper's protocol:

* trunk ``sequential`` (FedBERT Alg. 3, FL-GLM serial): one trunk, stepped by each client in turn; the
  last client's report carries it, so the "average" over the one holder is that trunk, exactly;
* trunk ``parallel`` (FedBERT Alg. 2, FL-GLM server-hierarchical): every client trains its own copy of the
  round's starting trunk; each report carries its copy and FedAvg weighs them by examples;
* trunk ``client_batch`` (FL-GLM Fig. 3): every client's batch goes through one trunk step
  (:class:`~fedlm.split.client_batch.BatchingTrunkBackend`); clients run in lockstep;
* client parts ``share`` (Head-Emd Share): a client starts from the parts the previous client finished
  with, and the last client's parts become the round's result (only its report carries them); in
  ``client_batch`` mode the clients train at once, so all start from the parts the last round handed on;
  ``average`` (Head-Emd Avg): bottom and top averaged; ``average_bottom`` (EmdAvg): bottom averaged, top
  kept by each client; ``local``: both kept by each client.

By default (``optimizer_state: reset``) clients keep no optimizer state between turns and neither does the
trunk (a fresh optimizer per client turn, or per round in ``client_batch`` mode), so a one-client split run
equals one-client FedAvg. With ``carry`` the one trunk keeps its optimizer across turns and rounds, and under
``share`` the client parts travel with their optimizer state (counted in the bytes), so sequential Head-Emd
Share is one continuous training run over the clients' data in turn, as FedBERT calls it "logically
centralized". Carried state is not checkpointed: a resumed run starts the optimizers afresh.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from fedlm.config import SplitConfig
from fedlm.errors import UserError
from fedlm.federation.client_round import client_failure, finite_update
from fedlm.federation.codecs import Codec
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import (
    LocalSettings,
    make_optimizer,
)
from fedlm.federation.params import NamedTensors, load_into, nbytes, snapshot
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import ClientUpdate
from fedlm.models.cut import Cut, SplitModel
from fedlm.split.client import (
    BOUNDARY_DOWN,
    BOUNDARY_UP,
    Request,
    client_steps,
    drive,
    drive_lockstep,
    load_optimizer_tensors,
    optimizer_tensors,
)
from fedlm.split.grpc import LoopbackGrpc
from fedlm.split.parts import client_copy, split_parts
from fedlm.split.transport import InProcessTransport, Transport
from fedlm.split.trunk import WIRE_DTYPES, MessageHook, TrunkBackend
from fedlm.split.trunk_batching import BatchingTrunkBackend
from fedlm.tasks import Task

TRUNK_MODES = ("sequential", "parallel", "client_batch")
OPTIMIZER_STATES = ("reset", "carry")


class RemoteClients(Protocol):
    """Clients on other machines (Flower nodes): ``run`` sends each job to its client, which trains its parts
    against this process's trunk over gRPC and answers with its shared parts and boundary byte counts."""

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]: ...

    def close(self) -> None: ...


TransportFactory = Callable[[str], Transport]


class SplitExecutor:
    """Runs a round's clients by split learning against a trunk held here (the server side)."""

    def __init__(self, model: torch.nn.Module, cut: Cut, trunk_mode: str, client_parts: str, task: Any,
                 client_rows: dict[int, Sequence[dict]], codec: Codec, store: ClientStore, settings: LocalSettings,
                 *, transport: str = "inprocess", hook: MessageHook | None = None,
                 progress: Callable[[int], None] | None = None, activation_dtype: str = "float32",
                 optimizer_state: str = "reset",
                 remote: Callable[[TrunkBackend, Codec], RemoteClients] | None = None) -> None:
        if trunk_mode not in TRUNK_MODES:
            raise UserError(f"split.trunk_mode = {trunk_mode!r}; choose one of {', '.join(TRUNK_MODES)}")
        if optimizer_state not in OPTIMIZER_STATES:
            raise UserError(f"split.optimizer_state = {optimizer_state!r}; choose one of {', '.join(OPTIMIZER_STATES)}")
        if optimizer_state == "carry" and trunk_mode == "parallel":
            raise UserError("split.optimizer_state = carry needs one trunk, but trunk_mode: parallel trains a fresh "
                            "copy per client; use trunk_mode sequential or client_batch, or optimizer_state: reset")
        self.server = SplitModel(model, cut)
        self.parts = split_parts(self.server, client_parts)
        if remote is not None and (optimizer_state == "carry" or self.parts.local or trunk_mode == "client_batch"):
            raise UserError("split learning across machines runs trunk_mode sequential or parallel with "
                            "client_parts share or average and optimizer_state reset (client_batch's lockstep "
                            "and state kept per client are simulator-only for now)")
        self.trunk_mode = trunk_mode
        self.client_parts = client_parts
        self.task = task
        self.client_rows = client_rows
        self.codec = codec
        self.store = store
        self.progress = progress
        self._clients: list[SplitModel] = []
        self._round_trunk: NamedTensors = {}
        self._relay: NamedTensors | None = None
        self.carry = optimizer_state == "carry"
        self._relay_state: NamedTensors = {}  # share + carry: the client optimizer state handed on
        self._round_start: tuple[int, dict, NamedTensors] | None = None  # carry: optimizer states a round began with
        self._optimizers: dict[int, tuple[torch.optim.Optimizer, int]] = {}  # share + carry: each client's
        # optimizer this round and the bytes of carried state it was handed
        backend_class = BatchingTrunkBackend if trunk_mode == "client_batch" else TrunkBackend
        self.backend = backend_class(self.server.trunk, model.config.hidden_size,
                                     lambda params: make_optimizer(params, settings),
                                     max_grad_norm=settings.max_grad_norm)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="fedlm-split")
        if activation_dtype not in WIRE_DTYPES:
            raise UserError(f"split.activation_dtype = {activation_dtype!r}; choose one of {', '.join(WIRE_DTYPES)}")
        self._connect = self._transports(transport, hook, WIRE_DTYPES[activation_dtype])
        self.remote = remote(self.backend, codec) if remote is not None else None

    # ------------------------------------------------------------------------------------- engine hooks

    def downlink(self, global_params: NamedTensors) -> NamedTensors:
        """What each client is sent at a round's start: the shared client parts, never the trunk."""
        return {n: global_params[n] for n in self.parts.shared}

    def begin_round(self, round_idx: int, global_params: NamedTensors) -> None:
        """The server's trunk takes the round's starting state (again on a retried attempt)."""
        self._round_trunk = {n: global_params[n] for n in self.parts.trunk}
        load_into(self.server.model, self._round_trunk)
        self._relay = None
        if self.carry:  # a retried attempt starts from the optimizer states the round began with, too
            if self._round_start is not None and self._round_start[0] == round_idx:
                self.backend.optimizer.load_state_dict(copy.deepcopy(self._round_start[1]))
                self._relay_state = self._round_start[2]
            else:
                self._round_start = (round_idx, copy.deepcopy(self.backend.optimizer.state_dict()), self._relay_state)

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        self.server.model.train()
        if self.trunk_mode == "client_batch":
            results = self._run_batch(jobs)
        else:
            results = []
            for job in jobs:
                results.append(self._run_turn(job))
                if self.progress is not None:
                    self.progress(job.client_id)
        self._finish(results)
        return results

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        self._pool.shutdown(wait=False)
        closer = getattr(self._connect, "close", None)
        if closer is not None:
            closer()

    # ---------------------------------------------------------------------------------------- internals

    def _client(self, index: int) -> SplitModel:
        while len(self._clients) <= index:
            self._clients.append(client_copy(self.server))
        return self._clients[index]

    def _prepare_client(self, client: SplitModel, job: ClientJob) -> None:
        received = self.codec.decode(job.params)
        if self.client_parts == "share" and self._relay is not None:
            received = self._relay  # the previous client's parts (passed through the server)
        load_into(client.model, received)
        load_into(client.model, self.store.get(job.client_id))

    def _steps(self, client: SplitModel, job: ClientJob) -> Generator[Request, Any, dict[str, float]]:
        optimizer = None
        if self.carries_client_state:
            optimizer = make_optimizer([p for p in client.client_parameters() if p.requires_grad], job.settings)
            load_optimizer_tensors(optimizer, client.model, self._relay_state)
            self._optimizers[job.client_id] = optimizer, nbytes(self._relay_state)
        return client_steps(client, self.task, self.client_rows[job.client_id], job.settings, job.seed,
                            job.deadline(), optimizer)

    @property
    def carries_client_state(self) -> bool:
        return self.carry and self.client_parts == "share"

    def _run_turn(self, job: ClientJob) -> ClientReport | ClientFailure:
        if self.trunk_mode == "parallel":
            load_into(self.server.model, self._round_trunk)  # this client's own copy of the round's trunk
        if not self.carry:
            self.backend.reset_optimizer()
        if self.remote is not None:  # the client's parts live on its own machine
            return self._remote_turns([job])[0]
        client = self._client(0)
        self._prepare_client(client, job)
        transport = self._connect(str(job.client_id))
        try:
            metrics = drive(self._steps(client, job), transport)
            return self._report(job, client, metrics, transport)
        except Exception as exc:
            return client_failure(job.client_id, exc)
        finally:
            transport.close()

    def _run_batch(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        assert isinstance(self.backend, BatchingTrunkBackend)
        self.backend.expect([str(job.client_id) for job in jobs])
        if not self.carry:
            self.backend.reset_optimizer()
        if self.remote is not None:
            results = self._remote_turns(jobs)
            if self.progress is not None:
                for job in jobs:
                    self.progress(job.client_id)
            return results
        clients = {job.client_id: self._client(i) for i, job in enumerate(jobs)}
        for job in jobs:
            self._prepare_client(clients[job.client_id], job)
        transports = {job.client_id: self._connect(str(job.client_id)) for job in jobs}
        steps = {job.client_id: self._steps(clients[job.client_id], job) for job in jobs}
        outcomes = drive_lockstep(steps, transports, self._pool)
        results: list[ClientReport | ClientFailure] = []
        for job in jobs:
            outcome = outcomes[job.client_id]
            try:
                if isinstance(outcome, BaseException):
                    raise outcome
                results.append(self._report(job, clients[job.client_id], outcome, transports[job.client_id]))
            except Exception as exc:
                results.append(client_failure(job.client_id, exc))
            if self.progress is not None:
                self.progress(job.client_id)
        return results

    def _remote_turns(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        """Clients on their own machines: each is sent what it would load here (``share``: the parts the
        previous client finished with) and its report is taken in as the in-process one would be."""
        if self.client_parts == "share" and self._relay is not None:
            relayed = self.codec.encode(self._relay)
            jobs = [dataclasses.replace(job, params=relayed) for job in jobs]
        results = self.remote.run(jobs)
        return [self._take_remote(r) if isinstance(r, ClientReport) else r for r in results]

    def _take_remote(self, report: ClientReport) -> ClientReport:
        metrics = dict(report.update.metrics)
        boundary_up, boundary_down = int(metrics.pop(BOUNDARY_UP, 0)), int(metrics.pop(BOUNDARY_DOWN, 0))
        params = dict(report.update.params)
        if self.client_parts == "share":
            self._relay, params = params, {}
        if self.trunk_mode == "parallel":
            params.update(snapshot(self.server.model, self.parts.trunk))
        update = dataclasses.replace(report.update, params=params, metrics=metrics)
        return dataclasses.replace(report, update=update, boundary_up=boundary_up, boundary_down=boundary_down)

    def _report(self, job: ClientJob, client: SplitModel, metrics: dict[str, float],
                transport: Transport) -> ClientReport:
        """Encode the client's shared parts for upload; keep its local parts; add the trunk copy (parallel)."""
        shared = finite_update(client.model, self.parts.shared, metrics)
        encoded = self.codec.encode(shared)
        params: NamedTensors = {}
        state_received = state_sent = 0
        if self.carries_client_state:
            optimizer, state_received = self._optimizers.pop(job.client_id)
            self._relay_state = optimizer_tensors(optimizer, client.model)
            state_sent = nbytes(self._relay_state)
        if self.client_parts == "share":
            self._relay = self.codec.decode(encoded)
        else:
            params.update(self.codec.decode(encoded))
        if self.trunk_mode == "parallel":
            params.update(snapshot(self.server.model, self.parts.trunk))
        self.store.put(job.client_id, snapshot(client.model, self.parts.local))
        update = ClientUpdate(job.client_id, len(self.client_rows[job.client_id]), params, metrics)
        return ClientReport(update, encoded.total_bytes + state_sent, encoded.meta_bytes, transport.bytes_sent,
                            transport.bytes_received, download_extra=state_received)

    def _finish(self, results: list[ClientReport | ClientFailure]) -> None:
        """The last reporting client carries what exists once: the passed-on parts and the single trunk."""
        reports = [r for r in results if isinstance(r, ClientReport)]
        if not reports:
            return
        last = reports[-1].update.params
        if self.client_parts == "share" and self._relay is not None:
            last.update(self._relay)
        if self.trunk_mode != "parallel":
            last.update(snapshot(self.server.model, self.parts.trunk))

    def _transports(self, kind: str, hook: MessageHook | None, wire_dtype: torch.dtype) -> TransportFactory:
        if kind == "inprocess":  # the hook sees each message as the client sends and receives it
            return lambda client_id: InProcessTransport(self.backend, client_id, hook=hook, wire_dtype=wire_dtype)
        if kind == "grpc":
            return LoopbackGrpc(self.backend, sorted(map(str, self.client_rows)), hook, wire_dtype)
        raise UserError(f"split.transport = {kind!r}; choose inprocess or grpc")


def split_policy(model: torch.nn.Module, spec: SplitConfig) -> SharingPolicy:
    """The engine's view of a split run: the trunk and the shared client parts are global, the kept ones local."""
    return split_parts(SplitModel(model, Cut(spec.bottom_blocks, spec.top_blocks)), spec.client_parts).policy()


def build_split_executor(model: torch.nn.Module, spec: SplitConfig, task: Task, client_rows: dict[int, Sequence[dict]],
                         codec: Codec, store: ClientStore, settings: LocalSettings, *,
                         progress: Callable[[int], None] | None = None,
                         remote: Callable[[TrunkBackend, Codec], RemoteClients] | None = None) -> SplitExecutor:
    """The executor a config's ``split`` section describes."""
    return SplitExecutor(model, Cut(spec.bottom_blocks, spec.top_blocks), spec.trunk_mode, spec.client_parts, task,
                         client_rows, codec, store, settings, transport=spec.transport, progress=progress,
                         activation_dtype=spec.activation_dtype, optimizer_state=spec.optimizer_state, remote=remote)
