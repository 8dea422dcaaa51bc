"""A gross-outlier screen on client reports: a report in which some tensor grew far beyond the global model's
scale is refused before it reaches the aggregate.

Honest local training moves parameters by a fraction of their size; a report whose tensor is 1000x the model's
is an attack (parameters scaled up) or a broken client, and averaging it in leaves a model every client then
diverges from. This is the backstop that keeps such a round from committing a poisoned model; it is not a robust
aggregator (sign flips, small scalings and backdoors pass it).

A tensor's scale is its root mean square; the global model's is floored at ``SCALE_FLOOR`` so a tensor that
starts at zero (a bias, a LoRA B) may grow to ``limit x SCALE_FLOOR`` before it counts as an outlier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedlm.federation.params import NamedTensors, squared_distance

SCALE_FLOOR = 0.01


def _rms(tensors: list[torch.Tensor]) -> list[float]:
    if not tensors:
        return []
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]).tolist()
    return [norm / math.sqrt(max(t.numel(), 1)) for norm, t in zip(norms, tensors, strict=True)]


@dataclass(frozen=True)
class Growth:
    """How far a report's tensors grew past the global model's scale (the worst tensor and its factor), and how
    far the report moved the model (the L2 norm of its change, which the round's record keeps per client)."""

    tensor: str
    factor: float  # NaN or Inf when the report holds them
    change: float = 0.0  # ||w_k - w|| over the floating tensors it sent

    @property
    def severity(self) -> float:
        """The factor to rank reports by, NaN counting as past any other."""
        return _severity(self.factor)


def _severity(factor: float) -> float:
    return factor if math.isfinite(factor) else math.inf


@dataclass(frozen=True)
class UpdateScreen:
    """The global model's scale per floating tensor, and the growth factor past which a report is refused
    (None: measure, refuse nothing)."""

    reference: dict[str, float]
    limit: float | None
    current: NamedTensors  # the global parameters the round started from

    @classmethod
    def of(cls, global_params: NamedTensors, limit: float | None) -> UpdateScreen:
        names = [n for n, t in global_params.items() if t.is_floating_point()]
        scales = _rms([global_params[n] for n in names])
        return cls({n: max(s, SCALE_FLOOR) for n, s in zip(names, scales, strict=True)}, limit, global_params)

    def growth(self, params: NamedTensors) -> Growth | None:
        """The tensor of ``params`` that grew most past its reference scale, and the norm of the change;
        None if no tensor is screened."""
        names = [n for n in params if n in self.reference]
        if not names:
            return None
        factors = [s / self.reference[n] for n, s in zip(names, _rms([params[n] for n in names]), strict=True)]
        worst = max(range(len(names)), key=lambda i: _severity(factors[i]))
        change = math.sqrt(sum(squared_distance(params[n], self.current[n]) for n in names))
        return Growth(names[worst], factors[worst], change)

    def refusal(self, growth: Growth | None) -> str | None:
        """Why a report with ``growth`` is refused, or None if it passes (NaN counts as past any limit)."""
        if self.limit is None or growth is None or growth.factor <= self.limit:
            return None
        return (f"update refused: its tensor {growth.tensor} is {growth.factor:.3g}x the global model's scale "
                f"(protocol.max_update_growth: {self.limit:g}); an attack or a broken client")
