"""Split learning's trunk modes (the config's ``split.trunk_mode``): how a round's clients meet the server's
trunk, and how the trunk they trained enters the global model. :class:`TrunkChoice` resolves the config's trunk
choices once and is the one place a trunk backend is made, for the round engine's executor and for
``fedlm trunk serve`` alike.

* ``sequential`` (:class:`Sequential`; FedBERT Alg. 3, FL-GLM serial): one trunk, stepped by each client in
  turn; the server hands that trunk to the global model at the round's end (``server_params``);
* ``parallel`` (:class:`Parallel`; FedBERT Alg. 2, FL-GLM server-hierarchical): every client trains its own
  copy of the round's starting trunk, and the copies are averaged, weighted by examples;
* ``client_batch`` (:class:`ClientBatch`; FL-GLM Fig. 3): the round's clients send one batch each, and every
  trunk step runs them together (:class:`~fedlm.split.trunk_batching.BatchingTrunkBackend`); the one trunk
  enters the global model as in ``sequential``.

A mode does not run the round: the split executor runs the turns and calls the mode's hooks around each
(``before_turn``, ``after_turn``), reading its flags to know how the turns go (``lockstep``) and where its
clients may run (``remote``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedlm.config import SplitConfig
from fedlm.errors import UserError
from fedlm.federation.local_training import LocalSettings, make_optimizer
from fedlm.federation.params import NamedTensors, load_into, snapshot
from fedlm.models.cut import SplitModel
from fedlm.split.trunk import WIRE_DTYPES, TrunkBackend, TrunkLimits
from fedlm.split.trunk_batching import BatchingTrunkBackend


class TrunkMode:
    """How a round's clients meet the trunk, and what of the trunk the reports and the server contribute.

    It acts on the server's trunk (``server``'s parameters ``names``, trained through ``backend``); the split
    executor calls its hooks as the round and each turn begin and end."""

    backend_class: ClassVar[type[TrunkBackend]] = TrunkBackend
    lockstep: ClassVar[bool] = False  # the round is one turn: its clients train together, a message each per step
    one_trunk: ClassVar[bool] = True  # a single trunk all round (its optimizer can be carried on)
    remote: ClassVar[bool] = True  # its clients can run on their own machines, one turn per message
    serves_alone: ClassVar[bool] = False  # a long-lived trunk server without a round engine behaves so

    def __init__(self, server: SplitModel, names: list[str], backend: TrunkBackend) -> None:
        self.server = server
        self.names = names
        self.backend = backend

    def trunk(self) -> NamedTensors:
        """A copy of the trunk's parameters as they are now."""
        return snapshot(self.server.model, self.names)

    def begin_round(self, trunk: NamedTensors) -> None:
        """The round (or a retried attempt) starts from ``trunk``."""
        load_into(self.server.model, trunk)

    def before_turn(self, client_ids: list[str]) -> None:
        """``client_ids`` (one client alone, or the round's clients in lockstep) are about to train."""
        del client_ids  # one trunk: it goes on from where the last turn left it

    def after_turn(self) -> NamedTensors:
        """What of the trunk the turn's reports carry into FedAvg's average, right after the turn."""
        return {}

    def server_params(self) -> NamedTensors:
        """What of the trunk the server hands to the global model itself at the round's end."""
        return self.trunk()


class Sequential(TrunkMode):
    """One trunk, stepped by each client in turn; that trunk is the round's."""

    serves_alone = True


class Parallel(TrunkMode):
    """A trunk copy per client, each starting from the round's trunk, averaged weighted by examples.

    FedBERT's Alg. 2 averages the copies as FedAvg averages client models, over the clients that reported
    and weighted by their examples; so each report carries its client's copy (``after_turn``) and the
    engine's FedAvg computes exactly that average, failed clients left out, with no second implementation
    of the weighting here. The server contributes nothing of its own (``server_params`` is empty).
    """

    one_trunk = False

    def __init__(self, server: SplitModel, names: list[str], backend: TrunkBackend) -> None:
        super().__init__(server, names, backend)
        self._start: NamedTensors = {}

    def begin_round(self, trunk: NamedTensors) -> None:
        super().begin_round(trunk)
        self._start = trunk

    def before_turn(self, client_ids: list[str]) -> None:
        load_into(self.server.model, self._start)  # this client's own copy of the round's trunk

    def after_turn(self) -> NamedTensors:
        return self.trunk()

    def server_params(self) -> NamedTensors:
        return {}


class ClientBatch(TrunkMode):
    """Every trunk step runs one batch from each of the round's clients, in lockstep; one trunk."""

    backend_class = BatchingTrunkBackend
    lockstep = True
    remote = False

    def before_turn(self, client_ids: list[str]) -> None:
        assert isinstance(self.backend, BatchingTrunkBackend), "built by TrunkChoice.backend from this mode"
        self.backend.expect(client_ids)


TRUNK_MODES: dict[str, type[TrunkMode]] = {
    "sequential": Sequential, "parallel": Parallel, "client_batch": ClientBatch,
}


@dataclass(frozen=True)
class TrunkChoice:
    """The config's trunk choices resolved: the trunk mode and the precision activations cross the boundary in."""

    mode: type[TrunkMode]
    wire_dtype: torch.dtype

    @classmethod
    def of(cls, spec: SplitConfig) -> TrunkChoice:
        return cls(TRUNK_MODES[spec.trunk_mode], WIRE_DTYPES[spec.activation_dtype])

    def backend(self, split: SplitModel, settings: LocalSettings, max_length: int | None = None) -> TrunkBackend:
        """The server's trunk: the mode's backend over ``split``'s trunk, the training optimizer (a factory, so
        a turn can start it afresh), gradient clipping at ``train.max_grad_norm``, activations and gradients
        taken in the wire dtype only, the trunk computing under ``train.precision``'s autocast on the device
        its parameters are on, and messages bounded to what a client of this run sends
        (:meth:`TrunkLimits.for_model`: the model's positions, ``max_length`` (the config's
        ``model.max_length``) when given, one ``train.batch_size`` batch).

        fp16 is refused: its loss scale would have to cross the boundary with every gradient (a client's scaled
        gradient overflowing is routine for a loss scaler, but a non-finite message is refused), so split runs
        train in fp32 or bf16, which needs no scaling."""
        if settings.precision == "fp16":
            raise UserError("train.precision = 'fp16' is not for split learning (its loss scale would have to "
                            "cross the client/trunk boundary); use bf16, which needs no loss scaling, or fp32")
        return self.mode.backend_class(
            split.trunk, split.model.config.hidden_size, lambda params: make_optimizer(params, settings),
            max_grad_norm=settings.max_grad_norm, wire_dtype=self.wire_dtype, precision=settings.precision,
            limits=TrunkLimits.for_model(split.model.config, max_length, settings.batch_size))
