"""Krum and Multi-Krum: keep the updates closest to their nearest neighbours, average those."""

from __future__ import annotations

from typing import Any

import torch

from fedlm.federation.params import NamedTensors, RunningMean
from fedlm.federation.strategies.base import ClientUpdate
from fedlm.federation.strategies.held import HeldUpdates


def krum_minimum(f: int) -> int:
    """Fewest updates Krum can score with ``f`` attackers: n > 2f + 2."""
    return 2 * f + 3


class Krum(HeldUpdates):
    r"""Multi-Krum: the ``m`` updates with the lowest Krum scores, averaged by example counts (``m = 1``: Krum).

    Notes
    -----
    With :math:`n` updates of which at most :math:`f` are malicious (:math:`n > 2f + 2`), update i's score is
    the sum of its squared distances to its :math:`n - f - 2` nearest other updates,
    :math:`s(i) = \sum_{j \in N_i} \lVert w_i - w_j \rVert^2`; the :math:`m` lowest scores are kept (ties go to
    the lower client id) and averaged as FedAvg averages. Distances are over the whole model: a tensor a client
    froze (did not send) counts as its current value. The average of a tensor is over the kept clients that sent
    it.

    References
    ----------
    Blanchard, El Mhamdi, Guerraoui, Stainer. "Machine Learning with Adversaries: Byzantine Tolerant Gradient
    Descent." NeurIPS 2017.
    """

    def __init__(self, current: NamedTensors, f: int, m: int) -> None:
        super().__init__(current)
        self.f, self.m = f, m
        self._kept: list[ClientUpdate] | None = None  # chosen once a round, when result or audit first asks

    def distances(self) -> torch.Tensor:
        """Squared distances between every two updates (client id order), in float64."""
        updates = self.ordered()
        n = len(updates)
        squared = torch.zeros(n, n, dtype=torch.float64)
        for name in self.sent & self.current.keys():  # a tensor nobody sent is the same in every update
            value = self.current[name]
            if not value.is_floating_point():
                continue
            rows = torch.stack([u.params.get(name, value).double().reshape(-1) for u in updates])
            for i in range(n):
                squared[i] += (rows - rows[i]).pow(2).sum(dim=1)
        return squared

    def scores(self) -> list[float]:
        n = len(self.updates)
        if n < krum_minimum(self.f):
            raise ValueError(f"Krum with f={self.f} needs at least {krum_minimum(self.f)} updates (n > 2f + 2), "
                             f"got {n}")
        squared = self.distances()
        nearest = n - self.f - 2
        return [float(torch.cat([row[:i], row[i + 1:]]).sort().values[:nearest].sum())
                for i, row in enumerate(squared)]

    def kept(self) -> list[ClientUpdate]:
        """The ``m`` updates with the lowest scores (a stable sort: ties keep client id order), scored once a round
        (``result`` and ``audit`` both ask)."""
        if self._kept is None:
            scores, updates = self.scores(), self.ordered()
            chosen = sorted(range(len(updates)), key=lambda i: scores[i])[: self.m]
            self._kept = [updates[i] for i in sorted(chosen)]
        return self._kept

    def result(self) -> NamedTensors:
        mean = RunningMean()
        for update in self.kept():
            mean.add(update.params, float(update.num_examples))
        return {**self.current, **mean.mean()}

    def audit(self) -> dict[str, Any]:
        """The clients Krum left out this round."""
        kept = {u.client_id for u in self.kept()}
        return {"dropped": [u.client_id for u in self.ordered() if u.client_id not in kept]}
