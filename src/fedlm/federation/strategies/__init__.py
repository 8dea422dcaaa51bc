"""Server strategies, one file each: FedAvg, FedProx (FedAvg + a client setting), FedOpt (FedAvg + a server
optimizer). The round engine is typed against :class:`~fedlm.federation.strategies.base.Strategy`. How a round's
updates become one is the strategy's rule: FedAvg's running example-weighted sum (``Averaging``) by default, or a
robust rule, one file each (``median``, ``trimmed_mean``, ``krum``, ``norm_bound``), that FedProx and FedOpt
build on the same way."""

from __future__ import annotations

from functools import partial

from fedlm.config import ProtocolConfig
from fedlm.federation.strategies.base import ClientUpdate, Strategy, sample_clients
from fedlm.federation.strategies.fedavg import Averaging, FedAvg, Rule
from fedlm.federation.strategies.fedopt import SERVER_OPTIMIZERS, FedOpt
from fedlm.federation.strategies.fedprox import FedProx
from fedlm.federation.strategies.krum import Krum, krum_minimum
from fedlm.federation.strategies.median import CoordinateMedian
from fedlm.federation.strategies.norm_bound import norm_bounding
from fedlm.federation.strategies.trimmed_mean import TrimmedMean


def aggregation_rule(protocol: ProtocolConfig) -> Rule:
    """``protocol.aggregator`` with its parameters, as the rule a strategy aggregates with."""
    if protocol.aggregator == "median":
        return CoordinateMedian
    if protocol.aggregator == "trimmed_mean":
        return partial(TrimmedMean, beta=protocol.trim_beta)
    if protocol.aggregator == "krum":
        return partial(Krum, f=protocol.krum_f, m=protocol.krum_m)
    if protocol.aggregator == "norm_bound":
        return partial(norm_bounding, bound=protocol.norm_bound)
    return Averaging


def rule_minimum(protocol: ProtocolConfig) -> int:
    """Fewest reports the aggregator can work with (Krum: 2f + 3; the others: one)."""
    return krum_minimum(protocol.krum_f) if protocol.aggregator == "krum" else 1


def build_strategy(protocol: ProtocolConfig) -> Strategy:
    """The strategy for a protocol config (centralized and isolated aggregate like FedAvg)."""
    rule = aggregation_rule(protocol)
    if protocol.kind == "fedprox":
        return FedProx(protocol.mu, rule)
    if protocol.kind == "fedopt":
        return FedOpt(protocol.server_optimizer, protocol.server_lr, protocol.server_momentum,
                      protocol.beta1, protocol.beta2, protocol.tau, rule)
    return FedAvg(rule)


__all__ = ["SERVER_OPTIMIZERS", "ClientUpdate", "FedAvg", "FedOpt", "FedProx", "Strategy", "aggregation_rule",
           "build_strategy", "rule_minimum", "sample_clients"]
