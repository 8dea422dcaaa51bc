"""Evaluation metrics as pure functions over numpy arrays.

Scores are plain floats so they can be logged, compared and aggregated across clients without torch.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np
from scipy import stats
from seqeval.metrics import f1_score as entity_f1
from seqeval.metrics import precision_score, recall_score
from seqeval.scheme import IOB2
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


def mean_interval(values: np.ndarray | Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean, sample standard deviation (n - 1) and the half-width of the two-sided Student-t interval of the
    mean over independent runs (seeds); sd and half-width are NaN below two values, where no spread is seen."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(values.mean())
    if values.size < 2:
        return mean, math.nan, math.nan
    sd = float(values.std(ddof=1))
    return mean, sd, float(stats.t.ppf(0.5 + confidence / 2, values.size - 1) * sd / math.sqrt(values.size))


def entity_scores(gold: list[list[str]], pred: list[list[str]]) -> dict[str, float]:
    """Entity-level precision / recall / F1 (seqeval, strict IOB2: an entity counts only when its type and
    exact span match, so an I- tag without its B- starts no entity) and word-level tag accuracy."""
    words = sum(len(tags) for tags in gold)
    if not words:
        return dict.fromkeys(("precision", "recall", "f1", "accuracy"), math.nan)
    strict = {"mode": "strict", "scheme": IOB2, "zero_division": 0}
    correct = sum(g == p for gs, ps in zip(gold, pred, strict=True) for g, p in zip(gs, ps, strict=True))
    return {
        "precision": float(precision_score(gold, pred, **strict)),
        "recall": float(recall_score(gold, pred, **strict)),
        "f1": float(entity_f1(gold, pred, **strict)),
        "accuracy": correct / words,
    }


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def squad_normalize(text: str) -> str:
    """SQuAD v1.1's answer normalisation: lower case, punctuation removed, articles removed, whitespace
    collapsed (the official evaluation script's order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact(prediction: str, answers: list[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold answer."""
    return float(any(squad_normalize(prediction) == squad_normalize(a) for a in answers))


def squad_f1(prediction: str, answers: list[str]) -> float:
    """Best token-overlap F1 against the gold answers (bag of normalised words, as SQuAD v1.1 scores)."""
    return max((_overlap_f1(squad_normalize(prediction).split(), squad_normalize(a).split()) for a in answers),
               default=0.0)


def _overlap_f1(pred: list[str], gold: list[str]) -> float:
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE-1 / ROUGE-2 / ROUGE-L F-measure (rouge-score: lower-cased alphanumeric tokens, Porter
    stemming), each example scored against its one reference; NaN without examples."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        return dict.fromkeys(ROUGE_TYPES, math.nan)
    from rouge_score import rouge_scorer  # here: it brings nltk (seconds of start-up) that only seq2seq needs

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references, strict=True)]
    return {name: float(np.mean([s[name].fmeasure for s in scores])) for name in ROUGE_TYPES}
