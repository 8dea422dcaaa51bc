"""FedSplitBERT's splits that the config spells out: fixed label mixes per client, and score ranges."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedlm.data.partition.base import Partitioner, PartitionInput, float_scores, int_labels
from fedlm.data.partition.dealing import assign_class_counts, deal, even_sizes, grouped_by_class, largest_remainder
from fedlm.errors import UserError


@dataclass(frozen=True, kw_only=True)
class LabelMixPartitioner(Partitioner):
    """FedSplitBERT Tables I/II: client j holds classes in the fixed proportions ``mixes[j]``.

    All clients get the same size, the largest for which every class can meet the demand, so the
    mixes hold exactly (up to rounding); examples the mixes cannot use are left out and counted."""

    name: ClassVar[str] = "label_mix"
    mixes: Sequence[Sequence[float]]

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        labels = int_labels(data, self.name)
        mixes = self.checked_mixes(labels, num_clients)
        counts = mix_counts(mixes, np.bincount(labels, minlength=mixes.shape[1]), data.n // num_clients)
        order, offsets = grouped_by_class(labels, mixes.shape[1], rng)
        return assign_class_counts(counts, order, offsets)[0]

    def checked_mixes(self, labels: np.ndarray, num_clients: int) -> np.ndarray:
        """The mixes as a matrix, once they fit the data: one row per client, one share per label."""
        mixes = np.asarray(self.mixes, dtype=np.float64)
        if mixes.shape[0] != num_clients:
            rows = mixes.shape[0]
            raise UserError(f"mixes has {rows} rows but num_clients={num_clients}; give one row per client")
        if labels.size and labels.max() >= mixes.shape[1]:
            raise UserError(
                f"mixes has {mixes.shape[1]} entries per client but labels go up to {labels.max()}; "
                "give one entry per label"
            )
        return mixes


def mix_counts(mixes: np.ndarray, available: np.ndarray, size: int) -> np.ndarray:
    """Clients × classes counts following ``mixes``, with the common client size shrunk until every
    class has enough examples."""
    demand = mixes.sum(axis=0)
    room = np.where(demand > 0, available / np.where(demand > 0, demand, 1.0), np.inf)
    size = min(size, int(room.min()))
    while size > 0:
        counts = np.stack([largest_remainder(size, row) for row in mixes])
        if np.all(counts.sum(axis=0) <= available):
            return counts
        size -= 1
    short = int(np.argmin(room))
    raise UserError(f"mixes cannot be met: they need label {short}, which has {available[short]} examples")


@dataclass(frozen=True, kw_only=True)
class ScoreRangePartitioner(Partitioner):
    """FedSplitBERT's STS-B split: sort by score and cut into K contiguous equal parts, so client 0
    holds the lowest scores.  Deterministic: ties keep dataset order and the seed is unused."""

    name: ClassVar[str] = "score_ranges"

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        scores = float_scores(data, self.name)
        return deal(np.argsort(scores, kind="stable"), even_sizes(data.n, num_clients))
