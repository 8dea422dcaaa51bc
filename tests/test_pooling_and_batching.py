"""Mean-pooled classifier heads and length-grouped batches: the two levers behind the quickstart's speed and
accuracy, each against an independent computation."""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pytest
import torch

from fedlm.config import AdapterConfig
from fedlm.errors import UserError
from fedlm.federation.local_training import LocalSettings, batch_order
from fedlm.models.adapters import apply_adapter
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Cut, SplitModel
from fedlm.models.heads import task_logits
from fedlm.tasks import get_task

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = ["the", "a", "farmer", "client", "server", "model", "trained", "shared", "weights", "boats", "river"]


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(2, 14))) for _ in range(n)]


@pytest.fixture(scope="module")
def bert_tokenizer():
    return build_tokenizer(None, "bert", _texts(80), 200)


# --------------------------------------------------------------------------------------- length grouping


def _padded_tokens(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)


@pytest.mark.parametrize("num_rows", [7, 100, 1234])
def test_grouped_batches_cover_each_epoch_once_with_the_same_count(num_rows: int) -> None:
    lengths = np.random.default_rng(num_rows).integers(1, 60, size=num_rows).tolist()
    plain = LocalSettings(batch_size=8, local_epochs=2)
    grouped = LocalSettings(batch_size=8, local_epochs=2, group_by_length=True)
    plain_batches = batch_order(num_rows, plain, torch.Generator().manual_seed(0), lengths)
    batches = batch_order(num_rows, grouped, torch.Generator().manual_seed(0), lengths)
    assert len(batches) == len(plain_batches)
    per_epoch = len(batches) // 2
    for epoch in (batches[:per_epoch], batches[per_epoch:]):
        assert sorted(i for batch in epoch for i in batch) == list(range(num_rows))
    if num_rows > 100:
        assert _padded_tokens(batches, lengths) < 0.6 * _padded_tokens(plain_batches, lengths)


def test_grouping_is_seeded_and_still_random() -> None:
    lengths = np.random.default_rng(1).integers(1, 60, size=500).tolist()
    settings = LocalSettings(batch_size=16, group_by_length=True)
    first = batch_order(500, settings, torch.Generator().manual_seed(3), lengths)
    assert first == batch_order(500, settings, torch.Generator().manual_seed(3), lengths)
    assert first != batch_order(500, settings, torch.Generator().manual_seed(4), lengths)
    # the longest batch is not always first: batch order is shuffled after sorting
    orders = [batch_order(500, settings, torch.Generator().manual_seed(s), lengths)[0] for s in range(6)]
    assert len({max(lengths[i] for i in batch) for batch in orders}) > 1


def test_grouping_respects_local_steps_and_needs_lengths() -> None:
    settings = LocalSettings(batch_size=4, local_steps=9, group_by_length=True)
    assert len(batch_order(10, settings, torch.Generator().manual_seed(0), list(range(10)))) == 9
    without = batch_order(10, settings, torch.Generator().manual_seed(0))  # no lengths: plain shuffle
    assert without == batch_order(10, LocalSettings(batch_size=4, local_steps=9), torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------------- mean pooling


def _classifier(tokenizer, pooling: str, family: str = "bert"):
    model = build_model(family, "tiny", "classification", tokenizer, num_labels=3, seed=0, pooling=pooling)
    return model.eval()


def test_mean_pooled_head_is_the_masked_mean_through_the_classifier(bert_tokenizer) -> None:
    model = _classifier(bert_tokenizer, "mean")
    assert model.config.classifier_pooling == "mean"
    enc = bert_tokenizer(["the farmer trained", "a model shared weights near the river"], padding=True,
                         return_tensors="pt")
    with torch.no_grad():
        hidden = model.base_model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        expected = model.classifier((hidden * mask).sum(1) / mask.sum(1))  # bert's pooler is skipped
        got = task_logits(model, hidden, enc["input_ids"])
    torch.testing.assert_close(got, expected)


def test_mean_pooling_ignores_padding_and_matches_the_split_path(bert_tokenizer) -> None:
    task = get_task("classification")
    rows = task.preprocess(datasets.Dataset.from_dict({"text": _texts(6, 5), "label": [0, 1, 2, 0, 1, 2]}),
                           bert_tokenizer, 32).to_list()
    model = _classifier(bert_tokenizer, "mean")
    batch = task.collate(rows, torch.Generator())
    alone = task.collate(rows[:1], torch.Generator())
    with torch.no_grad():
        logits = task._outputs(model, batch)
        single = task._outputs(model, alone)
        loss, _ = task.loss(model, batch)
        split_loss, _ = task.loss_from_hidden(model, model.base_model(input_ids=batch["input_ids"],
                                              attention_mask=batch["attention_mask"]).last_hidden_state, batch)
    torch.testing.assert_close(logits[:1], single, atol=1e-5, rtol=1e-5)  # row 0 padded in the batch, not alone
    torch.testing.assert_close(loss, split_loss)
    first = _classifier(bert_tokenizer, "first")
    with torch.no_grad():
        assert not torch.allclose(task._outputs(first, batch), logits)


@pytest.mark.parametrize("adapter", [None, "p_tuning_v2"])
def test_a_mean_pooled_classifier_splits_exactly(bert_tokenizer, adapter) -> None:
    """The split safety net compares the top's head against the mean-pooled logits the task trains on, not the
    family's first-token forward (which refused every split of the pretrained MiniLM, pooled by the mean)."""
    model = _classifier(bert_tokenizer, "mean")
    if adapter:
        model = apply_adapter(AdapterConfig(kind=adapter, prefix_length=3), model, "classification", seed=0).model
    SplitModel(model.eval(), Cut(bottom_blocks=1, top_blocks=0)).check_exact()


def test_auto_pooling_follows_a_sentence_transformers_checkpoint(bert_tokenizer, tmp_path) -> None:
    _classifier(bert_tokenizer, "first").save_pretrained(tmp_path)
    bert_tokenizer.save_pretrained(tmp_path)
    plain = build_model("bert", None, "classification", bert_tokenizer, num_labels=3, checkpoint=str(tmp_path))
    assert getattr(plain.config, "classifier_pooling", "first") == "first"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    pooled = build_model("bert", None, "classification", bert_tokenizer, num_labels=3, checkpoint=str(tmp_path))
    assert pooled.config.classifier_pooling == "mean"
    forced = build_model("bert", None, "classification", bert_tokenizer, num_labels=3, checkpoint=str(tmp_path),
                         pooling="first")
    assert forced.config.classifier_pooling == "first"


def test_mean_pooling_is_refused_for_decoders() -> None:
    tokenizer = build_tokenizer(None, "gpt2", _texts(80), 200)
    with pytest.raises(UserError, match=r"model\.pooling: mean is for encoders"):
        _classifier(tokenizer, "mean", family="gpt2")


def test_length_sorted_evaluation_gives_the_same_metrics(bert_tokenizer) -> None:
    task = get_task("classification")
    rows = task.preprocess(datasets.Dataset.from_dict({"text": _texts(40, 7), "label": [i % 3 for i in range(40)]}),
                           bert_tokenizer, 32).to_list()
    model = _classifier(bert_tokenizer, "first")
    assert task.sort_eval_by_length
    sorted_scores = task.evaluate(model, rows, 8, torch.Generator())
    task.sort_eval_by_length = False  # instance attribute: the class keeps its setting
    plain_scores = task.evaluate(model, rows, 8, torch.Generator())
    assert sorted_scores["accuracy"] == plain_scores["accuracy"]
    assert sorted_scores["loss"] == pytest.approx(plain_scores["loss"], rel=1e-5)
