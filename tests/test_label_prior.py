"""The label-prior baseline: each client's majority training label, scored on its local test set."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from fedlm.config import validate
from fedlm.run.label_prior import label_prior_scores, majority_label
from fedlm.run.prepare import prepare
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from fedlm.tasks import get_task
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def task():
    return get_task("classification")


def rows(labels: list[int]) -> list[dict]:
    return [{"input_ids": [2, 5 + i % 3, 3], "labels": label} for i, label in enumerate(labels)]


def test_label_prior_on_a_hand_built_client_is_its_majority_accuracy(task):
    train, test = rows([0, 1, 1, 2, 1]), rows([1, 0, 1, 2])  # majority 1: right on 2 of 4
    scores = label_prior_scores(task, train, test, num_labels=3)
    assert set(scores) == set(task.metric_names)
    assert scores["accuracy"] == 0.5
    assert math.isclose(scores["macro_f1"], (2 / 3) / 3)  # F1 of class 1: p = 1/2, r = 1; classes 0, 2: 0
    assert scores["mcc"] == 0.0  # constant predictions
    smoothed = {0: 2 / 8, 1: 4 / 8, 2: 2 / 8}  # add-one counts (1, 3, 1) + 1 over 5 + 3
    assert math.isclose(scores["loss"], -sum(math.log(smoothed[y]) for y in (1, 0, 1, 2)) / 4, rel_tol=1e-6)
    # the same numbers the task gives a model that always answers 1: the metrics cannot drift apart
    always_one = np.tile(np.eye(3)[1], (4, 1))
    assert {k: v for k, v in scores.items() if k != "loss"} == task._scores(always_one, np.array([1, 0, 1, 2]))


def test_ties_go_to_the_smallest_label_and_unseen_labels_still_count(task):
    assert majority_label([1, 0, 0, 1], num_labels=2) == 0
    assert majority_label([2, 2], num_labels=4) == 2
    assert label_prior_scores(task, rows([3]), rows([3, 0, 3]), num_labels=4)["accuracy"] == pytest.approx(2 / 3)


def test_no_prior_without_labels_or_rows(task):
    assert label_prior_scores(get_task("regression"), rows([1]), rows([1]), 1) is None
    assert label_prior_scores(task, [], rows([1]), 2) is None and label_prior_scores(task, rows([1]), [], 2) is None


def test_personalised_run_records_the_prior_beside_every_local_score(tmp_path, tiny_csv, one_thread):
    raw = tiny_config(tmp_path, tiny_csv, kind="isolated", rounds=1) | {
        "partition": {"kind": "label_mix", "num_clients": 3, "mixes": [[0.9, 0.1], [0.5, 0.5], [0.1, 0.9]],
                      "holdout": 0.25},
        "eval": {"batch_size": 32, "headline": "local"}}
    cfg = validate(raw)
    prep = prepare(cfg, tiny_csv)
    expected = {}
    for cid, test in prep.client_test.items():
        majority = min(Counter(r["labels"] for r in prep.client_train[cid]).most_common(),
                       key=lambda kv: (-kv[1], kv[0]))[0]
        expected[str(cid)] = sum(r["labels"] == majority for r in test) / len(test)
    run_dir = tmp_path / "run"
    run_single(cfg, tiny_csv, run_dir)
    records = read_metrics(run_dir)
    assert all(("local_prior_accuracy_mean" in r) == ("local_accuracy_mean" in r) for r in records)
    assert len(records) == 2
    for record in records:
        by_client = {c: m["accuracy"] for c, m in record["local_prior_by_client"].items()}
        assert by_client == pytest.approx(expected)
        assert record["local_prior_accuracy_mean"] == pytest.approx(sum(expected.values()) / 3)
    assert len(set(expected.values())) > 1  # the clients' label mixes give them different priors
    assert "label prior accuracy (local)" in (run_dir / "summary.md").read_text()
