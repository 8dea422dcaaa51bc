"""Federated split learning as an executor of the one round engine (FedBERT Alg. 2-3, FL-GLM section 3.3).

The engine's global state is the trunk plus whatever client parts are shared; clients are sent only the
shared client parts (``downlink``), never the trunk. Each client trains its bottom and top against the
trunk held here. :class:`SplitExecutor` runs the round's turns itself and calls, around each, the hooks of
the objects the config's ``split`` section chose (resolved once, :class:`~fedlm.split.setup.SplitSetup`):

* the trunk mode (:mod:`fedlm.split.modes`): what a turn starts from (``parallel``'s copy of the round's
  trunk), what of the trunk its reports carry, and what the server hands in at the round's end;
* the parts policy (:mod:`fedlm.split.parts`): what a turn's clients start from (``share``: the parts the
  previous client finished with), what of their uploads the reports carry, and what the server hands in;
* the optimizer state (:mod:`fedlm.split.optimizer_state`): reset at each turn, or carried on;
* the client side (:mod:`fedlm.split.turns`): clients in this process, or on other machines (Flower).

One turn, as :meth:`SplitExecutor.run` takes it::

    before: mode.before_turn, optimizer_state.start_turn, parts_policy.relayed
    turn:   clients.turn (one client alone) or clients.together (the round's, in lockstep)
    after:  mode.after_turn, parts_policy.take (what each report carries), observer.client_done

What the server trained itself enters the global model explicitly, through the engine's ``server_params``
hook, whose values replace the aggregate's; what the reports carry is averaged by FedAvg as usual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedlm.config import SplitConfig
from fedlm.federation.codecs import Codec
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport, Executor, Result
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.observer import SILENT, RoundObserver
from fedlm.federation.params import NamedTensors
from fedlm.federation.store import ClientStore
from fedlm.split.setup import SplitSetup
from fedlm.split.trunk import TO_CLIENT, MessageHook, TrunkBackend
from fedlm.split.turns import Clients, LocalClients, RemoteClients, RemoteSide
from fedlm.tasks import Task

__all__ = ["RemoteClients", "SplitExecutor"]


class SplitExecutor(Executor):
    """Runs a round's clients by split learning against a trunk held here (the server side).

    ``remote`` puts the clients on other machines (Flower): given this process's trunk backend and the
    codec, it returns the :class:`RemoteClients` that reach them. ``hook`` sees every boundary message;
    ``observer`` hears of each client step (the trunk's answer to its backward) and each finished client.
    ``max_length`` (the config's ``model.max_length``) bounds the sequences the trunk accepts. ``setup`` is
    ``spec`` already resolved on ``model`` (the run's, from its policy); without it the model is cut here.
    """

    def __init__(self, model: torch.nn.Module, spec: SplitConfig, task: Task, client_rows: dict[int, Sequence[dict]],
                 codec: Codec, store: ClientStore, settings: LocalSettings, *, hook: MessageHook | None = None,
                 observer: RoundObserver = SILENT,
                 remote: Callable[[TrunkBackend, Codec], RemoteClients] | None = None,
                 max_length: int | None = None, setup: SplitSetup | None = None) -> None:
        if setup is None:
            setup = SplitSetup.cut(model, spec)
        elif setup.server.model is not model or setup.spec != spec:
            raise ValueError("the split setup given was resolved for another model or split section")
        if remote is not None:
            setup.check_remote()
        self.setup, self.server, self.parts = setup, setup.server, setup.parts
        self.observer = observer
        self.backend = setup.trunk_backend(settings, max_length)
        self.mode = setup.trunk.mode(self.server, self.parts.trunk, self.backend)
        self.parts_policy = setup.parts_policy()
        self.optimizer_state = setup.optimizer_state(setup.parts_policy.relays)
        self.clients: Clients
        if remote is None:
            connect = setup.connect(self.backend, sorted(map(str, client_rows)), watched(hook, observer))
            self.clients = LocalClients(self.server, self.parts, self.optimizer_state, task, client_rows, codec, store,
                                        connect)
        else:
            self.clients = RemoteSide(remote(self.backend, codec), codec)

    # ------------------------------------------------------------------------------------- engine hooks

    def downlink(self, global_params: NamedTensors) -> NamedTensors:
        """What each client is sent at a round's start: the shared client parts, never the trunk."""
        return {n: global_params[n] for n in self.parts.shared}

    def begin_round(self, round_idx: int, global_params: NamedTensors) -> None:
        """The server's trunk takes the round's starting state (again on a retried attempt)."""
        self.mode.begin_round({n: global_params[n] for n in self.parts.trunk})
        self.parts_policy.begin_round()
        self.optimizer_state.begin_round(round_idx, self.backend)

    def run(self, jobs: list[ClientJob]) -> list[Result]:
        """The round's turns: one for all its clients in lockstep (``client_batch``), or one per client in job
        order, sent one by one or, where clients on other machines can take them independently, all at once
        (the trunk's turn gate keeps the order, :mod:`fedlm.split.turn_gate`)."""
        self.server.model.train()
        if self.mode.lockstep:
            return self._lockstep(jobs)
        if self._dispatches(jobs):
            return self._dispatched(jobs)
        return [self._alone(job) for job in jobs]

    def server_params(self) -> NamedTensors:
        """What the server trained or relayed itself this round, for the global model as it is: the one trunk
        (sequential, client_batch) and the client parts handed from client to client (share)."""
        return {**self.mode.server_params(), **self.parts_policy.server_params()}

    def close(self) -> None:
        self.clients.close()

    def trunk(self) -> NamedTensors:
        """A copy of the trunk's parameters as they are now."""
        return self.mode.trunk()

    # ------------------------------------------------------------------------------------------ turns

    def _alone(self, job: ClientJob) -> Result:
        self._before_turn([str(job.client_id)])
        result = self.clients.turn(job, self.parts_policy.relayed())
        return self._after_turn(job, result, self.mode.after_turn())

    def _lockstep(self, jobs: list[ClientJob]) -> list[Result]:
        self._before_turn([str(job.client_id) for job in jobs])
        results = self.clients.together(jobs, self.parts_policy.relayed())
        trunk = self.mode.after_turn()
        return [self._after_turn(job, result, trunk) for job, result in zip(jobs, results, strict=True)]

    def _dispatches(self, jobs: list[ClientJob]) -> bool:
        """Whether the turns can be sent at once: none starts from another's parts, and the remote side can."""
        return isinstance(self.clients, RemoteSide) and not self.parts_policy.relays and self.clients.dispatches(jobs)

    def _dispatched(self, jobs: list[ClientJob]) -> list[Result]:
        """The round's jobs sent at once; the trunk's turn gate runs the turns in job order, starting and ending
        each as :meth:`_alone` does (:mod:`fedlm.split.turn_gate`)."""
        assert isinstance(self.clients, RemoteSide)
        trunks: dict[str, NamedTensors] = {}

        def on_end(client_id: str) -> None:
            trunks[client_id] = self.mode.after_turn()

        results = self.clients.dispatch(jobs, lambda client_id: self._before_turn([client_id]), on_end)
        taken = []
        for job, result in zip(jobs, results, strict=True):
            trunk = trunks.get(str(job.client_id))
            if trunk is None and isinstance(result, ClientReport):  # reported without its turn on the trunk
                result = ClientFailure(job.client_id, "its report came back, but its turn never ran on the trunk")
            taken.append(self._after_turn(job, result, trunk or {}))
        return taken

    def _before_turn(self, client_ids: list[str]) -> None:
        self.mode.before_turn(client_ids)
        self.optimizer_state.start_turn(self.backend)

    def _after_turn(self, job: ClientJob, result: Result, trunk: NamedTensors) -> Result:
        """A client's upload, as its report carries it into the average: its shared parts unless the parts policy
        hands them on, plus what of the trunk the mode averages (``trunk``, taken right after its turn)."""
        if isinstance(result, ClientReport):
            params = self.parts_policy.take(dict(result.update.params))
            params.update(trunk)
            result = dataclasses.replace(result, update=dataclasses.replace(result.update, params=params))
        self.observer.client_done(job.client_id)
        return result


def watched(hook: MessageHook | None, observer: RoundObserver) -> MessageHook | None:
    """``hook`` that also tells ``observer`` of each client step: a step ends with the trunk's answer to its
    backward."""
    if observer is SILENT:
        return hook

    def seen(direction: str, client_id: str, kind: str, tensors: dict[str, Any]) -> None:
        if hook is not None:
            hook(direction, client_id, kind, tensors)
        if direction == TO_CLIENT and kind == "backward":
            observer.client_step(int(client_id))

    return seen
