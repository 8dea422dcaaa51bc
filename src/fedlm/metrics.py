"""Evaluation metrics as pure functions over numpy arrays.

Scores are plain floats so they can be logged, compared and aggregated across clients without torch.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats
from sklearn.metrics import f1_score, matthews_corrcoef


def mean_loss(losses: np.ndarray, counts: np.ndarray) -> float:
    """Mean per-unit loss from per-batch means weighted by each batch's unit count (tokens or examples)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    return float(np.dot(np.asarray(losses, dtype=np.float64), counts) / total) if total else math.nan


def perplexity(mean_token_loss: float) -> float:
    """exp of the mean token cross-entropy; inf rather than an overflow error for diverged models."""
    return math.exp(mean_token_loss) if mean_token_loss < math.log(np.finfo(np.float64).max) else math.inf


def accuracy(preds: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.asarray(preds) == np.asarray(labels))) if len(labels) else math.nan


def macro_f1(preds: np.ndarray, labels: np.ndarray) -> float:
    return float(f1_score(labels, preds, average="macro", zero_division=0))


def mcc(preds: np.ndarray, labels: np.ndarray) -> float:
    """Matthews correlation; 0.0 when predictions or labels are constant (sklearn's convention). A client's
    local test split often holds one class only: when predictions match it, that 0.0 is given here, since
    sklearn would warn that its 1x1 confusion matrix lacks the other classes."""
    if len(np.union1d(labels, preds)) < 2:
        return 0.0
    return float(matthews_corrcoef(labels, preds))


def mse(preds: np.ndarray, targets: np.ndarray) -> float:
    return float(np.mean((np.asarray(preds, dtype=np.float64) - np.asarray(targets, dtype=np.float64)) ** 2))


def pearson(preds: np.ndarray, targets: np.ndarray) -> float:
    """Pearson r; 0.0 for constant inputs, where it is undefined, so model selection never sees NaN."""
    return float(stats.pearsonr(preds, targets).statistic) if _both_vary(preds, targets) else 0.0


def spearman(preds: np.ndarray, targets: np.ndarray) -> float:
    """Spearman rho; 0.0 for constant inputs (see ``pearson``)."""
    return float(stats.spearmanr(preds, targets).statistic) if _both_vary(preds, targets) else 0.0


def _both_vary(preds: np.ndarray, targets: np.ndarray) -> bool:
    return all(len(a) >= 2 and np.ptp(np.asarray(a)) > 0 for a in (preds, targets))
