"""FedOpt: FedAvg's average taken as a pseudo-gradient for a server optimizer chosen from a table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fedlm.federation.collective import Collective
from fedlm.federation.params import NamedTensors
from fedlm.federation.strategies.base import Audited, ClientUpdate
from fedlm.federation.strategies.fedavg import Combining, FedAvg, Rule


@dataclass(frozen=True)
class ServerHyperParams:
    """A server optimizer's hyper-parameters (see :class:`FedOpt`); each step reads the ones its rule uses."""

    lr: float
    momentum: float
    beta1: float
    beta2: float
    tau: float


# (x, delta, m, v, hyper-parameters) -> (new x, new m, new v); m and v start as None
ServerStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, ServerHyperParams],
                      tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def _sgdm(x: torch.Tensor, delta: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor | None,
          hp: ServerHyperParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Heavy-ball SGD on the pseudo-gradient -delta: m = momentum m - delta; x = x - lr m (FedNLP's default)."""
    m = -delta if m is None else hp.momentum * m - delta
    return x - hp.lr * m, m, v


def _adaptive(second_moment: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> ServerStep:
    """FedAdagrad / FedAdam / FedYogi: m = b1 m + (1 - b1) delta; v from its rule; x = x + lr m / (sqrt(v) + tau)."""

    def step(x: torch.Tensor, delta: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor | None,
             hp: ServerHyperParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        m = hp.beta1 * (torch.zeros_like(x) if m is None else m) + (1 - hp.beta1) * delta
        v = second_moment(torch.zeros_like(x) if v is None else v, delta * delta, hp.beta2)
        return x + hp.lr * m / (v.sqrt() + hp.tau), m, v

    return step


SERVER_OPTIMIZERS: dict[str, ServerStep] = {
    "sgdm": _sgdm,
    "adagrad": _adaptive(lambda v, sq, beta2: v + sq),
    "adam": _adaptive(lambda v, sq, beta2: beta2 * v + (1 - beta2) * sq),
    "yogi": _adaptive(lambda v, sq, beta2: v - (1 - beta2) * sq * torch.sign(v - sq)),
}


class FedOpt(FedAvg):
    r"""Treat the averaged change as a pseudo-gradient and step a server optimizer on it.

    Parameters
    ----------
    optimizer : str
        A key of :data:`SERVER_OPTIMIZERS`: ``sgdm`` (heavy-ball SGD, FedNLP's default), ``adagrad``,
        ``adam`` or ``yogi``.
    lr : float
        Server learning rate :math:`\eta`.
    momentum : float
        ``sgdm``'s momentum.
    beta1, beta2 : float
        First- and second-moment decay of the adaptive optimizers.
    tau : float
        Adaptivity constant :math:`\tau` (the denominator's floor).

    Notes
    -----
    With :math:`\bar w^{t+1}` FedAvg's average, :math:`\Delta^t = \bar w^{t+1} - w^t`. ``sgdm``:
    :math:`m = \mu m - \Delta^t`, :math:`w^{t+1} = w^t - \eta m`. The adaptive ones:
    :math:`m = \beta_1 m + (1-\beta_1)\Delta^t`, :math:`w^{t+1} = w^t + \eta\, m / (\sqrt v + \tau)`, no bias
    correction, with

    .. math::

        v_{\text{adagrad}} = v + \Delta^2, \qquad
        v_{\text{adam}} = \beta_2 v + (1-\beta_2)\Delta^2, \qquad
        v_{\text{yogi}} = v - (1-\beta_2)\Delta^2 \operatorname{sign}(v - \Delta^2)

    References
    ----------
    Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan. "Adaptive Federated Optimization."
    ICLR 2021 (Algorithm 2).
    """

    name = "fedopt"

    def __init__(self, optimizer: str, lr: float, momentum: float = 0.9, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3, rule: Rule | None = None) -> None:
        super().__init__(rule)
        if optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"server optimizer {optimizer!r} is not one of {', '.join(SERVER_OPTIMIZERS)}")
        self.optimizer = optimizer
        self._step = SERVER_OPTIMIZERS[optimizer]
        self.hyper = ServerHyperParams(lr=lr, momentum=momentum, beta1=beta1, beta2=beta2, tau=tau)
        self.m: NamedTensors = {}
        self.v: NamedTensors = {}

    def aggregation(self, current: NamedTensors) -> ServerStepped:
        return ServerStepped(self, self.rule(current), current)

    def apply_step(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        new, m, v = self._step(x, delta, self.m.get(name), self.v.get(name), self.hyper)
        self.m[name] = m
        if v is not None:
            self.v[name] = v
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = dict(state.get("m", {}))
        self.v = dict(state.get("v", {}))


class ServerStepped:
    """The rule's aggregate (FedAvg's running average, or a robust one), then one server-optimizer step per
    tensor some client sent."""

    def __init__(self, opt: FedOpt, inner: Combining, current: NamedTensors) -> None:
        self.opt, self.inner, self.current = opt, inner, current

    def add(self, update: ClientUpdate) -> None:
        self.inner.add(update)

    def merge(self, collective: Collective) -> None:
        self.inner.merge(collective)

    def audit(self) -> dict[str, Any]:
        return self.inner.audit() if isinstance(self.inner, Audited) else {}

    def result(self) -> NamedTensors:
        averaged, sent, current = self.inner.result(), self.inner.sent, self.current
        return {name: self.opt.apply_step(name, current[name], averaged[name] - current[name]) if name in sent
                else current[name] for name in current}
