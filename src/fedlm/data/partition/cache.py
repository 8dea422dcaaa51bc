"""Partitions memoised on disk, keyed by a hash of everything that determines them, so a grid's runs (and a
resumed run) partition each dataset once."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fedlm.data.partition.base import Partition, Partitioner, PartitionInput


def _hash_key(*parts: Any) -> str:
    """sha256 of the JSON form of ``parts``; JSON (not repr) so the key is stable across Python versions."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _load_array(cache_dir: Path, key: str) -> np.ndarray | None:
    """The cached array for ``key``, or None when absent or unreadable (a damaged file is recomputed)."""
    path = cache_dir / f"{key}.npy"
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None


def _save_array(cache_dir: Path, key: str, array: np.ndarray) -> None:
    """Write through a temporary file and rename, so a concurrent reader never sees half a file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, cache_dir / f"{key}.npy")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def partition_cached(
    partitioner: Partitioner, data: PartitionInput, num_clients: int, seed: int, cache_dir: Path | None
) -> Partition:
    """``partitioner.partition`` memoised on disk under sha256(fingerprint, partitioner, clients, seed)."""
    if cache_dir is None:
        return partitioner.partition(data, num_clients, seed)
    key = _hash_key(data.cache_fingerprint(), partitioner.cache_key(), int(num_clients), int(seed))
    stored = _load_array(cache_dir, key)
    if stored is not None and stored.shape == (data.n,):
        return Partition(stored, num_clients)
    result = partitioner.partition(data, num_clients, seed)
    _save_array(cache_dir, key, result.assignment)
    return result
