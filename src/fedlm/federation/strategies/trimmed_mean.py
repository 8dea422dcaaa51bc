"""Coordinate-wise trimmed mean: each parameter is the mean of the clients' values once the largest and the
smallest share ``beta`` of them are dropped."""

from __future__ import annotations

import math
from typing import Any

import torch

from fedlm.federation.params import NamedTensors
from fedlm.federation.strategies.held import HeldUpdates


class TrimmedMean(HeldUpdates):
    r"""The coordinate-wise beta-trimmed mean of the clients' parameters (unweighted).

    Notes
    -----
    For every coordinate j, with the :math:`n` values the clients sent for it sorted,
    :math:`w^{t+1}_j = \frac{1}{n - 2k} \sum_{i=k+1}^{n-k} w_{(i),j}` where :math:`k = \lfloor \beta n \rfloor`.
    :math:`\beta \in [0, 0.5)`; 0 is the plain (unweighted) mean.

    References
    ----------
    Yin, Chen, Ramchandran, Bartlett. "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates."
    ICML 2018.
    """

    def __init__(self, current: NamedTensors, beta: float) -> None:
        super().__init__(current)
        self.beta = beta
        self.cut: dict[int, list[int]] | None = None  # client -> [its values cut, its values sent], for the audit

    def result(self) -> NamedTensors:
        self.cut = {}
        out: NamedTensors = {}
        for name, value, senders, stack in self.stacks():
            if stack is None:
                out[name] = value
                continue
            mean, cut = trimmed_mean(stack, self.beta)
            out[name] = mean.to(value.dtype)
            for update, count in zip(senders, cut.tolist(), strict=True):
                tally = self.cut.setdefault(update.client_id, [0, 0])
                tally[0] += count
                tally[1] += value.numel()
        return out

    def audit(self) -> dict[str, Any]:
        """Each client's share of its values cut: coordinate-wise nobody is dropped whole, but an outlier's
        values are cut far more often than the 2 * beta an honest client's are on average."""
        if self.cut is None:
            self.result()
        return {"trimmed_share": {str(c): cut / sent for c, (cut, sent) in sorted((self.cut or {}).items())}}


def trimmed_mean(stack: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The beta-trimmed mean along the first axis, and how many of each row's values were cut."""
    n = stack.shape[0]
    k = math.floor(beta * n)
    ordered = stack.sort(dim=0)
    cut = torch.cat([ordered.indices[:k], ordered.indices[n - k:]]).reshape(-1)
    return ordered.values[k:n - k].mean(dim=0), torch.bincount(cut, minlength=n)
