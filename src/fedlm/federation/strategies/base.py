"""Server strategies: which clients train each round, what they are told, and how their results merge.

One round engine drives all of them; FedProx is FedAvg plus one client setting, FedOpt is FedAvg plus a
server optimizer applied to the averaged change. Algorithm settings travel as data, not code paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedlm.federation.params import NamedTensors, weighted_mean


@dataclass
class ClientUpdate:
    """What a client reports after local training (params already decoded to fp32)."""

    client_id: int
    num_examples: int
    params: NamedTensors
    metrics: dict[str, float] = field(default_factory=dict)


def sample_clients(client_ids: list[int], count: int, seed: int, round_idx: int, attempt: int = 0) -> list[int]:
    """Uniform sampling without replacement, a pure function of (seed, round, attempt) so resumes agree."""
    if count >= len(client_ids):
        return list(client_ids)
    rng = np.random.default_rng([seed, round_idx, attempt])
    chosen = rng.choice(len(client_ids), size=count, replace=False)
    return sorted(client_ids[i] for i in chosen)


class FedAvg:
    """McMahan et al.: average the clients' parameters weighted by their example counts."""

    name = "fedavg"

    def client_config(self) -> dict[str, Any]:
        return {}

    def aggregate(self, current: NamedTensors, updates: list[ClientUpdate]) -> NamedTensors:
        """Each tensor averaged over the clients that sent it (a client that froze it this round did not);
        a tensor nobody sent keeps its current value."""
        merged = dict(current)
        merged.update(weighted_mean([(u.params, float(u.num_examples)) for u in updates]))
        return merged

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class FedProx(FedAvg):
    """Li et al.: FedAvg whose clients add (mu/2)||w - w_global||^2 to their loss."""

    name = "fedprox"

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def client_config(self) -> dict[str, Any]:
        return {"mu": self.mu}


class FedOpt(FedAvg):
    """Reddi et al.: treat (current - average) as a pseudo-gradient and step a server optimizer on it.

    Update rules follow the paper's Algorithm 2 (FedAdagrad / FedAdam / FedYogi, no bias correction,
    tau as the adaptivity constant); ``sgdm`` is heavy-ball SGD, FedNLP's default server optimizer.
    """

    name = "fedopt"

    def __init__(self, optimizer: str, lr: float, momentum: float = 0.9, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3) -> None:
        self.optimizer = optimizer
        self.lr = lr
        self.momentum = momentum
        self.beta1 = beta1
        self.beta2 = beta2
        self.tau = tau
        self.m: NamedTensors = {}
        self.v: NamedTensors = {}

    def aggregate(self, current: NamedTensors, updates: list[ClientUpdate]) -> NamedTensors:
        sent = {name for u in updates for name in u.params}
        averaged = super().aggregate(current, updates)
        return {name: self._step(name, current[name], averaged[name] - current[name]) if name in sent
                else current[name] for name in current}

    def _step(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.optimizer == "sgdm":
            buf = self.m.get(name)
            buf = -delta if buf is None else self.momentum * buf - delta
            self.m[name] = buf
            return x - self.lr * buf
        m = self.m.get(name, torch.zeros_like(x))
        v = self.v.get(name, torch.zeros_like(x))
        m = self.beta1 * m + (1 - self.beta1) * delta
        sq = delta * delta
        if self.optimizer == "adagrad":
            v = v + sq
        elif self.optimizer == "adam":
            v = self.beta2 * v + (1 - self.beta2) * sq
        else:  # yogi
            v = v - (1 - self.beta2) * sq * torch.sign(v - sq)
        self.m[name], self.v[name] = m, v
        return x + self.lr * m / (v.sqrt() + self.tau)

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = dict(state.get("m", {}))
        self.v = dict(state.get("v", {}))


def build_strategy(protocol: Any) -> FedAvg:
    """The strategy for a protocol config (centralized and isolated aggregate like FedAvg)."""
    if protocol.kind == "fedprox":
        return FedProx(protocol.mu)
    if protocol.kind == "fedopt":
        return FedOpt(protocol.server_optimizer, protocol.server_lr, protocol.server_momentum,
                      protocol.beta1, protocol.beta2, protocol.tau)
    return FedAvg()
