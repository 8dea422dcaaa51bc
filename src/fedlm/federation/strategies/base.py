"""What every server strategy is: the protocol the round engine is typed against, and what clients report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from fedlm.federation.params import NamedTensors

if TYPE_CHECKING:
    from fedlm.federation.collective import Collective
    from fedlm.federation.local_training import LocalSettings


@dataclass
class ClientUpdate:
    """What a client reports after local training (params already decoded to fp32)."""

    client_id: int
    num_examples: int
    params: NamedTensors
    metrics: dict[str, float] = field(default_factory=dict)


class Aggregation(Protocol):
    """One round's aggregate in the making: the engine adds each client's update as its report arrives, then
    takes the result once the round's clients are in. When several processes share a round's clients
    (``fedlm run --workers``), each adds its own clients' updates and ``merge`` then combines the processes'
    partial aggregates (a linear rule sums them; a rule that needs every update would gather them)."""

    def add(self, update: ClientUpdate) -> None: ...

    def merge(self, collective: Collective) -> None: ...

    def result(self) -> NamedTensors: ...


@runtime_checkable
class Audited(Protocol):
    """An aggregation that can say whom it left out or weighed less this round (a robust rule), so the round's
    record shows an operator who looked malicious: ``{"dropped": [client ids], "down_weighted": {id: weight}}``
    or what the rule measures instead."""

    def audit(self) -> dict[str, Any]: ...


class Strategy:
    """A server algorithm, as data the engine consults each round (Flower's strategies are the model).

    ``configure`` is what every sampled client is told besides the parameters (FedProx: its mu);
    ``aggregation`` turns the round's updates into the next global parameters, fed one update at a time as the
    reports arrive (the linear strategies here keep a running sum, so memory does not grow with the clients per
    round; a rule that needs every update at once keeps them itself); ``aggregate`` is the same for updates at
    hand; ``account`` adds the strategy's ledger to the round's record (differential privacy's epsilon);
    ``state_dict`` / ``load_state_dict`` carry server-side state (FedOpt's moments) through checkpoints.
    """

    name: str  # the protocol kind it implements (a wrapper takes its inner strategy's)

    def configure(self, settings: LocalSettings) -> LocalSettings:
        """The round's client settings: the run's, as this strategy wants them (unchanged here)."""
        return settings

    def aggregation(self, current: NamedTensors) -> Aggregation:
        """A round's aggregate in the making, starting from the global parameters ``current``."""
        raise NotImplementedError

    def aggregate(self, current: NamedTensors, updates: list[ClientUpdate]) -> NamedTensors:
        """The aggregate of ``updates`` at once (each added in order, as the engine adds them)."""
        aggregation = self.aggregation(current)
        for update in updates:
            aggregation.add(update)
        return aggregation.result()

    def account(self, round_idx: int, reported: list[ClientUpdate]) -> dict[str, Any]:
        """The round's ledger entries, told the reporting clients (their counts and metrics, without params)."""
        del round_idx, reported
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def sample_clients(client_ids: list[int], count: int, seed: int, round_idx: int, attempt: int = 0) -> list[int]:
    """Uniform sampling without replacement, a pure function of (seed, round, attempt) so resumes agree."""
    if count >= len(client_ids):
        return list(client_ids)
    rng = np.random.default_rng([seed, round_idx, attempt])
    chosen = rng.choice(len(client_ids), size=count, replace=False)
    return sorted(client_ids[i] for i in chosen)
