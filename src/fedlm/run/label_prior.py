"""The label-prior baseline of personalised classification: each client predicts the majority label of its own
training data for every example of its local test set.

A client whose local test set mirrors its training label mix scores high with no model at all, so a
personalised method's local scores mean little until read beside this one. The scores use the metric
functions the classification task scores models with (``fedlm.metrics``); the loss is the cross-entropy of
the client's add-one smoothed training label frequencies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fedlm import metrics
from fedlm.tasks import ClassificationTask, Task

SCORES: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": metrics.accuracy, "macro_f1": metrics.macro_f1, "mcc": metrics.mcc}


def majority_label(labels: Sequence[int], num_labels: int) -> int:
    """The most frequent label, the smallest one on a tie."""
    return int(np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_labels).argmax())


def label_prior_scores(task: Task, train_rows: Sequence[dict], test_rows: Sequence[dict],
                       num_labels: int) -> dict[str, float] | None:
    """The task's metrics for predicting ``train_rows``' majority label on ``test_rows``; None where there is no
    label prior (a task other than single-label classification, or no training or test rows)."""
    if not isinstance(task, ClassificationTask) or not train_rows or not test_rows:
        return None
    train = np.array([row["labels"] for row in train_rows], dtype=np.int64)
    test = np.array([row["labels"] for row in test_rows], dtype=np.int64)
    counts = np.bincount(train, minlength=num_labels)
    frequencies = (counts + 1) / (counts.sum() + num_labels)
    preds = np.full(test.shape, majority_label(train, num_labels))
    scores = {"loss": float(-np.log(frequencies[test]).mean())}
    scores.update({name: score(preds, test) for name, score in SCORES.items() if name in task.metric_names})
    return scores


def num_labels_of(label_names: Sequence[str] | None, *row_sets: Sequence[dict]) -> int:
    """How many classes there are: the data's label names, else one more than the largest label seen."""
    if label_names:
        return len(label_names)
    return 1 + max((int(row["labels"]) for rows in row_sets for row in rows), default=0)
