"""FedAvg: the example-weighted average every other strategy here builds on."""

from __future__ import annotations

from fedlm.federation.params import NamedTensors, weighted_mean
from fedlm.federation.strategies.base import ClientUpdate, Strategy


class FedAvg(Strategy):
    r"""Average the clients' parameters, weighted by their example counts.

    Centralized and isolated runs aggregate this way too (one client, or nothing shared).

    Notes
    -----
    With :math:`S_t` the clients that reported in round :math:`t` and :math:`n_k` client k's examples,

    .. math::  w^{t+1} = \sum_{k \in S_t} \frac{n_k}{\sum_{j \in S_t} n_j} \, w_k^{t+1}

    A tensor is averaged over the clients that sent it (a client that froze it this round did not); a
    tensor nobody sent keeps its current value.

    References
    ----------
    McMahan, Moore, Ramage, Hampson, Agüera y Arcas. "Communication-Efficient Learning of Deep Networks
    from Decentralized Data." AISTATS 2017.
    """

    name = "fedavg"

    def aggregate(self, current: NamedTensors, updates: list[ClientUpdate]) -> NamedTensors:
        merged = dict(current)
        merged.update(weighted_mean([(u.params, float(u.num_examples)) for u in updates]))
        return merged
