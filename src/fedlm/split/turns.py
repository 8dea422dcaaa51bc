"""Where a split round's clients run: in this process (:class:`LocalClients`, the simulator) or on their own
machines (:class:`RemoteSide`, Flower nodes reaching this process's trunk over gRPC).

Either answers a client turn with a :class:`~fedlm.federation.executor.ClientReport` whose params are the
client parts it uploaded, with the boundary's byte counts filled in. What a turn's clients start from besides
the round's parts (``relayed``, the parts policy's) and what the report then carries into the average are the
split executor's business, which calls the trunk mode's and the parts policy's hooks around each turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from fedlm.federation.client_round import ClientAbandoned, client_failure, finite_update, stop_at_next_module
from fedlm.federation.codecs import Codec
from fedlm.federation.executor import ClientJob, ClientReport, Result
from fedlm.federation.params import NamedTensors, load_into, snapshot
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import ClientUpdate
from fedlm.models.cut import SplitModel
from fedlm.split.client import (
    BOUNDARY_DOWN,
    BOUNDARY_UP,
    Steps,
    client_steps,
    cut_off_at,
    drive,
    drive_lockstep,
)
from fedlm.split.grpc_client import LoopbackGrpc
from fedlm.split.optimizer_state import OptimizerState
from fedlm.split.parts import SplitParts, client_copy
from fedlm.split.transport import InProcessConnections, Transport
from fedlm.split.trunk import MessageHook, TrunkBackend
from fedlm.split.turn_gate import TurnHook
from fedlm.tasks import Task


class Connections(Protocol):
    """Opens one client's session with the trunk (``split.transport``); ``close`` releases what it holds."""

    def __call__(self, client_id: str) -> Transport: ...

    def close(self) -> None: ...


Connect = Callable[[TrunkBackend, list[str], MessageHook | None, torch.dtype], Connections]  # the session opener

CONNECTIONS: dict[str, Connect] = {
    "inprocess": InProcessConnections,  # through the same serialisation and checks as the network
    "grpc": LoopbackGrpc,  # a loopback TLS server: every message crosses the real gRPC stack
}


class RemoteClients(Protocol):
    """Clients on other machines (Flower nodes): ``run`` sends each job to its client, which trains its parts
    against this process's trunk over gRPC and answers with its shared parts and boundary byte counts."""

    def run(self, jobs: list[ClientJob]) -> list[Result]: ...

    def dispatches(self, jobs: list[ClientJob]) -> bool:
        """Whether ``jobs``, turns that do not depend on each other, can be sent at once (:meth:`dispatch`)."""
        ...

    def dispatch(self, jobs: list[ClientJob], on_start: TurnHook, on_end: TurnHook) -> list[Result]:
        """Every job sent at once, the trunk admitting the clients one at a time in job order and calling
        ``on_start`` / ``on_end`` with the client id as each turn begins and ends (:mod:`fedlm.split.turn_gate`)."""
        ...

    def close(self) -> None: ...


class Clients(Protocol):
    """Runs client turns against the trunk: one client alone, or several in lockstep; each client starts from
    ``relayed`` instead of the parts its job was sent, when given."""

    def turn(self, job: ClientJob, relayed: NamedTensors | None) -> Result: ...

    def together(self, jobs: list[ClientJob], relayed: NamedTensors | None) -> list[Result]: ...

    def close(self) -> None: ...


class LocalClients:
    """The round's clients in this process, each a model copy holding no trunk weights, talking to the trunk
    through a transport (``connect``). A client starts from the parts it was sent (or those handed on), plus
    what it keeps in ``store``; it keeps its local parts there again after its turn.

    With ``client_timeout_s`` a client's computation runs in worker threads cut off at its deadline
    (:func:`~fedlm.split.client.cut_off_at`). An abandoned client's session is closed, so it cannot reach
    the trunk again, and its model copy is retired: it stops at its next module, and later turns use a new one.
    Clients trained together (``client_batch``) meet at the trunk every step, so they share one clock: a
    member stuck at the deadline holds the others up to it, as it would in a deployment.
    """

    def __init__(self, server: SplitModel, parts: SplitParts, optimizer_state: OptimizerState, task: Task,
                 client_rows: dict[int, Sequence[dict]], codec: Codec, store: ClientStore,
                 connect: Connections) -> None:
        self.server = server
        self.parts = parts
        self.optimizer_state = optimizer_state
        self.task = task
        self.client_rows = client_rows
        self.codec = codec
        self.store = store
        self.connect = connect
        self.models: list[SplitModel] = []  # client copies, made once and reused by every turn
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="fedlm-split")

    def turn(self, job: ClientJob, relayed: NamedTensors | None) -> Result:
        client = self._model(0)
        self._prepare(client, job, relayed)
        transport = self.connect(str(job.client_id))
        try:
            metrics = drive(self._steps(client, job), transport)
            return self._report(job, client, metrics, transport)
        except ClientAbandoned as exc:
            self._retire(0)
            return client_failure(job.client_id, exc)
        except Exception as exc:
            return client_failure(job.client_id, exc)
        finally:
            transport.close()

    def together(self, jobs: list[ClientJob], relayed: NamedTensors | None) -> list[Result]:
        clients = {job.client_id: self._model(i) for i, job in enumerate(jobs)}
        for job in jobs:
            self._prepare(clients[job.client_id], job, relayed)
        transports = {job.client_id: self.connect(str(job.client_id)) for job in jobs}
        steps = {job.client_id: self._steps(clients[job.client_id], job) for job in jobs}
        outcomes = drive_lockstep(steps, transports, self._pool)
        results: list[Result] = []
        for job in jobs:
            outcome = outcomes[job.client_id]
            try:
                if isinstance(outcome, BaseException):
                    raise outcome
                results.append(self._report(job, clients[job.client_id], outcome, transports[job.client_id]))
            except Exception as exc:
                if isinstance(exc, ClientAbandoned):
                    self._retire(self.models.index(clients[job.client_id]))
                results.append(client_failure(job.client_id, exc))
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.connect.close()

    def _model(self, index: int) -> SplitModel:
        while len(self.models) <= index:
            self.models.append(client_copy(self.server))
        return self.models[index]

    def _retire(self, index: int) -> None:
        """Leave client copy ``index`` to its abandoned worker (stopped at its next module); a new copy
        takes its place."""
        stop_at_next_module(self.models[index].model)
        self.models[index] = client_copy(self.server)

    def _prepare(self, client: SplitModel, job: ClientJob, relayed: NamedTensors | None) -> None:
        """The parts the client was sent, or those relayed (share: the previous client's, through the server),
        then what it keeps."""
        load_into(client.model, self.codec.decode(job.params) if relayed is None else relayed)
        load_into(client.model, self.store.get(job.client_id))

    def _steps(self, client: SplitModel, job: ClientJob) -> Steps:
        optimizer = self.optimizer_state.client_optimizer(client, job)
        deadline = job.deadline()
        steps = client_steps(client, self.task, self.client_rows[job.client_id], job.settings, job.seed, deadline,
                             optimizer)
        return cut_off_at(steps, deadline, job.timeout_s, name=f"fedlm-client-{job.client_id}")

    def _report(self, job: ClientJob, client: SplitModel, metrics: dict[str, float],
                transport: Transport) -> ClientReport:
        """Encode the client's shared parts for upload (with any optimizer state it hands on); keep its local
        parts."""
        shared = finite_update(client.model, self.parts.shared, metrics)
        encoded = self.codec.encode(shared)
        state_received, state_sent = self.optimizer_state.client_done(job.client_id, client)
        self.store.put(job.client_id, snapshot(client.model, self.parts.local))
        update = ClientUpdate(job.client_id, len(self.client_rows[job.client_id]), self.codec.decode(encoded), metrics)
        return ClientReport(update, encoded.total_bytes + state_sent, encoded.meta_bytes, transport.bytes_sent,
                            transport.bytes_received, download_extra=state_received)


class RemoteSide:
    """The round's clients on their own machines: each is sent what it would load here (``share``: the parts
    the previous client finished with), and its report's boundary counts move from its metrics to the report."""

    def __init__(self, remote: RemoteClients, codec: Codec) -> None:
        self.remote = remote
        self.codec = codec

    def turn(self, job: ClientJob, relayed: NamedTensors | None) -> Result:
        return self.together([job], relayed)[0]

    def dispatches(self, jobs: list[ClientJob]) -> bool:
        """Whether the remote side can send ``jobs``, turns that do not depend on each other, at once."""
        return self.remote.dispatches(jobs)

    def dispatch(self, jobs: list[ClientJob], on_start: TurnHook, on_end: TurnHook) -> list[Result]:
        """The round's turns sent at once, the trunk's turn gate running them in job order."""
        return _boundary_counted(self.remote.dispatch(jobs, on_start, on_end))

    def together(self, jobs: list[ClientJob], relayed: NamedTensors | None) -> list[Result]:
        if relayed is not None:
            encoded = self.codec.encode(relayed)
            jobs = [dataclasses.replace(job, params=encoded) for job in jobs]
        return _boundary_counted(self.remote.run(jobs))

    def close(self) -> None:
        self.remote.close()


def _boundary_counted(results: list[Result]) -> list[Result]:
    """Each report with its boundary's byte counts moved from its metrics to the report; failures as they are."""
    return [_report_counted(r) if isinstance(r, ClientReport) else r for r in results]


def _report_counted(report: ClientReport) -> ClientReport:
    metrics = dict(report.update.metrics)
    boundary_up, boundary_down = int(metrics.pop(BOUNDARY_UP, 0)), int(metrics.pop(BOUNDARY_DOWN, 0))
    update = dataclasses.replace(report.update, params=dict(report.update.params), metrics=metrics)
    return dataclasses.replace(report, update=update, boundary_up=boundary_up, boundary_down=boundary_down)
