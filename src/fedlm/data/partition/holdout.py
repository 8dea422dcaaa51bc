"""Local test sets carved from each client's own share."""

from __future__ import annotations

import numpy as np

from fedlm.data.partition.base import Partition


def holdout_split(partition: Partition, fraction: float, seed: int) -> tuple[Partition, Partition]:
    """Split every client's examples into a train part and a local test part (FedSplitBERT's 80/20).

    Each client puts round(fraction × size) random examples, but never all of them, into the test
    part.  In the returned train partition the test examples are marked -1 and vice versa, so both
    keep the original client ids and example indices.  ``fraction`` is in [0, 1), as the partition
    config's ``holdout`` guarantees."""
    assignment = partition.assignment
    sizes = partition.sizes()
    test_sizes = np.minimum(np.floor(fraction * sizes + 0.5), np.maximum(sizes - 1, 0)).astype(np.int64)
    order = np.lexsort((np.random.default_rng(seed).random(assignment.size), assignment))
    kept = order[assignment[order] >= 0]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    clients = assignment[kept]
    position = np.arange(kept.size) - offsets[clients]
    in_test = np.zeros(assignment.size, dtype=bool)
    in_test[kept[position < test_sizes[clients]]] = True
    train = np.where(in_test, -1, assignment)
    test = np.where(in_test, assignment, -1)
    return Partition(train, partition.num_clients), Partition(test, partition.num_clients)
