"""FedProx: FedAvg with a proximal term in every client's loss."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fedlm.federation.strategies.fedavg import FedAvg, Rule

if TYPE_CHECKING:
    from fedlm.federation.local_training import LocalSettings


class FedProx(FedAvg):
    r"""FedAvg whose clients minimise a proximal objective around the round's global parameters.

    Aggregation is FedAvg's; only the clients' loss changes, so the strategy is FedAvg plus one client
    setting, sent to every sampled client through :meth:`configure`.

    Parameters
    ----------
    mu : float
        Weight of the proximal term (``protocol.mu``); 0 is FedAvg.

    Notes
    -----
    Client k, starting from the global :math:`w^t`, minimises

    .. math::  F_k(w) + \frac{\mu}{2} \lVert w - w^t \rVert^2

    References
    ----------
    Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "Federated Optimization in Heterogeneous Networks."
    MLSys 2020.
    """

    name = "fedprox"

    def __init__(self, mu: float, rule: Rule | None = None) -> None:
        super().__init__(rule)
        self.mu = mu

    def configure(self, settings: LocalSettings) -> LocalSettings:
        return dataclasses.replace(settings, mu=self.mu)
