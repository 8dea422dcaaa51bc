"""Federated split learning as an executor of the one round engine (FedBERT Alg. 2-3, FL-GLM section 3.3).

The engine's global state is the trunk plus whatever client parts are shared; clients are sent only the
shared client parts (``downlink``), never the trunk. Each client trains its bottom and top against the
trunk held here. :class:`SplitExecutor` only coordinates; each choice of the config's ``split`` section is
an object with one job:

* the trunk mode (:mod:`fedlm.split.modes`): how the round's clients meet the trunk, and what of it enters
  the global model through the reports (``parallel``'s copies) or from the server (the one trunk);
* the client-part policy (:mod:`fedlm.split.parts`): which client parameters are shared, and whether they
  are averaged from the reports or handed from client to client (``share``) and given in by the server;
* the optimizer state (:mod:`fedlm.split.optimizer_state`): reset at each turn, or carried on;
* the client side (:mod:`fedlm.split.turns`): clients in this process, or on other machines (Flower).

What the server trained itself enters the global model explicitly, through the engine's ``server_params``
hook, whose values replace the aggregate's; what the reports carry is averaged by FedAvg as usual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from fedlm.config import SplitConfig
from fedlm.errors import UserError
from fedlm.federation.codecs import Codec
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import NamedTensors, load_into, snapshot
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.store import ClientStore
from fedlm.split.modes import TRUNK_MODES, build_trunk_backend
from fedlm.split.optimizer_state import OPTIMIZER_STATES
from fedlm.split.parts import CLIENT_PARTS, split_model, split_parts
from fedlm.split.trunk import WIRE_DTYPES, MessageHook, TrunkBackend
from fedlm.split.turns import CONNECTIONS, Clients, LocalClients, RemoteClients, RemoteSide
from fedlm.tasks import Task

__all__ = ["RemoteClients", "SplitExecutor", "split_policy"]

Result = ClientReport | ClientFailure


class SplitExecutor:
    """Runs a round's clients by split learning against a trunk held here (the server side).

    ``remote`` puts the clients on other machines (Flower): given this process's trunk backend and the
    codec, it returns the :class:`RemoteClients` that reach them. ``hook`` sees every boundary message.
    ``max_length`` (the config's ``model.max_length``) bounds the sequences the trunk accepts.
    """

    def __init__(self, model: torch.nn.Module, spec: SplitConfig, task: Task, client_rows: dict[int, Sequence[dict]],
                 codec: Codec, store: ClientStore, settings: LocalSettings, *, hook: MessageHook | None = None,
                 progress: Callable[[int], None] | None = None,
                 remote: Callable[[TrunkBackend, Codec], RemoteClients] | None = None,
                 max_length: int | None = None) -> None:
        self.mode = TRUNK_MODES[spec.trunk_mode]()
        self.policy = CLIENT_PARTS[spec.client_parts]()
        self.optimizer_state = OPTIMIZER_STATES[spec.optimizer_state](self.policy.relays)
        if self.optimizer_state.keeps_state and not self.mode.one_trunk:
            raise UserError("split.optimizer_state = carry needs one trunk, but trunk_mode: parallel trains a fresh "
                            "copy per client; use trunk_mode sequential or client_batch, or optimizer_state: reset")
        self.server = split_model(model, spec)
        self.parts = split_parts(self.server, self.policy)
        if remote is not None and (self.optimizer_state.keeps_state or self.parts.local or not self.mode.remote):
            raise UserError("split learning across machines runs trunk_mode sequential or parallel with "
                            "client_parts share or average and optimizer_state reset (client_batch's lockstep "
                            "and state kept per client need the clients in this process)")
        self.progress = progress
        self.backend = build_trunk_backend(self.server, spec, settings, max_length)
        self.clients: Clients
        if remote is None:
            connect = CONNECTIONS[spec.transport](self.backend, sorted(map(str, client_rows)), hook,
                                                  WIRE_DTYPES[spec.activation_dtype])
            self.clients = LocalClients(self.server, self.parts, self.policy, self.optimizer_state, task,
                                        client_rows, codec, store, connect)
        else:
            self.clients = RemoteSide(remote(self.backend, codec), self.policy, codec)

    # ------------------------------------------------------------------------------------- engine hooks

    def downlink(self, global_params: NamedTensors) -> NamedTensors:
        """What each client is sent at a round's start: the shared client parts, never the trunk."""
        return {n: global_params[n] for n in self.parts.shared}

    def begin_round(self, round_idx: int, global_params: NamedTensors) -> None:
        """The server's trunk takes the round's starting state (again on a retried attempt)."""
        trunk = {n: global_params[n] for n in self.parts.trunk}
        self.load_trunk(trunk)
        self.mode.begin_round(trunk)
        self.policy.begin_round()
        self.optimizer_state.begin_round(round_idx, self.backend)

    def run(self, jobs: list[ClientJob]) -> list[Result]:
        self.server.model.train()
        return self.mode.run(jobs, self)

    def server_params(self) -> NamedTensors:
        """What the server trained or relayed itself this round, for the global model as it is: the one trunk
        (sequential, client_batch) and the client parts handed from client to client (share)."""
        return {**self.mode.server_params(self), **self.policy.server_params()}

    def close(self) -> None:
        self.clients.close()

    # ---------------------------------------------------------------------- the round, as modes drive it

    def trunk(self) -> NamedTensors:
        return snapshot(self.server.model, self.parts.trunk)

    def load_trunk(self, params: NamedTensors) -> None:
        load_into(self.server.model, params)

    def turns(self, jobs: list[ClientJob]) -> list[Result]:
        if isinstance(self.clients, RemoteSide) and self.clients.dispatches(jobs):
            return self._dispatched(jobs)
        results = []
        for job in jobs:
            self._start_turn()
            results.append(self._take(self.clients.turn(job), self.mode.report_params(self)))
            self._done([job])
        return results

    def together(self, jobs: list[ClientJob]) -> list[Result]:
        self.optimizer_state.start_turn(self.backend)
        together = self.clients.together(jobs)
        trunk = self.mode.report_params(self)
        results = [self._take(result, trunk) for result in together]
        self._done(jobs)
        return results

    def _start_turn(self) -> None:
        self.mode.start_turn(self)
        self.optimizer_state.start_turn(self.backend)

    def _dispatched(self, jobs: list[ClientJob]) -> list[Result]:
        """The round's jobs sent at once; the trunk's turn gate runs the turns in job order, starting and
        ending each as :meth:`turns` does (:mod:`fedlm.split.turn_gate`)."""
        trunks: dict[str, NamedTensors] = {}

        def on_end(client_id: str) -> None:
            trunks[client_id] = self.mode.report_params(self)

        results = self.clients.dispatch(jobs, lambda client_id: self._start_turn(), on_end)
        taken = []
        for job, result in zip(jobs, results, strict=True):
            trunk = trunks.get(str(job.client_id))
            if trunk is None and isinstance(result, ClientReport):  # reported without its turn on the trunk
                result = ClientFailure(job.client_id, "its report came back, but its turn never ran on the trunk")
            taken.append(self._take(result, trunk or {}))
        self._done(jobs)
        return taken

    def _take(self, result: Result, trunk: NamedTensors) -> Result:
        """A client's upload, as its report carries it into the average: its shared parts unless the policy
        hands them on, plus what of the trunk the mode averages (``trunk``, taken right after its turn)."""
        if not isinstance(result, ClientReport):
            return result
        params = self.policy.take(dict(result.update.params))
        params.update(trunk)
        return dataclasses.replace(result, update=dataclasses.replace(result.update, params=params))

    def _done(self, jobs: list[ClientJob]) -> None:
        if self.progress is not None:
            for job in jobs:
                self.progress(job.client_id)


def split_policy(model: torch.nn.Module, spec: SplitConfig) -> SharingPolicy:
    """The engine's view of a split run: the trunk and the shared client parts are global, the kept ones local."""
    return split_parts(split_model(model, spec), CLIENT_PARTS[spec.client_parts]()).policy()
