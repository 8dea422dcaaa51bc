"""FedNLP's Dirichlet skews: client sizes (quantity) and client label proportions (label, with dynamic
reassigning), alone or combined."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy.special import gammaincinv, gammaln

from fedlm.data.partition.base import Partitioner, PartitionInput, int_labels
from fedlm.data.partition.dealing import (
    assign_class_counts,
    at_least_one,
    deal,
    even_sizes,
    grouped_by_class,
    largest_remainder_rows,
)

_TINY = np.finfo(np.float64).tiny


def dirichlet_rows(uniforms: np.ndarray, concentration: np.ndarray) -> np.ndarray:
    """Rows of Dir(concentration) from uniforms by inverse-CDF gammas.

    Unlike ``rng.dirichlet`` the result moves continuously with ``concentration``, so train and test
    splits (whose label priors differ slightly) give each client nearly the same proportions.  Where
    the gamma quantile underflows (tiny concentrations), its small-x form x ≈ (u·Γ(a+1))^(1/a) is used
    in log space."""
    present = concentration > 0
    shape = np.where(present, concentration, 1.0)
    uniforms = np.maximum(uniforms, _TINY)  # u = 0 would give log 0
    x = gammaincinv(shape, uniforms)
    log_small = (np.log(uniforms) + gammaln(shape + 1)) / shape
    log_x = np.where(x > _TINY, np.log(np.maximum(x, _TINY)), log_small)
    log_x = np.where(present, log_x, -np.inf)
    weights = np.exp(log_x - log_x.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def first_come_counts(wanted: np.ndarray, available: np.ndarray) -> np.ndarray:
    """How much of each class each client gets when clients take their wanted counts in turn until a
    class is used up (the sequential sampling of FedNLP, vectorised with a cumulative sum)."""
    cumulative = np.cumsum(wanted, axis=0)
    return np.minimum(cumulative, available) - np.minimum(cumulative - wanted, available)


def label_dirichlet(
    classes: np.ndarray, num_classes: int, sizes: np.ndarray, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    """FedNLP §4.1 label skew with dynamic reassigning.

    Client j wants size_j·q_j examples (rounded, which keeps multinomial noise out of q_j) with
    q_j ~ Dir(alpha·p), p the class frequencies.  Clients take their wants in turn; a want whose class
    is used up becomes a vacancy, and vacancies are filled from all remaining examples at random, i.e.
    from the other classes in proportion to what remains of them, so every client gets exactly its
    size and no example is dropped.  The client-level draw (q) comes first from ``rng``."""
    available = np.bincount(classes, minlength=num_classes)
    proportions = dirichlet_rows(rng.random((sizes.size, num_classes)), alpha * available / available.sum())
    wanted = largest_remainder_rows(sizes, proportions)
    taken = first_come_counts(wanted, available)
    order, offsets = grouped_by_class(classes, num_classes, rng)
    assignment, rest = assign_class_counts(taken, order, offsets)
    vacancies = sizes - taken.sum(axis=1)
    assignment[rng.permutation(rest)] = np.repeat(np.arange(sizes.size, dtype=np.int32), vacancies)
    return assignment


def client_sizes(n: int, num_clients: int, beta: float | None, rng: np.random.Generator) -> np.ndarray:
    """Equal sizes, or Dir_N(beta) sizes drawn before anything else so they match across splits."""
    if beta is None:
        return even_sizes(n, num_clients)
    return at_least_one(n, rng.dirichlet(np.full(num_clients, beta)))


@dataclass(frozen=True, kw_only=True)
class QuantityDirichletPartitioner(Partitioner):
    """FedNLP §4.2: client sizes z_i·|D| with z ~ Dir_N(beta), examples at random; small beta gives
    very unequal sizes.  Every client keeps at least one example."""

    name: ClassVar[str] = "quantity_dirichlet"
    beta: float

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        sizes = at_least_one(data.n, rng.dirichlet(np.full(num_clients, self.beta)))
        return deal(rng.permutation(data.n), sizes)


@dataclass(frozen=True, kw_only=True)
class LabelDirichletPartitioner(Partitioner):
    """FedNLP §4.1 label skew (see :func:`label_dirichlet`); with ``beta`` the client sizes are also
    drawn from Dir_N(beta) (label and quantity skew combined), otherwise they are equal."""

    name: ClassVar[str] = "label_dirichlet"
    alpha: float
    beta: float | None

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        labels = int_labels(data, self.name)
        sizes = client_sizes(data.n, num_clients, self.beta, rng)
        return label_dirichlet(labels, int(labels.max()) + 1, sizes, self.alpha, rng)
