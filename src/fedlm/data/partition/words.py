"""Word statistics of texts and of clients' shares: words per text and vocabulary per client.

The FDAPT partitioners build their skews on these numbers and the partition report measures them, so
what the report shows is exactly what those partitioners optimise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from scipy import sparse

WORD = re.compile(r"\w+")  # a word: a maximal run of letters, digits and underscores (str.isalnum or "_")
CHUNK = 1 << 16  # texts per batch: bounds the temporary lists and buffers, not the result
_ASCII_WORD = np.zeros(256, dtype=bool)
for _low, _high in ((b"0", b"9"), (b"a", b"z"), (b"_", b"_")):
    _ASCII_WORD[ord(_low) : ord(_high) + 1] = True


def word_matrix(texts: Sequence[str]) -> sparse.csr_matrix:
    """Texts × word types count matrix of the lower-cased texts' words (types in first-seen order); one pass
    yields lengths, vocabularies and document frequencies.

    The words are scikit-learn's CountVectorizer's (``\\w+`` on lower-cased text), found without its Python
    loop over texts and words (~30 s per million short texts): an all-ASCII batch is split by Arrow kernels
    after one byte-table pass turns every non-word byte into a space; any other batch is split by ``re``
    per text. Arrow's dictionary encoding numbers the words either way."""
    vocabulary: dict[str, int] = {}
    rows, types = [], []
    for start in range(0, len(texts), CHUNK):
        words = _words(pa.array(texts[start : start + CHUNK], type=pa.large_string()))
        nonempty = pc.not_equal(pc.list_flatten(words), "")  # Arrow's split keeps empty edge pieces
        flat = pc.list_flatten(words).filter(nonempty)
        rows.append(pc.list_parent_indices(words).filter(nonempty).to_numpy().astype(np.int64) + start)
        encoded = pc.dictionary_encode(flat) if len(flat) else pa.DictionaryArray.from_arrays(
            pa.array([], pa.int32()), pa.array([], pa.large_string()))
        ids = np.fromiter((vocabulary.setdefault(w, len(vocabulary)) for w in encoded.dictionary.to_pylist()),
                          dtype=np.int64, count=len(encoded.dictionary))
        types.append(ids[encoded.indices.to_numpy(zero_copy_only=False)])
    row = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    col = np.concatenate(types) if types else np.zeros(0, dtype=np.int64)
    matrix = sparse.csr_matrix((np.ones(row.size, dtype=np.int32), (row, col)), shape=(len(texts), len(vocabulary)))
    matrix.sum_duplicates()
    return matrix


def _words(batch: pa.LargeStringArray) -> pa.ListArray:
    """The words of each text of a batch (a list per text)."""
    if not pc.all(pc.string_is_ascii(batch)).as_py():
        return pa.array([WORD.findall(text.lower()) for text in batch.to_pylist()],
                        type=pa.list_(pa.large_string()))
    lowered = pc.ascii_lower(batch)
    validity, offsets, data = lowered.buffers()
    raw = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    spaced = np.where(_ASCII_WORD[raw], raw, np.uint8(32)).astype(np.uint8)
    spaced_batch = pa.LargeStringArray.from_buffers(len(lowered), offsets, pa.py_buffer(spaced), validity,
                                                    offset=lowered.offset)
    return pc.ascii_split_whitespace(spaced_batch)


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
