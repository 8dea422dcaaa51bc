"""Partition kind -> partitioner, built from the kind's typed config section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedlm.config import PartitionConfig, parse_partition
from fedlm.data.partition.base import Partitioner
from fedlm.data.partition.clustered import ClusteredPartitioner
from fedlm.data.partition.dirichlet import LabelDirichletPartitioner, QuantityDirichletPartitioner
from fedlm.data.partition.explicit import LabelMixPartitioner, ScoreRangePartitioner
from fedlm.data.partition.fdapt import FdaptLengthPartitioner, FdaptQuantityPartitioner, FdaptVocabPartitioner
from fedlm.data.partition.iid import IidPartitioner
from fedlm.data.partition.natural import NaturalPartitioner

PARTITIONERS: dict[str, type[Partitioner]] = {
    cls.name: cls
    for cls in (
        IidPartitioner,
        QuantityDirichletPartitioner,
        LabelDirichletPartitioner,
        LabelMixPartitioner,
        ScoreRangePartitioner,
        NaturalPartitioner,
        ClusteredPartitioner,
        FdaptQuantityPartitioner,
        FdaptLengthPartitioner,
        FdaptVocabPartitioner,
    )
}


def build_partitioner(config: PartitionConfig | Mapping[str, Any]) -> Partitioner:
    """The partitioner a partition section asks for.  A plain mapping (e.g. {"kind": "label_dirichlet",
    "alpha": 1.0}) is validated as the config file's section is, so a bad one raises the same one-line
    UserError; checks that need the data (labels, columns, num_clients) happen in ``partition``."""
    section = parse_partition(config) if isinstance(config, Mapping) else config
    fields = type(section).model_fields
    params = {name: getattr(section, name) for name in fields if name not in ("kind", "num_clients")}
    return PARTITIONERS[section.kind](**params)
