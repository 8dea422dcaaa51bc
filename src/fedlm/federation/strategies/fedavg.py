"""FedAvg: the example-weighted average every other strategy here builds on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from fedlm.federation.collective import Collective
from fedlm.federation.params import NamedTensors, RunningMean
from fedlm.federation.strategies.base import Aggregation, ClientUpdate, Strategy


class Combining(Aggregation, Protocol):
    """An aggregation that also tells which tensors some client sent (FedOpt steps only those)."""

    @property
    def sent(self) -> set[str]: ...


# How a round's client tensors become one set, started from the global parameters: FedAvg's weighted mean by
# default, or a robust rule (median, trimmed mean, Krum, norm bounding) that FedProx and FedOpt then build on.
Rule = Callable[[NamedTensors], Combining]


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
    rule: Rule  # FedAvg's own mean unless a robust rule is given (a subclass need not call __init__)

    def __init__(self, rule: Rule | None = None) -> None:
        if rule is not None:
            self.rule = rule

    def aggregation(self, current: NamedTensors) -> Combining:
        return self.rule(current)


class Averaging:
    """FedAvg's aggregate as updates arrive: a running example-weighted sum per tensor (one update's worth of
    memory however many clients report), merged into ``current`` at the end."""

    def __init__(self, current: NamedTensors) -> None:
        self.current = current
        self.running = RunningMean()

    def add(self, update: ClientUpdate) -> None:
        self.running.add(update.params, float(update.num_examples))

    def merge(self, collective: Collective) -> None:
        self.running.merge(collective)

    @property
    def sent(self) -> set[str]:
        """The names some client sent (a tensor everyone froze keeps its current value)."""
        return set(self.running.sums)

    def result(self) -> NamedTensors:
        return {**self.current, **self.running.mean()}


FedAvg.rule = Averaging  # set after the class it names exists
