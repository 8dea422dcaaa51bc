"""The uniform partition every skew is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedlm.data.partition.base import Partitioner, PartitionInput
from fedlm.data.partition.dealing import deal, even_sizes


@dataclass(frozen=True, kw_only=True)
class IidPartitioner(Partitioner):
    """Uniform: a random permutation cut into equal parts (sizes differ by at most one)."""

    name: ClassVar[str] = "iid"

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        return deal(rng.permutation(data.n), even_sizes(data.n, num_clients))
