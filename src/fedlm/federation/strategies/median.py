"""Coordinate-wise median: each parameter is the median of the values the clients sent for it."""

from __future__ import annotations

import torch

from fedlm.federation.params import NamedTensors
from fedlm.federation.strategies.held import HeldUpdates


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """The median along the first axis; with an even count, the mean of the two middle values."""
    ordered = stack.sort(dim=0).values
    n = ordered.shape[0]
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class CoordinateMedian(HeldUpdates):
    r"""The coordinate-wise median of the clients' parameters (unweighted: a client's example count cannot buy it
    influence).

    Notes
    -----
    For every coordinate j, with :math:`S_t^j` the clients that sent it,
    :math:`w^{t+1}_j = \operatorname{median}\{w^{t+1}_{k,j} : k \in S_t^j\}` (the mean of the two middle values
    when :math:`|S_t^j|` is even). A tensor nobody sent keeps its value. It stays within the honest values'
    range while fewer than half the clients are malicious.

    References
    ----------
    Yin, Chen, Ramchandran, Bartlett. "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates."
    ICML 2018.
    """

    def result(self) -> NamedTensors:
        return self.per_tensor(coordinate_median)
