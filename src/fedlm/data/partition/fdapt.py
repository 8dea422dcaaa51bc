"""FDAPT's text skews: quantity, sentence length and vocabulary, each spread across clients while the
other two statistics stay balanced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy import sparse

from fedlm.data.partition.base import Partitioner, PartitionInput, require_texts
from fedlm.data.partition.dealing import at_least_one, deal, even_sizes
from fedlm.data.partition.words import client_means, client_vocab_sizes, word_matrix, words_per_text


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
