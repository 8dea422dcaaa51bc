"""FedProx: Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020)."""

from __future__ import annotations

from typing import Any

from fedlm.federation.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    r"""FedAvg whose clients minimise a proximal objective around the round's global parameters.

    .. math::  \min_w \; F_k(w) + \frac{\mu}{2} \lVert w - w^t \rVert^2

    Aggregation is FedAvg's; only the clients' loss changes, so the strategy is FedAvg plus one client setting.
    """

    name = "fedprox"

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def client_config(self) -> dict[str, Any]:
        return {"mu": self.mu}
