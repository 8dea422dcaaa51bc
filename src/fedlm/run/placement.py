"""Where a run's clients run: the one choice ``run_single`` takes besides the config.

A placement builds the round engine's executor from the run's prepared pieces. :class:`Simulation` (the default)
keeps every client in this process; Flower's placement (``fedlm.flower.placement``) sends each job to a node, and
for split learning serves the trunk to nodes that hold the client parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from fedlm.errors import UserError
from fedlm.federation.client_round import fit_client
from fedlm.federation.codecs import Codec
from fedlm.federation.collective import LOCAL, Collective
from fedlm.federation.executor import Executor
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.observer import RoundObserver
from fedlm.federation.sharded import ShardedExecutor
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import ClientStore
from fedlm.run.prepare import Prepared
from fedlm.split.executor import RemoteClients, SplitExecutor
from fedlm.split.setup import SplitSharing
from fedlm.split.trunk import TrunkBackend


@dataclass(frozen=True)
class RunClients:
    """What any placement builds a run's executor from. A split run's ``policy`` (``run_policy``'s) carries the
    run's :class:`~fedlm.split.setup.SplitSetup`: the model cut once, for the policy and the executor alike."""

    prep: Prepared
    policy: SharingPolicy
    codec: Codec
    store: ClientStore
    settings: LocalSettings
    observer: RoundObserver


class Placement(Protocol):
    """Where the clients of a run train; ``executor`` is asked once per run. ``collective`` is the processes
    that share each round's clients (this one alone but for :class:`Sharded`)."""

    collective: Collective

    def executor(self, clients: RunClients) -> Executor: ...


def split_executor(clients: RunClients,
                   remote: Callable[[TrunkBackend, Codec], RemoteClients] | None = None) -> SplitExecutor:
    """Split learning's executor: the trunk in this process, the clients here (``remote`` None) or reached by
    ``remote``; the model as ``run_policy`` cut it."""
    prep, policy = clients.prep, clients.policy
    if not isinstance(policy, SplitSharing):
        raise TypeError(f"a split run's executor needs the policy run_policy made of its split section, not a "
                        f"{type(policy).__name__}")
    return SplitExecutor(prep.model, prep.config.split, prep.task, prep.client_train, clients.codec, clients.store,
                         clients.settings, observer=clients.observer, remote=remote,
                         max_length=prep.config.model.max_length, setup=policy.setup)


@dataclass(frozen=True)
class Simulation:
    """Every client in this process, one after another (the FedAvg family's ``executor_class`` may be a
    subclass that, say, fails on purpose in a test)."""

    executor_class: type[InProcessExecutor] = InProcessExecutor
    collective: Collective = LOCAL

    def executor(self, clients: RunClients) -> Executor:
        prep = clients.prep
        if prep.config.split is not None:
            return split_executor(clients)
        return self.in_process(clients)

    def in_process(self, clients: RunClients) -> InProcessExecutor:
        """The FedAvg family's executor: the clients trained in this process, one after another."""
        prep = clients.prep
        fit = partial(fit_client, attack=prep.attack, borrow=True)  # the engine folds each report at once
        return self.executor_class(prep.model, prep.task, prep.client_train, clients.codec, clients.store,
                                   clients.policy.local_names, fit_fn=fit, observer=clients.observer)


@dataclass(frozen=True)
class Sharded:
    """Each round's clients spread over the processes of ``collective`` (``fedlm run --workers``, torchrun);
    every process runs this placement. Split learning stays in one process."""

    collective: Collective

    def executor(self, clients: RunClients) -> Executor:
        prep = clients.prep
        if prep.config.split is not None:
            raise UserError("split learning runs in one process (its trunk takes the clients' turns in order): "
                            "run it without --workers")
        if prep.config.model.quantization is not None:
            raise UserError("a quantized base runs in one process for now (its packed weights are not handed "
                            "between workers): run it without --workers")
        return ShardedExecutor(Simulation().in_process(clients), self.collective)
