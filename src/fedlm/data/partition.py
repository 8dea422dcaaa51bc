"""Split one dataset among federated clients: IID, the FedNLP non-IID strategies (label Dirichlet with
dynamic reassigning, quantity Dirichlet, clustered input features, natural factors), FedSplitBERT's
explicit label mixes and score ranges, and FDAPT's quantity / sentence-length / vocabulary skews.

A partition is an int32 array with one client id per example (-1 = left out).  Every partitioner is a
pure function of (data, params, num_clients, seed): the arithmetic works on per-label or per-client
count matrices and whole-array permutations, so a million examples over ten thousand clients takes
well under a second and memory stays O(examples + clients × labels).

flwr-datasets is not used: its IidPartitioner shards a pre-shuffled Hugging Face Dataset one
partition at a time (about 4 s to shuffle and flatten 1M rows plus 0.27 ms per shard, ~7 s for
10,000 clients on the reference machine) and hands back Dataset objects rather than an assignment, and
its NaturalIdPartitioner loops over examples in Python and cannot group values.  A permutation cut or
an ``np.unique`` inverse does the same jobs in milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from scipy import sparse
from scipy.special import gammaincinv, gammaln

from fedlm.data import cache
from fedlm.data.partition_stats import client_means, client_vocab_sizes, word_matrix, words_per_text
from fedlm.errors import UserError

_TINY = np.finfo(np.float64).tiny


# ----------------------------------------------------------------------------------------------- data


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


# ------------------------------------------------------------------------------------------ arithmetic


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


# ---------------------------------------------------------------------------------- input validation


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
    if data.texts is None:
        raise UserError(f"partition kind {kind!r} needs the example texts, but the data has none")
    return data.texts


def check_num_clients(num_clients: int, n: int) -> None:
    if not isinstance(num_clients, int | np.integer) or num_clients < 1:
        raise UserError(f"num_clients={num_clients!r} must be a positive integer")
    if num_clients > n:
        raise UserError(f"num_clients={num_clients} exceeds the {n} examples; every client needs one")


# ----------------------------------------------------------------------------------------- partitioners


@dataclass(frozen=True, kw_only=True)
class Partitioner(ABC):
    """A pure function of (data, params, num_clients, seed) -> Partition. Client-level random
    quantities (e.g. each client's label proportions q_j, client sizes) are drawn FIRST from
    np.random.default_rng(seed), so applying the same partitioner with the same seed to the train
    split and to the test split gives each client the same label proportions in both.

    ``holdout`` is the per-client local-test fraction callers apply with :func:`holdout_split`; it
    does not change the partition itself and so is not part of the cache key."""

    name: ClassVar[str]
    holdout: float = 0.0

    def partition(self, data: PartitionInput, num_clients: int, seed: int) -> Partition:
        check_num_clients(num_clients, data.n)
        assignment = self.assign(data, num_clients, np.random.default_rng(seed))
        return Partition(assignment, num_clients)

    @abstractmethod
    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        """Client id per example (-1 = left out)."""

    def cache_key(self) -> str:
        params = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "holdout"}
        return f"{self.name}:{json.dumps(params, sort_keys=True, default=str)}"


@dataclass(frozen=True, kw_only=True)
class IidPartitioner(Partitioner):
    """Uniform: a random permutation cut into equal parts (sizes differ by at most one)."""

    name: ClassVar[str] = "iid"

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        return deal(rng.permutation(data.n), even_sizes(data.n, num_clients))


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
    beta: float | None = None

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        labels = int_labels(data, self.name)
        sizes = client_sizes(data.n, num_clients, self.beta, rng)
        return label_dirichlet(labels, int(labels.max()) + 1, sizes, self.alpha, rng)


def client_sizes(n: int, num_clients: int, beta: float | None, rng: np.random.Generator) -> np.ndarray:
    """Equal sizes, or Dir_N(beta) sizes drawn before anything else so they match across splits."""
    if beta is None:
        return even_sizes(n, num_clients)
    return at_least_one(n, rng.dirichlet(np.full(num_clients, beta)))


@dataclass(frozen=True, kw_only=True)
class LabelMixPartitioner(Partitioner):
    """FedSplitBERT Tables I/II: client j holds classes in the fixed proportions ``mixes[j]``.

    All clients get the same size, the largest for which every class can meet the demand, so the
    mixes hold exactly (up to rounding); examples the mixes cannot use are left out and counted."""

    name: ClassVar[str] = "label_mix"
    mixes: tuple[tuple[float, ...], ...]

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        labels = int_labels(data, self.name)
        mixes = self.checked_mixes(labels, num_clients)
        counts = mix_counts(mixes, np.bincount(labels, minlength=mixes.shape[1]), data.n // num_clients)
        order, offsets = grouped_by_class(labels, mixes.shape[1], rng)
        return assign_class_counts(counts, order, offsets)[0]

    def checked_mixes(self, labels: np.ndarray, num_clients: int) -> np.ndarray:
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


@dataclass(frozen=True, kw_only=True)
class NaturalPartitioner(Partitioner):
    """FedNLP §4.4: one client per value of ``column`` (clients ordered by sorted value), or one per
    group of values in ``groups`` order; values in no group are left out.  Values are compared as
    strings so that a YAML ``1`` matches a column value ``"1"``.  num_clients must equal the number of
    values or groups."""

    name: ClassVar[str] = "natural"
    column: str
    groups: tuple[tuple[Any, ...], ...] | None = None

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
        columns = dict(data.column_items())
        if self.column not in columns:
            raise UserError(f"column={self.column!r} does not exist; available columns: {sorted(columns)}")
        return columns[self.column]

    def client_of_value(self, unique: np.ndarray) -> np.ndarray:
        """Client id for each distinct value (looped over values, not examples)."""
        if self.groups is None:
            return np.arange(unique.size, dtype=np.int32)
        group_of = {str(value): g for g, group in enumerate(self.groups) for value in group}
        return np.array([group_of.get(value, -1) for value in unique], dtype=np.int32)


@dataclass(frozen=True, kw_only=True)
class ClusteredPartitioner(Partitioner):
    """FedNLP §4.3 input-feature shift: MiniLM sentence embeddings, k-means into ``clusters`` groups
    (fixed k-means seed, so clusters depend on the data only), then the label-Dirichlet split over the
    cluster ids.  Cluster ids of separately clustered train and test splits do not correspond: to
    give clients matching local test sets, cluster the splits together and divide afterwards."""

    name: ClassVar[str] = "clustered"
    clusters: int
    alpha: float
    beta: float | None = None

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        texts = require_texts(data, self.name)
        if self.clusters > data.n:
            raise UserError(f"clusters={self.clusters} exceeds the {data.n} examples")
        sizes = client_sizes(data.n, num_clients, self.beta, rng)
        return label_dirichlet(cluster_ids(texts, self.clusters), self.clusters, sizes, self.alpha, rng)


def cluster_ids(texts: Sequence[str], clusters: int) -> np.ndarray:
    """k-means cluster of each text's sentence embedding."""
    from sklearn.cluster import KMeans

    from fedlm.data.embeddings import embed_texts

    # Ten k-means++ starts: a single start often splits one topic and merges two others.
    kmeans = KMeans(n_clusters=clusters, n_init=10, random_state=0)
    return kmeans.fit_predict(embed_texts(texts)).astype(np.int64)


# --------------------------------------------------------------------------------- FDAPT text skews


def vocabulary_scores(words: sparse.csr_matrix, num_clients: int) -> np.ndarray:
    """Each text's expected addition to its client's vocabulary.

    A client's vocabulary is not a sum over texts, but Σ_t Σ_{w∈t} 1/c_w (c_w = the client's texts
    containing w) is exactly its vocabulary size; with c_w ≈ max(1, df_w / K) this gives the additive
    per-text score Σ_{w∈t} min(1, K / df_w), which the skews can sort and balance."""
    present = (words > 0).astype(np.float64)
    df = np.asarray(present.sum(axis=0)).ravel()
    return np.asarray(present @ np.minimum(1.0, num_clients / np.maximum(df, 1.0))).ravel()


def quantile_strata(values: np.ndarray, strata: int) -> np.ndarray:
    """Stratum 0..strata-1 of each value by rank, so strata have equal sizes."""
    ranks = np.empty(values.size, dtype=np.int64)
    ranks[np.argsort(values, kind="stable")] = np.arange(values.size)
    return ranks * strata // max(values.size, 1)


def strata_count(n: int, num_clients: int) -> int:
    """As many strata as keep ~20 examples per client in each (fewer make balancing coarse)."""
    return int(np.clip(n // (20 * num_clients), 1, 50))


def stratified_deal(
    strata: np.ndarray, key: np.ndarray, sizes: np.ndarray, tiebreak: np.ndarray
) -> np.ndarray:
    """Rank examples by ``key`` inside their stratum, order everything by that within-stratum rank
    fraction, and deal contiguous blocks of ``sizes``.

    Each client thus gets its share of every stratum (whatever defines the strata stays balanced)
    while ``key`` rises from client 0 to the last client as steeply as the balance allows: sorting by
    the skewed statistic and dealing blocks, with the rebalancing built into the order."""
    order = np.lexsort((tiebreak, key, strata))
    counts = np.bincount(strata)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    rank = np.empty(strata.size, dtype=np.float64)
    rank[order] = np.arange(strata.size) - np.repeat(offsets[:-1], counts)
    fraction = (rank + 0.5) / counts[strata]
    return deal(np.lexsort((tiebreak, fraction)), sizes)


def balancing_tilt(imbalance: Callable[[float], float], steps: int = 8) -> float:
    """The tilt t in [-1, 1] where ``imbalance`` (falling as t rises) crosses zero, by bisection; the
    better end when it does not cross."""
    low, high = -1.0, 1.0
    if imbalance(low) <= 0:
        return low
    if imbalance(high) >= 0:
        return high
    for _ in range(steps):
        middle = (low + high) / 2
        if imbalance(middle) > 0:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass(frozen=True, kw_only=True)
class FdaptQuantityPartitioner(Partitioner):
    """FDAPT Appendix C quantity skew: client i (1-based) holds i / Σj of the texts.

    To keep sentence length and vocabulary level, every client gets its share of each length stratum,
    and inside a stratum the smaller clients get the texts richer in rare words, which offsets part of
    the vocabulary a smaller client lacks for having fewer texts."""

    name: ClassVar[str] = "fdapt_quantity"

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        words = word_matrix(require_texts(data, self.name))
        sizes = at_least_one(data.n, np.arange(1, num_clients + 1, dtype=np.float64))
        strata = quantile_strata(words_per_text(words), strata_count(data.n, num_clients))
        novelty = vocabulary_scores(words, num_clients)
        return stratified_deal(strata, -novelty, sizes, rng.random(data.n))


@dataclass(frozen=True, kw_only=True)
class FdaptLengthPartitioner(Partitioner):
    """FDAPT sentence-length skew: maximise the spread of mean words per text at equal client sizes
    and near-equal vocabularies.

    Texts are stratified by vocabulary score and sorted by length inside each stratum, so client 0
    gets short texts and the last client long ones with the same vocabulary mix (short, rare-worded
    texts balance long, common-worded ones).  The score is an estimate, so the strata are tilted by
    t·(mean score per word)·length, t found by bisection until the clients' vocabulary sizes no
    longer rise or fall with their mean length.  Deterministic: the seed only breaks ties."""

    name: ClassVar[str] = "fdapt_length"

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        words = word_matrix(require_texts(data, self.name))
        lengths = words_per_text(words).astype(np.float64)
        novelty = vocabulary_scores(words, num_clients)
        per_word = novelty.sum() / max(lengths.sum(), 1.0)
        sizes, tiebreak = even_sizes(data.n, num_clients), rng.random(data.n)
        strata_n = strata_count(data.n, num_clients)

        def tilted(tilt: float) -> np.ndarray:
            strata = quantile_strata(novelty + tilt * per_word * lengths, strata_n)
            return stratified_deal(strata, lengths, sizes, tiebreak)

        def imbalance(tilt: float) -> float:
            assignment = tilted(tilt)
            mean_words = client_means(assignment, num_clients, lengths)
            vocab = client_vocab_sizes(assignment, num_clients, words)
            return float(np.cov(mean_words, vocab)[0, 1]) if num_clients > 1 else 0.0

        return tilted(balancing_tilt(imbalance))


@dataclass(frozen=True, kw_only=True)
class FdaptVocabPartitioner(Partitioner):
    """FDAPT vocabulary skew: maximise the spread of vocabulary size at equal client sizes and
    near-equal mean length.  Texts are stratified by length and sorted by vocabulary score inside
    each stratum, so every client has the same length profile but client 0 gets the common-worded
    texts and the last client the rare-worded ones.  Deterministic: the seed only breaks ties."""

    name: ClassVar[str] = "fdapt_vocab"

    def assign(self, data: PartitionInput, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        words = word_matrix(require_texts(data, self.name))
        strata = quantile_strata(words_per_text(words), strata_count(data.n, num_clients))
        novelty = vocabulary_scores(words, num_clients)
        return stratified_deal(strata, novelty, even_sizes(data.n, num_clients), rng.random(data.n))


# ------------------------------------------------------------------------------------- construction

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


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise UserError(f"partition {key}={value!r} must be a number")
    return float(value)


def _positive(key: str, value: Any) -> float:
    number = _number(key, value)
    if number <= 0:
        raise UserError(f"partition {key}={value!r} must be > 0")
    return number


def _fraction(key: str, value: Any) -> float:
    number = _number(key, value)
    if not 0 <= number < 1:
        raise UserError(f"partition {key}={value!r} must be in [0, 1), e.g. 0.2 for an 80/20 local split")
    return number


def _cluster_count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise UserError(f"partition {key}={value!r} must be an integer >= 2")
    return value


def _column(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise UserError(f"partition {key}={value!r} must be a column name")
    return value


def _mixes(key: str, value: Any) -> tuple[tuple[float, ...], ...]:
    """Per-client label proportions: a non-empty list of equal-length lists, each >= 0 summing to 1."""
    rows_ok = isinstance(value, list | tuple) and value and all(isinstance(r, list | tuple) for r in value)
    if not rows_ok:
        raise UserError(f"partition {key} must be a list of per-client label proportions, got {value!r}")
    rows = tuple(tuple(_number(f"{key}[{i}]", x) for x in row) for i, row in enumerate(value))
    for i, row in enumerate(rows):
        if len(row) != len(rows[0]):
            raise UserError(f"partition {key}[{i}] has {len(row)} entries but {key}[0] has {len(rows[0])}")
        if min(row) < 0 or abs(sum(row) - 1) > 1e-6:
            raise UserError(f"partition {key}[{i}]={list(row)} must be non-negative and sum to 1")
    return rows


def _groups(key: str, value: Any) -> tuple[tuple[Any, ...], ...]:
    """Lists of column values, each value in at most one group."""
    if not isinstance(value, list | tuple) or not all(isinstance(g, list | tuple) and g for g in value):
        raise UserError(f"partition {key} must be a list of non-empty lists of column values, got {value!r}")
    seen: set[str] = set()
    for group in value:
        for item in map(str, group):
            if item in seen:
                raise UserError(f"partition {key}: value {item!r} is in more than one group")
            seen.add(item)
    return tuple(tuple(group) for group in value)


PARAMETERS: dict[str, Callable[[str, Any], Any]] = {
    "alpha": _positive,
    "beta": _positive,
    "holdout": _fraction,
    "clusters": _cluster_count,
    "column": _column,
    "mixes": _mixes,
    "groups": _groups,
}


def build_partitioner(spec: Mapping[str, Any]) -> Partitioner:
    """The partitioner a run config asks for, e.g. {"kind": "label_dirichlet", "alpha": 1.0}.

    Unknown kinds, unknown or missing keys and out-of-range values raise UserError naming the key;
    checks that need the data (label counts, columns, num_clients) happen in ``partition``."""
    kind = spec.get("kind")
    if kind not in PARTITIONERS:
        raise UserError(f"partition kind={kind!r} is unknown; choose one of {sorted(PARTITIONERS)}")
    cls = PARTITIONERS[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    params = {}
    for key, value in spec.items():
        if key == "kind":
            continue
        if key not in fields:
            raise UserError(f"partition key {key!r} does not apply to kind {kind!r}; use {sorted(fields)}")
        params[key] = PARAMETERS[key](key, value)
    for name, f in fields.items():
        if name not in params and f.default is dataclasses.MISSING:
            raise UserError(f"partition kind {kind!r} needs the key {name!r}")
    return cls(**params)


# ------------------------------------------------------------------------------- caching and holdout


def partition_cached(
    partitioner: Partitioner, data: PartitionInput, num_clients: int, seed: int, cache_dir: Path | None
) -> Partition:
    """``partitioner.partition`` memoised on disk under sha256(fingerprint, partitioner, clients, seed)."""
    if cache_dir is None:
        return partitioner.partition(data, num_clients, seed)
    key = cache.hash_key(data.cache_fingerprint(), partitioner.cache_key(), int(num_clients), int(seed))
    stored = cache.load_array(cache_dir, key)
    if stored is not None and stored.shape == (data.n,):
        return Partition(stored, num_clients)
    result = partitioner.partition(data, num_clients, seed)
    cache.save_array(cache_dir, key, result.assignment)
    return result


def holdout_split(partition: Partition, fraction: float, seed: int) -> tuple[Partition, Partition]:
    """Split every client's examples into a train part and a local test part (FedSplitBERT's 80/20).

    Each client puts round(fraction × size) random examples, but never all of them, into the test
    part.  In the returned train partition the test examples are marked -1 and vice versa, so both
    keep the original client ids and example indices."""
    fraction = _fraction("holdout", fraction)
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
