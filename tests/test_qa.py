"""Extractive QA: SQuAD scores, windows and offsets, span search, readers, training, FedAvg, split."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch

from fedlm import metrics
from fedlm.config import validate
from fedlm.data.sources import load_source
from fedlm.errors import UserError
from fedlm.models.build import FAMILIES, build_tokenizer
from fedlm.models.cut import Cut
from fedlm.run.recorder import read_metrics
from fedlm.tasks import get_task
from fedlm.tasks.qa import best_spans
from tests.conftest import SHARED_DATA
from tests.split_helpers import assert_split_step_equals_unsplit
from tests.tiny_models import tiny_model
from tests.training_helpers import central_steps, cli_run, one_client_fedavg_equals_centralized

pytestmark = pytest.mark.usefixtures("one_thread")

FILLER = "the river runs past the old mill and the farmers sell grain at the market every week . "
EXAMPLES = [
    ("Who founded the mill?", FILLER * 3 + "The mill was founded by Anna Berg in 1850 .", "Anna Berg"),
    ("When was the mill founded?", "The mill was founded in 1850 by Anna Berg . " + FILLER, "1850"),
    ("What do farmers sell?", "Farmers sell grain at the market . " + FILLER * 2, "grain"),
    ("Where is grain sold?", FILLER + "Grain is sold at the market by the river .", "the market"),
]


def _dataset(examples=EXAMPLES) -> datasets.Dataset:
    return datasets.Dataset.from_dict({
        "text": [q for q, _, _ in examples], "text_pair": [c for _, c, _ in examples],
        "id": [f"q{i}" for i in range(len(examples))], "title": ["t"] * len(examples),
        "answer_texts": [[a] for _, _, a in examples], "answer_starts": [[c.index(a)] for _, c, a in examples],
    })


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    texts = [q for q, _, _ in EXAMPLES] + [c for _, c, _ in EXAMPLES]
    return {family: build_tokenizer(None, family, texts, 160) for family in FAMILIES}


def _model(family, tokenizers, layers=2):
    return tiny_model(family, "qa", tokenizers[family], layers)


# ------------------------------------------------------------------------------------------------- scores


def test_squad_normalisation_exact_match_and_f1_by_hand():
    assert metrics.squad_normalize("  The Quick,  brown fox!") == "quick brown fox"
    assert metrics.squad_normalize("An apple. A pear; the end") == "apple pear end"
    assert metrics.squad_exact("the Denver Broncos", ["Denver Broncos"]) == 1.0
    assert metrics.squad_exact("Denver Broncos.", ["Carolina", "denver broncos"]) == 1.0
    assert metrics.squad_exact("Broncos", ["Denver Broncos"]) == 0.0
    # pred {denver, broncos, won} vs gold {denver, broncos}: P = 2/3, R = 1 -> F1 = 0.8
    assert metrics.squad_f1("Denver Broncos won", ["the Denver Broncos"]) == pytest.approx(0.8)
    # best over the golds: vs "Denver Broncos" P = 1, R = 1/2 -> 2/3
    assert metrics.squad_f1("Broncos", ["Carolina Panthers", "Denver Broncos"]) == pytest.approx(2 / 3)
    # repeated words count by multiplicity: common = min(2, 1) = 1; P = 1/2, R = 1/1 -> 2/3
    assert metrics.squad_f1("grain grain", ["grain"]) == pytest.approx(2 / 3)
    assert metrics.squad_f1("", ["grain"]) == 0.0 and metrics.squad_f1("the", ["a"]) == 0.0


def test_best_span_respects_context_order_and_length():
    start = torch.tensor([[9.0, 1.0, 0.0, 3.0, 0.0, 0.0]])
    end = torch.tensor([[9.0, 0.0, 2.0, 0.0, 0.0, 5.0]])
    context = torch.tensor([[False, True, True, True, True, True]])  # position 0 (a special token) is out
    score, first, last = best_spans(start, end, context, max_answer_length=3)
    assert (first.item(), last.item()) == (3, 5) and score.item() == 8.0  # 3 + 5; (1, 5) is too long
    score, first, last = best_spans(start, end, context, max_answer_length=2)
    assert (first.item(), last.item()) == (4, 5) and score.item() == 5.0  # 0 + 5; (5, 5) ties: the first wins
    score, first, _ = best_spans(start, end, torch.zeros_like(context), max_answer_length=3)
    assert first.item() == -1 and torch.isneginf(score).item()


# --------------------------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("family", FAMILIES)
def test_answer_only_in_the_second_window(tokenizers, family):
    task = get_task("qa", doc_stride=8)
    rows = task.preprocess(_dataset(EXAMPLES[:1]), tokenizers[family], 48).to_list()
    assert len(rows) >= 2 and {row["example_id"] for row in rows} == {"q0"}
    labelled = [i for i, row in enumerate(rows) if row["labels"] != [0, 0]]
    assert labelled and labelled[0] >= 1 and rows[0]["labels"] == [0, 0]  # not in the first window
    for i in labelled:
        first, last = rows[i]["labels"]
        span = rows[i]["context"][rows[i]["offsets"][first][0] : rows[i]["offsets"][last][1]]
        assert span.strip() == "Anna Berg"
    # consecutive windows share doc_stride context tokens
    in_context = [[tuple(span) for span in row["offsets"] if span[0] >= 0] for row in rows]
    assert in_context[0][-8:] == in_context[1][:8]


@pytest.mark.parametrize("family", FAMILIES)
def test_answer_targets_recover_every_answer_text(tokenizers, family):
    rows = get_task("qa", doc_stride=8).preprocess(_dataset(), tokenizers[family], 40).to_list()
    found = {}
    for row in rows:
        if row["labels"] != [0, 0]:
            first, last = row["labels"]
            found[row["example_id"]] = row["context"][row["offsets"][first][0] : row["offsets"][last][1]].strip()
    assert found == {f"q{i}": answer for i, (_, _, answer) in enumerate(EXAMPLES)}


def test_the_best_window_answers_the_question(tokenizers):
    task = get_task("qa", doc_stride=8, max_answer_length=5)
    rows = task.preprocess(_dataset(EXAMPLES[:1]), tokenizers["bert"], 48).to_list()
    second = next(i for i, row in enumerate(rows) if row["labels"] != [0, 0])
    # window scores by hand: the labelled window has the best span, the others lower scores
    parts = [{"rows": rows, "count": len(rows), "loss_sum": 0.0,
              "score": [10.0 if i == second else 1.0 for i in range(len(rows))],
              "first": [row["labels"][0] if i == second else 1 for i, row in enumerate(rows)],
              "last": [row["labels"][1] if i == second else 1 for i, row in enumerate(rows)]}]
    scores = task._summarize(parts)
    assert scores["exact_match"] == 1.0 and scores["f1"] == 1.0


# --------------------------------------------------------------------------------------------------- readers


def test_squad_json_and_jsonl_readers(tmp_path):
    context = "Anna Berg founded the mill in 1850."
    squad = {"data": [{"title": f"T{a}", "paragraphs": [{"context": context, "qas": [
        {"id": f"a{a}", "question": "Who founded the mill?", "answers": [{"text": "Anna Berg", "answer_start": 0},
                                                                         {"text": "Berg", "answer_start": 5}]}]}]}
        for a in range(4)]}
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    loaded = load_source(str(tmp_path / "squad.json"), tmp_path, task="qa", test_fraction=0.25)
    assert loaded.kind == "qa" and len(loaded.splits["train"]) == 3 and len(loaded.splits["test"]) == 1
    assert loaded.splits["train"][0]["answer_texts"] == ["Anna Berg", "Berg"]
    assert "(1 test, 3 train articles)" in loaded.split_note
    line = {"id": "x", "question": "When?", "context": context, "answers": {"text": ["1850"], "answer_start": [30]}}
    folder = tmp_path / "dir"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps(line) + "\n")
    loaded = load_source(str(folder), tmp_path, task="qa")
    assert loaded.splits["test"][0]["answer_starts"] == [30]


def test_answer_not_matching_its_context_is_one_line(tmp_path):
    line = {"id": "x", "question": "When?", "context": "Built in 1850.", "answers": [{"text": "1850",
                                                                                       "answer_start": 3}]}
    (tmp_path / "train.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(UserError, match=r"train\.jsonl line 1 \(question x\): answer '1850' does not match the "
                                        r"context at character 3 \(found 'lt i'\)") as error:
        load_source(str(tmp_path / "train.jsonl"), tmp_path, task="qa")
    assert "\n" not in str(error.value)


def test_named_squad_is_split_by_article():
    loaded = load_source("squad", SHARED_DATA)
    train, test = loaded.splits["train"], loaded.splits["test"]
    assert len(train) + len(test) == 10570
    assert not set(train["title"]) & set(test["title"])
    assert "dev-v1.1.json" in loaded.split_note and "article" in loaded.split_note
    assert load_source("squad", SHARED_DATA).splits["test"]["id"] == test["id"]  # deterministic


# -------------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_loss_equals_the_hf_span_loss_without_padding(tokenizers, family):
    task = get_task("qa", doc_stride=8)
    rows = task.preprocess(_dataset(), tokenizers[family], 40).to_list()
    full = [row for row in rows if len(row["input_ids"]) == 40][:1] + [row for row in rows if row["labels"] != [0, 0]
                                                                        and len(row["input_ids"]) == 40][:1]
    batch = task.collate(full, torch.Generator())
    assert not (batch["attention_mask"] == 0).any()  # HF scores padding positions too; here there are none
    model = _model(family, tokenizers).eval()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    expected = model(**inputs, start_positions=batch["labels"][:, 0], end_positions=batch["labels"][:, 1]).loss
    ours, count = task.loss(model, batch)
    assert count == len(full)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_a_few_central_steps_lower_the_loss(tokenizers):
    task = get_task("qa", doc_stride=8)
    rows = task.preprocess(_dataset(), tokenizers["bert"], 40).to_list()
    model = _model("bert", tokenizers).train()
    losses, count = central_steps(task, model, task.collate(rows, torch.Generator()))
    assert count == len(rows) and losses[-1] < 0.5 * losses[0]
    scores = task.evaluate(model, rows, 4, torch.Generator())
    assert set(scores) == set(task.metric_names) and scores["f1"] > 0.5


@pytest.mark.parametrize("cut", [Cut(0, 0), Cut(1, 1)], ids=["k0m0", "k1m1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_step_equals_unsplit_step(tokenizers, family, cut):
    task = get_task("qa", doc_stride=8)
    rows = task.preprocess(_dataset(), tokenizers[family], 40).to_list()  # last windows are short: padding
    batch = task.collate(rows, torch.Generator())
    assert (batch["attention_mask"] == 0).any()
    assert_split_step_equals_unsplit(task, batch, _model(family, tokenizers, layers=3).train(), cut)


def _config(tmp_path, name, kind, clients=1, rounds=1, family="bert", local_eval=True):
    return validate({
        "name": name, "seed": 3, "output_dir": str(tmp_path / "runs"), "task": "qa",
        "data": {"source": "squad", "max_train_examples": 24, "max_test_examples": 12},
        "partition": {"kind": "iid", "num_clients": clients},
        "model": {"family": family, "preset": "tiny", "vocab_size": 400, "max_length": 96, "doc_stride": 24},
        "train": {"lr": 0.003, "batch_size": 8},
        "protocol": {"kind": kind, "rounds": rounds}, "eval": {"batch_size": 16, "local": local_eval},
    })


def test_one_client_fedavg_equals_centralized_on_squad(tmp_path):
    records = one_client_fedavg_equals_centralized(lambda kind: _config(tmp_path, kind, kind, local_eval=False),
                                                   SHARED_DATA, tmp_path)
    fed_records, central_records = records["fedavg"], records["centralized"]
    assert fed_records[-1]["test_loss"] == pytest.approx(central_records[-1]["test_loss"], abs=1e-6)
    assert fed_records[0]["round"] == 0 and "test_exact_match" in fed_records[0]  # the starting point


def test_cli_runs_qa_end_to_end(tmp_path):
    raw = _config(tmp_path, "squad", "fedavg", clients=2, rounds=1, family="llama").model_dump(mode="json")
    cli_run(raw, tmp_path / "squad.yaml", SHARED_DATA)
    run_dir = tmp_path / "runs" / "squad"
    records = read_metrics(run_dir)
    assert [r["round"] for r in records] == [0, 1] and np.isfinite(records[-1]["test_f1"])
    assert "f1" in (run_dir / "summary.md").read_text()
    assert json.loads((run_dir / "data.json").read_text())["task"] == "qa"
