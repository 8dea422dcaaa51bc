"""Split one dataset among federated clients: IID, the FedNLP non-IID strategies (label Dirichlet with
dynamic reassigning, quantity Dirichlet, clustered input features, natural factors), FedSplitBERT's
explicit label mixes and score ranges, and FDAPT's quantity / sentence-length / vocabulary skews.

flwr-datasets is not used: its IidPartitioner shards a pre-shuffled Hugging Face Dataset one
partition at a time and hands back Dataset objects rather than an assignment, and its
NaturalIdPartitioner loops over examples in Python and cannot group values.  A permutation cut or an
``np.unique`` inverse does the same jobs in milliseconds.
"""

from fedlm.data.partition.base import Partition, Partitioner, PartitionInput
from fedlm.data.partition.cache import partition_cached
from fedlm.data.partition.clustered import ClusteredPartitioner, cluster_ids
from fedlm.data.partition.dirichlet import (
    LabelDirichletPartitioner,
    QuantityDirichletPartitioner,
    first_come_counts,
    label_dirichlet,
)
from fedlm.data.partition.explicit import LabelMixPartitioner, ScoreRangePartitioner
from fedlm.data.partition.fdapt import FdaptLengthPartitioner, FdaptQuantityPartitioner, FdaptVocabPartitioner
from fedlm.data.partition.holdout import holdout_split
from fedlm.data.partition.iid import IidPartitioner
from fedlm.data.partition.natural import NaturalPartitioner
from fedlm.data.partition.registry import PARTITIONERS, build_partitioner

__all__ = [
    "PARTITIONERS",
    "ClusteredPartitioner",
    "FdaptLengthPartitioner",
    "FdaptQuantityPartitioner",
    "FdaptVocabPartitioner",
    "IidPartitioner",
    "LabelDirichletPartitioner",
    "LabelMixPartitioner",
    "NaturalPartitioner",
    "Partition",
    "PartitionInput",
    "Partitioner",
    "QuantityDirichletPartitioner",
    "ScoreRangePartitioner",
    "build_partitioner",
    "cluster_ids",
    "first_come_counts",
    "holdout_split",
    "label_dirichlet",
    "partition_cached",
]
