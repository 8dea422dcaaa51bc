"""Server strategies, one file each: FedAvg, FedProx (FedAvg + a client setting), FedOpt (FedAvg + a server
optimizer). The round engine is typed against :class:`~fedlm.federation.strategies.base.Strategy`; each of these
folds the round's updates into a running example-weighted sum as they arrive (``FedAvg``'s ``Averaging``)."""

from __future__ import annotations

from fedlm.config import ProtocolConfig
from fedlm.federation.strategies.base import ClientUpdate, Strategy, sample_clients
from fedlm.federation.strategies.fedavg import FedAvg
from fedlm.federation.strategies.fedopt import SERVER_OPTIMIZERS, FedOpt
from fedlm.federation.strategies.fedprox import FedProx


def build_strategy(protocol: ProtocolConfig) -> Strategy:
    """The strategy for a protocol config (centralized and isolated aggregate like FedAvg)."""
    if protocol.kind == "fedprox":
        return FedProx(protocol.mu)
    if protocol.kind == "fedopt":
        return FedOpt(protocol.server_optimizer, protocol.server_lr, protocol.server_momentum,
                      protocol.beta1, protocol.beta2, protocol.tau)
    return FedAvg()


__all__ = ["SERVER_OPTIMIZERS", "ClientUpdate", "FedAvg", "FedOpt", "FedProx", "Strategy", "build_strategy",
           "sample_clients"]
