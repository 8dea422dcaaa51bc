"""On-disk cache of small numpy arrays, keyed by a hash of everything that determines them."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def hash_key(*parts: Any) -> str:
    """sha256 of the JSON form of ``parts``; JSON (not repr) so the key is stable across Python versions."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_array(cache_dir: Path, key: str) -> np.ndarray | None:
    """The cached array for ``key``, or None when absent or unreadable (a damaged file is recomputed)."""
    path = cache_dir / f"{key}.npy"
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None


def save_array(cache_dir: Path, key: str, array: np.ndarray) -> None:
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
