"""Integer client sizes and the dealing of examples to clients, shared by the partitioners."""

from __future__ import annotations

import numpy as np


def largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers proportional to ``weights`` that sum exactly to ``total`` (Hamilton's method)."""
    raw = total * weights / weights.sum()
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(counts - raw, kind="stable")[:short]] += 1
    return counts


def largest_remainder_rows(totals: np.ndarray, proportions: np.ndarray) -> np.ndarray:
    """Row-wise :func:`largest_remainder`: integer rows close to totals[:, None] * proportions that
    sum exactly to ``totals``."""
    raw = totals[:, None] * proportions
    counts = np.floor(raw).astype(np.int64)
    short = totals - counts.sum(axis=1)
    rank = np.argsort(np.argsort(counts - raw, axis=1, kind="stable"), axis=1, kind="stable")
    return counts + (rank < short[:, None])


def even_sizes(n: int, num_clients: int) -> np.ndarray:
    """n // k examples each, the first n % k clients one more."""
    sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
    sizes[: n % num_clients] += 1
    return sizes


def at_least_one(n: int, weights: np.ndarray) -> np.ndarray:
    """Sizes proportional to ``weights`` but never zero: a client without data cannot train."""
    return 1 + largest_remainder(n - weights.size, weights)


def deal(order: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Give the first sizes[0] examples of ``order`` to client 0, the next sizes[1] to client 1, ..."""
    assignment = np.full(order.size, -1, dtype=np.int32)
    ids = np.repeat(np.arange(sizes.size, dtype=np.int32), sizes)
    assignment[order[: ids.size]] = ids
    return assignment


def grouped_by_class(
    classes: np.ndarray, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Example indices grouped by class, in random order inside each class, and the class offsets."""
    shuffled = rng.permutation(classes.size)
    order = shuffled[np.argsort(classes[shuffled], kind="stable")]
    counts = np.bincount(classes, minlength=num_classes)
    return order, np.concatenate(([0], np.cumsum(counts)))


def assign_class_counts(
    counts: np.ndarray, order: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Hand each client counts[c, l] random examples of class l; return the assignment and the
    examples nobody took."""
    assignment = np.full(order.size, -1, dtype=np.int32)
    clients = np.arange(counts.shape[0], dtype=np.int32)
    rest = []
    for label in range(counts.shape[1]):
        block = order[offsets[label] : offsets[label + 1]]
        ids = np.repeat(clients, counts[:, label])
        assignment[block[: ids.size]] = ids
        rest.append(block[ids.size :])
    return assignment, np.concatenate(rest) if rest else np.empty(0, dtype=np.int64)
