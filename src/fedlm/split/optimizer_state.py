"""What happens to optimizer state between split-learning turns (the config's ``split.optimizer_state``).

``reset`` (:class:`Reset`): every client turn, or every round of ``client_batch``, starts a fresh trunk
optimizer, and clients keep none, so a one-client split run equals one-client FedAvg.

``carry`` (:class:`Carry`): the one trunk keeps its optimizer across turns and rounds; when the client parts
are handed from client to client (``share``), their optimizer state travels with them (counted in the bytes),
so sequential Head-Emd Share is one continuous training run over the clients' data in turn, what FedBERT calls
"logically centralized". A retried round starts again from the states the round began with. Carried state is
not checkpointed: a resumed run starts the optimizers afresh.

State travels as named tensors ``<parameter>/<key>`` (:func:`optimizer_tensors`), like any other update.
"""

from __future__ import annotations

import abc
import copy
from typing import ClassVar

import torch

from fedlm.federation.executor import ClientJob
from fedlm.federation.local_training import make_optimizer
from fedlm.federation.params import NamedTensors, nbytes
from fedlm.models.cut import SplitModel
from fedlm.split.trunk import TrunkBackend


class OptimizerState(abc.ABC):
    """The trunk's and the clients' optimizer state from one turn to the next. ``relays_clients``: the client
    parts are handed from client to client (``share``), so their state can travel with them."""

    keeps_state: ClassVar[bool]

    def __init__(self, relays_clients: bool) -> None:
        self.relays_clients = relays_clients

    @abc.abstractmethod
    def begin_round(self, round_idx: int, backend: TrunkBackend) -> None:
        """A round, or a retried attempt at one, starts."""

    @abc.abstractmethod
    def start_turn(self, backend: TrunkBackend) -> None:
        """Clients are about to train against the trunk (one client, or a client batch)."""

    @abc.abstractmethod
    def client_optimizer(self, client: SplitModel, job: ClientJob) -> torch.optim.Optimizer | None:
        """The optimizer a client's turn starts with; None: a fresh one."""

    @abc.abstractmethod
    def client_done(self, client_id: int, client: SplitModel) -> tuple[int, int]:
        """A client finished its turn: (state bytes it was handed, state bytes it hands on)."""


class Reset(OptimizerState):
    """A fresh trunk optimizer at each turn; clients start fresh too."""

    keeps_state = False

    def begin_round(self, round_idx: int, backend: TrunkBackend) -> None:
        del round_idx, backend

    def start_turn(self, backend: TrunkBackend) -> None:
        backend.reset_optimizer()

    def client_optimizer(self, client: SplitModel, job: ClientJob) -> torch.optim.Optimizer | None:
        return None

    def client_done(self, client_id: int, client: SplitModel) -> tuple[int, int]:
        return 0, 0


class Carry(OptimizerState):
    """One trunk optimizer for the whole run; under ``share``, the clients' state is handed on too."""

    keeps_state = True

    def __init__(self, relays_clients: bool) -> None:
        super().__init__(relays_clients)
        self._handed_on: NamedTensors = {}  # the client optimizer state the next client starts from
        self._round_start: tuple[int, dict, NamedTensors] | None = None  # (round, trunk state, handed-on state)
        self._running: dict[int, tuple[torch.optim.Optimizer, int]] = {}  # client -> (optimizer, bytes handed)

    def begin_round(self, round_idx: int, backend: TrunkBackend) -> None:
        if self._round_start is not None and self._round_start[0] == round_idx:  # a retried attempt
            backend.optimizer.load_state_dict(copy.deepcopy(self._round_start[1]))
            self._handed_on = self._round_start[2]
        else:
            self._round_start = (round_idx, copy.deepcopy(backend.optimizer.state_dict()), self._handed_on)

    def start_turn(self, backend: TrunkBackend) -> None:
        del backend

    def client_optimizer(self, client: SplitModel, job: ClientJob) -> torch.optim.Optimizer | None:
        if not self.relays_clients:
            return None
        optimizer = make_optimizer([p for p in client.client_parameters() if p.requires_grad], job.settings)
        load_optimizer_tensors(optimizer, client.model, self._handed_on)
        self._running[job.client_id] = optimizer, nbytes(self._handed_on)
        return optimizer

    def client_done(self, client_id: int, client: SplitModel) -> tuple[int, int]:
        if not self.relays_clients:
            return 0, 0
        optimizer, received = self._running.pop(client_id)
        self._handed_on = optimizer_tensors(optimizer, client.model)
        return received, nbytes(self._handed_on)


OPTIMIZER_STATES: dict[str, type[OptimizerState]] = {"reset": Reset, "carry": Carry}


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> NamedTensors:
    """The optimizer's per-parameter state (AdamW's step and moments) as named tensors
    ``<parameter>/<key>``, so it can travel with the parameters like any other update."""
    names = {id(param): name for name, param in model.named_parameters()}
    return {f"{names[id(param)]}/{key}": value.detach().clone()
            for param, state in optimizer.state.items() for key, value in state.items() if torch.is_tensor(value)}


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, model: torch.nn.Module, tensors: NamedTensors) -> None:
    """The inverse of :func:`optimizer_tensors`: set ``model``'s parameters' state in ``optimizer``."""
    params = dict(model.named_parameters())
    for full_name, value in tensors.items():
        name, key = full_name.rsplit("/", 1)
        optimizer.state[params[name]][key] = value.clone()
