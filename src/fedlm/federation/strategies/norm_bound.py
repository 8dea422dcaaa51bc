"""Norm bounding: each client's change to the model is scaled down to a bound before FedAvg averages it."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

import torch

from fedlm.federation.params import NamedTensors, RunningMean, squared_distance
from fedlm.federation.strategies.base import ClientUpdate
from fedlm.federation.strategies.held import HeldUpdates

if TYPE_CHECKING:
    from fedlm.federation.collective import Collective


def update_norm(current: NamedTensors, params: NamedTensors) -> float:
    """The L2 norm of a client's change, over the tensors it sent: ||w_k - w||."""
    return math.sqrt(sum(squared_distance(params[n], current[n], torch.float64) for n in params if n in current))


def bounded(current: NamedTensors, params: NamedTensors, bound: float) -> tuple[NamedTensors, float]:
    """``params`` moved back toward ``current`` so the change's norm is at most ``bound`` (unchanged within it),
    and the factor its change was scaled by."""
    norm = update_norm(current, params)
    if norm <= bound:
        return params, 1.0
    scale = bound / norm
    return {n: (current[n].double() + scale * (v.double() - current[n].double())).to(v.dtype) if n in current else v
            for n, v in params.items()}, scale


class NormBounded:
    r"""FedAvg of the clients' updates, each change first bounded to norm ``M`` (folded as reports arrive).

    Notes
    -----
    With :math:`\Delta_k = w_k - w^t` over the tensors client k sent,
    :math:`w^{t+1} = w^t + \sum_k \frac{n_k}{\sum_j n_j} \Delta_k \min(1, M / \lVert\Delta_k\rVert)`
    (per tensor, over the clients that sent it). A scaled-up update keeps its direction but not its size.

    References
    ----------
    Sun, Kairouz, Suresh, McMahan. "Can You Really Backdoor Federated Learning?" NeurIPS FL workshop 2019.
    """

    def __init__(self, current: NamedTensors, bound: float) -> None:
        self.current, self.bound = current, bound
        self.running = RunningMean()
        self.scaled: dict[int, float] = {}  # the clients whose change was cut down, and by what factor

    def add(self, update: ClientUpdate) -> None:
        params, scale = bounded(self.current, update.params, self.bound)
        if scale < 1.0:
            self.scaled[update.client_id] = scale
        self.running.add(params, float(update.num_examples))

    def merge(self, collective: Collective) -> None:
        self.running.merge(collective)
        self.scaled = {c: s for part in collective.all_gather(self.scaled) for c, s in part.items()}

    def audit(self) -> dict[str, Any]:
        """The clients whose change was scaled down to the bound, with the factor (1 / how far past it they were)."""
        return {"bound": self.bound, "down_weighted": {str(c): s for c, s in sorted(self.scaled.items())}}

    @property
    def sent(self) -> set[str]:
        return set(self.running.sums)

    def result(self) -> NamedTensors:
        return {**self.current, **self.running.mean()}


class MedianNormBounded(HeldUpdates):
    """:class:`NormBounded` with the round's own bound: the median of its updates' change norms (adaptive: no bound
    to tune, and fewer than half the clients cannot raise it)."""

    def bound(self) -> float:
        return statistics.median(update_norm(self.current, u.params) for u in self.ordered())

    def bounded(self) -> NormBounded:
        """The round's updates bounded at their median change norm (once: ``result`` and ``audit`` share it)."""
        if getattr(self, "_bounded", None) is None:
            self._bounded = NormBounded(self.current, self.bound())
            for update in self.ordered():
                self._bounded.add(update)
        return self._bounded

    def result(self) -> NamedTensors:
        return self.bounded().result()

    def audit(self) -> dict[str, Any]:
        return self.bounded().audit()


def norm_bounding(current: NamedTensors, bound: float | None) -> NormBounded | MedianNormBounded:
    """Norm bounding at ``bound``, or at the round's median change norm when ``bound`` is None."""
    return NormBounded(current, bound) if bound is not None else MedianNormBounded(current)



