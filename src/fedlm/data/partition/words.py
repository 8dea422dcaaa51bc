"""Word statistics of texts and of clients' shares: words per text and vocabulary per client.

The FDAPT partitioners build their skews on these numbers and the partition report measures them, so
what the report shows is exactly what those partitioners optimise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import sparse
from sklearn.feature_extraction.text import CountVectorizer

WORD_PATTERN = r"(?u)\b\w+\b"


def word_matrix(texts: Sequence[str]) -> sparse.csr_matrix:
    """Texts × word types count matrix (lower-cased ``\\w+`` words); one pass yields lengths,
    vocabularies and document frequencies."""
    vectorizer = CountVectorizer(token_pattern=WORD_PATTERN, lowercase=True, dtype=np.int32)
    try:
        return vectorizer.fit_transform(texts).tocsr()
    except ValueError:  # sklearn refuses a corpus without a single word
        return sparse.csr_matrix((len(texts), 0), dtype=np.int32)


def words_per_text(words: sparse.csr_matrix) -> np.ndarray:
    """Length of each text in words."""
    return np.asarray(words.sum(axis=1)).ravel()


def client_matrix(assignment: np.ndarray, num_clients: int) -> sparse.csr_matrix:
    """Sparse clients × examples indicator (never dense: that would be clients × examples memory)."""
    kept = np.flatnonzero(assignment >= 0)
    ones = np.ones(kept.size, dtype=np.int32)
    shape = (num_clients, assignment.size)
    return sparse.csr_matrix((ones, (assignment[kept], kept)), shape=shape)


def client_vocab_sizes(assignment: np.ndarray, num_clients: int, words: sparse.csr_matrix) -> np.ndarray:
    """Number of distinct words each client holds."""
    per_client = (client_matrix(assignment, num_clients) @ words).tocsr()
    return np.diff(per_client.indptr)


def client_means(assignment: np.ndarray, num_clients: int, values: np.ndarray) -> np.ndarray:
    """Mean of ``values`` over each client's examples (NaN for an empty client)."""
    kept = assignment >= 0
    sums = np.bincount(assignment[kept], weights=values[kept], minlength=num_clients)
    counts = np.bincount(assignment[kept], minlength=num_clients)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts
