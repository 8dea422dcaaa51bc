"""FedNLP's input-feature shift: clients skewed over k-means clusters of sentence embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from sklearn.cluster import KMeans

from fedlm.data.embeddings import embed_texts
from fedlm.data.partition.base import Partitioner, PartitionInput, require_texts
from fedlm.data.partition.dirichlet import client_sizes, label_dirichlet
from fedlm.errors import UserError


@dataclass(frozen=True, kw_only=True)
class ClusteredPartitioner(Partitioner):
    """FedNLP §4.3 input-feature shift: MiniLM sentence embeddings, k-means into ``clusters`` groups
    (fixed k-means seed, so clusters depend on the data only), then the label-Dirichlet split over the
    cluster ids.  Cluster ids of separately clustered train and test splits do not correspond: to
    give clients matching local test sets, cluster the splits together and divide afterwards."""

    name: ClassVar[str] = "clustered"
    clusters: int
    alpha: float
    beta: float | None

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        texts = require_texts(data, self.name)
        if self.clusters > data.n:
            raise UserError(f"clusters={self.clusters} exceeds the {data.n} examples")
        sizes = client_sizes(data.n, num_clients, self.beta, rng)
        return label_dirichlet(cluster_ids(texts, self.clusters), self.clusters, sizes, self.alpha, rng)


def cluster_ids(texts: Sequence[str], clusters: int) -> np.ndarray:
    """k-means cluster of each text's sentence embedding."""
    # Ten k-means++ starts: a single start often splits one topic and merges two others.
    kmeans = KMeans(n_clusters=clusters, n_init=10, random_state=0)
    return kmeans.fit_predict(embed_texts(texts)).astype(np.int64)
