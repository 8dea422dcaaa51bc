"""FedNLP's natural-factor split: clients defined by the values of a data column."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from fedlm.data.partition.base import Partitioner, PartitionInput
from fedlm.errors import UserError


@dataclass(frozen=True, kw_only=True)
class NaturalPartitioner(Partitioner):
    """FedNLP §4.4: one client per value of ``column`` (clients ordered by sorted value), or one per
    group of values in ``groups`` order; values in no group are left out.  Values are compared as
    strings so that a YAML ``1`` matches a column value ``"1"``.  num_clients must equal the number of
    values or groups.  ``column`` is a column of the data (a user's file: what data.columns.group maps, by its
    own name or as ``group``)."""

    name: ClassVar[str] = "natural"
    column: str
    groups: Sequence[Sequence[Any]] | None

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        values = np.asarray(self.column_values(data)).astype(str)
        unique, inverse = np.unique(values, return_inverse=True)
        client_of_value = self.client_of_value(unique)
        clients = unique.size if self.groups is None else len(self.groups)
        if clients != num_clients:
            what = "groups" if self.groups is not None else f"distinct values in column {self.column!r}"
            raise UserError(f"num_clients={num_clients} but there are {clients} {what}; use that many")
        return client_of_value[inverse].astype(np.int32)

    def column_values(self, data: PartitionInput) -> Sequence:
        """The values of ``column``, or a UserError listing the columns the data has."""
        values = data.column(self.column)
        if values is None:
            names = sorted({*(name for name, _ in data.column_items()), *(data.aliases or {})})
            raise UserError(f"partition.column {self.column!r} is not a column of the data (its partition columns: "
                            f"{', '.join(names) or 'none'}); name one of those, or a column of your own file")
        return values

    def for_test(self, train: PartitionInput) -> NaturalPartitioner:
        """Clients by the training split's values: client j holds the same value (or group) in both splits, a
        value the training split lacks is left out of the test split, and a client may have no test examples."""
        if self.groups is not None:
            return self
        values = np.unique(np.asarray(self.column_values(train)).astype(str))
        return replace(self, groups=[[str(v)] for v in values])

    def client_of_value(self, unique: np.ndarray) -> np.ndarray:
        """Client id for each distinct value (looped over values, not examples)."""
        if self.groups is None:
            return np.arange(unique.size, dtype=np.int32)
        group_of = {str(value): g for g, group in enumerate(self.groups) for value in group}
        return np.array([group_of.get(value, -1) for value in unique], dtype=np.int32)
