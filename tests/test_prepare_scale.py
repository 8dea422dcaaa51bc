"""Preparing many clients: a split tokenized once gives every client the rows its own tokenization would, and a
test split smaller than the population is enough when nobody scores clients on their own shares."""

from __future__ import annotations

import pytest

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.run.prepare import prepare
from tests.conftest import tiny_config


def test_a_row_wise_task_tokenized_once_gives_each_client_its_own_rows(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["partition"] = {"kind": "label_dirichlet", "alpha": 0.5, "num_clients": 6}
    prep = prepare(validate(raw), tiny_csv)
    assert prep.task.row_wise
    train = prep.loaded.splits["train"]
    for cid, rows in prep.client_train.items():  # the same split_rows cuts each client's test share
        alone = train.select(prep.train_partition.client_indices(cid))
        assert rows == prep.task.preprocess(alone, prep.tokenizer, 32).to_list()
    assert sum(len(rows) for rows in prep.client_test.values()) == len(prep.test_rows)


def test_more_clients_than_test_examples_need_local_evaluation_to_be_refused(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["partition"] = {"kind": "iid", "num_clients": 60}  # 120 training sentences, 40 test sentences
    raw["eval"]["local"] = False
    prep = prepare(validate(raw), tiny_csv)
    assert prep.client_test == {} and len(prep.client_train) == 60 and len(prep.test_rows) == 40
    raw["eval"]["local"] = True
    with pytest.raises(UserError, match=r"^the test split has 40 examples, fewer than the 60 clients .* eval.local"):
        prepare(validate(raw), tiny_csv)
