"""What a partition is and what every partitioner shares.

A partition is an int32 array with one client id per example (-1 = left out).  Every partitioner is a
pure function of (data, params, num_clients, seed): the arithmetic works on per-label or per-client
count matrices and whole-array permutations, so a million examples over ten thousand clients takes
well under a second and memory stays O(examples + clients × labels).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from fedlm.errors import UserError


@dataclass(frozen=True, eq=False)
class Partition:
    """Which client holds each example; -1 marks an example given to no client."""

    assignment: np.ndarray
    num_clients: int

    def __post_init__(self) -> None:
        assignment = np.ascontiguousarray(self.assignment, dtype=np.int32)
        if assignment.ndim != 1:
            raise ValueError(f"assignment must be 1-D, got shape {assignment.shape}")
        if assignment.size and (assignment.min() < -1 or assignment.max() >= self.num_clients):
            raise ValueError(f"assignment holds client ids outside [-1, {self.num_clients})")
        object.__setattr__(self, "assignment", assignment)

    @cached_property
    def _grouped(self) -> tuple[np.ndarray, np.ndarray]:
        """Example indices grouped by client (ascending inside a group) and the group offsets; computed
        once so that walking all clients is O(examples), not O(examples × clients)."""
        order = np.argsort(self.assignment, kind="stable")
        counts = np.bincount(self.assignment.astype(np.int64) + 1, minlength=self.num_clients + 1)
        return order, np.concatenate(([0], np.cumsum(counts)))

    def client_indices(self, client_id: int) -> np.ndarray:
        """Sorted indices of the examples held by ``client_id``."""
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"client_id {client_id} outside [0, {self.num_clients})")
        order, offsets = self._grouped
        return order[offsets[client_id + 1] : offsets[client_id + 2]]

    def sizes(self) -> np.ndarray:
        """Number of examples per client."""
        return np.bincount(self.assignment.astype(np.int64) + 1, minlength=self.num_clients + 1)[1:]

    @property
    def left_out(self) -> int:
        """Number of examples held by no client."""
        return int(np.count_nonzero(self.assignment == -1))


@dataclass
class PartitionInput:
    """What a partitioner may look at; only ``n`` is always needed."""

    n: int
    labels: np.ndarray | None = None
    texts: Sequence[str] | None = None
    columns: Mapping[str, Sequence] | None = None
    fingerprint: str = ""
    # another name -> a column's name: the data's own name for a role's column ('hospital' for group), so a
    # natural partition may name the column either way
    aliases: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.labels is not None:
            self.labels = np.asarray(self.labels)
        named = {"labels": self.labels, "texts": self.texts}
        named.update((f"column {name!r}", values) for name, values in self.column_items())
        for what, values in named.items():
            if values is not None and len(values) != self.n:
                raise UserError(f"partition input: {what} has {len(values)} entries but n={self.n}")

    def column_items(self) -> list[tuple[str, Sequence]]:
        """The extra columns as (name, values) pairs (none when ``columns`` is None)."""
        return list((self.columns or {}).items())

    def column(self, name: str) -> Sequence | None:
        """The extra column called ``name`` (directly or through an alias), or None."""
        columns = self.columns or {}
        return columns.get(name, columns.get((self.aliases or {}).get(name, name)))

    def shown_name(self, column: str) -> str:
        """The name to show for an extra column: the data's own, where it has one ('hospital', not 'group')."""
        return next((alias for alias, name in (self.aliases or {}).items() if name == column), column)

    def cache_fingerprint(self) -> str:
        """The dataset fingerprint, or a hash of the content when the caller gave none: an empty
        fingerprint would make different datasets share cache entries."""
        if self.fingerprint:
            return self.fingerprint
        digest = hashlib.sha256(str(self.n).encode())
        if self.labels is not None:
            digest.update(np.ascontiguousarray(self.labels).tobytes())
        for text in self.texts or ():
            digest.update(text.encode("utf-8", "surrogatepass") + b"\0")
        for name, values in self.column_items():
            digest.update(name.encode() + b"\1" + "\0".join(map(str, values)).encode())
        return "content-" + digest.hexdigest()


@dataclass(frozen=True, kw_only=True)
class Partitioner(ABC):
    """A pure function of (data, params, num_clients, seed) -> Partition. Client-level random
    quantities (e.g. each client's label proportions q_j, client sizes) are drawn FIRST from
    np.random.default_rng(seed), so applying the same partitioner with the same seed to the train
    split and to the test split gives each client the same label proportions in both.

    The fields are the parameters of the kind's section in ``fedlm.config``, which validated them;
    only what needs the data (labels, columns, num_clients) is checked here.  ``holdout`` is the
    per-client local-test fraction callers apply with :func:`holdout_split`; it does not change the
    partition itself and so is not part of the cache key."""

    name: ClassVar[str]
    holdout: float = 0.0

    def partition(self, data: PartitionInput, num_clients: int, seed: int) -> Partition:
        """The partition of ``data`` among ``num_clients`` clients for ``seed``."""
        check_num_clients(num_clients, data.n)
        assignment = self.assign(data, num_clients, np.random.default_rng(seed))
        return Partition(assignment, num_clients)

    @abstractmethod
    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        """Client id per example (-1 = left out)."""

    def for_test(self, train: PartitionInput) -> Partitioner:
        """The partitioner of the test split, whose clients must be the training split's: this one, as the
        same seed draws the same client-level quantities (see the class docstring); a kind whose clients
        depend on the data itself (natural) fixes them from ``train``."""
        return self

    def cache_key(self) -> str:
        """The kind and its parameters as text: what, besides data, clients and seed, fixes the result."""
        params = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "holdout"}
        return f"{self.name}:{json.dumps(params, sort_keys=True, default=str)}"


def int_labels(data: PartitionInput, kind: str) -> np.ndarray:
    """Class ids 0..L-1 of every example, or a UserError saying why the labels do not qualify."""
    if data.labels is None:
        raise UserError(f"partition kind {kind!r} needs labels, but the data has none")
    labels = np.asarray(data.labels)
    if labels.dtype.kind == "f" and np.all(np.isfinite(labels)) and np.all(labels == np.round(labels)):
        labels = labels.astype(np.int64)
    if labels.dtype.kind not in "iub":
        raise UserError(f"partition kind {kind!r} needs integer class labels, got {labels.dtype} values")
    if labels.size and labels.min() < 0:
        raise UserError(f"partition kind {kind!r}: labels must be >= 0, found {labels.min()}")
    return labels.astype(np.int64)


def float_scores(data: PartitionInput, kind: str) -> np.ndarray:
    """Regression targets as floats; NaN would make the sort order meaningless."""
    if data.labels is None:
        raise UserError(f"partition kind {kind!r} needs score labels, but the data has none")
    scores = np.asarray(data.labels, dtype=np.float64)
    if not np.all(np.isfinite(scores)):
        raise UserError(f"partition kind {kind!r}: scores must be finite numbers, found NaN or inf")
    return scores


def require_texts(data: PartitionInput, kind: str) -> Sequence[str]:
    """The example texts, or a UserError naming the kind that needs them."""
    if data.texts is None:
        raise UserError(f"partition kind {kind!r} needs the example texts, but the data has none")
    return data.texts


def check_num_clients(num_clients: int, n: int) -> None:
    """Every client needs at least one example, so there can be no more clients than examples."""
    if not isinstance(num_clients, int | np.integer) or num_clients < 1:
        raise UserError(f"num_clients={num_clients!r} must be a positive integer")
    if num_clients > n:
        raise UserError(f"num_clients={num_clients} exceeds the {n} examples; every client needs one")
