"""Split learning's trunk modes (the config's ``split.trunk_mode``): how a round's clients meet the server's
trunk, and how the trunk they trained enters the global model. :func:`build_trunk_backend` is the one place a
trunk backend is made, for the round engine's executor and for ``fedlm trunk serve`` alike.

* ``sequential`` (:class:`Sequential`; FedBERT Alg. 3, FL-GLM serial): one trunk, stepped by each client in
  turn; the server hands that trunk to the global model at the round's end (``server_params``);
* ``parallel`` (:class:`Parallel`; FedBERT Alg. 2, FL-GLM server-hierarchical): every client trains its own
  copy of the round's starting trunk, and the copies are averaged, weighted by examples;
* ``client_batch`` (:class:`ClientBatch`; FL-GLM Fig. 3): the round's clients send one batch each, and every
  trunk step runs them together (:class:`~fedlm.split.trunk_batching.BatchingTrunkBackend`); the one trunk
  enters the global model as in ``sequential``.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Protocol

from fedlm.config import SplitConfig
from fedlm.errors import UserError
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings, make_optimizer
from fedlm.federation.params import NamedTensors
from fedlm.models.cut import SplitModel
from fedlm.split.trunk import WIRE_DTYPES, TrunkBackend, TrunkLimits
from fedlm.split.trunk_batching import BatchingTrunkBackend

Result = ClientReport | ClientFailure


class Round(Protocol):
    """A round in progress, as a trunk mode drives it (the split executor)."""

    backend: TrunkBackend

    def trunk(self) -> NamedTensors:
        """A copy of the trunk's parameters as they are now."""
        ...

    def load_trunk(self, params: NamedTensors) -> None: ...

    def turns(self, jobs: list[ClientJob]) -> list[Result]:
        """The clients train against the trunk alone, one after another in job order, each turn started by
        the mode's :meth:`TrunkMode.start_turn` and its report taken in before the next turn."""
        ...

    def together(self, jobs: list[ClientJob]) -> list[Result]:
        """The clients train at once, one message each per trunk step (a client batch)."""
        ...


class TrunkMode(abc.ABC):
    """How a round's clients meet the trunk, and what of the trunk the reports and the server contribute."""

    backend: ClassVar[type[TrunkBackend]] = TrunkBackend
    one_trunk: ClassVar[bool] = True  # a single trunk all round (its optimizer can be carried on)
    remote: ClassVar[bool] = True  # its clients can run on their own machines, one turn per message
    serves_alone: ClassVar[bool] = False  # a long-lived trunk server without a round engine behaves so

    def begin_round(self, trunk: NamedTensors) -> None:
        """The round starts from ``trunk`` (already loaded into the server's model)."""
        del trunk  # one trunk: nothing to keep

    @abc.abstractmethod
    def run(self, jobs: list[ClientJob], round: Round) -> list[Result]:
        """The round's client turns, one result per job, in job order."""

    def start_turn(self, round: Round) -> None:
        """A client's turn alone against the trunk begins."""
        del round  # one trunk: it goes on from where the last turn left it

    def report_params(self, round: Round) -> NamedTensors:
        """What of the trunk a report carries into FedAvg's average, right after its client's turn."""
        return {}

    def server_params(self, round: Round) -> NamedTensors:
        """What of the trunk the server hands to the global model itself at the round's end."""
        return round.trunk()


class Sequential(TrunkMode):
    """One trunk, stepped by each client in turn; that trunk is the round's."""

    serves_alone = True

    def run(self, jobs: list[ClientJob], round: Round) -> list[Result]:
        return round.turns(jobs)


class Parallel(TrunkMode):
    """A trunk copy per client, each starting from the round's trunk, averaged weighted by examples.

    FedBERT's Alg. 2 averages the copies as FedAvg averages client models, over the clients that reported
    and weighted by their examples; so each report carries its client's copy (``report_params``) and the
    engine's FedAvg computes exactly that average, failed clients left out, with no second implementation
    of the weighting here. The server contributes nothing of its own (``server_params`` is empty).
    """

    one_trunk = False

    def __init__(self) -> None:
        self._start: NamedTensors = {}

    def begin_round(self, trunk: NamedTensors) -> None:
        self._start = trunk

    def run(self, jobs: list[ClientJob], round: Round) -> list[Result]:
        return round.turns(jobs)

    def start_turn(self, round: Round) -> None:
        round.load_trunk(self._start)  # this client's own copy of the round's trunk

    def report_params(self, round: Round) -> NamedTensors:
        return round.trunk()

    def server_params(self, round: Round) -> NamedTensors:
        return {}


class ClientBatch(TrunkMode):
    """Every trunk step runs one batch from each of the round's clients, in lockstep; one trunk."""

    backend = BatchingTrunkBackend
    remote = False

    def run(self, jobs: list[ClientJob], round: Round) -> list[Result]:
        backend = round.backend
        assert isinstance(backend, BatchingTrunkBackend), "built by build_trunk_backend from this mode"
        backend.expect([str(job.client_id) for job in jobs])
        return round.together(jobs)


TRUNK_MODES: dict[str, type[TrunkMode]] = {
    "sequential": Sequential, "parallel": Parallel, "client_batch": ClientBatch,
}


def build_trunk_backend(split: SplitModel, spec: SplitConfig, settings: LocalSettings,
                        max_length: int | None = None) -> TrunkBackend:
    """The server's trunk as a config describes it: the trunk mode's backend over ``split``'s trunk, the
    training optimizer (a factory, so a turn can start it afresh), gradient clipping at
    ``train.max_grad_norm``, activations and gradients taken in ``split.activation_dtype`` only, and the
    trunk computing under ``train.precision``'s autocast on the device its parameters are on, and messages
    bounded to what a client of this run sends (:meth:`TrunkLimits.for_model`: the model's positions,
    ``max_length`` (the config's ``model.max_length``) when given, one ``train.batch_size`` batch).

    fp16 is refused: its loss scale would have to cross the boundary with every gradient (a client's scaled
    gradient overflowing is routine for a loss scaler, but a non-finite message is refused), so split runs
    train in fp32 or bf16, which needs no scaling."""
    if settings.precision == "fp16":
        raise UserError("train.precision = 'fp16' is not for split learning (its loss scale would have to cross "
                        "the client/trunk boundary); use bf16, which needs no loss scaling, or fp32")
    backend_class = TRUNK_MODES[spec.trunk_mode].backend
    return backend_class(split.trunk, split.model.config.hidden_size, lambda params: make_optimizer(params, settings),
                         max_grad_norm=settings.max_grad_norm, wire_dtype=WIRE_DTYPES[spec.activation_dtype],
                         precision=settings.precision,
                         limits=TrunkLimits.for_model(split.model.config, max_length, settings.batch_size))
