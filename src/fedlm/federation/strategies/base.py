"""What every server strategy is: the protocol the round engine is typed against, and what clients report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fedlm.federation.params import NamedTensors


@dataclass
class ClientUpdate:
    """What a client reports after local training (params already decoded to fp32)."""

    client_id: int
    num_examples: int
    params: NamedTensors
    metrics: dict[str, float] = field(default_factory=dict)


class Strategy(Protocol):
    """A server algorithm, as data the engine consults each round (Flower's strategies are the model).

    ``client_config`` is what every sampled client is told besides the parameters (FedProx: its mu);
    ``aggregate`` turns the round's updates into the next global parameters; ``state_dict`` /
    ``load_state_dict`` carry server-side state (FedOpt's moments) through checkpoints.
    """

    name: str

    def client_config(self) -> dict[str, Any]: ...

    def aggregate(self, current: NamedTensors, updates: list[ClientUpdate]) -> NamedTensors: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def sample_clients(client_ids: list[int], count: int, seed: int, round_idx: int, attempt: int = 0) -> list[int]:
    """Uniform sampling without replacement, a pure function of (seed, round, attempt) so resumes agree."""
    if count >= len(client_ids):
        return list(client_ids)
    rng = np.random.default_rng([seed, round_idx, attempt])
    chosen = rng.choice(len(client_ids), size=count, replace=False)
    return sorted(client_ids[i] for i in chosen)
