"""Differential privacy around the server strategies: client-level DP-FedAvg and sample-level DP-SGD's ledger.

Each kind is its own strategy wrapping another (FedAvg, FedProx, FedOpt). :class:`ClientLevelDP` replaces the
clients' updates by one privatized update before the inner strategy sees them (so FedOpt's server optimizer steps
on the noised average); :class:`SampleLevelDP` tells the clients to train by DP-SGD
(``fedlm.federation.dp_sgd``) and keeps each client's privacy ledger. Epsilon comes from Opacus' accountants
(``fedlm.federation.opacus``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from fedlm.config import PrivacyConfig
from fedlm.federation.collective import Collective
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.opacus import epsilon, require_opacus
from fedlm.federation.params import NamedTensors, RunningMean
from fedlm.federation.strategies.base import Aggregation, ClientUpdate, Strategy

Kind = Literal["none", "client", "sample"]


@dataclass(frozen=True)
class PrivacySpec:
    """What a run's ``privacy`` section asks for, decoupled from the config classes."""

    kind: Kind = "none"
    noise_multiplier: float = 1.0  # z: noise std in units of the clipping norm
    clip: float = 1.0  # C, client level: the L2 bound of one client's update
    max_grad_norm: float = 1.0  # sample level: the L2 bound of one example's gradient
    delta: float = 1e-5
    accountant: Literal["rdp", "prv"] = "rdp"

    @classmethod
    def from_config(cls, privacy: PrivacyConfig) -> PrivacySpec:
        return cls(**privacy.model_dump())


def clip_update(current: NamedTensors, params: NamedTensors, clip: float) -> tuple[NamedTensors, float]:
    """``params`` moved back towards ``current`` so that the update (their difference over the names sent) has L2
    norm at most ``clip``; an update already within the bound is returned as it is (the same tensors). Also
    returns the update's norm before clipping."""
    deltas = {name: value - current[name] for name, value in params.items()}
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in deltas.values()))
    if norm <= clip:
        return params, norm
    scale = clip / norm
    return {name: current[name] + d * scale for name, d in deltas.items()}, norm


def noise_seed(seed: int, round_idx: int) -> int:
    """The seed of round ``round_idx``'s server noise: reproducible, and the same after a resume."""
    return int(np.random.SeedSequence([seed, round_idx, 0x44_50]).generate_state(1)[0])


class ClippedMean:
    r"""McMahan et al.'s DP-FedAvg aggregate with uniform weights, in parameter space, folded one update at a time.

    .. math::  \tilde w = w + \frac{1}{|S|}\Big(\sum_{k\in S} \Delta_k \min\big(1, \tfrac{C}{\lVert\Delta_k\rVert}\big)
               + \mathcal N(0, z^2 C^2 I)\Big)

    with :math:`\Delta_k` client k's update over the parameters that travel (a tensor a client did not send counts
    as unchanged). Every client weighs the same: weighting by example counts would let one client move the
    average by more than ``C / |S|``. Memory is one clipped sum, however many clients report.
    """

    def __init__(self, current: NamedTensors, clip: float) -> None:
        self.current = current
        self.clip = clip
        self.running = RunningMean()  # the clipped updates, each of weight 1
        self.count = 0

    def add(self, params: NamedTensors) -> None:
        self.running.add(clip_update(self.current, params, self.clip)[0], 1.0)  # unsent tensors: no delta, no norm
        self.count += 1

    def merge(self, collective: Collective) -> None:
        """The other processes' clipped sums and counts of the same round added to this one's."""
        self.running.merge(collective)
        self.count = sum(collective.all_gather(self.count))

    def noised_mean(self, noise_multiplier: float, generator: torch.Generator) -> NamedTensors:
        """The mean over every client that reported, a tensor it did not send counted as its current value, plus
        the Gaussian noise (std z C / |S|), drawn tensor by tensor in the order the tensors first came."""
        running, count = self.running, self.count
        for name, total in running.sums.items():
            if running.weights[name] < count:
                total.add_(self.current[name], alpha=count - running.weights[name])
                running.weights[name] = float(count)
        mean = running.mean()
        if noise_multiplier > 0:
            std = noise_multiplier * self.clip / count
            mean = {n: v + torch.normal(0.0, std, v.shape, generator=generator) for n, v in mean.items()}
        return mean


def private_mean(current: NamedTensors, updates: list[ClientUpdate], clip: float, noise_multiplier: float,
                 generator: torch.Generator) -> NamedTensors:
    """:class:`ClippedMean` of ``updates`` at once."""
    clipped = ClippedMean(current, clip)
    for update in updates:
        clipped.add(update.params)
    return clipped.noised_mean(noise_multiplier, generator)


class Private(Strategy):
    """What both kinds share: the inner strategy does the server's work, and the ledger counts released rounds."""

    def __init__(self, inner: Strategy, spec: PrivacySpec) -> None:
        require_opacus("accountants")  # a missing dp extra stops the run before its first round, in one line
        self.inner = inner
        self.name = inner.name
        self.spec = spec
        self.rounds = 0  # rounds released (aggregated and accounted)
        # DP-SGD steps each client has taken, all rounds together (sample level; client level keeps it empty, so
        # both kinds write the one checkpoint format)
        self.steps: dict[int, int] = {}

    def configure(self, settings: LocalSettings) -> LocalSettings:
        return self.inner.configure(settings)

    def aggregation(self, current: NamedTensors) -> Aggregation:
        return self.inner.aggregation(current)

    def ledger(self) -> dict[str, Any]:
        spec = self.spec
        return {"dp_kind": spec.kind, "dp_delta": spec.delta, "dp_noise_multiplier": spec.noise_multiplier}

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "rounds": self.rounds, "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.rounds = int(state.get("rounds", 0))
        self.steps = {int(k): int(v) for k, v in state.get("steps", {}).items()}


class ClientLevelDP(Private):
    """Client-level DP-FedAvg: each round's updates clipped, averaged uniformly and noised (:func:`private_mean`)
    before the inner strategy aggregates the one privatized update.

    Parameters
    ----------
    inner : Strategy
        The server algorithm (FedAvg, FedProx, FedOpt); it aggregates the privatized update.
    spec : PrivacySpec
        The ``privacy`` section (kind ``client``).
    num_clients, clients_per_round : int
        The sampling rate q = clients_per_round / num_clients per round, which the accountant composes over.
    seed : int
        Seeds the server's noise, one stream per round.
    """

    def __init__(self, inner: Strategy, spec: PrivacySpec, *, num_clients: int, clients_per_round: int,
                 seed: int = 0) -> None:
        super().__init__(inner, spec)
        self.client_rate = clients_per_round / num_clients
        self.seed = seed

    def aggregation(self, current: NamedTensors) -> Privatized:
        return Privatized(self, current)

    def account(self, round_idx: int, reported: list[ClientUpdate]) -> dict[str, Any]:
        """The round's privacy record (joins metrics.jsonl): epsilon at delta so far, and the sampling rate."""
        self.rounds = round_idx
        spec = self.spec
        return {**self.ledger(), "dp_sample_rate": self.client_rate,
                "dp_epsilon": epsilon(spec.noise_multiplier, self.client_rate, round_idx, spec.delta, spec.accountant)}


class Privatized:
    """Client-level DP's aggregate as reports arrive: each update clipped into a running sum; at the end the
    noised mean (this round's noise stream) is the one update the inner strategy aggregates."""

    def __init__(self, dp: ClientLevelDP, current: NamedTensors) -> None:
        self.dp = dp
        self.current = current
        self.clipped = ClippedMean(current, dp.spec.clip)

    def add(self, update: ClientUpdate) -> None:
        self.clipped.add(update.params)

    def merge(self, collective: Collective) -> None:
        self.clipped.merge(collective)

    def result(self) -> NamedTensors:
        generator = torch.Generator().manual_seed(noise_seed(self.dp.seed, self.dp.rounds + 1))
        noised = self.clipped.noised_mean(self.dp.spec.noise_multiplier, generator)
        return self.dp.inner.aggregate(self.current, [ClientUpdate(client_id=-1, num_examples=1, params=noised)])


class SampleLevelDP(Private):
    """Sample-level DP: the clients train by DP-SGD (each example's gradient clipped, noise on each step), and the
    server keeps every client's ledger; the run reports its worst-off client's epsilon.

    Parameters
    ----------
    inner : Strategy
        The server algorithm (FedAvg or FedOpt: DP-SGD adds no proximal term).
    spec : PrivacySpec
        The ``privacy`` section (kind ``sample``).
    client_examples : dict[int, int]
        Each client's training examples: its DP-SGD sampling rate is batch_size / examples.
    batch_size : int
        The clients' batch size.
    """

    def __init__(self, inner: Strategy, spec: PrivacySpec, *, client_examples: dict[int, int],
                 batch_size: int) -> None:
        super().__init__(inner, spec)
        self.client_examples = client_examples
        self.batch_size = batch_size

    def configure(self, settings: LocalSettings) -> LocalSettings:
        """The inner strategy's settings, trained by DP-SGD at the section's noise and clip."""
        return dataclasses.replace(self.inner.configure(settings), dp_noise_multiplier=self.spec.noise_multiplier,
                                   dp_max_grad_norm=self.spec.max_grad_norm)

    def account(self, round_idx: int, reported: list[ClientUpdate]) -> dict[str, Any]:
        """The round's privacy record: the worst-off client's epsilon at delta so far, its rate and steps."""
        self.rounds = round_idx
        spec = self.spec
        for u in reported:
            self.steps[u.client_id] = self.steps.get(u.client_id, 0) + int(u.metrics.get("steps", 0))
        worst, client = 0.0, None
        for cid, steps in self.steps.items():
            eps = epsilon(spec.noise_multiplier, self._sample_rate(cid), steps, spec.delta, spec.accountant)
            if client is None or eps > worst:
                worst, client = eps, cid
        return {**self.ledger(), "dp_epsilon": worst, "dp_epsilon_client": client,
                "dp_sample_rate": self._sample_rate(client) if client is not None else None,
                "dp_steps": self.steps.get(client, 0) if client is not None else 0}

    def _sample_rate(self, client_id: int) -> float:
        return min(1.0, self.batch_size / max(1, self.client_examples.get(client_id, 1)))



def with_privacy(strategy: Strategy, spec: PrivacySpec, *, num_clients: int, clients_per_round: int,
                 client_examples: dict[int, int], batch_size: int, seed: int) -> Strategy:
    """``strategy`` itself without DP, else wrapped in the privacy section's kind."""
    if spec.kind == "client":
        return ClientLevelDP(strategy, spec, num_clients=num_clients, clients_per_round=clients_per_round, seed=seed)
    if spec.kind == "sample":
        return SampleLevelDP(strategy, spec, client_examples=client_examples, batch_size=batch_size)
    return strategy
